"""The MQAR task on the one run path and Zoology's Figure 2 sweep end to end (tiny sizes): the learning rate is
chosen on validation, the first seed's search run is reused, the sweep resumes per cell and seed, and the table,
results and plot are written; training mixtures: their data, their per-length scores, one model per row, width,
rate and seed reported at every length."""

import json
import shutil

import pytest
import torch

from longattn import attention
from longattn.config import ConfigError
from longattn.data.mqar import IGNORE
from longattn.experiment.config import resolve_config
from longattn.experiment.recall import (estimate_sweep_cost, load_recall_sweep, plan_sweep, run_recall_sweep,
                                       write_cost_estimate)
from longattn.experiment.run import run
from longattn.tasks.base import get_task
from longattn.tasks.mqar import recall_step

TINY = ["data.train_examples=16", "data.val_examples=8", "data.test_examples=8", "train.epochs=1",
        "train.progress=false"]


def test_task_trains_and_records_its_form(tmp_path):
    config = resolve_config("mqar", "cpu", None, [*TINY, "model.dim=8"], attention="skeleton")
    assert config.data.vocab_size == 8192 and config.model["hidden"] == 0 and config.optim.weight_decay == 0.1
    results = run(config, tmp_path / "run")
    assert results["form"] == "bidirectional" and results["seq_len"] == 64 and results["test"]["examples"] == 8
    assert 0.0 <= results["test"]["accuracy"] <= 1.0
    causal = resolve_config("mqar", "cpu", None, [*TINY, "model.dim=8"], attention="linear")
    assert get_task("mqar").form(causal) == "causal"
    with pytest.raises(ConfigError, match="too short"):
        run(resolve_config("mqar", "cpu", None, [*TINY, "data.seq_len=8"], attention="softmax"), tmp_path / "bad")


def test_same_seed_same_data_other_seed_other_data():
    task = get_task("mqar")
    a, b, c = (task.build_data(resolve_config("mqar", "cpu", None, TINY, attention="softmax", seed=s))
               for s in (0, 0, 1))
    assert a.train.segments[0].inputs.equal(b.train.segments[0].inputs)
    assert not a.train.segments[0].inputs.equal(c.train.segments[0].inputs)
    assert not a.train.segments[0].inputs[:8].equal(a.val.segments[0].inputs)


def test_shipped_sweep_plans_every_mechanism():
    spec = load_recall_sweep("zoology_fig2")
    plan = plan_sweep(spec, "cpu")
    short = {row.attention for arm in plan.arms if arm.max_len <= 256 for row in arm.rows}
    assert {"softmax", "skeleton", "singular", "fsat", "skein", "nystrom", "performer", "linformer", "linear",
            "cosformer", "local", "bigbird", "luna", "flash"} <= short
    # the cpu preset: one model on the main lengths' mixture, tested at each; the long arm one model per length
    assert [arm.lengths for arm in plan.arms] == [((64, 4), (128, 8), (256, 16)), ((1024, 64),), ((4096, 256),)]
    assert plan.arms[0].train_mix and [n for _, n, _ in plan.tested()] == [64, 128, 256, 1024, 4096]
    assert plan.widths == [64, 128, 256]
    long_rows = {row.attention for arm in plan.arms[1:] for row in arm.rows}
    assert all(attention.capabilities(name).subquadratic for name in long_rows - {"softmax"})
    # a mixture's model takes its longest length's budgets; a run's config holds only its own mechanism's options
    rows = {row.name: row for row in plan.arms[0].rows}
    config = resolve_config("mqar", "cpu", None, plan.cell(rows["nystrom"], plan.arms[0], 64, 1e-3).overrides,
                            attention="nystrom")
    assert config.attention_options == {"nystrom": {"num_landmarks": 64}}
    assert [(s.seq_len, s.num_kv_pairs) for s in config.data.train_mix] == [(64, 4), (128, 8), (256, 16)]
    assert config.train.group_by_length and config.train.epochs == spec["presets"]["cpu"]["mix_set"]["train.epochs"]
    per_length = plan_sweep(spec, "cpu", per_length=True, lengths=[64])
    assert [arm.lengths for arm in per_length.arms] == [((64, 4),)] and not per_length.arms[0].train_mix
    config = resolve_config("mqar", "cpu", None, per_length.cell(rows["nystrom"], per_length.arms[0], 64, 1e-3)
                            .overrides, attention="nystrom")
    assert config.attention_options == {"nystrom": {"num_landmarks": 16}} and config.data.seq_len == 64
    paper = plan_sweep(spec, "paper", lengths=[256])  # Zoology's Figure 2: one model per length
    assert paper.batch_size[256] == 256 and len(paper.lrs) == 4 and [a.lengths for a in paper.arms] == [((256, 16),)]
    with pytest.raises(ConfigError, match="not in the sweep"):
        plan_sweep(spec, "cpu", lengths=[100])
    with pytest.raises(ConfigError, match="no preset"):
        plan_sweep(spec, "laptop")


def test_sweep_searches_on_validation_reuses_and_resumes(tmp_path, monkeypatch):
    spec = load_recall_sweep("zoology_fig2")
    plan = plan_sweep(spec, "cpu", attentions=["softmax", "softmax-bidirectional", "nystrom"], lengths=[64],
                      widths=[8], seeds=[0, 1], lrs=[1e-3, 3e-3], extra_overrides=TINY, per_length=True)
    assert plan.runs() == 3 * (2 + 1)
    out = tmp_path / "fig2"
    summary = run_recall_sweep(plan, out)
    cells = {c["row"]: c for c in summary["cells"]}
    assert set(cells) == {"softmax", "softmax-bidirectional", "nystrom"}
    for cell in cells.values():
        assert cell["error"] is None and cell["seeds"] == [0, 1] and len(cell["test"]) == 2
        search = {float(lr): acc for lr, acc in cell["lr_search"].items()}
        assert cell["lr"] == max(search, key=lambda lr: (search[lr], -lr)) or search[cell["lr"]] == max(search.values())
        # the first seed's result is its search run at the chosen rate
        run_folder = out / cell["row"] / "N64_K4" / "d8" / f"lr{cell['lr']:.3g}"
        assert json.loads((run_folder / "seed0" / "results.json").read_text())["test"]["accuracy"] * 100 == \
            pytest.approx(cell["test"][0])
        assert (run_folder / "seed1" / "results.json").is_file()
    assert cells["softmax"]["form"] == "causal" and cells["softmax-bidirectional"]["form"] == "bidirectional"
    assert cells["nystrom"]["difference"]["n"] == 2 and cells["softmax"]["difference"] is None
    table = (out / "table.md").read_text()
    assert "N = 64, K = 4" in table and "| nystrom" in table and "Paired difference from softmax" in table
    assert (out / "zoology_fig2.png").stat().st_size > 0
    assert json.loads((out / "results.json").read_text())["provenance"]["seeds"] == [0, 1]

    # resumable per cell and seed: a lost seed (its whole folder; a finished run's marker also holds its results)
    # is retrained, nothing else
    shutil.rmtree(out / "nystrom" / "N64_K4" / "d8" / f"lr{cells['nystrom']['lr']:.3g}" / "seed1")
    trained = []
    import longattn.experiment.grid as grid

    real_run = grid.run
    monkeypatch.setattr(grid, "run", lambda config, folder, **kw: trained.append(folder) or real_run(config, folder, **kw))
    again = run_recall_sweep(plan, out, resume=True)
    assert [f.parts[-5:] for f in trained] == [("nystrom", "N64_K4", "d8", f"lr{cells['nystrom']['lr']:.3g}", "seed1")]
    assert {c["row"]: c["test"] for c in again["cells"]}["softmax"] == cells["softmax"]["test"]


def test_cost_estimate_measures_every_cell(tmp_path):
    spec = load_recall_sweep("zoology_fig2")
    plan = plan_sweep(spec, "cpu", attentions=["softmax", "linear"], lengths=[64], widths=[8, 16],
                      extra_overrides=TINY, per_length=True)
    cost = estimate_sweep_cost(plan, steps=1, log=lambda line: None)
    assert len(cost["cells"]) == 4 and all(c["step_s"] > 0 and c["runs"] == len(plan.lrs) + 2 for c in cost["cells"])
    assert cost["cells"][0]["steps"] == 1  # 16 examples, one epoch, one batch
    assert cost["total_s"] == pytest.approx(sum(c["cell_s"] for c in cost["cells"]))
    assert {(c["device"], c["clock"]) for c in cost["cells"]} == {("cpu", "process CPU time of one thread")}
    text = write_cost_estimate(cost, tmp_path)
    assert "N=64 d=16" in text and (tmp_path / "cost.json").is_file() and "Not measured" not in text
    # out of time for measuring: the cells not reached are listed, not counted
    late = estimate_sweep_cost(plan, steps=1, log=lambda line: None, budget_s=-1.0)
    assert late["cells"] == [] and [(c["row"], c["width"]) for c in late["unmeasured"]] == [
        ("softmax", 8), ("linear", 8), ("softmax", 16), ("linear", 16)]
    assert "Not measured (the time for measuring ran out; the total leaves them out): softmax N=64 d=8" in \
        write_cost_estimate(late)


MIX = ["data.val_examples=8", "data.test_examples=8", "train.epochs=1", "train.progress=false"]


def test_mixture_sweep_reports_every_length_from_one_model(tmp_path, monkeypatch):
    """The cpu preset's main arm: one model per (row, width, rate, seed), trained on the mixture, a result per
    tested length; the cost estimate weighs each segment's steps."""
    spec = load_recall_sweep("zoology_fig2")
    spec["presets"]["cpu"]["train_mix"] = [(64, 4, 24), (128, 8, 8)]
    spec["lengths"] = [(64, 4), (128, 8)]
    plan = plan_sweep(spec, "cpu", attentions=["softmax", "linear"], lengths=[64], widths=[8], seeds=[0, 1],
                      lrs=[1e-3], extra_overrides=MIX)
    assert len(plan.arms) == 1 and plan.runs() == 2 * 2
    out = tmp_path / "mix"
    summary = run_recall_sweep(plan, out)
    cells = {(c["row"], c["seq_len"]): c for c in summary["cells"]}
    assert set(cells) == {("softmax", 64), ("softmax", 128), ("linear", 64), ("linear", 128)}
    run = json.loads((out / "softmax" / "mix" / "d8" / "lr0.001" / "seed0" / "results.json").read_text())
    assert run["train_mix"] == [[64, 4, 24], [128, 8, 8]] and run["test"]["examples"] == 16
    for (row, n), cell in cells.items():
        metric = f"accuracy_{n}x{n // 16}"
        assert cell["test"][0] == pytest.approx(100 * json.loads(
            (out / row / "mix" / "d8" / "lr0.001" / "seed0" / "results.json").read_text())["test"][metric])
        assert cell["seeds"] == [0, 1] and cell["train_mix"] == [[64, 4, 24], [128, 8, 8]]
    assert cells[("linear", 128)]["difference"]["n"] == 2
    table = (out / "table.md").read_text()
    assert "N = 128, K = 8: test accuracy (%) of the model trained on the mixture" in table
    cost = estimate_sweep_cost(plan, steps=1, log=lambda line: None)
    assert [c["arm"] for c in cost["cells"]] == ["mixture", "mixture"]
    assert cost["cells"][0]["steps"] == 1 + 1  # a batch of each segment


def test_command_line(tmp_path, capsys):
    from longattn.cli import main

    tiny = ["--per-length", "--set", *TINY]  # the cpu preset's mixture would train 140,000 sequences
    assert main(["paper", "zoology-fig2", "--attentions", "softmax", "linear", "--lengths", "64", "--widths", "8",
                 "--seeds", "0", "--lrs", "1e-3", *tiny, "--out", str(tmp_path / "fig2")]) == 0
    results = json.loads((tmp_path / "fig2" / "results.json").read_text())
    assert [c["row"] for c in results["cells"]] == ["softmax", "linear"] and results["lrs"] == [1e-3]
    assert main(["paper", "zoology-fig2", "--attentions", "softmax", "--lengths", "64", "--widths", "8", *tiny,
                 "--estimate", "--out", str(tmp_path / "cost")]) == 0
    assert (tmp_path / "cost" / "cost.md").is_file()
    assert main(["paper", "zoology-fig2", "--attentions", "softmx", "--out", str(tmp_path / "x")]) == 2
    assert "softmx" in capsys.readouterr().err


MIX_DATA = ["data.train_mix=[{seq_len: 16, num_kv_pairs: 2, examples: 12}, "
            "{seq_len: 32, num_kv_pairs: 4, examples: 6}]",
            "data.eval_lengths=[[16, 2], [32, 4]]", "data.val_examples=5", "data.test_examples=3"]


def test_mixture_data_is_deterministic_and_scored_per_length():
    """Each (split, configuration) is its own stream of the run's seed; the validation and test splits hold
    every evaluated configuration; a mixed batch scores only real queries and the per-length accuracies are
    those of each configuration's sequences; bad mixtures are clear errors."""
    task = get_task("mqar")
    config = resolve_config("mqar", "cpu", None, MIX_DATA, attention="softmax", seed=0)
    a, b = task.build_data(config), task.build_data(config)
    assert [len(s) for s in a.train.segments] == [12, 6] and [len(s) for s in a.val.segments] == [5, 5]
    assert all(x.inputs.equal(y.inputs) for x, y in zip(a.train.segments + a.test.segments,
                                                        b.train.segments + b.test.segments))
    assert not a.train.segments[0].inputs[:5].equal(a.val.segments[0].inputs)
    other = task.build_data(resolve_config("mqar", "cpu", None, MIX_DATA, attention="softmax", seed=1))
    assert not a.train.segments[0].inputs.equal(other.train.segments[0].inputs)
    # a configuration's sequences do not depend on the others evaluated with it
    alone = task.build_data(resolve_config("mqar", "cpu", None, [*MIX_DATA, "data.eval_lengths=[[32, 4]]"],
                                           attention="softmax", seed=0))
    assert alone.test.segments[0].inputs.equal(a.test.segments[1].inputs)
    assert task.model_inputs(config, a)["max_len"] == 32
    metrics = task.metrics(config, a)
    assert set(metrics) == {"accuracy", "accuracy_16x2", "accuracy_32x4"}
    batch = a.collate([a.test[0], a.test[3]])  # one sequence of each length
    assert batch["answers"].shape == (2, 4)

    class Oracle(torch.nn.Module):  # answers the first sequence right, the second wrong after its first query
        def __init__(self, answers):
            super().__init__()
            self.answers = answers.clamp(min=0)

        def forward(self, tokens, positions):
            assert positions.shape == self.answers.shape
            logits = torch.zeros(*positions.shape, 8192).scatter_(-1, self.answers.unsqueeze(-1), 1.0)
            logits[1, 1:, :] = 0
            logits[1, 1:, 0] = 1.0
            return logits

    out = recall_step(Oracle(batch["answers"]), batch)
    assert torch.equal(out.targets[0, 2:], torch.full((2,), IGNORE))  # the short sequence's padded slots: not scored
    assert metrics["accuracy_16x2"](out.predictions, out.targets) == 1.0
    assert metrics["accuracy_32x4"](out.predictions, out.targets) == 0.25
    assert metrics["accuracy"](out.predictions, out.targets) == pytest.approx((1.0 + 0.25) / 2)
    # a batch of short sequences only: logits at its 2 slots, predictions and targets padded to the task's 4
    short = a.collate([a.test[0], a.test[1]])
    assert short["answers"].shape == (2, 2)
    padded = task.step_fn(config, a)(Oracle(short["answers"]), short)
    assert padded.predictions.shape == padded.targets.shape == (2, 4)
    assert torch.equal(padded.targets[:, 2:], torch.full((2, 2), IGNORE))
    assert metrics["accuracy_16x2"](padded.predictions, padded.targets) == 0.75  # 2/2 and 1/2
    with pytest.raises(ValueError, match="query_width=1 is below the batch's 2 query slots"):
        recall_step(Oracle(short["answers"]), short, query_width=1)
    for bad, message in (("data.eval_lengths=[[32, 4], [64, 4]]", "differ in num_kv_pairs"),
                         ("data.eval_lengths=[[32]]", "must be"),
                         ("data.train_mix=[{seq_len: 16, num_kv_pairs: 8, examples: 4}]", "too short")):
        with pytest.raises(ConfigError, match=message):
            task.build_data(resolve_config("mqar", "cpu", None, [*MIX_DATA, bad], attention="softmax"))


def test_mixture_batches_hold_one_length(tmp_path):
    """With one length window for the epoch (what the sweep sets), every batch holds one sequence length but
    where two lengths meet."""
    from longattn.train.loop import Trainer

    config = resolve_config("mqar", "cpu", None, [*MIX_DATA, "train.group_by_length=true",
                                                  "train.length_window=1000000", "train.batch_size=4"],
                            attention="softmax")
    task = get_task("mqar")
    data = task.build_data(config)
    lengths = data.train.lengths()
    trainer = Trainer(torch.nn.Linear(1, 1), data.train, data.val, data.test, data.collate, recall_step,
                      task.metrics(config, data), train=config.train, optim=config.optim, out_dir=tmp_path)
    batches = trainer._epoch_batches(0)
    assert sorted(i for batch in batches for i in batch) == list(range(18))
    assert sum(len({lengths[i] for i in batch}) > 1 for batch in batches) <= 1
