"""Skeinformer Figure 3: accuracy and training time against learning rate and batch (stub LRA data)."""

import json

import pytest

from longattn.cli import main


@pytest.fixture(autouse=True)
def stub(lra_stub_data):
    return lra_stub_data


def test_cli_trains_the_grid_and_writes_json_table_and_plot(tmp_path):
    assert main(["bench", "lr-batch", "--task", "listops", "--attention", "skein", "--lrs", "1e-3,1e-5",
                 "--batches", "2,4", "--seeds", "3", "--set", "train.max_steps=2", "--set", "train.eval_every=2", "--set", "optim.warmup_steps=0",
                 "--set", "model.dim=8", "--set", "model.hidden=16", "--set", "data.options.num_examples=8",
                 "--set", "attention_options.skein.samples=4", "--out", str(tmp_path)]) == 0
    rows = json.loads((tmp_path / "lr_batch.json").read_text())["rows"]
    assert [(r["learning_rate"], r["batch"]) for r in rows] == [(1e-3, 2), (1e-3, 4), (1e-5, 2), (1e-5, 4)]
    for r in rows:
        assert r["error"] is None and len(r["test_accuracy"]) == 1 and r["steps"] == [2]
        assert all(0 <= a <= 100 for a in r["test_accuracy"]) and all(t > 0 for t in r["train_time_s"])
    # every cell is an ordinary run with its own config: the batch and learning rate were applied
    config = (tmp_path / "runs" / "lr=1e-05" / "batch=4" / "seed3" / "config.yaml").read_text()
    assert "batch_size: 4" in config and "lr: 1.0e-05" in config
    table = (tmp_path / "lr_batch.md").read_text()
    assert "| 1e-05 " in table and "batch 4" in table
    assert (tmp_path / "lr_batch.png").stat().st_size > 0


def test_paper_analyses_take_their_default_seeds_from_the_grid():
    import argparse

    from longattn.commands._bench_papers import _seeds
    from longattn.experiment.grid import DEMO_SEEDS, PAPER_SEEDS

    assert _seeds(argparse.Namespace(seeds=None, preset="demo")) == list(range(DEMO_SEEDS))
    assert _seeds(argparse.Namespace(seeds=None, preset="paper")) == list(range(PAPER_SEEDS))
    assert _seeds(argparse.Namespace(seeds=[4, 7], preset="paper")) == [4, 7]
