"""Structure and sanity of the speed benchmark; never its timings."""

import json

import pytest

from longattn.bench.speed import SpeedConfig, count_flops, growth, plot_speed, run_in_subprocess, speed_table, traffic_bytes
from longattn.cli import main

@pytest.fixture(scope="module")
def measured(tmp_path_factory):
    """One command-line run (softmax, whose math path the command adds, at two lengths) for every test here."""
    out = tmp_path_factory.mktemp("speed")
    assert main(["bench", "speed", "--attention", "softmax", "--lengths", "256", "1024", "--batch", "2", "--heads",
                 "2", "--head-dim", "16", "--threads", "1", "--warmup", "1", "--repeats", "2", "--timeout", "120",
                 "--no-peers", "--out", str(out)]) == 0
    return out


@pytest.fixture(scope="module")
def rows(measured):
    return json.loads((measured / "speed.json").read_text())["rows"]


def test_every_configuration_is_measured(rows):
    assert [(r["target"], r["length"]) for r in rows] == [
        ("softmax", 256), ("softmax_math", 256), ("softmax", 1024), ("softmax_math", 1024)
    ]
    for r in rows:
        assert r["status"] == "ok", r
        assert 0 < r["forward_s"] and 0 < r["forward_backward_s"]
        # single-thread CPU run: the compared figure is process CPU time, wall time beside it
        assert r["forward_backward_s"] == r["forward_backward_cpu_s"] and r["forward_backward_wall_s"] > 0
        assert r["floor_s"] > 0 and r["floor_ratio"] > 0 and r["gemm_flop_per_s"] > 0 and r["copy_bytes_per_s"] > 0
        assert r["parameters"] == 4 * (32 * 32 + 32)


def test_sdpa_is_measured_in_the_same_process_only_for_other_targets(rows):
    by = {(r["target"], r["length"]): r for r in rows}
    assert "sdpa_forward_backward_s" not in by[("softmax", 256)]
    math_row = by[("softmax_math", 256)]
    assert "sdpa_forward_backward_s" not in math_row  # SDPA's own paths are the baseline, not compared


def test_flop_count_matches_the_analytic_count_of_sdpa(rows):
    by = {(r["target"], r["length"]): r for r in rows}
    b, h, n, d = 2, 2, 1024, 16
    projections = 2 * b * n * 32 * 32 * 4 * 3  # four dim x dim projections, forward + two backward GEMMs
    # math path: two GEMMs forward, four backward; the fused kernel's backward also recomputes the scores
    assert by[("softmax_math", 1024)]["flops"] == projections + 2 * b * h * n * n * d * (2 + 4)
    assert by[("softmax", 1024)]["flops"] == projections + 2 * b * h * n * n * d * (2 + 5)


def test_flop_count_includes_in_place_gemms():
    import torch

    out, a, b = torch.zeros(5, 7), torch.randn(5, 3), torch.randn(3, 7)
    assert count_flops(lambda: out.addmm_(a, b)) == 2 * 5 * 3 * 7
    assert count_flops(lambda: torch.addmm(out, a, b)) == 2 * 5 * 3 * 7


def test_peak_memory_sees_the_math_paths_score_matrix(rows):
    by = {(r["target"], r["length"]): r["peak_memory_bytes"] for r in rows}
    scores = 2 * 2 * 1024 * 1024 * 4  # B * H * N^2 float32: the math path must hold it
    assert by[("softmax_math", 1024)] >= scores
    assert by[("softmax", 1024)] < scores  # the fused kernel never forms it


def test_table_growth_and_plot(rows, tmp_path):
    table = speed_table(rows)
    assert table.startswith("Times: median, process CPU time, 1 thread")
    assert table.count("\n") == 3 + len(rows)
    assert "| softmax | 1024 |" in table and "| 1.00 |" in table
    g = growth(rows)
    assert set(g) == {"softmax", "softmax_math"} and g["softmax"]["from"] == 256
    plot_speed(rows, tmp_path / "speed.png")
    assert (tmp_path / "speed.png").stat().st_size > 1000


def test_out_of_memory_is_recorded_not_raised():
    config = SpeedConfig(target="softmax_math", length=32768, threads=1, warmup=0, repeats=1)
    row = run_in_subprocess(config, timeout_s=120, memory_limit_bytes=6 * 2**30)
    assert row["status"] == "oom", row


def test_timeout_is_recorded():
    config = SpeedConfig(target="softmax", length=256, threads=1)
    assert run_in_subprocess(config, timeout_s=0.01, memory_limit_bytes=None)["status"] == "timeout"


def test_traffic_floor_counts_activations_and_parameters():
    config = SpeedConfig(target="softmax", length=100, batch=2, heads=2, head_dim=16)
    assert traffic_bytes(config, parameters=10) == 5 * 2 * 100 * 32 * 4 + 3 * 10 * 4


def test_cli_writes_json_markdown_and_plot(measured):
    assert {r["target"] for r in json.loads((measured / "speed.json").read_text())["rows"]} == {"softmax",
                                                                                                "softmax_math"}
    assert (measured / "speed.md").exists() and (measured / "speed.png").exists()


def test_a_target_is_compared_with_sdpa_measured_beside_it(tmp_path):
    out = tmp_path / "speed"
    assert main(["bench", "speed", "--attention", "local", "--lengths", "256,512", "--repeats", "1", "--no-math",
                 "--no-peers", "--options", '{"window_size": 64}', "--reference-max-length", "256", "--out", str(out)]) == 0
    rows = {(r["target"], r["length"]): r for r in json.loads((out / "speed.json").read_text())["rows"]}
    near = rows[("local", 256)]
    assert near["options"] == {"window_size": 64}
    assert near["speedup_vs_sdpa"] == near["sdpa_forward_backward_s"] / near["forward_backward_s"]
    assert rows[("softmax", 512)]["status"].startswith("skipped")
    assert rows[("local", 512)]["status"] == "ok" and "speedup_vs_sdpa" not in rows[("local", 512)]


def test_cli_rejects_malformed_options(tmp_path, capsys):
    assert main(["bench", "speed", "--attention", "local", "--options", "[1]", "--out", str(tmp_path)]) == 2
    assert "--options must be a JSON object" in capsys.readouterr().err


def test_cli_rejects_unknown_target(tmp_path, capsys):
    with pytest.raises(SystemExit) as stop:
        main(["bench", "speed", "--attention", "softmx", "--out", str(tmp_path)])
    assert stop.value.code == 2 and "unknown mechanism 'softmx' (did you mean 'softmax'?)" in capsys.readouterr().err


def test_model_level_benchmark_trains_the_lra_text_model(tmp_path):
    out = tmp_path / "model"
    assert main(["bench", "model", "--attention", "singular", "--lengths", "64", "--batch", "2",
                 "--threads", "1", "--repeats", "1", "--out", str(out)]) == 0
    rows = json.loads((out / "model.json").read_text())["rows"]
    assert [(r["target"], r["status"]) for r in rows] == [("softmax", "ok"), ("singular", "ok")]
    assert all(r["kind"] == "lra_text" and r["parameters"] > 50_000 for r in rows)
    assert "train steps/s" in (out / "model.md").read_text()


def test_sdpa_baseline_takes_the_causal_form_of_the_mechanism_options():
    from longattn.bench.speed import baseline_options, benchmark_calls

    assert baseline_options({"causal": True, "top_k": 4}) == {"causal": True}
    assert baseline_options({"top_k": 4}) == {}
    module, _, _ = benchmark_calls(SpeedConfig(target="softmax", length=16, options={"causal": True}), "softmax")
    assert module.causal
