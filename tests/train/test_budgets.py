"""Budgets that hold on any data: epochs with a step floor, at least min_evals validations (an interval longer
than the run is corrected with a warning), a subset larger than its split warns, warm-up as a fraction of the
run, a learning rate of their own for new parameters, the convergence flag, and progress lines off a terminal."""

from __future__ import annotations

import contextlib
import json
import re

import pytest
import torch
from torch import nn

from longattn.cli import main
from longattn.experiment.config import resolve_config
from longattn.experiment.grid import Cell, write_sweep_table
from longattn.experiment.run import run
from longattn.tasks.base import get_task
from longattn.train.loop import (CONVERGENCE_MARGIN, StepOutput, Trainer, convergence, parameter_groups,
                                 run_convergence)
from longattn.train.settings import OptimConfig, TrainConfig


@pytest.fixture(autouse=True)
def _stub(lra_stub_data):
    """LRA runs below use the in-memory stand-in for the LRA data."""


def tiny(*overrides: str):
    base = ["train.batch_size=8", "data.options.num_examples=40", "optim.lr=3e-3", "optim.warmup_steps=0",
            "model.dim=16", "model.hidden=32", "train.progress=false"]
    return resolve_config("listops", attention="softmax", overrides=[*base, *overrides])


def validated_steps(results) -> list[int]:
    return [record["step"] for record in results["history"]]


def test_an_interval_longer_than_the_run_is_corrected_with_a_warning(tmp_path, capsys):
    results = run(tiny("train.max_steps=10", "train.eval_every=250"), tmp_path)
    err = capsys.readouterr().err
    assert "warning: the validation interval, train.eval_every=250 steps, is longer than this run (10 steps" in err
    assert "validating every 2 steps instead (5 times; train.min_evals=5)" in err
    assert validated_steps(results) == [2, 4, 6, 8, 10]


def test_too_few_validations_are_made_at_least_min_evals_with_a_note(tmp_path, capsys):
    # 40 examples / batch 8 = 5 steps per epoch; 2 epochs validated per epoch would be 2 validations
    results = run(tiny("train.epochs=2", "train.eval_every_epoch=true", "train.min_evals=4"), tmp_path)
    err = capsys.readouterr().err
    assert "note: validating every epoch (5 steps) would validate 2 times in this run of 10 steps" in err
    assert "warning" not in err and validated_steps(results) == [2, 4, 6, 8, 10]


def test_epochs_with_a_step_floor_and_evals_spread_over_the_run(tmp_path, capsys):
    results = run(tiny("train.epochs=1", "train.min_steps=18", "train.evals=6"), tmp_path)
    assert "1 epoch(s) of 5 steps is 5 steps; training 18 steps instead (train.min_steps)" in capsys.readouterr().err
    assert results["steps"] == 18 and validated_steps(results) == [3, 6, 9, 12, 15, 18]


def test_early_stopping_waits_for_min_evals_validations(tmp_path):
    # nothing changes (lr 1e-12): patience 2 alone would stop at the third validation (step 6)
    results = run(tiny("train.max_steps=40", "train.eval_every=2", "train.patience=2", "optim.lr=1e-12",
                       "optim.schedule=constant"), tmp_path)
    assert results["stopped_early"] and validated_steps(results) == [2, 4, 6, 8, 10]
    assert results["convergence"]["converged"]  # it stopped after its best point


def test_a_subset_larger_than_its_split_warns_with_both_numbers(capsys):
    config = tiny("data.subset.train=100", "data.subset.val=10")
    data = get_task("listops").build_data(config)
    err = capsys.readouterr().err
    assert "warning: data.subset.train=100 is larger than the train split of listops (40 examples); using all 40" in err
    assert "subset.val" not in err  # a subset smaller than its split is what was asked for
    assert (len(data.train), len(data.val)) == (40, 10)


class Line(nn.Module):
    """y = w x + b, with ``b`` marked as a new parameter (as a converted mechanism's are)."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.zeros(()))
        self.b = nn.Parameter(torch.zeros(()))

    def forward(self, x):
        return self.w * x + self.b

    def new_parameters(self):
        return [self.b]


def line_step(model, batch):
    prediction = model(batch[:, 0])
    return StepOutput(nn.functional.mse_loss(prediction, batch[:, 1]), prediction.detach(), batch[:, 1])


def line_data(count: int = 32) -> list[torch.Tensor]:
    x = torch.linspace(-1, 1, count)
    return list(torch.stack([x, 2 * x + 1], dim=1))


def line_trainer(tmp_path, **train) -> Trainer:
    settings = {"batch_size": 8, "max_steps": 12, "eval_every": 3, "progress": False, **train}
    mae = lambda p, t: float((p - t).abs().mean())  # noqa: E731
    return Trainer(Line(), line_data(), line_data(8), None, torch.stack, line_step, {"mae": mae},
                   train=TrainConfig(**settings), optim=OptimConfig(lr=0.01, new_lr=0.05, schedule="constant"),
                   out_dir=tmp_path, select_metric="mae", select_mode="min")


def test_new_parameters_get_their_own_learning_rate_and_warmup_is_a_fraction_of_the_run(tmp_path):
    trainer = line_trainer(tmp_path)
    assert [group["lr"] for group in trainer.optimizer.param_groups] == [0.01, 0.05]
    assert trainer.optimizer.param_groups[1]["params"] == [trainer.model.b]
    trainer.release()
    with pytest.raises(ValueError, match="marks no new parameters"):
        parameter_groups(nn.Linear(2, 2), OptimConfig(new_lr=1e-3))
    assert len(parameter_groups(nn.Linear(2, 2), OptimConfig())) == 1
    ratio = Trainer(Line(), line_data(), None, None, torch.stack, line_step, {}, train=TrainConfig(max_steps=50),
                    optim=OptimConfig(warmup_ratio=0.06), out_dir=tmp_path / "w", select_metric="loss",
                    select_mode="min")
    assert ratio.optim_settings.warmup_steps == 3  # ceil(0.06 * 50), as transformers' warmup_ratio
    ratio.release()


def record(step, loss, value, best):
    return {"split": "val", "step": step, "loss": loss, "mae": value, "best": best}


def test_convergence_is_judged_from_the_last_two_validations():
    still_improving = [record(3, 1.0, 0.9, True), record(6, 0.8, 0.7, True)]
    flag = convergence(still_improving, "mae")
    assert not flag["converged"] and flag["val_losses"] == [1.0, 0.8] and flag["metric_values"] == [0.9, 0.7]
    assert flag["text"].startswith("not converged: the best mae is at the last validation (step 6: 0.7; step 3: 0.9)")
    assert "validation loss is still falling (1 -> 0.8)" in flag["text"]
    assert convergence([record(3, 1.0, 0.9, True), record(6, 1.1, 0.7, True)], "mae")["converged"]  # loss rising
    assert convergence([record(3, 1.0, 0.7, True), record(6, 0.9, 0.8, False)], "mae")["converged"]  # best earlier
    assert not convergence([record(3, 1.0, 0.7, True)], "mae")["converged"]  # once: nothing shows it had stopped
    reached = convergence(still_improving, "mae", target_reached=True)  # stopped at train.stop_at: its target
    assert reached["converged"] and reached["target_reached"] and "text" not in reached
    assert convergence([], "mae") is None


def accuracy_record(step, loss, value, best):
    return {"split": "val", "step": step, "loss": loss, "accuracy": value, "best": best}


def test_a_metric_still_rising_at_the_last_validation_is_not_converged_whatever_the_loss():
    # 20 Newsgroups, Singularformer, fold 0: accuracy 0.85 -> 0.857 at the last epoch while the loss rose
    rising = [accuracy_record(4, 0.60, 0.85, True), accuracy_record(5, 0.65, 0.857, True)]
    flag = convergence(rising, "accuracy")
    assert not flag["converged"] and flag["metric_rising"] and not flag["val_loss_falling"]
    assert flag["noise_margin"] == CONVERGENCE_MARGIN and flag["mode"] == "max"
    assert ("and the accuracy is still rising by more than the 0.2% noise margin (0.85 -> 0.857): a longer run"
            in flag["text"])
    within_noise = [accuracy_record(4, 0.60, 0.85, True), accuracy_record(5, 0.65, 0.851, True)]
    assert convergence(within_noise, "accuracy")["converged"]  # +0.12%: noise, and the loss rose
    assert not convergence(within_noise, "accuracy", margin=0.001)["converged"]
    both = convergence([accuracy_record(4, 0.7, 0.85, True), accuracy_record(5, 0.6, 0.86, True)], "accuracy")
    assert "still rising" in both["text"] and "the validation loss is still falling (0.7 -> 0.6)" in both["text"]
    falling_mse = [{"step": 1, "loss": 1.0, "mse": 0.50, "best": True}, {"step": 2, "loss": 1.1, "mse": 0.45,
                                                                        "best": True}]
    assert not convergence(falling_mse, "mse", mode="min")["converged"]  # lower is better: still improving
    assert convergence(falling_mse, "mse", mode="max")["metric_rising"] is False


def test_results_written_under_the_loss_only_rule_are_judged_again_by_the_metric_rule():
    history = [accuracy_record(4, 0.60, 0.85, True), accuracy_record(5, 0.65, 0.857, True)]
    old_record = {"converged": True, "best_at_last_validation": True, "val_loss_falling": False}
    assert not run_convergence({"history": history, "convergence": old_record}, "accuracy")["converged"]
    mse_history = [{"step": 1, "loss": 1.0, "mse": 0.50, "best": True}, {"step": 2, "loss": 1.1, "mse": 0.51,
                                                                        "best": False}]
    assert run_convergence({"history": mse_history}, "mse")["converged"]  # best earlier: min mode inferred
    stopped = {"history": history, "convergence": {"target_reached": True, "mode": "max"}}
    assert run_convergence(stopped, "accuracy")["converged"]


def test_an_unconverged_run_says_so_in_results_summary_and_tables(tmp_path, capsys):
    # a line fitted with a small learning rate improves at every validation: stopped while still improving
    results = line_trainer(tmp_path, min_evals=1).fit()
    assert not results["convergence"]["converged"] and results["convergence"]["validations"] == 4
    assert "not converged: the best mae is at the last validation (step 12" in capsys.readouterr().err
    summary = get_task("listops").summary(results)
    assert summary["converged"] is False and summary["convergence"].startswith("not converged")
    cells = [Cell("line", "listops", "listops", results=[{**results, "seed": 0, "test": {"accuracy": 0.5}},
                                                           {**results, "seed": 1, "test": {"accuracy": 0.6},
                                                            "convergence": None,
                                                            "history": results["history"][:2] + [
                                                                {**results["history"][2], "best": False}]}])]
    assert cells[0].not_converged() == [0]  # seed 1: recomputed from a history whose best is not the last
    table = write_sweep_table({"title": "t"}, cells, tmp_path / "table", [0, 1])
    text = (tmp_path / "table" / "table.md").read_text()
    assert "(1/2 not converged)" in text and "k of the cell's n runs" in text
    assert table["cells"][0]["not_converged"] == [0]


def test_train_with_stdout_in_a_file_prints_progress_lines(tmp_path, capsys):
    log = tmp_path / "stdout.txt"
    args = ["train", "--task", "listops", "--attention", "softmax", "--out", str(tmp_path / "run"),
            *(a for s in ("train.max_steps=20", "train.eval_every=4", "train.batch_size=8", "train.log_every=5",
                          "train.progress_every_s=0", "data.options.num_examples=40", "model.dim=16",
                          "model.hidden=32") for a in ("--set", s))]
    with open(log, "w") as handle, contextlib.redirect_stdout(handle):
        assert not handle.isatty()
        assert main(args) == 0
    text = log.read_text()
    threads, schedule = text.split("\n", 2)[:2]  # a single run's log opens with its thread choice
    assert threads.startswith("threads: ")
    assert schedule.startswith("train: 20 optimiser steps (4 epochs of 5), 8 examples per step, validation every 4 steps")
    lines = re.findall(r"^train step (\d+)/20 \(\d+%\): loss [\d.]+, [\d.e+-]+ steps/s \([\d.e+-]+ examples/s\), "
                       r"elapsed \d+ s, (?:about .+ left|done); validation at step \d+: accuracy [\d.]+", text, re.M)
    assert lines == ["5", "10", "15", "20"]
    assert '"converged"' in text  # the printed summary says whether the run converged
    assert json.loads((tmp_path / "run" / "results.json").read_text())["convergence"] is not None


def test_config_yaml_records_the_schedule_that_ran_and_reruns_it(tmp_path):
    from longattn.config import read_yaml
    from longattn.experiment.config import load_saved
    from longattn.experiment.run import evaluate_run

    # 40 examples / batch 8 = 5 steps per epoch: 2 epochs are 10 steps, not max_steps=1000; eval_every=100 would
    # validate once, so min_evals=4 validates every 2 steps
    first = run(tiny("train.epochs=2", "train.max_steps=1000", "train.eval_every=100", "train.min_evals=4"),
                tmp_path / "a")
    saved = read_yaml(tmp_path / "a" / "config.yaml")
    assert (saved["train"]["max_steps"], saved["train"]["eval_every"], saved["train"]["epochs"]) == (10, 2, 2)
    schedule = saved["schedule"]
    assert schedule["optimiser_steps"] == {"value": 10, "decided_by": "train.epochs",
                                           "overrode": {"train.max_steps": 1000}}
    assert schedule["validation_interval"] == {"value": 2, "decided_by": "train.min_evals",
                                               "overrode": {"train.eval_every": 100}}
    assert schedule["steps_per_epoch"]["value"] == 5 and schedule["batch_size"]["value"] == 8
    assert schedule["warmup_steps"] == {"value": 0, "decided_by": "optim.warmup_steps"}
    assert first["schedule"] == schedule  # results.json holds the same record
    assert load_saved(tmp_path / "a" / "config.yaml").train.max_steps == 1000  # the config as asked, for --resume

    again = run(resolve_config(config_file=tmp_path / "a" / "config.yaml"), tmp_path / "b")
    assert again["steps"] == first["steps"] == 10
    assert validated_steps(again) == validated_steps(first) == [2, 4, 6, 8, 10]
    rerun = read_yaml(tmp_path / "b" / "config.yaml")["schedule"]  # the same values, now the file's own settings
    assert {name: entry["value"] for name, entry in rerun.items()} == {n: e["value"] for n, e in schedule.items()}
    assert "overrode" not in rerun["validation_interval"]
    assert evaluate_run(tmp_path / "a")["schedule"] == schedule


def test_resume_from_the_runs_own_config_yaml_and_a_changed_training_set(tmp_path):
    from longattn.config import ConfigError

    asked = tiny("train.epochs=2", "train.min_evals=4")
    run(asked, tmp_path)
    saved = resolve_config(config_file=tmp_path / "config.yaml")
    assert run(saved, tmp_path, resume=True)["steps"] == 10  # the saved (used) form resumes the same run
    bigger = tiny("train.epochs=2", "train.min_evals=4", "data.options.num_examples=80")
    with pytest.raises(ConfigError, match="sections"):
        run(bigger, tmp_path, resume=True)
