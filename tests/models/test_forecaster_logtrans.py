"""LogTrans: the LogSparse pattern against its set definition, convolutional attention against a plain loop,
the diagonal (pattern-only) scores against the dense masked form, causality, shapes, gradients, overfit."""

from __future__ import annotations

import math

import pytest
import torch

from forecaster_checks import (SMALL_OPTIONS, check_forward_and_gradients, check_matches_reference_with_dropout,
                               check_rejects_bad_input, overfit_ratio, tiny)
from longattn.attention.base import merge_heads, split_heads
from longattn.models import logtrans
from longattn.models.logtrans import LogSparseConvAttention, logsparse_gaps, logsparse_mask
from longattn.testing import LargestTensorRecorder


@pytest.mark.parametrize("n, window", [(1, 0), (13, 0), (20, 3)])
def test_logsparse_mask_is_the_papers_index_set(n, window):
    mask = logsparse_mask(n, window)
    for i in range(n):
        # I_p^l = {l - 2^floor(log2 l), ..., l - 2^1, l - 2^0, l} (0-based: l - 2^m >= 0), plus the local window
        expected = {i} | {i - 2**m for m in range(i.bit_length())}  # 2^m <= i
        expected |= {i - s for s in range(1, window + 1) if i - s >= 0}
        assert set(torch.nonzero(mask[i]).flatten().tolist()) == expected
    assert mask.sum() <= n * (int(math.log2(max(n, 1))) + 2 + window)  # O(L log L) cells


def test_conv_attention_matches_a_plain_loop_and_is_causal():
    torch.manual_seed(0)
    layer = LogSparseConvAttention(8, 2, kernel_size=3, local_window=1).double().eval()
    x = torch.randn(2, 11, 8, dtype=torch.float64)
    out = layer(x)
    padded = torch.cat([torch.zeros(2, 2, 8, dtype=torch.float64), x], dim=1)
    conv = lambda c: torch.stack([  # noqa: E731
        torch.einsum("bkd,edk->be", padded[:, t : t + 3], c.weight) + c.bias for t in range(11)], dim=1)
    q, k, v = conv(layer.to_q), conv(layer.to_k), layer.to_v(x)
    mask = logsparse_mask(11, 1)
    expected = torch.zeros(2, 11, 8, dtype=torch.float64)
    for i in range(11):
        keys = torch.nonzero(mask[i]).flatten()
        for h in range(2):
            sl = slice(4 * h, 4 * h + 4)
            weights = torch.softmax(torch.einsum("bd,bkd->bk", q[:, i, sl], k[:, keys, sl]) / 2.0, dim=-1)
            expected[:, i, sl] = torch.einsum("bk,bkd->bd", weights, v[:, keys, sl])
    torch.testing.assert_close(out, layer.to_out(expected))
    changed = x.clone()
    changed[:, 7:] += 1.0
    torch.testing.assert_close(layer(changed)[:, :7], out[:, :7])  # no position sees a later one


def masked_dense_reference(layer, x, dropout_factor=None):
    """The layer's attention written the plain way: scaled scores, masked_fill outside the pattern, softmax,
    dropout (``layer.dropout``, or the given [B, H, L, L] factor), values."""
    q, k, v = (split_heads(f(x), layer.heads) for f in (layer.to_q, layer.to_k, layer.to_v))
    scores = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
    scores = scores.masked_fill(~logsparse_mask(x.shape[1], layer.local_window), float("-inf"))
    weights = torch.softmax(scores, dim=-1)
    weights = layer.dropout(weights) if dropout_factor is None else weights * dropout_factor
    return layer.to_out(merge_heads(weights @ v))


def dense_factor(pattern_factor, gaps, n):
    """A dropout factor on the pattern's cells [B, #gaps, H, L] written on the dense [B, H, L, L] weights (cell
    (i, i - g_m) = factor[:, m, :, i]; 0 outside the pattern)."""
    dense = pattern_factor.new_zeros(pattern_factor.shape[0], pattern_factor.shape[2], n, n)
    for m, g in enumerate(gaps):
        dense.diagonal(-g, dim1=-2, dim2=-1).copy_(pattern_factor[:, m, :, g:])
    return dense


@pytest.mark.parametrize("n, window", [(1, 0), (2, 0), (13, 0), (16, 0), (17, 0), (30, 2), (33, 5), (6, 9)])
def test_gaps_are_the_diagonals_of_the_mask(n, window):
    mask = logsparse_mask(n, window)
    expected = sorted({i - j for i in range(n) for j in range(n) if mask[i, j]})
    assert logsparse_gaps(n, window) == expected


@pytest.mark.parametrize("n, window", [(2, 0), (13, 0), (17, 0), (30, 2), (33, 5), (6, 9)])
def test_pattern_scores_match_the_masked_dense_reference_with_the_same_dropout(n, window):
    """Forward and gradients in float64, in training mode: the layer's output is the dense form's with the layer's
    own dropout draw (for the same seed) written on the dense weights, at odd lengths, just past a power of two,
    and with a local window longer than the sequence; another seed, other masks."""
    torch.manual_seed(0)
    layer = LogSparseConvAttention(8, 2, kernel_size=3, local_window=window, dropout=0.3).double().train()
    x = torch.randn(2, n, 8, dtype=torch.float64, requires_grad=True)
    gaps = logsparse_gaps(n, window)

    def reference(t):
        factor = dense_factor(layer.dropout_noise(t.shape[0], n, gaps, t), gaps, n)
        return masked_dense_reference(layer, t, factor)

    check_matches_reference_with_dropout(layer, reference, x, list(layer.parameters()))


def test_dropout_draws_the_pattern_cells_like_nn_dropout():
    """Each of the pattern's cells is kept with probability 1 - p and scaled by 1 / (1 - p), independently
    (nn.Dropout's law on those weights); a draw of B * #gaps * H * L numbers, not B * H * L * L."""
    layer = LogSparseConvAttention(8, 2, dropout=0.25).train()
    n, gaps = 4096, logsparse_gaps(4096)
    x = torch.zeros(4, n, 8)
    torch.manual_seed(3)
    factor = layer.dropout_noise(4, n, gaps, x)
    assert factor.shape == (4, len(gaps), 2, n)
    kept = factor != 0
    torch.testing.assert_close(factor[kept], torch.full_like(factor[kept], 1 / 0.75))
    fraction = kept.double().mean().item()  # 4 * 13 * 2 * 4096 = 425,984 cells: 3 std of the mean is 0.002
    assert abs(fraction - 0.75) < 0.003, fraction
    per_gap = kept.double().mean(dim=(0, 2, 3))
    assert (per_gap - 0.75).abs().max() < 0.012, per_gap  # 32,768 cells per gap: 3 std is 0.0072
    assert not torch.equal(factor, layer.dropout_noise(4, n, gaps, x))


@pytest.mark.parametrize("n, dropout, train", [(21, 0.0, True), (21, 1.0, True), (21, 0.3, False), (1, 0.3, False)])
def test_pattern_scores_match_the_reference_without_dropout_draws(n, dropout, train):
    """No dropout (p = 0, or evaluation) and p = 1: the same output and gradients as the dense form, and, as
    nn.Dropout, no random number is drawn."""
    torch.manual_seed(0)
    layer = LogSparseConvAttention(8, 2, kernel_size=2, local_window=1, dropout=dropout).double().train(train)
    x = torch.randn(3, n, 8, dtype=torch.float64, requires_grad=True)
    torch.manual_seed(7)
    out = layer(x)
    after_fast = torch.rand(1)
    torch.manual_seed(7)
    ref = masked_dense_reference(layer, x)
    torch.testing.assert_close(torch.rand(1), after_fast)
    torch.testing.assert_close(out, ref)
    g = torch.randn_like(out)
    params = list(layer.parameters())
    for a, r in zip(torch.autograd.grad(out, [x, *params], g), torch.autograd.grad(ref, [x, *params], g)):
        torch.testing.assert_close(a, r)


@pytest.mark.parametrize("rows, with_noise", [(1, True), (2, False), (3, True)])
def test_pattern_attention_passes_gradcheck_in_groups_of_rows(monkeypatch, rows, with_noise):
    """Finite differences of _PatternAttention itself in float64 (its backward is written out), groups of 1, 2
    (a shorter last group) and 3 of 3 batch rows, with and without a dropout factor, 11 positions (past a power of
    two), a local window of 2; and the same numbers as the whole batch at once."""
    g = torch.Generator().manual_seed(rows)
    q, k, v = (torch.randn(3, 2, 4, 11, generator=g, dtype=torch.float64, requires_grad=True) for _ in range(3))
    gaps = logsparse_gaps(11, 2)
    noise = (torch.rand(3, len(gaps), 2, 11, generator=g) > 0.3).double() / 0.7 if with_noise else None
    monkeypatch.setattr(logtrans, "PATTERN_GROUP_ELEMENTS", rows * 2 * 4 * 11)
    assert torch.autograd.gradcheck(lambda *t: logtrans._PatternAttention.apply(*t, gaps, noise), (q, k, v))
    grouped = logtrans._PatternAttention.apply(q, k, v, gaps, noise)
    monkeypatch.setattr(logtrans, "PATTERN_GROUP_ELEMENTS", 3 * 2 * 4 * 11)
    torch.testing.assert_close(grouped, logtrans._PatternAttention.apply(q, k, v, gaps, noise), rtol=1e-13, atol=1e-15)


@pytest.mark.parametrize("rows", [1, 2, 5])
def test_evaluation_in_slices_of_rows_matches_the_whole_batch(monkeypatch, rows):
    """Without gradients in evaluation the layer attends slices of 1 and 2 of 5 batch rows (a shorter last slice)
    and the whole batch (5): the same output as the whole batch with gradients; in training it never slices (the
    dropout draw is over the whole batch)."""
    torch.manual_seed(0)
    layer = LogSparseConvAttention(8, 2, kernel_size=3, local_window=1, dropout=0.3).double().eval()
    x = torch.randn(5, 19, 8, dtype=torch.float64)
    monkeypatch.setattr(logtrans, "EVALUATION_SLICE_ELEMENTS", rows * 19 * 8 + rows - 1)
    sliced, attend = [], layer.attend
    monkeypatch.setattr(layer, "attend", lambda t: sliced.append(t.shape[0]) or attend(t))
    with torch.no_grad():
        out = layer(x)
    assert sliced == [rows] * (5 // rows) + [5 % rows] * (5 % rows > 0)
    torch.testing.assert_close(out, layer(x.requires_grad_()).detach(), rtol=1e-13, atol=1e-15)
    sliced.clear()
    with torch.no_grad():
        layer.train()(x)
    assert sliced == [5]


@pytest.mark.parametrize("train, dropout", [(False, 0.0), (True, 0.0), (True, 0.1)])
def test_no_length_squared_tensor(train, dropout):
    """Scores, weights and dropout draws of the pattern only: in evaluation and in training, with and without
    dropout, nothing of B * H * L * L elements is formed, forward or backward."""
    layer = LogSparseConvAttention(16, 2, kernel_size=3, dropout=dropout).train(train)
    x = torch.randn(2, 256, 16, requires_grad=True)
    with LargestTensorRecorder() as rec:
        layer(x).sum().backward()
    assert rec.max_numel < 2 * 2 * 256 * 256 / 4, rec.max_shape


SMALL = SMALL_OPTIONS["logtrans"]


@pytest.mark.parametrize("seq_len, pred_len, options", [(23, 5, {}), (24, 7, {"kernel_size": 1, "local_window": 2})])
def test_shapes_and_gradients(seq_len, pred_len, options):
    model = tiny("logtrans", 3, seq_len, pred_len, **SMALL, **options)
    check_forward_and_gradients(model, seq_len, pred_len, 3)
    check_rejects_bad_input(model, seq_len, 3)


def test_overfits_a_synthetic_series():
    assert overfit_ratio(tiny("logtrans", 2, 24, 6, **SMALL), 24, 6, 2) < 0.5
