"""Skeinformer Table 3: the analytic FLOP counts against torch's counter, and the command."""

import json

import pytest

from longattn.bench.flops import FLOP_MODELS, flop_rows, measure_attention_macs
from longattn.cli import main

# the acceptance: agreement within 10% at n = 4096 (d = 256, p = 32, the paper's sizes)
ACCEPTANCE_N = 4096


@pytest.fixture(scope="module")
def rows_at_4096():
    return {r["mechanism"]: r for r in flop_rows(list(FLOP_MODELS), [ACCEPTANCE_N])}


@pytest.mark.parametrize("mechanism", sorted(FLOP_MODELS))
def test_measured_flops_agree_with_the_analytic_count_at_4096(rows_at_4096, mechanism):
    row = rows_at_4096[mechanism]
    assert row["measured_over_analytic"] == pytest.approx(1.0, abs=0.10), row


@pytest.mark.parametrize("mechanism", ["softmax", "bigbird", "linformer", "informer", "skein"])
def test_table_3_leading_term_holds_where_the_implementation_computes_what_the_paper_counts(rows_at_4096, mechanism):
    assert rows_at_4096[mechanism]["measured_over_paper"] == pytest.approx(1.0, abs=0.10)


def test_nystrom_grows_with_the_papers_leading_coefficient_in_n():
    # its count at n = 4096 is dominated by the n-independent pseudo-inverse (24 d^3); the slope in n is 4dp
    rows = flop_rows(["nystrom"], [1024, 2048])
    assert rows[1]["slope_over_paper"] == pytest.approx(1.0, abs=0.10)
    assert rows[1]["measured_over_paper"] > 2  # the table's term alone is far off at this n


def test_the_projections_are_not_counted():
    # Q, K, V given: a wider model changes the projections' FLOPs only, not the attention's
    assert measure_attention_macs("linformer", 512, d=64, p=16) == 4 * 512 * 64 * 16


def test_unknown_mechanism_is_a_clear_error():
    with pytest.raises(ValueError, match="no FLOP model for 'skeleton'"):
        flop_rows(["skeleton"], [256])


def test_cli_writes_json_markdown_and_plot(tmp_path):
    assert main(["bench", "flops", "--attention", "skein", "softmax", "--lengths", "256,512", "--features", "32",
                 "--head-dim", "8", "--out", str(tmp_path)]) == 0
    data = json.loads((tmp_path / "flops.json").read_text())
    assert [(r["mechanism"], r["n"]) for r in data["rows"]] == [("skein", 256), ("skein", 512), ("softmax", 256), ("softmax", 512)]
    assert all(r["measured_over_analytic"] == pytest.approx(1.0, abs=0.10) for r in data["rows"])
    assert "| skein | 4ndp | 512 |" in (tmp_path / "flops.md").read_text()
    assert (tmp_path / "flops.png").stat().st_size > 0
