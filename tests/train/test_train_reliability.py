"""Reliability of training runs (issue 13): a non-finite loss stops the run with the last good
checkpoint intact; one run per output folder; damaged checkpoints fall back or fail clearly;
stale temp files go; a finished run is not redone; checkpoints load with weights_only=True;
strict JSON logs; DDP keeps every rank's random state, logs the global loss and times out."""

from __future__ import annotations

import json
import os
import pickle
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from longattn.train.checkpoint import CheckpointError, load_checkpoint, previous_path, save_atomic
from longattn.train.loop import Trainer, TrainingError
from longattn.experiment.run import run
from ddp_kill_resume import launch_two_ranks, worker_command, worker_env
from reliability import CLEAR_ERROR, CORRECT_RESULT, RESUME, TRAINING, bad_input, cases
from test_loop import Interrupt, final_state, interrupt_at, tiny_config

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(autouse=True)
def _stub(lra_stub_data):
    """LRA runs below use the in-memory stand-in for the LRA data."""
STOCHASTIC = ["model.dropout=0.3", "train.grad_accum=2", "train.max_steps=12", "train.checkpoint_every=2",
              "data.options.num_examples=36"]


def strict_lines(path: Path) -> list[dict]:
    """Parse JSON lines, refusing the non-standard NaN/Infinity tokens."""
    def refuse(token):
        raise AssertionError(f"{path} holds a bare {token}")

    return [json.loads(line, parse_constant=refuse) for line in path.read_text().splitlines()]


def poison_loss_at(step_to_poison: int):
    """An on_step_end hook that makes the loss of the following step NaN."""
    def hook(trainer: Trainer, step: int) -> None:
        if step == step_to_poison - 1:
            step_fn = trainer.step_fn

            def nan_step(model, batch):
                out = step_fn(model, batch)
                return out._replace(loss=out.loss * float("nan"))

            trainer.step_fn = nan_step

    return hook


@bad_input(TRAINING, CLEAR_ERROR)
def test_non_finite_loss_stops_with_the_last_checkpoint_intact(tmp_path):
    config = tiny_config(*STOCHASTIC)
    with pytest.raises(TrainingError, match=r"non-finite training loss \(nan\) at step 7 .*step 6\) is intact"):
        run(config, tmp_path, on_step_end=poison_loss_at(7))
    state = load_checkpoint(tmp_path / "checkpoints" / "last.pt")
    assert state["progress"]["step"] == 6
    assert all(torch.isfinite(t).all() for t in state["model"].values())
    records = strict_lines(tmp_path / "metrics.jsonl")
    assert max(r["step"] for r in records) <= 6 and all(r["split"] != "test" for r in records)
    # the lock is released: the interrupted run resumes to the same end as an uninterrupted one
    resumed = run(config, tmp_path, resume=True)
    full = run(config, tmp_path / "full")
    assert resumed["test"] == full["test"] and resumed["steps"] == 12


@bad_input(TRAINING, CLEAR_ERROR)
def test_overflowing_weights_are_never_checkpointed(tmp_path):
    def overflow_at_step_3(trainer, step):
        if step == 3:  # the update of step 4 overflows, as a huge learning rate would; its loss is finite
            update = trainer.optimizer.step

            def overflowing_update(*args, **kwargs):
                result = update(*args, **kwargs)
                with torch.no_grad():
                    next(trainer.model.parameters()).fill_(float("inf"))
                return result

            trainer.optimizer.step = overflowing_update

    config = tiny_config(*STOCHASTIC)
    with pytest.raises(TrainingError, match=r"non-finite weights \(.*\) after step 4; not saved, the last "
                                            r"checkpoint \(step 2\) is intact"):
        run(config, tmp_path, on_step_end=overflow_at_step_3)
    state = load_checkpoint(tmp_path / "checkpoints" / "last.pt")
    assert state["progress"]["step"] == 2 and all(torch.isfinite(t).all() for t in state["model"].values())


@bad_input(TRAINING, CLEAR_ERROR, cases=2)  # this process, another
def test_second_run_into_the_same_folder_is_refused(tmp_path):
    config = tiny_config("train.max_steps=2", "train.eval_every=2")

    def second_run(trainer, step):
        with pytest.raises(TrainingError, match=rf"output folder {tmp_path} is in use by another run \(pid {os.getpid()}"):
            run(config, tmp_path)

    run(config, tmp_path, on_step_end=second_run)
    # another process is refused too, with a one-line error and nothing written into the folder
    holder = subprocess.Popen([sys.executable, "-c", (
        "import fcntl, sys, time; f = open(sys.argv[1], 'a+'); fcntl.flock(f, fcntl.LOCK_EX); "
        "f.seek(0); f.truncate(); f.write('pid 1 on elsewhere'); f.flush(); print('locked', flush=True); "
        "time.sleep(60)"), str(tmp_path / ".lock")], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "locked"
        before = sorted(p.name for p in tmp_path.rglob("*"))
        with pytest.raises(TrainingError, match="in use by another run \\(pid 1 on elsewhere\\)"):
            run(config, tmp_path)
        assert sorted(p.name for p in tmp_path.rglob("*")) == before
    finally:
        holder.kill()
        holder.wait()
    assert run(config, tmp_path, overwrite=True)["steps"] == 2  # the lock went with the process


def _cut_run(tmp_path, config, stop_at=9):
    with pytest.raises(Interrupt):
        run(config, tmp_path / "cut", on_step_end=interrupt_at(stop_at))
    return tmp_path / "cut" / "checkpoints" / "last.pt"


@bad_input(RESUME, CORRECT_RESULT)
@pytest.mark.parametrize("damage", ["truncated", "zeros", "missing"])
def test_damaged_last_checkpoint_falls_back_to_the_previous_one(tmp_path, damage, capsys):
    config = tiny_config(*STOCHASTIC)
    run(config, tmp_path / "full")
    last = _cut_run(tmp_path, config)  # checkpoints at steps 6 (prev) and 8 (last)
    data = last.read_bytes()
    if damage == "truncated":
        last.write_bytes(data[: len(data) // 2])
    elif damage == "zeros":
        middle = len(data) // 2
        last.write_bytes(data[:middle] + bytes(256) + data[middle + 256:])
    else:
        last.unlink()  # killed between the two renames of a checkpoint write
    resumed = run(config, tmp_path / "cut", resume=True)
    assert "falling back to" in capsys.readouterr().err or damage == "missing"
    full_results, full_lines, full_weights = final_state(tmp_path / "full")
    cut_results, cut_lines, cut_weights = final_state(tmp_path / "cut")
    assert resumed["steps"] == 12 and cut_results["test"] == full_results["test"] and cut_lines == full_lines
    for name, tensor in full_weights.items():
        assert torch.equal(tensor, cut_weights[name]), name


@bad_input(TRAINING, CLEAR_ERROR)
def test_no_usable_checkpoint_is_a_clear_error(tmp_path):
    config = tiny_config(*STOCHASTIC)
    last = _cut_run(tmp_path, config)
    for path in (last, previous_path(last)):
        path.write_bytes(path.read_bytes()[:100])
    with pytest.raises(CheckpointError, match=r"no usable checkpoint: .*last.pt is damaged .*last.prev.pt is damaged"):
        run(config, tmp_path / "cut", resume=True)


@bad_input(RESUME, CORRECT_RESULT)
def test_stale_temp_files_are_removed_and_checkpoints_are_weights_only(tmp_path):
    config = tiny_config(*STOCHASTIC)
    last = _cut_run(tmp_path, config)
    stale = last.parent / ".last.pt.k1ll3d.tmp"
    stale.write_bytes(b"")  # what a kill -9 during a write leaves
    run(config, tmp_path / "cut", resume=True)
    assert not stale.exists()
    assert sorted(p.name for p in last.parent.iterdir()) == ["best.pt", "finished.json", "last.prev.pt", "last.pt"]
    raw = torch.load(last, weights_only=True)  # the checksummed container; load_checkpoint loads its
    assert raw["format"] == "longattn-checkpoint-v1"  # payload with weights_only=True as well
    assert len(load_checkpoint(last)["rng"]) == 1  # one random state per rank


@bad_input(RESUME, CORRECT_RESULT)
@pytest.mark.parametrize("hard_links", [True, False])
def test_interrupted_replacement_never_leaves_the_checkpoint_missing(tmp_path, monkeypatch, hard_links):
    """An interrupt (Ctrl-C) at the final rename leaves ``last.pt`` holding the old state, the previous copy
    beside it and no temporary file; with or without hard links on the file system."""
    last = tmp_path / "last.pt"
    save_atomic({"step": 1}, last, keep_previous=True)
    save_atomic({"step": 2}, last, keep_previous=True)
    if not hard_links:
        monkeypatch.setattr("longattn.train.checkpoint.os.link", _raise(OSError("links not supported")))
    real_replace = os.replace

    def replace(source, target):
        if Path(target) == last:
            raise KeyboardInterrupt
        real_replace(source, target)

    monkeypatch.setattr("longattn.train.checkpoint.os.replace", replace)
    with pytest.raises(KeyboardInterrupt):
        save_atomic({"step": 3}, last, keep_previous=True)
    monkeypatch.undo()
    assert load_checkpoint(last)["step"] == 2 and load_checkpoint(previous_path(last))["step"] == 2
    assert sorted(p.name for p in tmp_path.iterdir()) == ["last.prev.pt", "last.pt"]
    save_atomic({"step": 4}, last, keep_previous=True)  # the next save goes on as usual
    assert load_checkpoint(last)["step"] == 4 and load_checkpoint(previous_path(last))["step"] == 2


def _raise(error: BaseException):
    def fail(*args, **kwargs):
        raise error
    return fail


@bad_input(TRAINING, CLEAR_ERROR, cases=2)  # a pickle with os.system, a wrong SHA256
def test_crafted_checkpoint_does_not_execute(tmp_path):
    marker = tmp_path / "pwned"

    class RunsCommand:
        def __reduce__(self):
            return os.system, (f"touch {marker}",)

    evil = tmp_path / "last.pt"
    evil.write_bytes(pickle.dumps({"model": RunsCommand()}))
    with pytest.raises(CheckpointError, match="last.pt is damaged"):
        load_checkpoint(evil)
    torch.save({"format": "longattn-checkpoint-v1", "sha256": "0", "payload": b"x"}, evil)
    with pytest.raises(CheckpointError, match="SHA256 does not match"):
        load_checkpoint(evil)
    assert not marker.exists()


@bad_input(RESUME, CORRECT_RESULT)
def test_resume_of_a_finished_run_does_nothing(tmp_path, capsys):
    config = tiny_config("train.max_steps=4", "train.eval_every=2")
    results = run(config, tmp_path)
    lines = (tmp_path / "metrics.jsonl").read_text()
    stamp = (tmp_path / "checkpoints" / "last.pt").stat().st_mtime_ns
    again = run(config, tmp_path, resume=True)
    assert "already finished at step 4; nothing to do" in capsys.readouterr().err
    assert (tmp_path / "metrics.jsonl").read_text() == lines  # no duplicate test record
    assert (tmp_path / "checkpoints" / "last.pt").stat().st_mtime_ns == stamp
    assert again["test"] == results["test"] and again["steps"] == 4


@bad_input(RESUME, CORRECT_RESULT)
def test_logs_are_strict_json(tmp_path, monkeypatch):
    from longattn.tasks.classification import ClassificationTask

    config = tiny_config("train.max_steps=4", "train.eval_every=2")
    # every validation and test metric is NaN
    monkeypatch.setattr(ClassificationTask, "metrics", lambda self, config, data: {"accuracy": lambda p, t: float("nan")})
    run(config, tmp_path)
    records = strict_lines(tmp_path / "metrics.jsonl")
    assert [r["accuracy"] for r in records if r["split"] != "train"] == [None, None, None]
    results = json.loads((tmp_path / "results.json").read_text(), parse_constant=lambda t: pytest.fail(t))
    assert results["test"]["accuracy"] is None


# ----------------------------------------------------------------------------- DDP (2 gloo processes)

needs_gloo = pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(),
                                reason="torch.distributed with gloo is unavailable")


def torchrun(out_dir: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(worker_command(out_dir, *args), env=worker_env(), capture_output=True, text=True,
                          timeout=180)


@needs_gloo
@bad_input(RESUME, CORRECT_RESULT)
def test_ddp_log_reports_the_global_loss(tmp_path):
    """Two ranks with batch b see, at the first step, exactly the examples of one process with
    batch 2b: the logged (global) loss must be theirs, not rank 0's half."""
    done = torchrun(tmp_path / "ddp", "run", "single_batch")
    assert done.returncode == 0, done.stderr[-3000:]
    ddp = [r for r in strict_lines(tmp_path / "ddp" / "metrics.jsonl") if r["split"] == "train"]
    rank_losses = [json.loads((tmp_path / "ddp" / f"rank{r}.loss").read_text()) for r in (0, 1)]
    assert ddp[0]["loss"] == pytest.approx(sum(rank_losses) / 2, rel=1e-6)
    assert abs(rank_losses[0] - rank_losses[1]) > 1e-4  # the ranks' own losses differ
    # the checkpoint holds each rank's own random state (kill -9 and resume of a DDP run:
    # tests/train/ddp_kill_resume.py, figures in docs/reliability.md)
    states = load_checkpoint(tmp_path / "ddp" / "checkpoints" / "last.pt")["rng"]
    assert len(states) == 2 and not torch.equal(states[0]["torch"], states[1]["torch"])


def launch_by_hand(out_dir: Path, *args: str, env: dict) -> list[subprocess.Popen]:
    """Two ranks without torchrun, so the test decides when the hung one is killed."""
    return launch_two_ranks(ROOT / "tests" / "train" / "ddp_reliability_worker.py", str(out_dir), *args, env=env)


@needs_gloo
@bad_input(TRAINING, CLEAR_ERROR)
def test_hung_rank_becomes_a_clear_error(tmp_path):
    # The time-out covers every collective, the start-up ones too: on a loaded machine two ranks can reach their
    # first collective several seconds apart, so it must stay well above that skew for the test to be about the hang.
    ranks = launch_by_hand(tmp_path, "run", "stop_rank1_at_step=2", env={"LONGATTN_DIST_TIMEOUT_S": "15"})
    try:
        _, stderr = ranks[0].communicate(timeout=120)
        assert ranks[0].returncode != 0
        assert "another rank did not answer within 15 s" in stderr, stderr[-3000:]
    finally:
        for process in ranks:
            process.kill()
            process.communicate()


# ----------------------------------------------------------------------------- another run's or model's checkpoint

from reliability import FOREIGN_WEIGHTS  # noqa: E402
from test_loop import Regressor, collate_regression, loop_settings, regression_step  # noqa: E402

from longattn.experiment.run import evaluate_run  # noqa: E402


class WiderRegressor(Regressor):
    def __init__(self) -> None:
        super().__init__()
        self.out = torch.nn.Linear(4, 2)


@bad_input(FOREIGN_WEIGHTS, CLEAR_ERROR)
def test_trainer_without_fingerprint_refuses_another_models_checkpoint(tmp_path):
    data = [(torch.randn(3, 4), torch.randn(())) for _ in range(8)]
    settings = loop_settings(max_steps=4, eval_every=2, checkpoint_every=2, batch_size=4, progress=False,
                             select_metric="loss", select_mode="min")
    make = lambda model: Trainer(model, data, data, None, collate_regression, regression_step, {},  # noqa: E731
                                 **settings, out_dir=tmp_path)
    trainer = make(Regressor())
    trainer.on_step_end = interrupt_at(2)
    with pytest.raises(Interrupt):
        trainer.fit()
    with pytest.raises(TrainingError, match=rf"{tmp_path}/checkpoints/last.pt belongs to a run with another "
                                            r"configuration \(its model has other parameters: shape out.weight"):
        make(WiderRegressor()).fit(resume=True)
    assert make(Regressor()).fit(resume=True)["steps"] == 4  # the right model still resumes


FOREIGN = {
    "a checkpoint of another model": ({"overrides": ["model.dim=32"]}, r"holds the weights of another model \(.*shape"),
    "a checkpoint of another mechanism": ({"attention": "nystrom"},
                                          r"holds the weights of another model \(unexpected .*conv_weight"),
}


@pytest.mark.parametrize("change, message", cases(FOREIGN_WEIGHTS, CLEAR_ERROR, FOREIGN))
def test_eval_with_another_runs_checkpoint_names_the_file(tmp_path, capsys, change, message):
    from longattn.experiment.config import resolve_config

    steps = ["train.max_steps=2", "train.eval_every=2"]
    run(tiny_config(*steps), tmp_path / "mine")
    other = tiny_config(*steps, *change.get("overrides", []))
    if "attention" in change:
        other = resolve_config("listops", attention=change["attention"], overrides=[
            *steps, "data.options.num_examples=40", "model.dim=16", "model.hidden=32", "train.progress=false"])
    run(other, tmp_path / "other")
    theirs = tmp_path / "other" / "checkpoints" / "best.pt"
    with pytest.raises(CheckpointError, match=rf"{theirs} {message}"):
        evaluate_run(tmp_path / "mine", checkpoint=str(theirs))
    assert evaluate_run(tmp_path / "mine")["examples"] == 40  # its own checkpoint evaluates
    from longattn.cli import main

    capsys.readouterr()
    assert main(["eval", "--run", str(tmp_path / "mine"), "--checkpoint", str(theirs)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and str(theirs) in err and "another model" in err, err


# ----------------------------------------------------------------------------- resume after every fault

import faults  # noqa: E402

from longattn.train.outputs import LogError, NoSpaceError  # noqa: E402


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    """The reference: STOCHASTIC run to its end without a fault (results, log records, final weights)."""
    from lra_stub import API

    from longattn.tasks.lra import LRATask

    saved, LRATask.data_api = LRATask.data_api, API
    try:
        folder = tmp_path_factory.mktemp("uninterrupted")
        run(tiny_config(*STOCHASTIC), folder)
    finally:
        LRATask.data_api = saved
    return final_state(folder)


def assert_same_as(reference, folder: Path) -> None:
    results, lines, weights = final_state(folder)
    assert results["test"] == reference[0]["test"] and results["steps"] == 12
    assert lines == reference[1]
    for name, tensor in reference[2].items():
        assert torch.equal(tensor, weights[name]), name


@pytest.mark.parametrize("step", cases(RESUME, CORRECT_RESULT, {f"step {k}": k for k in range(1, 13)}))
def test_stopped_at_any_step_then_resumed_is_bit_identical(tmp_path, uninterrupted, step):
    with pytest.raises(Interrupt):
        run(tiny_config(*STOCHASTIC), tmp_path, on_step_end=interrupt_at(step))
    run(tiny_config(*STOCHASTIC), tmp_path, resume=True)
    assert_same_as(uninterrupted, tmp_path)


@pytest.mark.parametrize("room", cases(RESUME, CORRECT_RESULT, {"kernel ENOSPC (/dev/full)": None, "after 10 bytes": 10,
                                                                "after 100 bytes": 100, "after 5000 bytes": 5000}))
def test_full_disk_while_a_checkpoint_is_written(tmp_path, uninterrupted, room):
    if room is None and not faults.DEV_FULL.exists():
        pytest.skip("no /dev/full here")
    with pytest.MonkeyPatch.context() as patch:
        faults.full_disk_in_write(4, after_bytes=room, patch=patch.setattr)  # the step-8 checkpoint
        expected = (rf"^no space left on --out {tmp_path} while writing checkpoints/last.pt; the last checkpoint "
                    r"\(step 6\) is intact; free some space, then run again with --resume$")
        with pytest.raises(NoSpaceError, match=expected):
            run(tiny_config(*STOCHASTIC), tmp_path)
    assert load_checkpoint(tmp_path / "checkpoints" / "last.pt")["progress"]["step"] == 6
    assert not list((tmp_path / "checkpoints").glob(".*.tmp"))
    run(tiny_config(*STOCHASTIC), tmp_path, resume=True)
    assert_same_as(uninterrupted, tmp_path)


@bad_input(RESUME, CORRECT_RESULT)
def test_full_disk_during_a_log_append_leaves_a_torn_line_that_resume_drops(tmp_path, uninterrupted, capsys):
    with pytest.MonkeyPatch.context() as patch:
        faults.full_disk_in_log_append(3, patch=patch.setattr)  # the third record (step 8) is cut in half
        with pytest.raises(NoSpaceError, match=rf"no space left on --out {tmp_path} while writing metrics.jsonl"):
            run(tiny_config(*STOCHASTIC), tmp_path)
    assert not (tmp_path / "metrics.jsonl").read_text().endswith("\n")  # torn
    capsys.readouterr()
    run(tiny_config(*STOCHASTIC), tmp_path, resume=True)
    assert f"warning: {tmp_path / 'metrics.jsonl'}:3: dropped a torn last line" in capsys.readouterr().err
    assert_same_as(uninterrupted, tmp_path)


@bad_input(RESUME, CORRECT_RESULT)
def test_torn_last_log_line_after_a_kill_is_dropped_on_resume(tmp_path, uninterrupted, capsys):
    with pytest.raises(Interrupt):
        run(tiny_config(*STOCHASTIC), tmp_path, on_step_end=interrupt_at(9))
    faults.tear_last_line(tmp_path / "metrics.jsonl")
    run(tiny_config(*STOCHASTIC), tmp_path, resume=True)
    assert "dropped a torn last line" in capsys.readouterr().err
    assert_same_as(uninterrupted, tmp_path)


@bad_input(RESUME, CLEAR_ERROR)
def test_damaged_log_line_before_the_last_is_an_error_naming_it(tmp_path):
    with pytest.raises(Interrupt):
        run(tiny_config(*STOCHASTIC), tmp_path, on_step_end=interrupt_at(9))
    log = tmp_path / "metrics.jsonl"
    lines = log.read_text().splitlines()
    assert len(lines) == 2  # validations at steps 4 and 8
    log.write_text("\n".join([lines[0][:10], *lines[1:]]) + "\n")
    with pytest.raises(LogError, match=rf"{log}:1: not a JSON record .*fix or delete that line"):
        run(tiny_config(*STOCHASTIC), tmp_path, resume=True)


@bad_input(RESUME, CORRECT_RESULT)
def test_kill_9_during_a_checkpoint_write_then_resume_is_bit_identical(tmp_path):
    """A real SIGKILL of a one-process run half-way through writing its third last.pt."""
    from ddp_reliability_worker import BASE

    from longattn.experiment.config import resolve_config

    env = {k: v for k, v in worker_env().items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    killed = subprocess.run([sys.executable, str(ROOT / "tests" / "train" / "ddp_reliability_worker.py"),
                             str(tmp_path / "cut"), "run", "kill_in_write=3"], env=env, capture_output=True,
                            text=True, timeout=180)
    assert killed.returncode == -9, killed.stderr[-2000:]
    assert list((tmp_path / "cut" / "checkpoints").glob(".last.pt.*.tmp"))  # the half-written file
    config = resolve_config("listops", attention="softmax", overrides=BASE)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the killed worker's count: another one sums in another order (not bit-identical)
    try:
        run(config, tmp_path / "cut", resume=True)
        run(config, tmp_path / "full")
    finally:
        torch.set_num_threads(threads)
    full, cut = final_state(tmp_path / "full"), final_state(tmp_path / "cut")
    assert cut[0]["test"] == full[0]["test"] and cut[1] == full[1]
    assert all(torch.equal(full[2][k], cut[2][k]) for k in full[2])


@needs_gloo
@bad_input(RESUME, CORRECT_RESULT, cases=4)
def test_ddp_resume_after_kills_a_full_disk_and_a_torn_log_is_bit_identical(tmp_path):
    """Two gloo ranks: kill -9 of rank 1 at step 3; resume, and rank 0's disk fills during its first checkpoint
    write (both ranks stop with the error); a torn last log line; resume, and rank 0 is killed half-way
    through its second checkpoint write; resume to the end: the final weights equal an uninterrupted run's."""
    def launch(out, *args):
        ranks = launch_by_hand(out, *args, env={"LONGATTN_DIST_TIMEOUT_S": "60"})
        outputs = [process.communicate(timeout=180) for process in ranks]
        return [process.returncode for process in ranks], [err for _, err in outputs]

    codes, _ = launch(tmp_path / "full", "run")
    assert codes == [0, 0]
    cut = tmp_path / "cut"
    codes, errors = launch(cut, "run", "kill_at_step=3:1")
    assert codes[1] == -9 and codes[0] != 0 and "lost the connection to another rank" in errors[0], errors[0][-2000:]
    codes, errors = launch(cut, "resume", "full_disk_in_write=1")
    assert codes == [1, 1], errors
    assert f"no space left on --out {cut} while writing checkpoints/last.pt" in errors[0], errors[0][-2000:]
    assert f"rank 0: no space left on --out {cut}" in errors[1], errors[1][-2000:]
    faults.tear_last_line(cut / "metrics.jsonl")
    codes, errors = launch(cut, "resume", "kill_in_write=2")
    assert codes[0] == -9 and "dropped a torn last line" in errors[0], errors[0][-2000:]
    codes, errors = launch(cut, "resume")
    assert codes == [0, 0], errors
    full, resumed = final_state(tmp_path / "full"), final_state(cut)
    assert resumed[0]["test"] == full[0]["test"] and resumed[1] == full[1]
    assert all(torch.equal(full[2][k], resumed[2][k]) for k in full[2])


@needs_gloo
@bad_input(TRAINING, CLEAR_ERROR)
def test_ddp_ranks_started_with_other_settings_stop_with_one_error_naming_the_rank(tmp_path):
    ranks = launch_by_hand(tmp_path, "run", "rank1_wider", env={"LONGATTN_DIST_TIMEOUT_S": "60"})
    errors = [process.communicate(timeout=180)[1] for process in ranks]
    assert [process.returncode for process in ranks] == [1, 1], errors
    for rank, error in enumerate(errors):
        assert (f"rank 1 was started with other settings than rank 0 (the run's fingerprint, the model's parameters "
                f"differ; seen on rank {rank})") in error, error[-2000:]
