"""The transfer experiment end to end on fixtures: MLM pretraining (exact resume), GLUE fine-tuning with a
search over seeds, the Table 3 layout and the commands."""

import json
import shutil
import statistics
from pathlib import Path

import pytest
import torch

from longattn.cli import main
from longattn.config import write_yaml
from longattn.experiment.config import resolve_config
from longattn.experiment.run import run
from longattn.experiment.transfer import PAPER_TABLE3, load_spec
from longattn.tasks import get_task
from longattn.train.checkpoint import load_checkpoint

GLUE_FIXTURES = Path(__file__).resolve().parents[1] / "data" / "fixtures" / "glue_data"
TINY_MLM = ["model.hidden_size=16", "model.layers=1", "model.heads=2", "model.intermediate_size=32",
            "data.max_len=16", "train.batch_size=4", "optim.warmup_steps=0", "train.eval_every=2",
            "data.subset.val=4", "data.subset.test=4", "train.progress=false"]


def _mlm_config(corpus, *extra):
    return resolve_config("mlm", "cpu", None, [f"data.data_dir={corpus}", *TINY_MLM, *extra], attention="fnet")


class Stop(Exception):
    pass


def test_mlm_pretraining_resumes_exactly(corpus, tmp_path):
    config = _mlm_config(corpus, "train.max_steps=4", "train.checkpoint_every=1")

    def stop(trainer, step):
        if step == 2:
            raise Stop

    with pytest.raises(Stop):
        run(config, tmp_path / "interrupted", on_step_end=stop)
    resumed = run(config, tmp_path / "interrupted", resume=True)
    straight = run(config, tmp_path / "straight")
    a = load_checkpoint(tmp_path / "interrupted" / "checkpoints" / "last.pt")["model"]
    b = load_checkpoint(tmp_path / "straight" / "checkpoints" / "last.pt")["model"]
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert resumed["val"] == straight["val"]
    # the masked-token metrics are those of the fixed validation masks: perplexity = exp(token-mean loss)
    val = straight["val"]
    assert val["perplexity"] == pytest.approx(2.718281828 ** val["loss"], rel=1e-5)
    assert 0 <= val["mlm_accuracy"] <= 1 and val["examples"] > 0


def test_missing_corpus_folder_is_a_clear_error(tmp_path):
    config = resolve_config("mlm", "cpu", None, TINY_MLM, attention="softmax")
    with pytest.raises(ValueError, match="set data.data_dir"):
        run(config, tmp_path / "out")


def _spec(tmp_path):
    spec = {
        "title": "tiny Table 3",
        "mechanisms": ["softmax", "fnet"],
        "pretrain": {"preset": "cpu", "set": [*TINY_MLM, "train.max_steps=2"]},
        "finetune": {"preset": "cpu", "tasks": ["sst2", "stsb"], "seeds": [0, 1],
                     "search": {"optim.lr": [1.0e-4, 1.0e-3]},
                     "set": ["train.epochs=1", "train.min_steps=null", "train.batch_size=2", "data.max_len=16",
                             "train.progress=false"]},
    }
    path = tmp_path / "tiny.yaml"
    write_yaml(spec, path)
    return path


def _best_from_run_folders(out, mechanism, task, metric):
    """The chosen cell recomputed from the runs' own results.json files: best mean over seeds."""
    points = {}
    for folder in sorted((out / "finetune" / mechanism).glob(f"{task}_*")):
        values = [100 * json.loads(f.read_text())["val"][metric] for f in sorted(folder.glob("seed*/results.json"))]
        points[folder.name] = values
    label, values = max(points.items(), key=lambda item: statistics.mean(item[1]))
    return label, values


def test_table3_grid_end_to_end(corpus, tmp_path, capsys):
    spec = _spec(tmp_path)
    out = tmp_path / "table3"
    args = ["table3", "--config", str(spec), "--corpus-dir", str(corpus), "--glue-dir", str(GLUE_FIXTURES),
            "--out", str(out)]
    assert main(args) == 0
    for name in ("softmax", "fnet"):
        assert (out / "pretrain" / name / "results.json").is_file()
    summary = json.loads((out / "results.json").read_text())
    assert summary["measured"] == ["sst2", "stsb"]
    for entry in summary["best"]:
        metric = {"sst2": "accuracy", "stsb": "spearman"}[entry["task"]]
        label, values = _best_from_run_folders(out, entry["mechanism"], entry["task"], metric)
        assert entry["values"] == pytest.approx(values)
        assert label.endswith(entry["point"].replace("/", "_"))
        assert entry["std"] == pytest.approx(statistics.stdev(values))
    table = (out / "table.md").read_text()
    assert "| BERT-Base (paper)" in table and "91.07" in table and "80.37" in table
    assert table.count("(table3)") == 2  # our two rows, labelled by the output folder
    assert (out / "table3.png").stat().st_size > 0
    # a second start with --resume trains nothing and writes the same table
    stamp = (out / "pretrain" / "fnet" / "results.json").stat().st_mtime_ns
    assert main([*args, "--resume"]) == 0
    assert (out / "pretrain" / "fnet" / "results.json").stat().st_mtime_ns == stamp
    assert json.loads((out / "results.json").read_text())["best"] == summary["best"]

    # `report finetune` rebuilds the table from the run folders, training nothing; split into two folders and
    # merged, the same; the same run in two folders is an error naming both
    def best(folder):
        entries = json.loads((folder / "results.json").read_text())["best"]
        return sorted(entries, key=lambda e: (e["mechanism"], e["task"]))

    assert main(["report", "finetune", "--run", str(out), "--out", str(tmp_path / "report")]) == 0
    assert best(tmp_path / "report") == best(out)
    for name in ("softmax", "fnet"):
        shutil.copytree(out / "finetune" / name, tmp_path / name / "finetune" / name)
    merged = ["report", "finetune", "--run", str(tmp_path / "softmax"), str(tmp_path / "fnet")]
    assert main([*merged, "--out", str(tmp_path / "merged")]) == 0
    assert best(tmp_path / "merged") == best(out)
    capsys.readouterr()
    assert main([*merged, str(out), "--out", str(tmp_path / "twice")]) == 2
    assert "finished in both" in capsys.readouterr().err and not (tmp_path / "twice").exists()
    assert main(merged) == 2 and "--out is required" in capsys.readouterr().err
    # runs that do not record the majority class (finished before runs did) get it from --data-dir
    floors = {(e["mechanism"], e["task"]): e["majority_class"] for e in best(tmp_path / "report")}
    assert floors[("softmax", "sst2")] > 0 and floors[("softmax", "stsb")] == 0.0
    old = tmp_path / "old"
    shutil.copytree(out / "finetune", old / "finetune")
    for path in (old / "finetune").rglob("results.json"):
        results = json.loads(path.read_text())
        del results["majority_class"]
        path.write_text(json.dumps(results))
    assert main(["report", "finetune", "--run", str(old), "--out", str(tmp_path / "old_report")]) == 0
    assert all(e["majority_class"] is None for e in best(tmp_path / "old_report"))
    assert main(["report", "finetune", "--run", str(old), "--data-dir", str(GLUE_FIXTURES), "--out",
                 str(tmp_path / "old_report")]) == 0
    assert {(e["mechanism"], e["task"]): e["majority_class"] for e in best(tmp_path / "old_report")} == floors

    # fine-tuning on its own from the pretraining folders: the mechanism comes from each folder
    finetune = ["finetune", "--pretrained", str(out / "pretrain" / "fnet"), "--config", str(spec), "--tasks", "sst2",
                "--glue-dir", str(GLUE_FIXTURES)]
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert main([*finetune, "--out", str(tmp_path / "finetune")]) == 0
        torch.set_num_threads(2)  # two workers of one thread each: the same runs, the same numbers
        assert main([*finetune, "--out", str(tmp_path / "finetune_workers"), "--workers", "2"]) == 0
    finally:
        torch.set_num_threads(threads)
    rows = json.loads((tmp_path / "finetune" / "results.json").read_text())["best"]
    assert [(r["mechanism"], r["task"]) for r in rows] == [("fnet", "sst2")]
    assert json.loads((tmp_path / "finetune_workers" / "results.json").read_text())["best"] == rows


def test_glue_batches_are_padded_to_their_longest_example():
    # SST-2 sentences average 13 WordPieces: padding every batch to data.max_len=128 would cost several
    # times the compute of padding to the longest sentence of the batch.
    config = resolve_config("glue_mrpc", "cpu", None, [f"data.data_dir={GLUE_FIXTURES}"], attention="softmax")
    data = get_task("glue_mrpc").build_data(config)
    items = [data.train[i] for i in range(len(data.train))]
    lengths = [len(item["input_ids"]) for item in items]
    assert len(set(lengths)) > 1 and max(lengths) < config.data.max_len == 128
    for batch_items in (items, items[1:2]):
        batch = data.collate(batch_items)
        assert batch["input_ids"].shape[1] == max(len(item["input_ids"]) for item in batch_items)
        assert batch["attention_mask"].sum(1).tolist() == [len(item["input_ids"]) for item in batch_items]


def test_pretrain_command_and_errors(corpus, tmp_path, capsys):
    out = tmp_path / "pre"
    assert main(["pretrain", "--attention", "ponet", "--preset", "cpu", "--data-dir", str(corpus),
                 *[a for s in [*TINY_MLM, "train.max_steps=2"] for a in ("--set", s)], "--out", str(out)]) == 0
    assert '"val_perplexity"' in capsys.readouterr().out and (out / "checkpoints" / "best.pt").is_file()
    assert main(["finetune", "--pretrained", str(tmp_path), "--glue-dir", str(GLUE_FIXTURES),
                 "--out", str(tmp_path / "x")]) == 2
    assert "no config.yaml there" in capsys.readouterr().err
    assert main(["finetune", "--pretrained", str(out), "--attentions", "softmax", "--glue-dir",
                 str(GLUE_FIXTURES), "--out", str(tmp_path / "x")]) == 2


def test_specs_shipped_and_checked(tmp_path):
    for name in ("table3_cpu", "table3_paper", "minilm"):
        spec = load_spec(name)
        assert set(spec["mechanisms"]) >= {"softmax", "skeleton"}
    recipe = load_spec("minilm")["finetune"]
    assert recipe["seeds"] == [0, 1, 2] and recipe["task_set"] == {"sst2": ["train.epochs=1"]}
    write_yaml({"mechanisms": ["softmax"], "finetune": {"task_set": {"sst3": []}}}, tmp_path / "typo.yaml")
    with pytest.raises(Exception, match="sst3"):
        load_spec(tmp_path / "typo.yaml")
    paper = load_spec("table3_paper")["finetune"]["search"]
    assert paper == {"optim.lr": [5e-5, 1e-4], "train.batch_size": [16, 32], "train.epochs": [4, 8, 12, 16, 20]}
    bad = tmp_path / "bad.yaml"
    write_yaml({"mechanisms": ["softmax"], "finetune": {"tasks": ["wnli"]}}, bad)
    with pytest.raises(Exception, match="WNLI is excluded"):
        load_spec(bad)
    write_yaml({"mechanisms": ["softmax"], "finetune": {"serch": {}}}, bad)
    with pytest.raises(ValueError, match="unknown key"):
        load_spec(bad)


def test_paper_rows_are_table3():
    # SKTformer Table 3 = S^3 Table 3: each row's average is the mean of its eight columns (to the rounding)
    from longattn.experiment.transfer import PAPER_AVERAGES

    for name, (title, scores) in PAPER_TABLE3.items():
        assert statistics.mean(scores.values()) == pytest.approx(PAPER_AVERAGES[name], abs=0.01), title


@pytest.mark.parametrize("task", ["mlm", "glue_sst2", "glue_stsb", "glue_mnli"])
@pytest.mark.parametrize("preset", ["cpu", "paper"])
def test_presets_resolve_to_table15(task, preset):
    config = resolve_config(task, preset, attention="skeleton")
    if preset == "paper" and task == "mlm":  # Table 15, pre-training column
        assert (config.train.max_steps, config.train.batch_size, config.data.max_len) == (1_000_000, 256, 512)
        assert (config.optim.lr, config.optim.warmup_steps) == (1e-4, 5000)
        assert (config.model["hidden_size"], config.model["layers"], config.model["heads"]) == (768, 12, 12)
    if task != "mlm":  # GLUE column: linear decay, clip 1, dropout 0.1, length 128, validation every epoch
        assert (config.optim.schedule, config.train.clip_norm, config.model["dropout"]) == ("linear", 1.0, 0.1)
        assert config.data.max_len == 128 and config.train.eval_every_epoch
        assert 4 <= config.train.epochs <= 20 or preset == "cpu"


def test_the_recipe_gives_its_budget_in_epochs_and_a_subset_larger_than_the_data_warns(capsys):
    config = resolve_config("glue_mrpc", "recipe", None, [f"data.data_dir={GLUE_FIXTURES}", "data.subset.train=5000"],
                            attention="skeleton")
    assert (config.train.epochs, config.train.min_steps, config.train.evals, config.train.patience) == (3, 300, 10, 3)
    assert (config.optim.lr, config.optim.new_lr, config.optim.warmup_ratio) == (5e-5, 1e-3, 0.06)
    assert config.data.subset.train == 5000 and config.model["pooling"] == "mean"
    data = get_task("glue_mrpc").build_data(config)
    assert f"data.subset.train=5,000 is larger than the train split of MRPC/train.tsv ({len(data.train)} examples)" \
        in capsys.readouterr().err


from reliability import CLEAR_ERROR, OUTPUT_FOLDERS, bad_input  # noqa: E402


@bad_input(OUTPUT_FOLDERS, CLEAR_ERROR, cases=2)  # pretrain and finetune into a folder holding their runs
def test_pretrain_and_finetune_refuse_an_out_with_runs_unless_told(corpus, tmp_path, capsys):
    from tests.commands.test_output_flags import stamps

    pre = tmp_path / "pre"
    pretrain = ["pretrain", "--attention", "fnet", "--preset", "cpu", "--data-dir", str(corpus),
                *[a for s in [*TINY_MLM, "train.max_steps=2"] for a in ("--set", s)], "--out", str(pre)]
    assert main(pretrain) == 0
    spec = tmp_path / "spec.yaml"
    write_yaml({"mechanisms": ["fnet"], "finetune": {"preset": "cpu", "tasks": ["sst2"], "seeds": [0],
                                                     "set": ["train.epochs=1", "train.min_steps=null", "train.batch_size=2",
                                                             "data.max_len=16", "train.progress=false"]}}, spec)
    out = tmp_path / "finetune"
    finetune = ["finetune", "--pretrained", str(pre), "--config", str(spec), "--glue-dir", str(GLUE_FIXTURES),
                "--out", str(out)]
    assert main(finetune) == 0
    for argv, folder in ((pretrain, pre), (finetune, out)):
        before = stamps(folder)
        capsys.readouterr()
        assert main(argv) == 2
        assert "already hold" in capsys.readouterr().err and stamps(folder) == before
    assert main([*finetune, "--overwrite"]) == 0
    assert all(stamp != before[name] for name, stamp in stamps(out).items() if name in before)


def test_the_majority_class_is_recorded_and_the_table_measures_shares_above_it(tmp_path):
    """Each GLUE run records what always answering the most frequent training label scores on dev; with a
    reference, the table gives beside the plain share the share of the reference's gain over that floor, so that
    a model at the majority class reads 0% however high the metric of a constant answer is (MRPC's F1)."""
    from longattn.experiment.grid import Cell
    from longattn.experiment.transfer import write_transfer_table

    task = get_task("glue_sst2")
    data = task.build_data(resolve_config("glue_sst2", "recipe", None, [f"data.data_dir={GLUE_FIXTURES}"]))
    labels = [int(v) for v in data.train.labels]
    majority = max(set(labels), key=labels.count)
    expected = sum(int(v) == majority for v in data.val.labels) / len(data.val.labels)
    assert task.describe(None, data, {}) == {"majority_class": {"accuracy": pytest.approx(expected)}}
    stsb = get_task("glue_stsb")
    assert stsb.describe(None, stsb.build_data(resolve_config(
        "glue_stsb", "recipe", None, [f"data.data_dir={GLUE_FIXTURES}"])), {}) == {"majority_class": None}

    def cell(name, task, score, majority):
        return Cell(name, f"{task}/default", f"glue_{task}", explicit={"attention": name},
                    results=[{"seed": 0, "val": {"acc_and_f1": score, "spearman": score}, "majority_class": majority}])

    mrpc_floor = {"accuracy": 0.684, "f1": 0.812, "acc_and_f1": 0.748}
    cells = [cell("softmax", "mrpc", 0.805, mrpc_floor), cell("skeleton", "mrpc", 0.748, mrpc_floor),
             cell("nystrom", "mrpc", 0.7765, mrpc_floor), cell("softmax", "stsb", 0.85, None),
             cell("skeleton", "stsb", 0.425, None)]
    summary = write_transfer_table({"title": "t"}, cells, tmp_path, label="MiniLM", reference="softmax")
    assert summary["kept_percent"]["skeleton"]["mrpc"] == pytest.approx(100 * 0.748 / 0.805)
    above = summary["kept_above_majority_percent"]
    assert above["skeleton"]["mrpc"] == pytest.approx(0.0) and above["nystrom"]["mrpc"] == pytest.approx(50.0)
    assert above["skeleton"]["stsb"] == pytest.approx(50.0)  # a correlation's floor is 0
    table = (tmp_path / "table.md").read_text()
    assert "gain over the majority class" in table and "MRPC 74.80" in table
