"""Singularformer's 5-fold cross-validation protocol (experiment/crossval.py, `longattn crossval`) and the
document classification tasks (tasks/doccls.py), on a small corpus in R8's exact format."""

from __future__ import annotations

import json
import random
import statistics
from pathlib import Path

import pytest
import torch

from longattn.cli import main
from longattn.config import ConfigError
from longattn.experiment.config import load_saved, resolve_config
from longattn.experiment.crossval import PAPER_TABLE4, TABLE4_DATASETS, cost_markdown, run_crossval
from longattn.experiment.run import evaluate_run, run
from longattn.tasks.base import get_task
from longattn.tasks.doccls import DocClassificationTask

TINY = ["model.layers=1", "model.dim=16", "model.hidden=16", "model.heads=2", "train.epochs=2",
        "train.batch_size=8", "train.progress=false"]


def write_r8(folder: Path, per_class: int = 10, test_per_class: int = 3) -> Path:
    """`label<TAB>text` lines, no final newline (the published R8 files); each class has its own words."""
    rng = random.Random(0)
    words = {"earn": ["profit", "dividend", "quarter"], "acq": ["merger", "stake", "buy"],
             "trade": ["tariff", "export", "deficit"]}
    common = ["the", "company", "said", "mln", "pct", "year"]

    def lines(count: int) -> str:
        rows = []
        for label, own in words.items():
            for _ in range(count):
                text = " ".join(rng.choice(own + common) for _ in range(rng.randint(3, 12)))
                rows.append(f"{label}\t{text}")
        rng.shuffle(rows)
        return "\n".join(rows)

    folder.mkdir(parents=True)
    (folder / "train.txt").write_text(lines(per_class))
    (folder / "test.txt").write_text(lines(test_per_class))
    return folder


def fold_test_scores(out: Path, model: str) -> list[float]:
    return [json.loads((out / "r8" / model / f"fold{k}" / "results.json").read_text())["test"]["accuracy"]
            for k in range(3)]


def test_tasks_are_registered_with_the_papers_lengths_and_folds(tmp_path):
    lengths = {name: get_task(name).max_len for name in TABLE4_DATASETS}
    assert lengths == {"r8": 141, "bbc": 664, "20news": 700, "imdb": 539, "mimic3_50": 1024, "scope95": 328,
                       "scope40": 337, "cifar100": 256}
    assert all(isinstance(get_task(name), DocClassificationTask) for name in lengths)
    data_dir = write_r8(tmp_path / "R8")
    task = get_task("r8")
    for fold in range(5):
        data = task.build_data(resolve_config("r8", "cpu", overrides=[f"data.data_dir={data_dir}",
                                                                      f"data.fold={fold}"]))
        assert (len(data.train), len(data.val), len(data.test)) == (24, 6, 9)
        assert data.info["num_classes"] == 3
    whole = task.build_data(resolve_config("r8", "cpu", overrides=[f"data.data_dir={data_dir}", "data.fold=null"]))
    assert (len(whole.train), whole.val) == (30, None)
    with pytest.raises(ConfigError, match="data.fold"):
        resolve_config("r8", "cpu", overrides=["data.fold=-1"])


def test_paper_preset_is_table_2():
    config = resolve_config("r8", "paper")
    assert config.model_name == "singularformer" and config.attention == "singular"
    assert (config.model["layers"], config.model["dim"], config.model["heads"], config.model["hidden"]) == (6, 384, 6, 384)
    assert (config.model["dropout"], config.model["embedding_dropout"], config.model["init_std"]) == (0.1, 0.2, 0.02)
    assert (config.optim.optimizer, config.optim.lr, config.optim.warmup_epochs) == ("adamw", 1e-4, 4)
    assert (config.train.batch_size, config.train.epochs, config.train.eval_every_epoch) == (64, 256, True)
    assert config.data.num_folds == 5
    post = resolve_config("r8", "paper", model_name="post_ln")
    assert (post.attention, post.model["norm"]) == ("softmax", "post")


def test_crossval_layout_table_resume_and_command(tmp_path, monkeypatch, capsys):
    data_dir = write_r8(tmp_path / "R8")
    out = tmp_path / "table4"
    summary = run_crossval(["r8"], ["post_ln", "singularformer"], out, preset="cpu",
                           overrides=[f"data.data_dir={data_dir}", *TINY], folds=3)
    for model in ("post_ln", "singularformer"):
        entry = next(e for e in summary["entries"] if e["model"] == model)
        assert [f["fold"] for f in entry["folds"]] == [0, 1, 2] and not entry["errors"]
        assert entry["metric"] == "accuracy" and [f["test"] for f in entry["folds"]] == fold_test_scores(out, model)
        tests = []
        for fold in range(3):
            folder = out / "r8" / model / f"fold{fold}"
            assert (folder / "checkpoints" / "best.pt").is_file()
            result = json.loads((folder / "results.json").read_text())
            assert load_saved(folder / "config.yaml").data.fold == fold
            assert result["model"] == model and result["best_step"] is not None
            # the reported test accuracy is the best validation checkpoint's
            assert evaluate_run(folder)["accuracy"] == pytest.approx(result["test"]["accuracy"])
            tests.append(result["test"]["accuracy"])
        assert entry["test_mean"] == pytest.approx(statistics.mean(tests))
        assert entry["test_std"] == pytest.approx(statistics.stdev(tests))
        assert entry["paper"] == {"mean": PAPER_TABLE4[model]["r8"][0], "std": PAPER_TABLE4[model]["r8"][1]}
    table = (out / "table.md").read_text()
    assert "Post-LN Transformer" in table and "Singularformer" in table and "0.98145 ± 0.001" in table
    assert all(f["cpu_time_s"] > 0 for e in summary["entries"] for f in e["folds"])
    # Singularformer minus Post-LN, paired by fold (the reference has no difference of its own)
    post_ln, singular = (next(e for e in summary["entries"] if e["model"] == m) for m in ("post_ln", "singularformer"))
    gaps = [a["test"] - b["test"] for a, b in zip(singular["folds"], post_ln["folds"])]
    assert summary["reference"] == "post_ln" and post_ln["difference"] is None
    assert singular["difference"]["n"] == 3 and singular["difference"]["mean"] == pytest.approx(statistics.mean(gaps))
    assert "### Test score minus Post-LN Transformer's, paired by fold" in table and "(3 folds)" in table
    cost = table[table.index("### Cost per fold"):]
    post_ln = next(line for line in cost.splitlines() if line.startswith("| Post-LN Transformer"))
    steps = [f"{f['best_step']}/{f['steps']}" for f in summary["entries"][0]["folds"]]
    assert "| R8 " in post_ln and "| 0, 1, 2 " in post_ln and ", ".join(steps) in post_ln
    assert (out / "table4.png").stat().st_size > 0
    saved = json.loads((out / "results.json").read_text())
    assert saved["entries"] == json.loads(json.dumps(summary["entries"])) and "provenance" in saved

    # resume: finished folds are reused, a missing fold is trained again
    import shutil
    import longattn.experiment.grid as grid

    shutil.rmtree(out / "r8" / "singularformer" / "fold1")
    calls = []
    real_run = grid.run
    monkeypatch.setattr(grid, "run", lambda config, folder, **kw: calls.append(Path(folder)) or real_run(config, folder, **kw))
    capsys.readouterr()
    code = main(["crossval", "--tasks", "r8", "--models", "post_ln,singularformer", "--data-dir", str(data_dir),
                 "--folds", "3", "--out", str(out), "--resume", *(a for s in TINY for a in ("--set", s))])  # old name
    assert code == 0 and calls == [out / "r8" / "singularformer" / "fold1"]
    assert "Singularformer" in capsys.readouterr().out
    shutil.rmtree(out / "r8" / "post_ln" / "fold2")
    calls.clear()
    report = run_crossval(["r8"], ["post_ln", "singularformer"], out, folds=3, report_only=True)
    assert calls == [] and "(2/3 folds)" in (out / "table.md").read_text()
    assert [len(e["folds"]) for e in report["entries"]] == [2, 3]
    # training one fold writes the table from every fold finished in the folder, not from that fold alone
    one = run_crossval(["r8"], ["post_ln"], out, preset="cpu", overrides=[f"data.data_dir={data_dir}", *TINY],
                       folds=3, only_folds=[2], resume=True)
    assert calls == [out / "r8" / "post_ln" / "fold2"]
    assert [f["fold"] for f in one["entries"][0]["folds"]] == [0, 1, 2]
    assert "folds)" not in (out / "table.md").read_text()
    with pytest.raises(SystemExit) as stop:  # checked as the command line is read, with the nearest name
        main(["paper", "singularformer-table4", "--tasks", "r8", "--models", "post_lnn", "--out", str(out)])
    assert stop.value.code == 2 and "unknown model 'post_lnn' (did you mean 'post_ln'?)" in capsys.readouterr().err
    assert main(["paper", "singularformer-table4", "--tasks", "r8", "--only-folds", "7", "--out", str(out)]) == 2


def test_cost_table_gives_median_and_range_per_model():
    fold = {"best_step": 626, "steps": 1565, "peak_memory_mb": 2000.0}
    summary = {"entries": [
        {"model": "singularformer", "dataset": "imdb", "folds": [
            {**fold, "fold": 0, "cpu_time_s": 1952.0, "train_time_s": 3478.0},
            {**fold, "fold": 1, "cpu_time_s": 1610.0, "train_time_s": 1570.0, "best_step": 939},
            {**fold, "fold": 3, "cpu_time_s": 1597.0, "train_time_s": 1547.0, "peak_memory_mb": 2076.4}]},
        {"model": "post_ln", "dataset": "imdb", "folds": [
            {**fold, "fold": 0, "cpu_time_s": 3645.0, "train_time_s": None}]},
        {"model": "bigbird", "dataset": "imdb", "folds": []}]}
    rows = [line for line in cost_markdown(summary).splitlines() if line.startswith("| ") and "IMDb" in line]
    cells = [[c.strip() for c in row.strip("|").split("|")] for row in rows]
    assert cells == [
        ["Singularformer", "IMDb", "0, 1, 3", "26 min 50 s (26 min 37 s-32 min 32 s)",
         "26 min 10 s (25 min 47 s-57 min 58 s)", "626/1565, 939/1565, 626/1565", "2,076 MB"],
        ["Post-LN Transformer", "IMDb", "0", "1 h 0 min", "-", "626/1565", "2,000 MB"]]


def test_cifar100_patches_task_trains_a_fold(tmp_path):
    from cifar100_files import _write_cifar100

    folder = _write_cifar100(tmp_path / "cifar-100-python")
    config = resolve_config("cifar100", "cpu_reduced", overrides=[f"data.data_dir={tmp_path}", "data.options.check_counts=false",
                                                          *TINY], model_name="pre_ln")
    data = get_task("cifar100").build_data(config)
    assert (len(data.train), len(data.val), len(data.test)) == (32, 8, 10) and folder.is_dir()
    assert data.info == {"num_classes": 100, "vocab_size": 0, "input_dim": 12}
    assert config.train.group_by_length and data.train.lengths().tolist() == [256] * 32
    result = run(config, tmp_path / "run", plots=False)
    assert result["test"]["examples"] == 10 and result["best_step"] is not None


def test_mimic3_multilabel_task_trains_with_binary_cross_entropy(tmp_path):
    fixtures = Path(__file__).resolve().parents[1] / "data" / "fixtures" / "textcls" / "mimic3"
    config = resolve_config("mimic3_50", "cpu", overrides=[f"data.data_dir={fixtures}", "data.fold=null", *TINY],
                            model_name="post_ln")
    task = get_task("mimic3_50")
    data = task.build_data(config)
    assert task.select_metric == "micro_f1" and len(data.val) == 1  # the official dev file validates
    batch = data.collate([data.train[0], data.train[1]])
    assert batch["label"].dtype == torch.float32 and batch["label"].shape == (2, data.info["num_classes"])
    result = run(config, tmp_path / "run", plots=False)
    assert set(result["test"]) >= {"micro_f1", "macro_f1", "accuracy", "loss"}
    logits = torch.tensor([[2.0, -1.0, 0.5], [-3.0, -0.1, 1.0]])
    targets = torch.tensor([[1.0, 0.0, 0.0], [0.0, 1.0, 1.0]])
    micro = task.metrics(config, data)["micro_f1"](logits, targets)
    assert micro == pytest.approx(2 * 2 / (2 * 2 + 1 + 1))  # predicted {0, 2} and {2}: 2 hits, 1 false +, 1 missed
