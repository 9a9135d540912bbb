"""Skeinformer Table 2: the batch search, the accumulation that reaches the paper's batch, and the command."""

import json

import pytest

from longattn.bench import batch_limit
from longattn.bench.batch_limit import largest_batch, run_batch_limit
from longattn.bench.speed import MODEL_DEFAULTS
from longattn.cli import main


@pytest.mark.parametrize("limit,cap", [(1, 128), (5, 128), (64, 128), (100, 128), (128, 128), (300, 128), (0, 16)])
def test_search_finds_the_largest_batch_that_fits(limit, cap):
    batch, probed = largest_batch(lambda b: b <= limit, cap)
    assert batch == min(limit, cap)
    assert len(probed) <= 2 * cap.bit_length() + 1  # doubling then bisection, not a scan
    assert max(probed) <= cap


def test_accumulation_reaches_the_paper_batch(monkeypatch):
    calls = []

    def fake_subprocess(config, timeout_s, memory_limit_bytes, parts):
        calls.append((parts, config.batch, config.grad_accum, config.options))
        if parts == ("memory",):  # 1 MiB per sequence: 40 fit in the 40 MiB budget
            return {"status": "ok", "peak_memory_bytes": config.batch * 2**20}
        return {"status": "ok", "forward_backward_s": 0.5, "forward_backward_wall_s": 0.6}

    monkeypatch.setattr(batch_limit, "run_in_subprocess", fake_subprocess)
    (row,) = run_batch_limit(["linformer"], 1024, 40 * 2**20, 128, MODEL_DEFAULTS, progress=False)
    assert row["largest_batch"] == 40 and row["accumulation"] == 4 and row["micro_batch"] == 32
    assert row["minutes_per_thousand_steps"] == pytest.approx(0.5 * 1000 / 60)
    assert calls[-1][:3] == (("time",), 32, 4)
    assert calls[0][3] == {"k": 256}  # Skeinformer A.1's feature count


def test_a_mechanism_that_never_fits_is_recorded(monkeypatch):
    monkeypatch.setattr(batch_limit, "run_in_subprocess", lambda *a, **k: {"status": "oom", "error": "x"})
    (row,) = run_batch_limit(["skein"], 1024, 2**20, 128, MODEL_DEFAULTS, progress=False)
    assert row["largest_batch"] == 0 and row["status"] == "does not fit at batch 1"


def test_cli_measures_and_writes_json_markdown_and_plot(tmp_path):
    assert main(["bench", "batch-limit", "--attention", "skein", "--length", "64", "--paper-batch", "2",
                 "--budget-mib", "100000", "--features", "8", "--repeats", "1", "--out", str(tmp_path)]) == 0
    (row,) = json.loads((tmp_path / "batch_limit.json").read_text())["rows"]
    assert row["status"] == "ok" and row["probed"] == [1, 2] and row["largest_batch"] == 2
    assert row["accumulation"] == 1 and row["minutes_per_thousand_steps"] > 0
    assert "| skein | 2 | 1 x 2 |" in (tmp_path / "batch_limit.md").read_text()
    assert (tmp_path / "batch_limit.png").stat().st_size > 0
