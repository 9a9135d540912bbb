"""The generic Trainer: exact resume, accumulation, schedules, early stopping, aux losses, evaluation."""

from __future__ import annotations

import dataclasses
import json
import math

import pytest
import torch
from torch import nn

from longattn.attention import AttentionBase
from longattn.experiment.config import resolve_config
from longattn.experiment.run import run
from longattn.train.checkpoint import load_checkpoint, save_atomic
from longattn.train.loop import StepOutput, Trainer, accuracy, build_scheduler, mae, mse
from longattn.train.settings import OptimConfig, TrainConfig


@pytest.fixture(autouse=True)
def _stub(lra_stub_data):
    """LRA runs below use the in-memory stand-in for the LRA data."""


def tiny_config(*overrides: str, task: str = "listops"):
    # short ListOps trees (LRA's are 500-2,000 tokens): a run costs seconds, not a minute
    base = ["train.max_steps=12", "train.eval_every=4", "train.batch_size=8", "data.options.num_examples=40",
            "data.options.min_length=20", "data.options.max_length=120",
            "optim.lr=3e-3", "optim.warmup_steps=2", "model.dim=16", "model.hidden=32", "train.progress=false",
            "train.min_evals=1"]  # the validations these tests count
    return resolve_config(task, attention="softmax", overrides=[*base, *overrides])


def loop_settings(**values) -> dict:
    """Trainer keyword arguments from flat settings (train, optim, seed and selection in one call); the
    validation interval as given (min_evals 1) unless a test sets min_evals."""
    values.setdefault("min_evals", 1)
    optim = {k: values.pop(k) for k in list(values) if k in OptimConfig.__dataclass_fields__}
    chosen = {k: values.pop(k) for k in ("select_metric", "select_mode", "seed") if k in values}
    return {"train": TrainConfig(**values), "optim": OptimConfig(**optim), **chosen}


def final_state(out_dir) -> tuple[dict, list[dict], dict]:
    results = json.loads((out_dir / "results.json").read_text())
    # every record but the elapsed training time (a clock reading, never bit-identical)
    lines = [{k: v for k, v in json.loads(line).items() if k != "train_time_s"}
             for line in (out_dir / "metrics.jsonl").read_text().splitlines()]
    weights = load_checkpoint(out_dir / "checkpoints" / "last.pt")["model"]
    return results, lines, weights


class Interrupt(Exception):
    pass


def interrupt_at(step_to_stop: int):
    def hook(trainer: Trainer, step: int) -> None:
        if step == step_to_stop:
            raise Interrupt

    return hook


@pytest.mark.parametrize("checkpoint_every", [None, 3])
def test_interrupted_and_resumed_run_is_bit_identical(tmp_path, checkpoint_every):
    # 40 examples / batch 8 = 5 batches per epoch, so step 10 lies mid-epoch; dropout draws from the RNG.
    overrides = ["model.dropout=0.3", "model.embedding_dropout=0.2", "train.max_steps=14", "train.grad_accum=2",
                 "data.options.num_examples=36"]
    if checkpoint_every:
        overrides.append(f"train.checkpoint_every={checkpoint_every}")
    config = tiny_config(*overrides)
    run(config, tmp_path / "full")
    with pytest.raises(Interrupt):
        run(config, tmp_path / "cut", on_step_end=interrupt_at(10))
    resumed = run(config, tmp_path / "cut", resume=True)
    full_results, full_lines, full_weights = final_state(tmp_path / "full")
    cut_results, cut_lines, cut_weights = final_state(tmp_path / "cut")
    assert resumed["steps"] == 14
    for key in ("val", "test", "best_step", "steps", "epochs"):
        assert cut_results[key] == full_results[key], key
    assert cut_lines == full_lines
    for name, tensor in full_weights.items():
        assert torch.equal(tensor, cut_weights[name]), name


def test_resume_without_checkpoint_starts_fresh(tmp_path, capsys):
    results = run(tiny_config("train.max_steps=2", "train.eval_every=2"), tmp_path, resume=True)
    assert results["steps"] == 2
    assert "starting from scratch" in capsys.readouterr().err


def test_results_json_and_learning(tmp_path):
    results = run(tiny_config("train.max_steps=100", "train.eval_every=20", "data.options.num_examples=64"),
                      tmp_path)
    saved = json.loads((tmp_path / "results.json").read_text())
    for key in ("task", "attention", "options", "seed", "parameters", "val", "test", "train_time_s",
                "peak_memory_mb", "config", "provenance"):
        assert key in saved, key
    assert saved["config"]["model"]["dim"] == 16
    assert (tmp_path / "config.yaml").is_file()
    # majority-of-upper-half labels are learnable: well above the 50% chance level
    assert results["val"]["accuracy"] > 0.7
    assert results["test"]["examples"] == 64  # every example evaluated: no drop_last


def test_evaluation_counts_every_example_once(tmp_path):
    results = run(tiny_config("train.max_steps=1", "train.eval_every=1", "train.eval_batch_size=5", "optim.warmup_steps=0",
                                  "data.val.num_examples=13", "data.test.num_examples=11"), tmp_path)
    assert results["val"]["examples"] == 13
    assert results["test"]["examples"] == 11


def test_dual_tower_retrieval_trains(tmp_path):
    results = run(tiny_config("train.max_steps=2", "train.eval_every=2", task="retrieval"), tmp_path)
    assert results["test"]["examples"] == 40
    assert math.isfinite(results["test"]["loss"])


def test_bf16_autocast_on_cpu(tmp_path):
    results = run(tiny_config("train.max_steps=2", "train.eval_every=2", "train.precision=bf16"), tmp_path)
    assert math.isfinite(results["val"]["loss"])


def test_fp16_needs_cuda(tmp_path):
    if torch.cuda.is_available():
        pytest.skip("CUDA present: fp16 is allowed")
    with pytest.raises(ValueError, match="fp16"):
        run(tiny_config("train.precision=fp16"), tmp_path)


def test_early_stopping_when_validation_does_not_improve(tmp_path):
    # A learning rate far too small to change any prediction: validation never improves after the first check.
    results = run(tiny_config("train.max_steps=40", "train.eval_every=2", "train.patience=2", "optim.lr=1e-12",
                                  "optim.schedule=constant", "optim.warmup_steps=0"), tmp_path)
    assert results["stopped_early"]
    assert results["steps"] == 6 and results["best_step"] == 2


def test_stop_at_a_target_metric(tmp_path):
    # accuracy >= 0 holds at the first validation; a loss target of 0 (mode min) is never met
    results = run(tiny_config("train.stop_at=0.0", "train.eval_every=2"), tmp_path / "max")
    assert results["stopped_early"] and results["steps"] == 2
    results = run(tiny_config("train.stop_at=1.5"), tmp_path / "unreached")  # accuracy never exceeds 1
    assert not results["stopped_early"] and results["steps"] == 12
    # lower is better: a loss target far above the loss is met at once, a negative one never
    g = torch.Generator().manual_seed(0)
    data = [(torch.randn(3, 4, generator=g), torch.randn((), generator=g)) for _ in range(8)]
    for target, steps in ((1e6, 2), (-1.0, 6)):
        settings = loop_settings(max_steps=6, eval_every=2, batch_size=4, stop_at=target, select_metric="mse",
                                 select_mode="min", progress=False)
        results = Trainer(Regressor(), data, data[:4], None, collate_regression, regression_step, {"mse": mse},
                          **settings, out_dir=tmp_path / f"min{steps}").fit()
        assert results["steps"] == steps and results["stopped_early"] == (steps == 2)


def _weights_after(tmp_path, *overrides: str) -> dict:
    run(tiny_config("model.dropout=0", "model.embedding_dropout=0", "optim.schedule=constant",
                        "optim.warmup_steps=0", "data.options.num_examples=16", "data.options.min_length=24",
                        *overrides), tmp_path)
    return load_checkpoint(tmp_path / "checkpoints" / "last.pt")["model"]


def test_gradient_accumulation_matches_the_large_batch(tmp_path):
    # Equal-length sequences, no dropout: 2 micro-batches of 4 give the gradient of one batch of 8.
    # A large Adam eps makes the update ~linear in the gradient, so float noise in near-zero
    # gradients cannot flip a sign and the comparison stays tight.
    big = _weights_after(tmp_path / "big", "train.batch_size=8", "train.max_steps=2", "train.eval_every=2",
                         "optim.eps=1.0")
    small = _weights_after(tmp_path / "small", "train.batch_size=4", "train.grad_accum=2", "train.max_steps=2",
                           "train.eval_every=2", "optim.eps=1.0")
    for name in big:
        torch.testing.assert_close(small[name], big[name], rtol=1e-4, atol=1e-6)
    single = _weights_after(tmp_path / "single", "train.batch_size=4", "train.max_steps=2", "train.eval_every=2",
                            "optim.eps=1.0")
    assert not all(torch.allclose(single[n], big[n]) for n in big)  # the check can fail


def test_gradient_clipping_shrinks_the_update(tmp_path):
    # With Adam eps = 1 the first update is ~lr * grad, so clipping the gradient norm to 1e-4 must
    # shrink the step by orders of magnitude.
    common = ("train.max_steps=1", "train.eval_every=1", "optim.eps=1.0")
    initial = _weights_after(tmp_path / "initial", *common, "optim.lr=1e-30")
    free = _weights_after(tmp_path / "free", *common)
    clipped = _weights_after(tmp_path / "clipped", *common, "train.clip_norm=1e-4")
    def step_norm(weights: dict) -> float:
        return sum(float((weights[n] - initial[n]).norm() ** 2) for n in initial) ** 0.5

    assert 0 < step_norm(clipped) < step_norm(free) / 100


@pytest.mark.parametrize("schedule", ["constant", "linear", "cosine", "onecycle"])
def test_schedules(schedule):
    settings = OptimConfig(lr=1.0, warmup_steps=2, schedule=schedule, min_lr_ratio=0.1)
    param = nn.Parameter(torch.zeros(1))
    optimizer = torch.optim.AdamW([param], lr=1.0)
    scheduler = build_scheduler(optimizer, settings, max_steps=10)
    lrs = []
    for _ in range(10):
        lrs.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        scheduler.step()
    if schedule == "onecycle":
        assert lrs[0] == pytest.approx(1.0 / 25) and max(lrs) == pytest.approx(1.0) and lrs[-1] < 1e-3
        return
    assert lrs[:2] == pytest.approx([0.5, 1.0])  # linear warmup
    if schedule == "constant":
        assert lrs[2:] == pytest.approx([1.0] * 8)
    else:
        assert all(a >= b for a, b in zip(lrs[2:], lrs[3:])) and lrs[-1] >= 0.1
        expected = 0.1 + 0.9 * (1 - 7 / 8) if schedule == "linear" else 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 7 / 8))
        assert lrs[-1] == pytest.approx(expected)


# --------------------------------------------------------------------------- a non-LRA use of the Trainer


class ScaledAttention(AttentionBase):
    """A deliberately trivial, unregistered mechanism that records an auxiliary loss."""

    def __init__(self, dim: int) -> None:
        super().__init__(dim=dim, heads=1)
        self.scale = nn.Parameter(torch.ones(()))

    def attend(self, x, attention_mask, layer_state):
        if self.training:
            self.add_aux_loss("scale_penalty", 100.0 * (self.scale - 3.0) ** 2)
        return x * self.scale


class Regressor(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.mix = ScaledAttention(4)
        self.out = nn.Linear(4, 1)

    def forward(self, x):
        return self.out(self.mix(x)).squeeze(-1).mean(-1)


def regression_step(model, batch):
    prediction = model(batch["x"])
    return StepOutput(nn.functional.mse_loss(prediction, batch["y"]), prediction, batch["y"])


def collate_regression(items):
    return {"x": torch.stack([i[0] for i in items]), "y": torch.stack([i[1] for i in items])}


def test_trainer_is_generic_and_adds_aux_losses(tmp_path):
    g = torch.Generator().manual_seed(0)
    data = [(torch.randn(3, 4, generator=g), torch.randn((), generator=g)) for _ in range(16)]
    settings = loop_settings(max_steps=30, eval_every=10, batch_size=4, lr=0.05, schedule="constant",
                             select_metric="mae", select_mode="min", progress=False, log_every=10)
    mae = lambda p, t: float((p - t).abs().mean())  # noqa: E731
    model = Regressor()
    results = Trainer(model, data, data[:5], data[:7], collate_regression, regression_step, {"mae": mae},
                      **settings, out_dir=tmp_path, run_info={"experiment": "toy"}).fit()
    # the aux penalty pulls the scale towards 3 although the task loss alone would not
    assert abs(model.mix.scale.item() - 3.0) < abs(1.0 - 3.0)
    assert results["experiment"] == "toy" and results["test"]["examples"] == 7
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert records[0]["split"] == "train" and records[0]["aux_loss"] > 0


def test_accuracy_metric():
    logits = torch.tensor([[0.1, 0.9], [0.8, 0.2], [0.3, 0.7]])
    assert accuracy(logits, torch.tensor([1, 0, 0])) == pytest.approx(2 / 3)


def test_bad_select_metric(tmp_path):
    with pytest.raises(ValueError, match="select_metric"):
        Trainer(Regressor(), [1], None, None, list, regression_step, {"mae": accuracy},
                **loop_settings(select_metric="accuracy"), out_dir=tmp_path)


def test_step_schedule_decays_per_epoch():
    settings = OptimConfig(lr=1.0, schedule="step", step_decay=0.5)
    param = nn.Parameter(torch.zeros(1))
    optimizer = torch.optim.Adam([param], lr=1.0)
    scheduler = build_scheduler(optimizer, settings, max_steps=10, steps_per_epoch=3)
    lrs = []
    for _ in range(7):
        lrs.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        scheduler.step()
    assert lrs == pytest.approx([1.0] * 3 + [0.5] * 3 + [0.25])


def test_regression_metrics():
    predictions, targets = torch.tensor([[1.0, 2.0], [3.0, 5.0]]), torch.tensor([[1.0, 0.0], [4.0, 5.0]])
    assert mse(predictions, targets) == pytest.approx(5 / 4) and mae(predictions, targets) == pytest.approx(3 / 4)


def test_epoch_options_and_min_selection(tmp_path):
    # 18 examples, batch 4: 5 batches, 4 with drop_last, 3 with the cap; validation after each epoch.
    g = torch.Generator().manual_seed(0)
    data = [(torch.randn(3, 4, generator=g), torch.randn((), generator=g)) for _ in range(18)]
    settings = loop_settings(epochs=2, batch_size=4, lr=0.01, schedule="step", optimizer="adam", drop_last=True,
                             eval_every_epoch=True, select_metric="mse", select_mode="min", progress=False)
    trainer = Trainer(Regressor(), data, data[:5], data[:7], collate_regression, regression_step, {"mse": mse},
                      **settings, out_dir=tmp_path / "a")
    assert isinstance(trainer.optimizer, torch.optim.Adam) and not isinstance(trainer.optimizer, torch.optim.AdamW)
    results = trainer.fit()
    assert trainer.steps_per_epoch == 4 and results["steps"] == 8
    assert [r["step"] for r in results["history"]] == [4, 8] and [r["epoch"] for r in results["history"]] == [0, 1]
    assert [r["lr"] for r in results["history"]] == pytest.approx([0.01, 0.005])
    best = min(results["history"], key=lambda r: r["mse"])
    assert results["best_step"] == best["step"] and results["val"]["mse"] == best["mse"]
    assert not (tmp_path / "a" / "results.json").exists()
    capped = {**settings, "train": dataclasses.replace(settings["train"], max_steps_per_epoch=3)}
    trainer = Trainer(Regressor(), data, data[:5], None, collate_regression, regression_step, {"mse": mse},
                      **capped, out_dir=tmp_path / "b")
    assert trainer.steps_per_epoch == 3 and trainer.settings.max_steps == 6 and trainer.settings.eval_every == 3


def test_resume_refuses_another_fingerprint(tmp_path):
    data = [(torch.zeros(3, 4), torch.zeros(())) for _ in range(4)]
    settings = loop_settings(max_steps=2, eval_every=2, batch_size=2, progress=False, select_metric="loss",
                             select_mode="min")
    make = lambda fp: Trainer(Regressor(), data, data, None, collate_regression, regression_step, {},  # noqa: E731
                              **settings, out_dir=tmp_path, fingerprint=fp)
    make("a").fit()
    assert make("a").fit(resume=True)["steps"] == 2
    with pytest.raises(ValueError, match="another configuration"):
        make("b").fit(resume=True)


def test_resume_refuses_other_data_naming_the_split_and_what_changed(tmp_path):
    g = torch.Generator().manual_seed(0)
    data = [(torch.randn(3, 4, generator=g), torch.randn((), generator=g)) for _ in range(6)]
    settings = loop_settings(max_steps=4, eval_every=2, batch_size=2, progress=False, select_metric="loss",
                             select_mode="min")
    make = lambda train, val, out: Trainer(Regressor(), train, val, None, collate_regression,  # noqa: E731
                                           regression_step, {}, **settings, out_dir=tmp_path / out,
                                           on_step_end=interrupt_at(2))
    for out in ("edited", "shorter", "old"):
        with pytest.raises(Interrupt):
            make(data, data[:3], out).fit()
    edited = [*data[:5], (data[5][0] + 1e-3, data[5][1])]  # one example of the training set changed
    with pytest.raises(ValueError, match=r"last.pt was trained on other data than this run reads \(the training set: "
                                         r"the same 6 examples in number, but other ones\): has a data file changed"):
        make(edited, data[:3], "edited").fit(resume=True)
    with pytest.raises(ValueError, match="the validation set: 3 examples when the checkpoint was written, 2 now"):
        make(data, data[:2], "shorter").fit(resume=True)
    assert make(data, data[:3], "edited").fit(resume=True)["steps"] == 4  # the same data: resumed
    checkpoint = tmp_path / "old" / "checkpoints" / "last.pt"
    state = load_checkpoint(checkpoint)
    assert state["data"]["train"]["examples"] == 6 and state["data"]["test"] is None
    del state["data"]  # a checkpoint written before runs recorded their data: nothing to compare
    save_atomic(state, checkpoint)
    assert make(edited, data[:3], "old").fit(resume=True)["steps"] == 4


def test_a_run_resumed_on_other_data_files_is_refused(tmp_path, monkeypatch):
    """Through run(), on ListOps tsv files: the config is the same (the same data_dir), the files are not."""
    import longattn.data.lra as lra_data
    from longattn.config import ConfigError
    from longattn.data import listops
    from longattn.tasks.lra import LRATask

    monkeypatch.setattr(LRATask, "data_api", lra_data)  # the real files, not the stand-in
    data_dir = tmp_path / "data"
    sizes = {"train": 24, "val": 8, "test": 8}

    def write(seed, train=24):
        listops.write_listops_splits(data_dir, sizes={**sizes, "train": train}, seed=seed, min_length=5, max_length=20)

    base = ["train.batch_size=8", "train.eval_every=2", "optim.lr=3e-3", "optim.warmup_steps=1", "model.dim=16",
            "model.hidden=32", "train.progress=false", "train.min_evals=1", f"data.data_dir={data_dir}"]
    for steps, out in (("train.max_steps=4", "steps"), ("train.epochs=2", "epochs")):
        write(seed=0)
        config = resolve_config("listops", attention="softmax", overrides=[*base, steps])
        with pytest.raises(Interrupt):
            run(config, tmp_path / out, on_step_end=interrupt_at(2))
        write(seed=1, train=24 if out == "steps" else 16)
        if out == "steps":  # the same number of examples, other ones
            with pytest.raises(ValueError, match=r"trained on other data than this run reads \(the training set: the "
                                                 r"same 24 examples in number, but other ones; the validation set: "):
                run(config, tmp_path / out, resume=True)
        else:  # a training set of another size changes an epoch's steps, which the saved schedule shows first
            with pytest.raises(ConfigError, match=r"steps_per_epoch 3 recorded, 2 now.*has the training data changed"):
                run(config, tmp_path / out, resume=True)


def test_ema_of_the_weights_is_what_validation_and_test_see(tmp_path):
    """A loop option is the config field, the loop and this test: train.ema_decay."""
    g = torch.Generator().manual_seed(0)
    data = [(torch.randn(3, 4, generator=g), torch.randn((), generator=g)) for _ in range(16)]
    trajectory = []

    def record(trainer, step):
        trajectory.append({k: v.detach().clone() for k, v in trainer.model.state_dict().items()})

    settings = loop_settings(max_steps=6, eval_every=6, batch_size=4, lr=0.05, schedule="constant",
                             select_metric="mae", select_mode="min", progress=False, ema_decay=0.5)
    trainer = Trainer(Regressor(), data, data[:5], data[:7], collate_regression, regression_step,
                      {"mae": mae}, **settings, out_dir=tmp_path / "ema", on_step_end=record)
    results = trainer.fit()
    expected = {k: v.clone() for k, v in trajectory[0].items()}  # the average starts at the first step's weights
    for weights in trajectory[1:]:
        expected = {k: 0.5 * expected[k] + 0.5 * weights[k] for k in expected}
    best = load_checkpoint(tmp_path / "ema" / "checkpoints" / "best.pt")["model"]
    for name, tensor in expected.items():
        torch.testing.assert_close(best[name], tensor)
        torch.testing.assert_close(trainer.model.state_dict()[name], tensor)  # the model ends with them
    assert not torch.equal(trajectory[-1]["out.weight"], expected["out.weight"])  # the check can fail
    plain = Trainer(Regressor(), data, data[:5], data[:7], collate_regression, regression_step, {"mae": mae},
                    **loop_settings(max_steps=6, eval_every=6, batch_size=4, lr=0.05, schedule="constant",
                                    select_metric="mae", select_mode="min", progress=False),
                    out_dir=tmp_path / "plain").fit()
    assert results["test"]["mae"] != plain["test"]["mae"]


def test_ema_run_resumes_exactly(tmp_path):
    config = tiny_config("train.ema_decay=0.9", "model.dropout=0.3", "train.max_steps=8", "train.checkpoint_every=2")
    run(config, tmp_path / "full")
    with pytest.raises(Interrupt):
        run(config, tmp_path / "cut", on_step_end=interrupt_at(5))
    run(config, tmp_path / "cut", resume=True)
    full, cut = (json.loads((tmp_path / d / "results.json").read_text()) for d in ("full", "cut"))
    assert full["val"] == cut["val"] and full["test"] == cut["test"]
    a, b = (load_checkpoint(tmp_path / d / "checkpoints" / "best.pt")["model"] for d in ("full", "cut"))
    assert all(torch.equal(a[k], b[k]) for k in a)
    with pytest.raises(ValueError, match="train.ema_decay must be < 1"):
        tiny_config("train.ema_decay=1")


def test_warmup_in_epochs(tmp_path):
    # 18 examples, batch 4: 5 steps per epoch; 1.5 warm-up epochs = 8 steps rising linearly to lr.
    g = torch.Generator().manual_seed(0)
    data = [(torch.randn(3, 4, generator=g), torch.randn((), generator=g)) for _ in range(18)]
    settings = loop_settings(epochs=3, batch_size=4, lr=0.08, schedule="constant", warmup_epochs=1.5,
                             select_metric="mse", select_mode="min", progress=False, log_every=1)
    trainer = Trainer(Regressor(), data, None, None, collate_regression, regression_step, {"mse": mse},
                      **settings, out_dir=tmp_path)
    assert trainer.optim_settings.warmup_steps == 8 and trainer.settings.max_steps == 15
    trainer.fit()
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    lrs = [r["lr"] for r in records if r["split"] == "train"]  # the lr after each step's scheduler update
    assert lrs[:8] == pytest.approx([0.08 * (s + 1) / 8 for s in range(1, 8)] + [0.08])
    assert lrs[8:] == pytest.approx([0.08] * 7)


class _Lengthy(torch.utils.data.Dataset):
    def __init__(self, lengths):
        self._lengths = lengths

    def __len__(self):
        return len(self._lengths)

    def __getitem__(self, index):
        return index

    def lengths(self):
        return self._lengths


def test_group_by_length_batches_similar_lengths(tmp_path):
    g = torch.Generator().manual_seed(0)
    lengths = torch.randint(1, 200, (300,), generator=g).tolist()
    settings = loop_settings(max_steps=1, batch_size=8, progress=False, select_metric="mse", select_mode="min")
    grouped_settings = {**settings, "train": dataclasses.replace(settings["train"], group_by_length=True)}
    windowed_settings = {**settings, "train": dataclasses.replace(grouped_settings["train"], length_window=4)}
    padded = {}
    for name, chosen in (("plain", settings), ("grouped", grouped_settings), ("windowed", windowed_settings)):
        dataset = torch.utils.data.Subset(_Lengthy(lengths), list(range(10, 300)))
        trainer = Trainer(Regressor(), dataset, None, None, list, regression_step, {"mse": mse}, **chosen,
                          out_dir=tmp_path / name)
        epochs = [trainer._epoch_batches(e) for e in range(2)]
        for batches in epochs:
            assert sorted(i for b in batches for i in b) == list(range(290)) and len(batches) == 37
        assert epochs[0] != epochs[1]
        padded[name] = sum(max(lengths[10 + i] for i in b) * len(b) for b in epochs[0])
        trainer.release()
    assert padded["grouped"] < 0.7 * padded["plain"]
    # windows of 4 batches pad more than windows of 50 (the default), but much less than random batches
    assert padded["grouped"] < padded["windowed"] < 0.9 * padded["plain"]
    with pytest.raises(ValueError, match="group_by_length needs a training set with lengths"):
        Trainer(Regressor(), [1, 2], None, None, list, regression_step, {"mse": mse}, **grouped_settings,
                out_dir=tmp_path / "none")


def test_a_step_reads_nothing_back_and_the_losses_are_read_at_each_log(tmp_path, monkeypatch):
    """On a GPU a read-back per step stalls the queue of kernels: an optimiser step (forward, backward, clipping,
    the update) reads nothing to the host; the steps' losses are read together at each log (here every 20 steps
    of 40: two reads), and the logged means are those of the steps' losses. (torch's own scalar reads of
    host-side state, AdamW's step count, are not the library's and are not counted.)"""
    import traceback

    from torch.utils._python_dispatch import TorchDispatchMode

    class LibraryScalarReads(TorchDispatchMode):
        """Counts the scalar reads (``.item()``, ``float(t)``, ``int(t)``) made by longattn's own code."""

        def __init__(self):
            super().__init__()
            self.count = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func is torch.ops.aten._local_scalar_dense.default:  # the frame that asked, past torch's wrappers
                caller = next(f for f in reversed(traceback.extract_stack()[:-1])
                              if not any(part in f.filename for part in ("torch/_compile", "torch/_dynamo",
                                                                         "torch/utils/_python_dispatch")))
                self.count += "longattn" in caller.filename
            return func(*args, **(kwargs or {}))

    g = torch.Generator().manual_seed(0)
    data = [(torch.randn(3, 4, generator=g), torch.randn((), generator=g)) for _ in range(16)]
    settings = loop_settings(max_steps=40, batch_size=4, lr=0.01, clip_norm=1.0, progress=False, log_every=20,
                             select_metric="loss", select_mode="min")
    trainer = Trainer(Regressor(), data, None, None, collate_regression, regression_step, {}, **settings,
                      out_dir=tmp_path)
    step, read = trainer._optimizer_step, trainer._read_losses
    scalar_reads, reads, losses = [], [], []

    def counted_step(stream):
        with LibraryScalarReads() as reads_in_step:
            out = step(stream)
        scalar_reads.append(reads_in_step.count)
        losses.append(float(out[0]))
        return out

    monkeypatch.setattr(trainer, "_optimizer_step", counted_step)
    monkeypatch.setattr(trainer, "_read_losses", lambda *a, **k: reads.append(trainer.progress.step) or read(*a, **k))
    trainer.fit()
    assert scalar_reads == [0] * 40 and reads == [20, 40]
    logged = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["loss"] for r in logged if r["split"] == "train"] == pytest.approx(
        [sum(losses[:20]) / 20, sum(losses[20:]) / 20])
