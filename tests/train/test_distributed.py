"""Distributed data parallel with two CPU processes (gloo) launched by torch.distributed.run."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch.distributed as dist

from ddp_kill_resume import launch_two_ranks, worker_env

ROOT = Path(__file__).resolve().parents[2]
needs_gloo = pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(),
                                reason="torch.distributed with gloo is unavailable")


@needs_gloo
def test_two_cpu_processes_train_in_sync(tmp_path):
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
               str(ROOT / "tests" / "train" / "ddp_worker.py"), str(tmp_path)]
    done = subprocess.run(command, env=worker_env(), capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    # DDP keeps the replicas identical: the same weights on both ranks after training
    assert ranks[0]["checksum"] == ranks[1]["checksum"]
    results = json.loads((tmp_path / "results.json").read_text())
    assert results["world_size"] == 2
    # sharded evaluation still counts each of the 11 validation examples exactly once
    assert results["val"]["examples"] == 11 and results["test"]["examples"] == 20
    assert ranks[1]["results"]["val"] == results["val"]


def two_ranks_exit(mode: str) -> list[subprocess.CompletedProcess]:
    """Both ranks of ddp_exit_worker.py, launched by hand so that each one's exit status is seen."""
    ranks = launch_two_ranks(ROOT / "tests" / "train" / "ddp_exit_worker.py", mode,
                             env={"LONGATTN_DIST_TIMEOUT_S": "60"})
    try:
        outputs = [process.communicate(timeout=120) for process in ranks]
        return [subprocess.CompletedProcess(p.args, p.returncode, *out) for p, out in zip(ranks, outputs)]
    finally:
        for process in ranks:
            process.kill()


@needs_gloo
def test_ranks_leave_with_status_0_after_a_finished_ddp_run():
    """The exit handler meets the other rank before the group goes. Without it, a rank that left first
    sometimes aborted in the interpreter's teardown (exit -6, "terminate called without an active exception":
    gloo's workers outlive the group once DDP has wrapped a model); this order, rank 0 leaving a second
    later, is the one that did (2 runs in 15-30 on two busy cores)."""
    for rank, done in enumerate(two_ranks_exit("clean")):
        assert done.returncode == 0, f"rank {rank}: {done.stderr[-3000:]}"


@needs_gloo
def test_a_rank_that_fails_after_its_run_ends_every_rank_with_status_1():
    rank0, rank1 = two_ranks_exit("rank1_raises_after_run")
    assert rank1.returncode == 1 and "rank 1 failed after its run" in rank1.stderr, rank1.stderr[-3000:]
    assert rank0.returncode == 1, rank0.stderr[-3000:]
    assert "rank 0: another rank left without finishing" in rank0.stderr, rank0.stderr[-3000:]
