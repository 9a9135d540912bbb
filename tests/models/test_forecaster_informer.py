"""Informer: masked ProbSparse against a plain loop and (u = N) full causal attention, distilling, mix, the
family's feed-forward block against its convolutions, shapes, gradients, overfit."""

from __future__ import annotations

import math

import pytest
import torch

from forecaster_checks import (SMALL_OPTIONS, check_forward_and_gradients, check_matches_reference_with_dropout,
                               check_rejects_bad_input, overfit_ratio, tiny)
from longattn.attention.informer import sample_informer_keys
from longattn.attention.softmax import softmax_attention_reference
from longattn.models.forecast_blocks import DistillingLayer, FeedForward
from longattn.models.informer import MaskedProbSparseAttention, masked_probsparse_attention


def plain_masked_probsparse(q, k, v, factor, samples, lazy):
    b, h, n, d = q.shape
    count = min(n, math.floor(factor * math.ceil(math.log(n))))
    out = torch.zeros_like(v)
    for bi in range(b):
        for hi in range(h):
            scores = q[bi, hi] @ k[bi, hi].T / math.sqrt(d)  # [N, N]
            sampled = scores.gather(1, samples[bi, :, :count])
            measure = sampled.max(1).values - sampled.sum(1) / n  # eq. 4 on the sampled keys
            chosen = measure.topk(count).indices
            prefix = v[bi, hi].cumsum(0)
            out[bi, hi] = prefix if lazy == "cumsum" else prefix / torch.arange(1, n + 1, dtype=v.dtype)[:, None]
            for i in chosen.tolist():
                out[bi, hi, i] = torch.softmax(scores[i, : i + 1], 0) @ v[bi, hi, : i + 1]
    return out


@pytest.mark.parametrize("lazy", ["cumsum", "cummean"])
def test_masked_probsparse_matches_plain_loop(lazy):
    q, k, v = (torch.randn(2, 2, 29, 4, dtype=torch.float64) for _ in range(3))
    samples = sample_informer_keys(None, 2, 29, 2.0, q.device)
    out = masked_probsparse_attention(q, k, v, factor=2.0, lazy=lazy, key_samples=samples)
    torch.testing.assert_close(out, plain_masked_probsparse(q, k, v, 2.0, samples, lazy))


def test_masked_probsparse_with_every_query_active_is_causal_softmax_attention():
    q, k, v = (torch.randn(2, 3, 17, 4, dtype=torch.float64) for _ in range(3))
    out = masked_probsparse_attention(q, k, v, factor=100.0)  # u = min(c ceil(ln N), N) = N
    torch.testing.assert_close(out, softmax_attention_reference(q, k, v, is_causal=True))


def test_registered_encoder_probsparse_with_every_query_active_is_full_attention():
    model = tiny("informer", 3, 16, 5, d_model=8, heads=2, d_ff=8, factor=100.0).double().eval()
    attention = model.encoder[0].attention
    x = torch.randn(2, 16, 8, dtype=torch.float64)
    split = lambda t: t.reshape(2, 16, 2, 4).transpose(1, 2)  # noqa: E731
    q, k, v = (split(f(x)) for f in (attention.proj.to_q, attention.proj.to_k, attention.proj.to_v))
    expected = attention.proj.out(softmax_attention_reference(q, k, v))
    torch.testing.assert_close(attention(x), expected)


def test_distilling_halves_the_length():
    layer = DistillingLayer(4).eval()
    for n in (23, 24):
        assert layer(torch.randn(2, n, 4)).shape == (2, (n + 1) // 2, 4)


def test_mix_only_changes_the_head_layout():
    torch.manual_seed(0)
    mixed = MaskedProbSparseAttention(4, 1, factor=100.0, mix=True).double()
    plain = MaskedProbSparseAttention(4, 1, factor=100.0, mix=False).double()
    plain.load_state_dict(mixed.state_dict())
    x = torch.randn(2, 9, 4, dtype=torch.float64)
    torch.testing.assert_close(mixed(x), plain(x))  # one head: nothing to mix
    mixed2 = MaskedProbSparseAttention(4, 2, factor=100.0, mix=True).double()
    plain2 = MaskedProbSparseAttention(4, 2, factor=100.0, mix=False).double()
    plain2.load_state_dict(mixed2.state_dict())
    assert not torch.allclose(mixed2(x), plain2(x))


SMALL = SMALL_OPTIONS["informer"]


@pytest.mark.parametrize("seq_len, pred_len, options", [(23, 5, {}), (24, 7, {"distil": False, "label_len": 5}),
                                                        (25, 9, {"encoder_layers": 3, "mix": False})])
def test_shapes_and_gradients(seq_len, pred_len, options):
    model = tiny("informer", 3, seq_len, pred_len, **SMALL, **options)
    check_forward_and_gradients(model, seq_len, pred_len, 3)
    check_rejects_bad_input(model, seq_len, 3)


def test_calendar_marks():
    check_forward_and_gradients(tiny("informer", 3, 24, 7, calendar_dim=4, **SMALL), 24, 7, 3, calendar_dim=4)


def test_overfits_a_synthetic_series():
    assert overfit_ratio(tiny("informer", 2, 24, 6, **SMALL), 24, 6, 2) < 0.5


@pytest.mark.parametrize("bias", [True, False])
def test_feed_forward_products_match_its_convolutions_with_the_same_dropout(bias):
    """The family's FFN computes its kernel-1 convolutions as batched products: the convolutions' output and
    gradients (input and every parameter) in float64, training mode, and the same dropout masks per seed."""
    torch.manual_seed(0)
    ff = FeedForward(8, 20, dropout=0.3, activation="gelu", bias=bias).double().train()
    x = torch.randn(3, 17, 8, dtype=torch.float64, requires_grad=True)
    check_matches_reference_with_dropout(
        ff, lambda t: ff.dropout(ff.conv2(ff.dropout(ff.activation(ff.conv1(t.transpose(1, 2))))).transpose(1, 2)),
        x, list(ff.parameters()), seed=4)
