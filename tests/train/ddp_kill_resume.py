"""kill -9 of a 2-process gloo DDP run early, mid-run and during a checkpoint write, then resume:
are the final weights bit-identical to an uninterrupted run? (too slow for the suite)

    OMP_NUM_THREADS=1 python3 tests/train/ddp_kill_resume.py OUT [--every-step] [--src SRC]

``--every-step`` kills at every step of the 12 (rank 0 at odd steps, rank 1 at even ones) and in every
checkpoint write, not only at the three moments. ``--src`` runs another source tree (e.g. an older
checkout's ``src``) with the same worker. Prints one table row per kill moment; exit status 1 unless every
resume is bit-identical.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
MOMENTS = (("early (step 3, rank 0)", "kill_at_step=3:0"), ("mid (step 7, rank 1)", "kill_at_step=7:1"),
           ("in the 4th last.pt write (rank 0)", "kill_in_write=4"))
STEPS, WRITES = 12, 6  # the worker's run: 12 steps, a checkpoint every 2
EVERY_MOMENT = (*((f"step {k}, rank {k % 2 == 0:d}", f"kill_at_step={k}:{k % 2 == 0:d}") for k in range(1, STEPS + 1)),
                *((f"in the last.pt write {n} of {WRITES} (rank 0)", f"kill_in_write={n}")
                  for n in range(1, WRITES + 1)))


def worker_env(src: Path = HERE.parents[1] / "src") -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": os.pathsep.join([str(src), os.environ.get("PYTHONPATH", "")]),
            "OMP_NUM_THREADS": "1"}


def launch_two_ranks(script: Path, *args: str, env: dict[str, str]) -> list[subprocess.Popen]:
    """Ranks 0 and 1 of ``script`` without torchrun (a free local port), so that a test sees each one's exit
    status and decides when to kill one."""
    import socket

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    base = {**worker_env(), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "WORLD_SIZE": "2", **env}
    return [subprocess.Popen([sys.executable, str(script), *args], env={**base, "RANK": str(r), "LOCAL_RANK": str(r)},
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for r in (0, 1)]


def worker_command(out_dir: Path, *args: str) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
            str(HERE / "ddp_reliability_worker.py"), str(out_dir), *args]


def final_weights(out_dir: Path) -> dict:
    import torch

    path = out_dir / "checkpoints" / "last.pt"
    try:
        from longattn.train.checkpoint import load_checkpoint

        return load_checkpoint(path)["model"]
    except (ImportError, ValueError):
        return torch.load(path, weights_only=False)["model"]  # a source tree from before checksummed files


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--src", type=Path, default=HERE.parents[1] / "src")
    parser.add_argument("--every-step", action="store_true", help="kill at every step and in every checkpoint write")
    args = parser.parse_args()
    env = worker_env(args.src.resolve())
    sys.path.insert(0, str(args.src.resolve()))

    def run(out_dir: Path, *worker_args: str) -> tuple[int, str]:
        done = subprocess.run(worker_command(out_dir, *worker_args), env=env, capture_output=True, text=True)
        if done.returncode not in (0, -9, 1):
            print(done.stderr[-2000:], file=sys.stderr)
        return done.returncode, done.stderr

    code, _ = run(args.out / "full", "run")
    if code != 0:
        print(f"uninterrupted run failed (exit {code})", file=sys.stderr)
        return 1
    reference = final_weights(args.out / "full")
    print("| kill moment | killed run exit | temp files after the kill | resumed from step | resume exit "
          "| bit-identical | max abs weight difference | temp files after resume |")
    print("|---|---|---|---|---|---|---|---|")
    identical_everywhere = True
    for label, how in EVERY_MOMENT if args.every_step else MOMENTS:
        out = args.out / how.replace("=", "_").replace(":", "_")
        killed, _ = run(out, "run", how)
        left = len(list((out / "checkpoints").glob(".*.tmp")))
        resumed, log = run(out, "resume")
        if resumed != 0:
            print(f"{label}: the resume failed:\n{log[-3000:]}", file=sys.stderr)
        match = re.search(r"resuming from .* at step (\d+)", log)
        start = match.group(1) if match else "scratch"
        weights = final_weights(out) if resumed == 0 else {}
        same = bool(weights) and all((weights[k] == v).all().item() for k, v in reference.items())
        diff = max(((weights[k].double() - v.double()).abs().max().item() for k, v in reference.items()),
                   default=float("nan")) if weights else float("nan")
        temps = len(list((out / "checkpoints").glob(".*.tmp")))
        identical_everywhere &= same
        print(f"| {label} | {killed} | {left} | {start} | {resumed} | {same} | {diff:.3g} | {temps} |")
    return 0 if identical_everywhere else 1


if __name__ == "__main__":
    raise SystemExit(main())
