"""Table 3's threshold search: the bisection on synthetic measurements, one tiny real run, the classifier kind."""

import json

import pytest

from longattn.bench import thresholds
from longattn.bench.speed import SpeedConfig, measure
from longattn.cli import main

BASE = SpeedConfig(target="", length=0)


def synthetic(speed_from: dict[str, float], memory_from: dict[str, float], calls: list):
    """A target beats Post-LN in speed from N > speed_from[target], in memory from N > memory_from[target]."""

    def fake(config, parts):
        calls.append((config.target, config.length, parts))
        if config.target == "softmax_math":
            return {"status": "ok", "peak_memory_bytes": 1000}
        n = config.length
        return {"status": "ok", "forward_s": 1.0, "sdpa_forward_s": 1.0, "flops": 1,
                "forward_speedup_vs_sdpa": 1.5 if n > speed_from[config.target] else 0.8,
                "peak_memory_bytes": 900 if n > memory_from[config.target] else 1100}

    return fake


def test_bisection_brackets_each_crossing_to_the_resolution():
    calls = []
    report = thresholds.sweep_thresholds(
        ["singular", "flash"], BASE, grid=[64, 128, 256, 512, 1024], resolution=16, confirm=2,
        measure=synthetic({"singular": 140, "flash": 390}, {"singular": 100, "flash": 700}, calls))
    singular, flash = report["thresholds"]["singular"], report["thresholds"]["flash"]
    for entry, crossing in ((singular["speed"], 140), (singular["memory"], 100), (flash["speed"], 390)):
        assert entry["below"] <= crossing < entry["threshold"] and entry["threshold"] - entry["below"] <= 16
    assert flash["memory"] == {"threshold": 1024, "below": 512, "note": ""} or (
        flash["memory"]["below"] <= 700 < flash["memory"]["threshold"])
    # every (target, N) is measured once, Post-LN memory once per N and never timed
    measured = [(t, n) for t, n, _ in calls]
    assert len(measured) == len(set(measured))
    assert all(parts == ("memory",) for t, _, parts in calls if t == "softmax_math")
    assert report["config"]["reference_target"] == report["baseline"] == "softmax_math"
    # singular won both at 256 and 512: the walk stopped there
    assert ("singular", 1024) not in measured and ("singular", 512) in measured
    assert {p["target"] for p in report["points"]} == {"singular", "flash"}
    table = thresholds.thresholds_table(report)
    assert "| singular |" in table and "| 192 | 144 |" in table  # the paper's figures beside


def test_a_model_that_never_wins_or_always_wins_is_said_so():
    calls = []
    report = thresholds.sweep_thresholds(["bigbird", "linformer"], BASE, grid=[64, 128], confirm=1,
                                         measure=synthetic({"bigbird": 10_000, "linformer": 0},
                                                           {"bigbird": 10_000, "linformer": 0}, calls))
    assert report["thresholds"]["bigbird"]["speed"] == {"threshold": None, "below": 128,
                                                        "note": "loses up to the longest N measured (128)"}
    assert report["thresholds"]["linformer"]["memory"]["threshold"] == 64
    assert "> 128" in thresholds.thresholds_table(report) and "<= 64" in thresholds.thresholds_table(report)


def test_failed_measurement_and_bad_arguments():
    def failing(config, parts):
        return {"status": "oom"}

    report = thresholds.sweep_thresholds(["singular"], BASE, grid=[64], measure=failing)
    assert report["thresholds"]["singular"]["speed"]["note"] == "measurement failed at N=64"
    with pytest.raises(ValueError, match="Post-LN baseline"):
        thresholds.sweep_thresholds(["softmax"], BASE, measure=failing)
    with pytest.raises(ValueError, match="baseline is one of"):
        thresholds.sweep_thresholds(["singular"], BASE, baseline="linformer", measure=failing)
    with pytest.raises(ValueError, match="resolution"):
        thresholds.sweep_thresholds(["singular"], BASE, resolution=0, measure=failing)


@pytest.mark.parametrize("baseline", ["softmax", "softmax_math"])
def test_classifier_kind_times_inference_beside_the_post_ln_model(baseline):
    config = SpeedConfig(target="singular", length=33, batch=2, heads=2, head_dim=8, warmup=0, repeats=1,
                         kind="classifier", inference_only=True, reference_target=baseline,
                         model={"vocab_size": 40, "num_classes": 3, "layers": 1, "hidden": 16, "norm": "post",
                                "pooling": "maxmean", "head": "singular"})
    row = measure(config)
    assert row["forward_s"] > 0 and row["sdpa_forward_s"] > 0 and row["flops"] > 0
    assert row["forward_speedup_vs_sdpa"] == row["sdpa_forward_s"] / row["forward_s"]
    assert "forward_backward_s" not in row and "speedup_vs_sdpa" not in row
    assert measure(config, "memory")["peak_memory_bytes"] >= 0


def test_command_on_a_tiny_model(tmp_path, capsys):
    out = tmp_path / "t3"
    assert main(["bench", "thresholds", "--attention", "singular", "--grid", "16", "--resolution", "16",
                 "--confirm", "1", "--batch", "1", "--layers", "1", "--hidden", "16", "--heads", "2",
                 "--head-dim", "8", "--warmup", "0", "--repeats", "1", "--out", str(out)]) == 0
    report = json.loads((out / "thresholds.json").read_text())
    assert set(report["thresholds"]["singular"]) == {"speed", "memory"}
    assert report["rows"] and all(p["status"] == "ok" and p["speedup_vs_postln"] > 0 for p in report["rows"])
    assert report["config"]["kind"] == "classifier" and report["config"]["inference_only"]
    assert "| singular |" in (out / "thresholds.md").read_text()
    assert (out / "thresholds.png").stat().st_size > 1000
