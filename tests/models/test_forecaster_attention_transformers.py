"""The Transformer / Reformer / Performer / Nystromformer forecasters: the scaffold against a plain
encoder-decoder computation, the registered mechanisms in place, shapes, gradients, overfit."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from forecaster_checks import (SMALL_OPTIONS, check_forward_and_gradients, check_rejects_bad_input, overfit_ratio,
                               tiny)
from longattn.attention.nystrom import NystromAttention
from longattn.attention.performer import PerformerAttention
from longattn.attention.reformer import ReformerAttention
from longattn.attention.softmax import softmax_attention_reference
from longattn.models.forecast_blocks import FullCrossAttention

NAMES = ["nystromformer", "performer", "reformer", "transformer"]


def _attend(module, x, memory=None, causal=False):
    """Softmax attention written out with ``module``'s projections (registered softmax or FullCrossAttention)."""
    memory = x if memory is None else memory
    proj = module.proj if hasattr(module, "proj") else module
    split = lambda t: t.reshape(t.shape[0], t.shape[1], 2, -1).transpose(1, 2)  # noqa: E731
    q, k, v = split(proj.to_q(x)), split(proj.to_k(memory)), split(proj.to_v(memory))
    out = softmax_attention_reference(q, k, v, is_causal=causal)
    return proj.to_out(out.transpose(1, 2).reshape(x.shape))


def test_transformer_matches_a_plain_encoder_decoder():
    """Informer Section 3.3: decoder input = last label_len steps + zeros; one pass; last pred_len outputs."""
    model = tiny("transformer", 2, 12, 4, label_len=5, encoder_layers=1, **SMALL_OPTIONS["transformer"])
    model = model.double().eval()
    x = torch.randn(2, 12, 2, dtype=torch.float64)

    def embed(embedding, series):
        conv = embedding.value.conv
        value = F.conv1d(F.pad(series.transpose(1, 2), (1, 1), mode="circular"), conv.weight).transpose(1, 2)
        return value + embedding.positions[: series.shape[1]]

    enc = model.encoder[0]
    h = embed(model.encoder_embedding, x)
    h = enc.norm1(h + _attend(enc.attention, h))
    h = enc.norm2(h + enc.ff.conv2(F.gelu(enc.ff.conv1(h.transpose(1, 2)))).transpose(1, 2))
    memory = model.encoder_norm(h)
    dec = model.decoder[0]
    start = torch.cat([x[:, -5:], torch.zeros(2, 4, 2, dtype=torch.float64)], dim=1)
    h = embed(model.decoder_embedding, start)
    h = dec.norm1(h + _attend(dec.self_attention, h, causal=True))
    h = dec.norm2(h + _attend(dec.cross_attention, h, memory))
    h = dec.norm3(h + dec.ff.conv2(F.gelu(dec.ff.conv1(h.transpose(1, 2)))).transpose(1, 2))
    expected = model.projection(model.decoder_norm(h))[:, -4:]
    torch.testing.assert_close(model(x), expected)


@pytest.mark.parametrize("name, mechanism, decoder_causal", [
    ("reformer", ReformerAttention, None), ("performer", PerformerAttention, True),
    ("nystromformer", NystromAttention, False)])
def test_registered_mechanisms_fill_the_self_attention_slots(name, mechanism, decoder_causal):
    model = tiny(name, 3, 16, 8, **SMALL_OPTIONS[name])
    assert all(isinstance(layer.attention, mechanism) for layer in model.encoder)
    if decoder_causal is None:  # encoder-only form of the Autoformer code
        assert model.form == "encoder_only" and not hasattr(model, "decoder")
    else:
        assert all(layer.self_attention.causal == decoder_causal for layer in model.decoder)


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("seq_len, pred_len", [(23, 5), (16, 9)])
def test_shapes_and_gradients(name, seq_len, pred_len):
    model = tiny(name, 3, seq_len, pred_len, **SMALL_OPTIONS[name])
    check_forward_and_gradients(model, seq_len, pred_len, 3)
    check_rejects_bad_input(model, seq_len, 3)


def test_reformer_encoder_decoder_form():
    model = tiny("reformer", 3, 23, 5, form="encoder_decoder", **SMALL_OPTIONS["reformer"])
    check_forward_and_gradients(model, 23, 5, 3)


@pytest.mark.parametrize("name", ["transformer", "performer"])
def test_overfits_a_synthetic_series(name):
    assert overfit_ratio(tiny(name, 2, 24, 6, **SMALL_OPTIONS[name]), 24, 6, 2) < 0.5


@pytest.mark.parametrize("training", [True, False])
def test_full_cross_attention_module_matches_the_sdpa_call(training):
    module = FullCrossAttention(12, 3, dropout=0.1).double().train(training)
    x, memory = torch.randn(2, 11, 12, dtype=torch.float64), torch.randn(2, 7, 12, dtype=torch.float64)
    split = lambda t: t.reshape(2, t.shape[1], 3, 4).transpose(1, 2)  # noqa: E731
    torch.manual_seed(3)
    out = module(x, memory)
    torch.manual_seed(3)
    old = F.scaled_dot_product_attention(split(module.to_q(x)), split(module.to_k(memory)),
                                         split(module.to_v(memory)), dropout_p=0.1 if training else 0.0)
    torch.testing.assert_close(out, module.to_out(old.transpose(1, 2).reshape(2, 11, 12)))
