"""Every registered mechanism trains inside the LRA model (aux losses, layer_state, masks) for a few steps."""

import math

import pytest

from longattn import attention
from longattn.experiment.config import resolve_config
from longattn.experiment.run import run


@pytest.mark.parametrize("name", attention.available())
def test_mechanism_trains_in_the_lra_model(tmp_path, name, lra_stub_data):
    config = resolve_config("listops", "demo", attention=name, overrides=[
        "data.max_len=null", "data.train.num_examples=12", "data.val.num_examples=12", "data.test.num_examples=12",
        "train.max_steps=2", "train.eval_every=2", "train.batch_size=4", "optim.warmup_steps=0",
        "model.dim=16", "model.hidden=16", "train.progress=false",
    ])
    results = run(config, tmp_path)
    assert math.isfinite(results["val"]["loss"]) and results["test"]["examples"] == 12
