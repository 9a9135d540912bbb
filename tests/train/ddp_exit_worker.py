"""Run by test_distributed.py as one of two gloo processes: how a rank's process ends after DDP training.

    ddp_exit_worker.py clean | rank1_raises_after_run

Each rank wraps a model in DistributedDataParallel, takes a step and gathers an object, as a run of the
Trainer ends, then leaves: ``clean``: rank 0 leaves a second after rank 1 (the order in which rank 1 used to
abort in the interpreter's teardown); ``rank1_raises_after_run``: rank 1 raises after its run finished.
"""

import os
import sys
import time

import torch

from longattn.train.distributed import all_gather_objects, init_distributed, run_finished, run_started

RANK = int(os.environ["RANK"])


def main(mode: str) -> None:
    info = init_distributed(torch.device("cpu"))
    run_started()
    model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(8, 8))
    model(torch.randn(4, 8)).sum().backward()
    all_gather_objects({"rank": RANK}, info)
    run_finished()
    if mode == "clean" and RANK == 0:
        time.sleep(1.0)
    if mode == "rank1_raises_after_run" and RANK == 1:
        raise RuntimeError("rank 1 failed after its run")


if __name__ == "__main__":
    main(*sys.argv[1:])
