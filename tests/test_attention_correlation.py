"""Singularformer's attention correlation (Sec. 5.2): pooling of eqs. 19-20 and the row-wise Pearson mean."""

import pytest
import torch
from scipy.stats import pearsonr

from longattn.analysis import pooled_attention, row_pearson
from longattn.testing import scattered_mask


def test_pooling_is_max_over_heads_then_mean_over_layers():
    layers = [torch.rand(2, 3, 5, 5, dtype=torch.float64) for _ in range(4)]
    pooled = pooled_attention(layers)
    expected = sum(torch.stack([m[:, h] for h in range(3)]).max(0).values for m in layers) / 4
    torch.testing.assert_close(pooled, expected)
    with pytest.raises(ValueError, match="at least one layer"):
        pooled_attention([])
    with pytest.raises(ValueError, match="one shape"):
        pooled_attention([torch.rand(1, 2, 3, 3), torch.rand(1, 2, 4, 4)])


def test_row_pearson_is_scipys_pearson_over_real_keys_averaged_over_real_rows():
    g = torch.Generator().manual_seed(0)
    a, b = torch.rand(3, 11, 11, generator=g), torch.rand(3, 11, 11, generator=g)
    b = b + 0.5 * a  # correlated, so the figure is not near 0 by chance
    mask = scattered_mask(3, 11)
    got = row_pearson(a, b, mask)
    for i in range(3):
        idx = mask[i].nonzero().flatten()
        rows = [pearsonr(a[i, r, idx].double().numpy(), b[i, r, idx].double().numpy()).statistic for r in idx]
        assert got[i].item() == pytest.approx(sum(rows) / len(rows), abs=1e-10)
    assert row_pearson(a, a).tolist() == pytest.approx([1.0] * 3)
    assert row_pearson(a, -a).tolist() == pytest.approx([-1.0] * 3)


def test_constant_rows_are_left_out_and_an_example_without_rows_is_nan():
    a = torch.rand(2, 4, 4, dtype=torch.float64)
    b = a.clone()
    b[0, 0] = 0.25  # a uniform row: no correlation there
    a[1] = 0.25
    got = row_pearson(a, b)
    assert got[0].item() == pytest.approx(1.0) and torch.isnan(got[1])
    one_token = torch.zeros(1, 4, dtype=torch.bool)
    one_token[0, 2] = True
    assert torch.isnan(row_pearson(a[:1], b[:1], one_token)).all()
    with pytest.raises(ValueError, match="one shape"):
        row_pearson(a, b[:, :3])
