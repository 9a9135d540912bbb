"""Table 3's threshold search: the bisection on synthetic measurements, one tiny real run, the classifier kind."""

import json

import pytest

from longattn.bench import thresholds
from longattn.bench.speed import SpeedConfig, measure
from longattn.cli import main

BASE = SpeedConfig(target="", length=0)


def synthetic(speed_from: dict[str, list[tuple[int, int]]], memory_from: dict[str, float], calls: list):
    """A target beats Post-LN in speed on the N ranges of speed_from[target], in memory above memory_from[target]."""

    def fake(config, targets, baseline, length):
        calls.append((tuple(targets), baseline, length))
        rows = {baseline: {"status": "ok", "forward_s": 1.0, "forward_wall_s": 1.0, "peak_memory_bytes": 1000}}
        for t in targets:
            fast = any(lo < length <= hi for lo, hi in speed_from[t])
            rows[t] = {"status": "ok", "forward_s": 0.5 if fast else 1.5, "forward_wall_s": 1.0,
                       "peak_memory_bytes": 900 if length > memory_from[t] else 1100}
        return rows

    return fake


def test_bisection_brackets_each_crossing_to_the_resolution():
    calls = []
    report = thresholds.sweep_thresholds(
        ["singular", "bigbird"], BASE, grid=[64, 128, 256, 512, 1024], resolution=16,
        measure=synthetic({"singular": [(140, 10**6)], "bigbird": [(0, 100), (390, 10**6)]},
                          {"singular": 100, "bigbird": 700}, calls))
    singular, bigbird = report["thresholds"]["singular"], report["thresholds"]["bigbird"]
    for entry, crossing in ((singular["speed"], 140), (singular["memory"], 100), (bigbird["speed"], 390),
                            (bigbird["memory"], 700)):
        assert entry["below"] <= crossing < entry["threshold"] and entry["threshold"] - entry["below"] <= 16
    # every grid length is one process for all models, with the baseline beside them
    assert calls[:5] == [(("singular", "bigbird"), "softmax_math", n) for n in [64, 128, 256, 512, 1024]]
    measured = [(t, n) for targets, _, n in calls for t in targets]
    assert len(measured) == len(set(measured))  # nothing measured twice
    assert {p["target"] for p in report["points"]} == {"singular", "bigbird"}
    assert all(p["speedup_vs_postln"] in (2.0, 2 / 3) for p in report["points"])
    table = thresholds.thresholds_table(report)
    assert "| singular |" in table and "| 192 | 144 |" in table  # the paper's figures beside


def test_a_model_that_never_wins_or_always_wins_is_said_so():
    calls = []
    report = thresholds.sweep_thresholds(["bigbird", "linformer"], BASE, grid=[64, 128],
                                         measure=synthetic({"bigbird": [], "linformer": [(0, 10**6)]},
                                                           {"bigbird": 10_000, "linformer": 0}, calls))
    assert report["thresholds"]["bigbird"]["speed"] == {"threshold": None, "below": 128,
                                                        "note": "loses at the longest N (128)"}
    assert report["thresholds"]["linformer"]["memory"]["threshold"] == 64
    assert "> 128" in thresholds.thresholds_table(report) and "<= 64" in thresholds.thresholds_table(report)


def test_failed_measurement_and_bad_arguments():
    def failing(config, targets, baseline, length):
        return {name: {"status": "error", "error": "boom"} for name in [baseline, *targets]}

    report = thresholds.sweep_thresholds(["singular"], BASE, grid=[64], measure=failing)
    assert report["thresholds"]["singular"]["speed"]["note"] == "measurement failed at N=64"
    assert report["points"][0]["speedup_vs_postln"] is None and report["points"][0]["error"] == "boom"
    assert "| singular | 64 | error / baseline error |" in thresholds.points_table(report)
    with pytest.raises(ValueError, match="Post-LN baselines"):
        thresholds.sweep_thresholds(["softmax"], BASE, measure=failing)
    with pytest.raises(ValueError, match="baseline is one of"):
        thresholds.sweep_thresholds(["singular"], BASE, baseline="linformer", measure=failing)
    with pytest.raises(ValueError, match="resolution"):
        thresholds.sweep_thresholds(["singular"], BASE, resolution=0, measure=failing)


def test_one_process_measures_every_model_beside_the_baseline():
    tiny = SpeedConfig(target="", length=0, batch=2, heads=2, head_dim=8, warmup=0, repeats=1, kind="classifier",
                       model={"vocab_size": 40, "num_classes": 3, "layers": 1, "hidden": 16, "norm": "post",
                              "pooling": "maxmean", "head": "singular"})
    rows = thresholds.measure_point(tiny, ["singular", "linformer"], "softmax_math", 33)
    assert list(rows) == ["softmax_math", "singular", "linformer"]
    for row in rows.values():
        assert row["status"] == "ok" and row["forward_s"] == row["forward_cpu_s"] > 0
        assert row["peak_memory_bytes"] >= 0 and row["parameters"] > 0


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
                 "--batch", "1", "--layers", "1", "--hidden", "16", "--heads", "2",
                 "--head-dim", "8", "--warmup", "0", "--repeats", "1", "--out", str(out)]) == 0
    report = json.loads((out / "thresholds.json").read_text())
    assert set(report["thresholds"]["singular"]) == {"speed", "memory"}
    assert report["rows"] and all(p["status"] == "ok" and p["speedup_vs_postln"] > 0 for p in report["rows"])
    assert report["config"]["kind"] == "classifier" and report["config"]["inference_only"]
    assert "| singular |" in (out / "thresholds.md").read_text()
    assert (out / "thresholds.png").stat().st_size > 1000
