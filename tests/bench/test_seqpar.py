"""``longattn bench seqpar`` end to end on 2 gloo processes started by torchrun's launcher."""

from __future__ import annotations

import json

from longattn.cli import main


def test_bench_seqpar_bytes_flat_for_skeleton_linear_for_softmax(tmp_path) -> None:
    out = tmp_path / "seqpar"
    assert main(["bench", "seqpar", "--attention", "skeleton", "softmax", "--lengths", "64,256", "--procs", "2",
                 "--dim", "8", "--repeats", "1", "--warmup", "0", "--out", str(out)]) == 0
    report = json.loads((out / "seqpar.json").read_text())
    growth = report["bytes_growth"]
    assert growth["skeleton P=2"]["ratio"] == 1.0
    assert growth["softmax P=2"]["ratio"] > 3.0  # N grew 4x: the gathered K/V dominate
    assert len(report["per_rank"]) == 2 * 2 * 2
    assert all(r["wall_s"] > 0 and len(r["peak_memory_bytes_per_rank"]) == 2 for r in report["rows"])
    assert (out / "seqpar.png").stat().st_size > 0 and "bytes ratio" in (out / "seqpar.md").read_text()
