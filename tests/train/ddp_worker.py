"""Run by test_distributed.py under ``torch.distributed.run`` with two CPU processes."""

import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/: the stub data API
from lra_stub import API  # noqa: E402

from longattn.experiment.config import resolve_config  # noqa: E402
from longattn.experiment.run import run  # noqa: E402
from longattn.tasks.lra import LRATask  # noqa: E402


def main(out_dir: str) -> None:
    LRATask.data_api = API
    config = resolve_config("listops", attention="softmax", overrides=[
        "train.max_steps=4", "train.eval_every=2", "train.batch_size=4", "data.options.num_examples=20",
        "data.val.num_examples=11", "model.dim=16", "model.hidden=32", "train.progress=false", "train.grad_accum=2",
    ])
    seen = {}

    def keep_trainer(trainer, step):
        seen["trainer"] = trainer

    results = run(config, out_dir, on_step_end=keep_trainer)
    model = seen["trainer"].model
    checksum = float(sum(p.double().sum() for p in model.parameters()))
    rank = os.environ["RANK"]
    (Path(out_dir) / f"rank{rank}.json").write_text(json.dumps({"results": results, "checksum": checksum}, default=str))


if __name__ == "__main__":
    main(sys.argv[1])
