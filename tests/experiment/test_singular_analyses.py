"""Singularformer's analyses on tiny cross-validations: Figures 8-10 (attention correlation of trained models),
Figure 6 (accuracy against inference cost) and Figure 7 (accuracy against r)."""

from __future__ import annotations

import io
import json

import numpy as np
import pytest
import torch
from PIL import Image
from test_crossval import TINY, write_r8

from longattn.analysis import pooled_attention, row_pearson
from longattn.attention import record_attention_maps
from longattn.cli import main
from longattn.config import ConfigError
from longattn.experiment.attention_correlation import MAP_MODELS, load_fold_models, patches_to_image
from longattn.experiment.crossval import run_crossval
from longattn.experiment.singular_figures import run_rank_sweep


@pytest.fixture(scope="module")
def r8_runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("r8")
    data_dir = write_r8(root / "R8")
    run_crossval(["r8"], list(MAP_MODELS), root / "cv", preset="cpu", overrides=[f"data.data_dir={data_dir}", *TINY],
                 folds=2, only_folds=[0])
    return root


def test_figures_8_and_9_from_a_folds_checkpoints(r8_runs, capsys):
    out = r8_runs / "corr"
    assert main(["bench", "attention-correlation", "--runs", str(r8_runs / "cv"), "--tasks", "r8",
                 "--batch-size", "4", "--out", str(out)]) == 0
    report = json.loads((out / "attention_correlation.json").read_text())
    entry = report["tasks"]["r8"]
    assert len(entry["pairs"]) == 6 and entry["pairs"]["post_ln|singularformer"]["examples"] == 9  # the test set
    matrix = np.array(entry["mean_matrix"], dtype=float)
    assert matrix.shape == (4, 4) and np.allclose(np.diag(matrix), 1) and np.allclose(matrix, matrix.T)
    assert np.all(np.abs(matrix) <= 1)
    for name in ("figure8.png", "figure9_r8.png", "attention_correlation.md"):
        assert (out / name).stat().st_size > 500
    # the figure of one example is the correlation of the models' pooled maps, recomputed here by hand from the
    # command's first batch (--batch-size 4): alone, the example's float32 maps round differently by ~1e-8, and
    # the correlation of a nearly uniform row amplifies that far beyond any tolerance
    fold = load_fold_models(r8_runs / "cv", "r8", ["post_ln", "singularformer"], 0)
    batch = fold.data.collate([fold.data.test[i] for i in range(4)])
    maps = []
    for model in fold.models.values():
        with torch.no_grad(), record_attention_maps(model) as records:
            model(batch["tokens"], batch["attention_mask"])
        assert len(records) == 1  # TINY: one layer
        maps.append(pooled_attention([r.weights for r in records]))
    expected = row_pearson(maps[0], maps[1], batch["attention_mask"])[0].item()
    assert entry["per_example"]["post_ln|singularformer"][0] == pytest.approx(expected)


def test_missing_or_mismatched_folds_are_clear_errors(r8_runs):
    with pytest.raises(ConfigError, match="no finished fold"):
        load_fold_models(r8_runs / "cv", "r8", ["post_ln", "bigbird"], 0)


def test_figure_6_reads_the_accuracies_and_measures_the_models(r8_runs):
    out = r8_runs / "fig6"
    assert main(["bench", "accuracy-cost", "--runs", str(r8_runs / "cv"), "--models", "singularformer",
                 "--batch", "2", "--repeats", "1", "--out", str(out)]) == 0
    report = json.loads((out / "figure6.json").read_text())
    summary = json.loads((r8_runs / "cv" / "results.json").read_text())
    accuracy = next(e["test_mean"] for e in summary["entries"] if e["model"] == "singularformer")
    (row,) = report["rows"]
    assert row["status"] == "ok" and row["test_mean"] == accuracy and row["length"] == 141
    assert row["examples_per_s"] == pytest.approx(2 / row["forward_s"]) and row["peak_memory_bytes"] >= 0
    assert row["parameters"] == sum(p.numel() for p in load_fold_models(r8_runs / "cv", "r8", ["singularformer"], 0)
                                    .models["singularformer"].parameters())
    assert "| r8 | Singularformer | 141 |" in (out / "figure6.md").read_text()
    assert (out / "figure6.png").stat().st_size > 1000


def test_figure_7_sweeps_r_on_the_protocol(r8_runs):
    out = r8_runs / "fig7"
    report = run_rank_sweep("r8", [2, 4], out, data_dir=str(r8_runs / "R8"), overrides=TINY, folds=2, only_folds=[0])
    assert [r["rank"] for r in report["rows"]] == [2, 4] and report["head_dim"] == 8
    assert all(r["folds"] == [0] and 0 <= r["test_mean"] <= 1 for r in report["rows"])
    model = load_fold_models(out / "r4", "r8", ["singularformer"], 0).models["singularformer"]
    assert {block.attention.rank for block in model.encoder.blocks} == {4}
    assert (out / "figure7.png").stat().st_size > 1000 and "| 4 | 0 |" in (out / "figure7.md").read_text()


def _png(pixels: np.ndarray) -> bytes:
    buffer = io.BytesIO()
    Image.fromarray(pixels).save(buffer, format="PNG")
    return buffer.getvalue()


def test_figure_10_on_cifar10_patches(tmp_path):
    rng = np.random.default_rng(0)
    tree = tmp_path / "cifar10"
    for split, count in (("train", 10), ("test", 4)):
        for cls in ("airplane", "cat"):
            (tree / split / cls).mkdir(parents=True)
            for i in range(count):
                (tree / split / cls / f"{i}.png").write_bytes(_png(rng.integers(0, 256, (32, 32, 3), dtype=np.uint8)))
    models = ["post_ln", "singularformer"]
    run_crossval(["cifar10"], models, tmp_path / "cv", preset="cpu", folds=2, only_folds=[0],
                 overrides=[f"data.data_dir={tree}", "data.options.check_counts=false", *TINY])
    out = tmp_path / "corr"
    assert main(["bench", "attention-correlation", "--runs", str(tmp_path / "cv"), "--tasks", "cifar10", "--models",
                 ",".join(models), "--out", str(out)]) == 0
    entry = json.loads((out / "attention_correlation.json").read_text())["tasks"]["cifar10"]
    examples = entry["figure10_examples"]
    assert [e["quantile"] for e in examples] == [0.0, 0.2, 0.4, 0.6, 0.8, 1.0]
    assert [e["correlation"] for e in examples] == sorted(e["correlation"] for e in examples)
    assert (out / "figure10_cifar10.png").stat().st_size > 1000
    # the image of Figure 10 is the test image itself
    fold = load_fold_models(tmp_path / "cv", "cifar10", models, 0)
    first = fold.data.test[examples[0]["index"]]["patches"].numpy()
    test_files = sorted((tree / "test").glob("*/*.png"), key=lambda p: (p.parent.name, p.name))
    original = np.asarray(Image.open(test_files[examples[0]["index"]])) / 255
    assert np.allclose(patches_to_image(first), original)
