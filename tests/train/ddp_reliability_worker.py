"""Run by test_train_reliability.py as one of two gloo processes (torch.distributed.run or by hand), or
alone (no RANK: one process).

    ddp_reliability_worker.py OUT run|resume [kill_at_step=K:RANK | kill_in_write=N | single_batch |
                                              stop_rank1_at_step=K | full_disk_in_write=N | rank1_wider]
"""

import io
import json
import os
import signal
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/: the stub data API
sys.path.insert(0, str(Path(__file__).resolve().parent))  # tests/train/: the faults
from lra_stub import API  # noqa: E402

from longattn.experiment.config import resolve_config  # noqa: E402
from longattn.experiment.run import run  # noqa: E402
from longattn.tasks.lra import LRATask  # noqa: E402

RANK = int(os.environ.get("RANK", "0"))
# dropout and gradient accumulation make the ranks' random streams and the step layout matter
BASE = ["train.max_steps=12", "train.eval_every=4", "train.checkpoint_every=2", "train.batch_size=4",
        "train.grad_accum=2", "data.options.num_examples=40", "data.val.num_examples=11", "optim.lr=3e-3",
        "model.dim=16", "model.hidden=32", "model.dropout=0.3", "train.progress=false"]
SINGLE_BATCH = ["train.max_steps=1", "train.eval_every=1", "train.log_every=1", "train.batch_size=4",
                "data.options.num_examples=40", "model.dim=16", "model.hidden=32", "train.progress=false"]


def die() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


def kill_in_write(nth: int) -> None:
    """Rank 0 dies half-way through writing its nth last.pt (after the temp file is opened)."""
    original, writes = torch.save, []

    def save(obj, f, *args, **kwargs):
        name = getattr(getattr(f, "file", f), "name", "")  # through longattn's write recorder
        if isinstance(name, int):  # a file opened from a descriptor (os.fdopen): its path from /proc
            name = os.readlink(f"/proc/self/fd/{name}")
        if RANK == 0 and not isinstance(f, io.BytesIO) and ".last.pt." in str(name):
            writes.append(name)
            if len(writes) == nth:
                buffer = io.BytesIO()
                original(obj, buffer, *args, **kwargs)
                f.write(buffer.getvalue()[: buffer.tell() // 2])
                getattr(f, "file", f).flush()
                print(f"killed while writing {name}", file=sys.stderr, flush=True)
                die()
        return original(obj, f, *args, **kwargs)

    torch.save = save


def record_losses(out_dir: str) -> None:
    original = LRATask.step_fn

    def step_and_record(task, config, data):
        step = original(task, config, data)

        def recording(model, batch):
            out = step(model, batch)
            if model.training:
                Path(out_dir, f"rank{RANK}.loss").write_text(json.dumps(float(out.loss)))
            return out

        return recording

    LRATask.step_fn = step_and_record


def main(out_dir: str, mode: str, option: str = "") -> None:
    name, _, value = option.partition("=")
    hook = None
    if name == "kill_at_step":
        step, rank = (int(v) for v in value.split(":"))

        def hook(trainer, done):
            if done == step and RANK == rank:
                die()
    elif name == "kill_in_write":
        kill_in_write(int(value))
    elif name == "stop_rank1_at_step":
        def hook(trainer, done):
            if done == int(value) and RANK == 1:
                os.kill(os.getpid(), signal.SIGSTOP)
    elif name == "full_disk_in_write":
        if RANK == 0:  # the main process writes the checkpoints
            from faults import full_disk_in_write

            full_disk_in_write(int(value))
    elif name == "rank1_wider":  # rank 1 is started with another model width than rank 0
        if RANK == 1:
            BASE.append("model.dim=24")
    elif name == "single_batch":
        record_losses(out_dir)
    LRATask.data_api = API
    config = resolve_config("listops", attention="softmax", overrides=SINGLE_BATCH if option == "single_batch" else BASE)
    run(config, out_dir, resume=mode == "resume", on_step_end=hook)


if __name__ == "__main__":
    main(*sys.argv[1:])
