"""PatchTST: patching, RevIN, channel independence, residual attention, shapes, gradients, overfit."""

from __future__ import annotations

from functools import partial

import pytest
import torch

from forecaster_checks import (SMALL_OPTIONS, check_forward_and_gradients, check_matches_reference_with_dropout,
                               check_rejects_bad_input, overfit_ratio, tiny)
from longattn.attention.base import merge_heads, split_heads
from longattn.attention.softmax import softmax_attention_reference
from longattn.models.patchtst import ResidualAttention, RevIN, make_patches, patch_count

SMALL = SMALL_OPTIONS["patchtst"]


def test_patches_match_a_plain_loop():
    x = torch.randn(2, 3, 23, dtype=torch.float64)
    patches = make_patches(x, 6, 3)
    padded = torch.cat([x, x[..., -1:].repeat(1, 1, 3)], dim=-1)
    expected = torch.stack([padded[..., i : i + 6] for i in range(0, padded.shape[-1] - 6 + 1, 3)], dim=2)
    torch.testing.assert_close(patches, expected)
    assert patches.shape[2] == patch_count(23, 6, 3)
    assert patch_count(96, 16, 8) == 12  # the paper's N = floor((L - P) / S) + 2 for L = 96
    assert patch_count(96, 16, 8, pad_end=False) == 11


def test_revin_round_trip_and_statistics():
    revin = RevIN(3).double()
    with torch.no_grad():
        revin.weight.uniform_(0.5, 2.0)
        revin.bias.normal_()
    x = torch.randn(4, 20, 3, dtype=torch.float64) * 3 + 5
    h, mean, std = revin.normalise(x)
    plain = (x - x.mean(1, keepdim=True)) / (x.var(1, unbiased=False, keepdim=True) + 1e-5).sqrt()
    torch.testing.assert_close(h, plain * revin.weight + revin.bias)
    torch.testing.assert_close(revin.denormalise(h, mean, std), x, atol=1e-6, rtol=1e-6)


def test_residual_attention_is_softmax_attention_plus_previous_scores():
    torch.manual_seed(0)
    layer = ResidualAttention(8, 2).double()
    x = torch.randn(3, 5, 8, dtype=torch.float64)
    out, scores = layer(x, None)
    split = lambda t: t.reshape(3, 5, 2, 4).transpose(1, 2)  # noqa: E731
    q, k, v = split(layer.to_q(x)), split(layer.to_k(x)), split(layer.to_v(x))
    ref = softmax_attention_reference(q, k, v)
    torch.testing.assert_close(out, layer.to_out(ref.transpose(1, 2).reshape(3, 5, 8)))
    previous = torch.randn_like(scores)
    _, scores2 = layer(x, previous)
    torch.testing.assert_close(scores2, scores + previous)


def plain_residual_attention(layer, x, previous_scores):
    """The pre-change computation: [B, H, N_q, N_k] scores plus the previous ones, softmax over the last axis,
    dropout, values."""
    q, k, v = (split_heads(f(x), layer.heads) for f in (layer.to_q, layer.to_k, layer.to_v))
    scores = q @ k.transpose(-1, -2) * layer.scale + previous_scores
    return layer.to_out(merge_heads(layer.dropout(torch.softmax(scores, dim=-1)) @ v)), scores


@pytest.mark.parametrize("patches, attention_dropout", [(1, 0.0), (13, 0.0), (12, 0.3)])
def test_keys_major_scores_match_the_plain_form_with_the_same_dropout(patches, attention_dropout):
    """Forward and gradients (input, parameters, previous scores) in float64, in training mode, chained over two
    layers as the model chains them; with attention dropout the same mask is drawn for the same seed."""
    torch.manual_seed(patches)
    first, second = (ResidualAttention(8, 2, attention_dropout).double().train() for _ in range(2))
    x = torch.randn(3, patches, 8, dtype=torch.float64, requires_grad=True)
    previous = torch.randn(3, 2, patches, patches, dtype=torch.float64, requires_grad=True)

    def chained(attention, x):
        h, scores = attention(first, x, previous)
        out, scores = attention(second, h, scores)
        return torch.cat([out.flatten(), scores.flatten()])

    fast = partial(chained, lambda layer, h, scores: layer(h, scores))
    plain = partial(chained, plain_residual_attention)
    params = [previous, *first.parameters(), *second.parameters()]
    if attention_dropout:
        check_matches_reference_with_dropout(fast, plain, x, params)
        return
    out, ref = fast(x), plain(x)
    torch.testing.assert_close(out, ref)
    g = torch.randn_like(out)
    for a, r in zip(torch.autograd.grad(out, [x, *params], g), torch.autograd.grad(ref, [x, *params], g)):
        torch.testing.assert_close(a, r)


def test_channel_independence():
    """Channel c's forecast depends only on channel c's history (the backbone is shared, the series are not mixed)."""
    model = tiny("patchtst", 3, 23, 5, **SMALL).double().eval()
    x = torch.randn(2, 23, 3, dtype=torch.float64)
    changed = x.clone()
    changed[..., 1] += torch.randn(2, 23, dtype=torch.float64)
    a, b = model(x), model(changed)
    torch.testing.assert_close(a[..., [0, 2]], b[..., [0, 2]])
    assert not torch.allclose(a[..., 1], b[..., 1])


@pytest.mark.parametrize("seq_len, pred_len, options", [(23, 5, {}), (24, 7, {"pad_end": False}),
                                                        (17, 3, {"revin": False, "residual_attention": False})])
def test_shapes_and_gradients(seq_len, pred_len, options):
    model = tiny("patchtst", 3, seq_len, pred_len, **SMALL, **options)
    check_forward_and_gradients(model, seq_len, pred_len, 3)
    check_rejects_bad_input(model, seq_len, 3)


def test_defaults_are_the_papers():
    model = tiny("patchtst", 7, 96, 96)
    assert model.num_patches == 12 and len(model.layers) == 3
    assert model.patch_embedding.out_features == 128 and model.layers[0].attention.heads == 16


def test_overfits_a_synthetic_series():
    assert overfit_ratio(tiny("patchtst", 2, 24, 6, **SMALL), 24, 6, 2) < 0.5
