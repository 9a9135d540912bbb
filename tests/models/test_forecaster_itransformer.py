"""iTransformer: variates as tokens, normalisation, calendar tokens, shapes, gradients, overfit."""

from __future__ import annotations

import pytest
import torch

from forecaster_checks import SMALL_OPTIONS, check_forward_and_gradients, check_rejects_bad_input, overfit_ratio, tiny

SMALL = SMALL_OPTIONS["itransformer"]


def test_variates_are_tokens_permutation_equivariant():
    """Attention across variate tokens has no order: permuting the channels permutes the forecast."""
    model = tiny("itransformer", 4, 13, 5, **SMALL).double().eval()
    x = torch.randn(2, 13, 4, dtype=torch.float64)
    perm = torch.tensor([2, 0, 3, 1])
    torch.testing.assert_close(model(x[..., perm]), model(x)[..., perm])


def test_normalisation_makes_it_shift_and_scale_equivariant():
    model = tiny("itransformer", 3, 13, 5, eps=0.0, **SMALL).double().eval()  # eps = 0: exactly equivariant
    x = torch.randn(2, 13, 3, dtype=torch.float64)
    shift, scale = torch.randn(1, 1, 3, dtype=torch.float64), torch.rand(1, 1, 3, dtype=torch.float64) + 0.5
    torch.testing.assert_close(model(x * scale + shift), model(x) * scale + shift, atol=1e-6, rtol=1e-6)


def test_one_layer_matches_a_plain_computation():
    model = tiny("itransformer", 3, 11, 4, d_model=8, heads=2, layers=1, d_ff=8, normalise=False).double().eval()
    x = torch.randn(2, 11, 3, dtype=torch.float64)
    layer = model.layers[0]
    h = model.embedding(x.transpose(1, 2))
    attn = layer.attention
    q, k, v = (f(h).reshape(2, 3, 2, 4).transpose(1, 2) for f in (attn.proj.to_q, attn.proj.to_k, attn.proj.to_v))
    weights = torch.softmax(q @ k.transpose(-1, -2) / 2.0, dim=-1)
    h = layer.norm1(h + attn.proj.to_out((weights @ v).transpose(1, 2).reshape(2, 3, 8)))
    ff = layer.ff
    h = layer.norm2(h + ff.conv2(torch.nn.functional.gelu(ff.conv1(h.transpose(1, 2)))).transpose(1, 2))
    expected = model.projection(model.norm(h)).transpose(1, 2)
    torch.testing.assert_close(model(x), expected)


@pytest.mark.parametrize("seq_len, pred_len, calendar_dim", [(13, 5, 0), (24, 7, 4)])
def test_shapes_and_gradients(seq_len, pred_len, calendar_dim):
    model = tiny("itransformer", 3, seq_len, pred_len, calendar_dim=calendar_dim, **SMALL)
    check_forward_and_gradients(model, seq_len, pred_len, 3, calendar_dim=calendar_dim)
    if calendar_dim:
        with pytest.raises(ValueError, match="calendar"):
            model(torch.randn(2, seq_len, 3))
    else:
        check_rejects_bad_input(model, seq_len, 3)


def test_other_registered_attention():
    model = tiny("itransformer", 3, 13, 5, attention="performer", attention_options={"nb_features": 8}, **SMALL)
    check_forward_and_gradients(model, 13, 5, 3)


def test_overfits_a_synthetic_series():
    assert overfit_ratio(tiny("itransformer", 2, 24, 6, **SMALL), 24, 6, 2) < 0.5
