"""S^3 Table 14 / Figure 2: incoherence of the token matrix before and after the Smoother (stub LRA data)."""

import json

import pytest
import torch

from longattn import attention
from longattn.analysis import mu_incoherence
from longattn.cli import main
from longattn.experiment.incoherence import _smoother_inputs, _token_matrices, summarise

TINY = ["--set", "model.dim=16", "--set", "model.hidden=16", "--set", "data.options.num_examples=10",
        "--set", "data.val.num_examples=10",
        "--set", "train.batch_size=4", "--set", "optim.warmup_steps=0"]


@pytest.fixture(autouse=True)
def stub(lra_stub_data):
    return lra_stub_data


def test_cli_trains_measures_and_writes_json_table_and_images(tmp_path):
    assert main(["bench", "incoherence", "--tasks", "text,pathfinder", "--seeds", "0,1", "--steps", "2",
                 "--ranks", "2,4", "--out", str(tmp_path), *TINY]) == 0
    data = json.loads((tmp_path / "incoherence.json").read_text())
    per_seed = data["per_seed"]
    assert {(r["task"], r["seed"], r["rank"]) for r in per_seed} == {
        (t, s, r) for t in ("text", "pathfinder") for s in (0, 1) for r in (2, 4)}
    assert all(r["steps"] == 2 and r["examples"] == 10 and r["mu_before"] >= 1 and r["mu_after"] >= 1 for r in per_seed)
    summary = {(s["task"], s["rank"]): s for s in data["rows"]}
    text4 = [r for r in per_seed if r["task"] == "text" and r["rank"] == 4]
    assert summary["text", 4]["mu_before"] == pytest.approx(sum(r["mu_before"] for r in text4) / 2)
    assert summary["text", 4]["seeds"] == 2 and summary["text", 4]["mu_before_se"] is not None
    table = (tmp_path / "incoherence.md").read_text()
    assert "| text | 2 |" in table and "| pathfinder | 2 |" in table
    for name in ("incoherence.png", "token_matrix_text.png", "token_matrix_pathfinder.png"):
        assert (tmp_path / name).stat().st_size > 0


def test_the_hook_reads_the_smoothers_input_without_changing_the_output():
    torch.manual_seed(0)
    layer = attention.build("skeleton", dim=16, heads=2, max_len=32, s1=4, s2=4, smoother_segments=4).eval()
    x = torch.randn(2, 20, 16)
    mask = torch.ones(2, 20, dtype=torch.bool)
    mask[1, 15:] = False
    expected = layer(x, attention_mask=mask)
    with _smoother_inputs(layer, 0) as (smoother, captured):
        out = layer(x, attention_mask=mask)
    torch.testing.assert_close(out, expected)
    assert len(captured) == 1 and torch.equal(captured[0][0][mask], x[mask])  # padding enters as zeros
    pairs = list(_token_matrices(smoother, *captured[0]))
    assert [p[0].shape[0] for p in pairs] == [20, 15]  # real tokens only
    # X^smooth is the Fourier convolution alone (eq. 3): the Smoother without its stem, in eval mode
    torch.testing.assert_close(pairs[1][1], smoother.fourier_smooth(x[1:, :15])[0])
    assert mu_incoherence(pairs[1][0], 4) >= 1


def test_a_model_without_a_smoother_is_a_clear_error():
    with pytest.raises(ValueError, match="no Smoother"):
        with _smoother_inputs(attention.build("softmax", dim=8, heads=2), 0):
            pass


def test_summary_is_mean_and_standard_error_over_seeds():
    rows = [{"task": "text", "rank": 2, "seed": s, "mu_before": b, "mu_after": a}
            for s, (b, a) in enumerate([(3.0, 2.0), (5.0, 2.0)])]
    (s,) = summarise(rows)
    assert s["mu_before"] == 4.0 and s["mu_before_se"] == pytest.approx(2 ** 0.5 / 2 ** 0.5)
    assert s["mu_after_se"] == 0.0 and s["reduction"] == pytest.approx(0.5)
