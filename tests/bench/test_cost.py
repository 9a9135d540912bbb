"""compare's cost columns (longattn.bench.cost): what is measured for each registered mechanism, and how a
mechanism that runs out of time or memory shows; the measurement itself is bench speed's (tests/bench/test_speed.py,
and compare's own run in tests/commands/test_lra_generated_data.py)."""

from __future__ import annotations

from longattn.bench import cost, speed


def test_each_mechanism_at_each_length_one_thread_and_a_failure_ends_its_longer_lengths(monkeypatch):
    asked = []

    def fake(config, timeout_s, memory_limit_bytes):
        asked.append((config.target, config.length, config.threads, config.reference))
        if config.target == "softmax" and config.length > 4096:
            return {"status": "timeout"}
        return {"status": "ok", "forward_backward_s": config.length / 4096, "peak_memory_bytes": 3 * 2**20}

    monkeypatch.setattr(speed, "run_in_subprocess", fake)
    settings = cost.CostSettings(lengths=(16384, 4096, 65536))
    lines = []
    costs = cost.measure_costs(["softmax", "skein"], settings, write=lines.append)
    assert asked == [("softmax", 4096, 1, False), ("softmax", 16384, 1, False),
                     ("skein", 4096, 1, False), ("skein", 16384, 1, False), ("skein", 65536, 1, False)]
    assert costs["softmax"][65536] == {"status": "timeout at a shorter length"}
    assert lines[0] == "cost: softmax at N=4k: forward+backward 1 s CPU, peak 3 MB"
    assert lines[1] == "cost: softmax at N=16k: timeout"
    assert cost.cost_columns(settings) == ["fwd+bwd 4k (s)", "mem 4k (MB)", "fwd+bwd 16k (s)", "mem 16k (MB)",
                                           "fwd+bwd 64k (s)", "mem 64k (MB)"]
    assert cost.cost_cells(costs["softmax"], settings) == ["1", "3", "timeout", "-", "timeout at a shorter length",
                                                           "-"]
    assert cost.cost_cells(None, settings) == ["-"] * 6  # a mechanism not measured
    assert "process CPU time at one thread" in settings.describe()


def test_length_labels():
    assert [cost.length_label(n) for n in (4096, 16384, 1000, 64)] == ["4k", "16k", "1000", "64"]


def test_workers_measure_mechanisms_side_by_side_with_the_same_results(monkeypatch):
    import threading

    both_running = threading.Barrier(2, timeout=10)  # broken unless two measurements are in flight at once

    def fake(config, timeout_s, memory_limit_bytes):
        if config.length == 4096:
            both_running.wait()
        return {"status": "ok", "forward_backward_s": config.length / 4096, "peak_memory_bytes": 2**20}

    monkeypatch.setattr(speed, "run_in_subprocess", fake)
    settings = cost.CostSettings(lengths=(4096, 16384))
    side_by_side = cost.measure_costs(["skein", "softmax"], settings, write=lambda line: None, workers=2)
    assert list(side_by_side) == ["skein", "softmax"]  # the order asked for, whichever finished first
    both_running.reset()
    monkeypatch.setattr(cost, "_measure_mechanism", lambda mechanism, settings, write: {"mechanism": mechanism})
    assert cost.measure_costs(["skein", "softmax"], settings, workers=1) == {
        "skein": {"mechanism": "skein"}, "softmax": {"mechanism": "softmax"}}
    assert side_by_side["softmax"][16384] == {"status": "ok", "forward_backward_s": 4.0, "peak_memory_mb": 1.0}
