"""FSAT Figure 3: time and memory per sequence against N, through the speed benchmark."""

import json

from longattn.cli import main


def test_cli_writes_per_sequence_json_markdown_and_plot(tmp_path):
    assert main(["bench", "fsat-fig3", "--attention", "fsat", "--lengths", "64", "--batch", "2", "--repeats", "1",
                 "--out", str(tmp_path)]) == 0
    rows = json.loads((tmp_path / "fsat_fig3.json").read_text())["rows"]
    assert [(r["target"], r["length"], r["kind"]) for r in rows] == [("softmax", 64, "lra_text"), ("fsat", 64, "lra_text")]
    assert all(r["status"] == "ok" and r["batch"] == 2 for r in rows)
    fsat = rows[1]
    assert fsat["sdpa_forward_backward_s"] > 0  # the softmax model timed in the same process
    table = (tmp_path / "fsat_fig3.md").read_text()
    per_sequence_ms = 1000 * fsat["forward_backward_s"] / 2
    assert f"| fsat | 64 | {per_sequence_ms:.1f} |" in table
    assert (tmp_path / "fsat_fig3.png").stat().st_size > 0
