"""No run or grid overwrites finished work unless asked (--resume continues it, --overwrite replaces it), and a
grid counts a run as finished only when it is: its finished marker, written last, beside a saved config equal to
the cell's (library level; the commands' flags: tests/commands/test_output_flags.py)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

import longattn.experiment.grid as grid
from longattn.experiment.grid import Cell, run_cells
from longattn.experiment.run import run, run_status
from longattn.train.outputs import OutputFolderError
from reliability import CLEAR_ERROR, CORRECT_RESULT, OUTPUT_FOLDERS, bad_input
from tests.train.test_loop import Interrupt, interrupt_at, tiny_config

STEPS = ["train.max_steps=4", "train.eval_every=2", "train.checkpoint_every=2"]


@pytest.fixture(autouse=True)
def _stub(lra_stub_data):
    """LRA runs below use the in-memory stand-in for the LRA data."""


def snapshot(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()
            and p.name != ".lock"}


@bad_input(OUTPUT_FOLDERS, CLEAR_ERROR, cases=2)
def test_a_run_into_a_finished_or_interrupted_run_is_refused_and_nothing_changes(tmp_path):
    run(tiny_config(*STEPS), tmp_path / "finished")
    with pytest.raises(Interrupt):
        run(tiny_config(*STEPS), tmp_path / "cut", on_step_end=interrupt_at(3))
    for name, holds in (("finished", r"a finished run \(checkpoints/finished.json\)"),
                        ("cut", r"an interrupted run \(checkpoints/last.pt, checkpoints/best.pt, metrics.jsonl\)")):
        before = snapshot(tmp_path / name)
        with pytest.raises(OutputFolderError, match=rf"output folder {tmp_path / name} already holds {holds}; pass "
                                                    "--resume to continue it .*--overwrite to replace it"):
            run(tiny_config(*STEPS, "model.dim=32"), tmp_path / name)
        assert snapshot(tmp_path / name) == before


@bad_input(OUTPUT_FOLDERS, CLEAR_ERROR)
def test_resume_and_overwrite_exclude_each_other(tmp_path):
    with pytest.raises(OutputFolderError, match="--resume and --overwrite exclude each other"):
        run(tiny_config(*STEPS), tmp_path, resume=True, overwrite=True)


@bad_input(OUTPUT_FOLDERS, CORRECT_RESULT)
def test_overwrite_replaces_and_an_interrupted_replacement_never_looks_finished(tmp_path):
    old = run(tiny_config(*STEPS), tmp_path)
    new_config = tiny_config(*STEPS, "model.dim=32")
    with pytest.raises(Interrupt):  # stopped while replacing the finished run
        run(new_config, tmp_path, overwrite=True, on_step_end=interrupt_at(2))
    assert not (tmp_path / "results.json").exists() and not (tmp_path / "checkpoints" / "finished.json").exists()
    assert run_status(tmp_path, new_config).state == "interrupted"
    assert run_status(tmp_path, tiny_config(*STEPS)).state == "another"  # the old config no longer owns it
    new = run(new_config, tmp_path, resume=True)
    assert new["parameters"] > old["parameters"] and new["steps"] == 4
    assert run_status(tmp_path, new_config).state == "finished"


def _cells(*overrides: str) -> list[Cell]:
    return [Cell(name, "listops", "listops", None, None, [*tiny_overrides(), *STEPS, *overrides], {"attention": name})
            for name in ("softmax", "linear")]


def tiny_overrides() -> list[str]:
    return ["train.batch_size=8", "data.options.num_examples=40", "optim.lr=3e-3", "optim.warmup_steps=2",
            "model.dim=16", "model.hidden=32", "train.progress=false"]


def _run_dir(out: Path):
    return lambda cell, seed: out / cell.row / f"seed{seed}"


def _count_runs(monkeypatch) -> list[Path]:
    calls, real_run = [], grid.run
    monkeypatch.setattr(grid, "run", lambda config, folder, **kw: calls.append(Path(folder)) or real_run(config, folder,
                                                                                                       **kw))
    return calls


@bad_input(OUTPUT_FOLDERS, CLEAR_ERROR)
def test_a_grid_into_its_own_finished_folders_is_refused_before_anything_trains(tmp_path, monkeypatch):
    run_cells(_cells(), [0, 1], tmp_path, run_dir=_run_dir(tmp_path))
    before, calls = snapshot(tmp_path), _count_runs(monkeypatch)
    with pytest.raises(OutputFolderError, match=r"the output folders of this grid already hold runs \(4 finished: .*"
                                                r"and 1 more\); pass --resume .*--overwrite"):
        run_cells(_cells(), [0, 1], tmp_path, run_dir=_run_dir(tmp_path))
    assert calls == [] and snapshot(tmp_path) == before


@bad_input(OUTPUT_FOLDERS, CORRECT_RESULT)
def test_results_json_beside_newer_partial_checkpoints_is_not_finished(tmp_path, monkeypatch):
    run_cells(_cells(), [0], tmp_path, run_dir=_run_dir(tmp_path))
    folder = tmp_path / "linear" / "seed0"
    stale = json.loads((folder / "results.json").read_text())
    # what the code before the finished marker left after an interrupted re-run: the old results.json beside
    # the new run's partial checkpoints and log
    (folder / "checkpoints" / "finished.json").unlink()
    assert run_status(folder, grid._cell_config(_cells()[1], 0)).state == "interrupted"
    calls = _count_runs(monkeypatch)
    cells = run_cells(_cells(), [0], tmp_path, run_dir=_run_dir(tmp_path), resume=True)
    assert calls == [folder]  # the finished softmax run is reused; the linear one is continued, not counted done
    assert len(cells[1].results) == 1 and (folder / "checkpoints" / "finished.json").is_file()
    assert cells[1].results[0]["steps"] == stale["steps"]


@bad_input(OUTPUT_FOLDERS, CLEAR_ERROR)
def test_resume_refuses_cells_of_another_configuration_naming_them(tmp_path, monkeypatch):
    run_cells(_cells(), [0], tmp_path, run_dir=_run_dir(tmp_path))
    calls = _count_runs(monkeypatch)
    with pytest.raises(OutputFolderError, match=r"2 run folder\(s\) of this grid hold a run of another configuration: "
                                                rf"{tmp_path}/softmax/seed0 \(sections \['model'\]\).*--overwrite"):
        run_cells(_cells("model.dim=32"), [0], tmp_path, run_dir=_run_dir(tmp_path), resume=True)
    assert calls == []
    cells = run_cells(_cells("model.dim=32"), [0], tmp_path, run_dir=_run_dir(tmp_path), overwrite=True)
    assert len(calls) == 2 and all(c.results[0]["config"]["model"]["dim"] == 32 for c in cells)


@bad_input(OUTPUT_FOLDERS, CORRECT_RESULT)
def test_options_of_a_mechanism_a_run_does_not_use_leave_its_run_the_same_configuration(tmp_path):
    folder = tmp_path / "run"
    run(tiny_config(*STEPS, "attention_options.moba.top_k=3"), folder)
    assert run_status(folder, tiny_config(*STEPS, "attention_options.moba.top_k=5")).state == "finished"
    other = run_status(folder, tiny_config(*STEPS, "attention_options.softmax.dropout=0.1"))
    assert other.state == "another" and other.differences == ("attention_options",)


@bad_input(OUTPUT_FOLDERS, CORRECT_RESULT)
def test_an_archived_run_with_results_and_config_only_counts_as_finished(tmp_path, monkeypatch):
    run_cells(_cells(), [0], tmp_path, run_dir=_run_dir(tmp_path))
    for cell in ("softmax", "linear"):  # as results/forecasting keeps them: checkpoints and log left out
        shutil.rmtree(tmp_path / cell / "seed0" / "checkpoints")
        (tmp_path / cell / "seed0" / "metrics.jsonl").unlink()
    calls = _count_runs(monkeypatch)
    cells = run_cells(_cells(), [0], tmp_path, run_dir=_run_dir(tmp_path), resume=True)
    assert calls == [] and all(len(c.results) == 1 for c in cells)


def test_only_the_main_rank_probes_the_lock_the_main_rank_already_holds(tmp_path, monkeypatch):
    """Rank 1 of a DDP run reaches ``run`` after rank 0's Trainer may have locked the folder: it must not
    refuse its own run (the main rank decides for all, in the Trainer); a lone process still refuses."""
    import longattn.experiment.run as run_module
    from longattn.train.distributed import launched_rank
    from longattn.train.outputs import lock_output_folder

    class PastTheCheck(Exception):
        pass

    def stop(*args, **kwargs):
        raise PastTheCheck

    monkeypatch.setattr(run_module, "_data", stop)
    held = lock_output_folder(tmp_path)  # the main rank's lock
    try:
        with pytest.raises(OutputFolderError, match="in use by another run"):
            run(tiny_config(), tmp_path)
        monkeypatch.setenv("WORLD_SIZE", "2")
        monkeypatch.setenv("RANK", "1")
        assert launched_rank() == 1
        with pytest.raises(PastTheCheck):
            run(tiny_config(), tmp_path)
    finally:
        held.close()
