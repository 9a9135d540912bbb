"""DeltaNet: the delta rule (attention/ops/delta_rule.py) against flash-linear-attention's naive recurrence and
the chunked paths against the step-by-step recurrence; the module's options and errors. Decoding, packing,
padding, the GPU path's op count and accuracy, the HF bridge: the registry-wide tests."""

import pytest
import torch
import torch.nn.functional as F
from delta_rule_checks import HEAD_DIM, fla_peer, rule_inputs, upstream_grads

from longattn import attention
from longattn.attention import AttentionError
from longattn.attention.ops import delta_layer
from longattn.attention.ops.delta_layer import causal_short_conv, conv_features
from longattn.attention.ops.delta_rule import (
    delta_rule,
    delta_rule_attention,
    delta_rule_attention_reference,
    delta_rule_reference,
    l2_normalised,
)
from longattn.testing import scattered_mask

pytest.importorskip("fla", reason="fla-core (the 'peers' extra) holds the naive references")
SCALE = HEAD_DIM ** -0.5


@pytest.mark.parametrize("n", [1, 37, 101])
def test_chunked_paths_equal_fla_naive_recurrence_with_padding(n, path):
    """Forward and gradients in float64 against fla's naive delta rule (which computes in float32: its bound)."""
    q, k, v, beta = rule_inputs(n, gated=False)
    mask = scattered_mask(2, n)
    real = mask[:, None, :, None]
    ours = delta_rule_attention(q, k, v, mask, beta=beta, is_causal=True, l2_norm=False, chunk_size=16)
    # fla has no mask: a padded token is beta = 0 (it leaves the state alone) and its output is not compared
    peer = fla_peer(q, k, v, beta * mask[:, None, :])[0].masked_fill(~real, 0.0)
    torch.testing.assert_close(ours, peer, atol=2e-6, rtol=1e-5)
    for got, want in zip(upstream_grads(ours, [q, k, v, beta]), upstream_grads(peer, [q, k, v, beta])):
        torch.testing.assert_close(got, want, atol=2e-6, rtol=1e-5)


def test_float64_reference_equals_fla_naive_recurrence():
    q, k, v, beta = rule_inputs(29, gated=False, seed=3)
    out, state = delta_rule_reference(q, k, v, beta, scale=SCALE)
    peer_out, peer_state = fla_peer(q, k, v, beta)
    torch.testing.assert_close(out, peer_out, atol=2e-6, rtol=1e-5)
    torch.testing.assert_close(state, peer_state.double(), atol=2e-6, rtol=1e-5)  # fla's state stays float32


@pytest.mark.parametrize("chunk", [1, 16, 64])
def test_chunked_equals_the_step_by_step_recurrence(chunk, path):
    """N = 101 is no multiple of 16 or 64; output, final state and every gradient, float64."""
    q, k, v, beta = rule_inputs(101, gated=False, seed=1)
    out, state = delta_rule(q, k, v, beta, scale=SCALE, chunk=chunk)
    ref, ref_state = delta_rule_reference(q, k, v, beta, scale=SCALE)
    torch.testing.assert_close(out, ref, atol=1e-12, rtol=1e-10)
    torch.testing.assert_close(state, ref_state, atol=1e-12, rtol=1e-10)
    for got, want in zip(upstream_grads(out, [q, k, v, beta]), upstream_grads(ref, [q, k, v, beta])):
        torch.testing.assert_close(got, want, atol=1e-12, rtol=1e-10)


@pytest.mark.parametrize("is_causal", [True, False])
def test_functional_form_equals_its_reference(is_causal, path):
    """With L2-normalised keys and padding; not causal: the forward scan plus the backward scan."""
    q, k, v, beta = rule_inputs(45, gated=False, seed=2)
    mask = scattered_mask(2, 45)
    options = dict(beta=beta, is_causal=is_causal)
    out = delta_rule_attention(q, k, v, mask, chunk_size=8, **options)
    ref = delta_rule_attention_reference(q, k, v, mask, **options)
    torch.testing.assert_close(out, ref, atol=1e-12, rtol=1e-10)
    for got, want in zip(upstream_grads(out, [q, k, v, beta]), upstream_grads(ref, [q, k, v, beta])):
        torch.testing.assert_close(got, want, atol=1e-12, rtol=1e-10)


@pytest.mark.parametrize("normalised", [0, 32])
def test_tiled_convolution_features_equal_the_plain_composition(normalised, path, monkeypatch):
    """SiLU(short conv), then L2 norm of the first channels: 4 tiles of 5 tokens and a shorter last one on the
    CPU path (one tile on the GPU path), against autograd through the plain pieces; float64, every gradient."""
    monkeypatch.setattr(delta_layer, "CONV_TILE", 5)
    g = torch.Generator().manual_seed(4)
    x = torch.randn(2, 23, 48, generator=g, dtype=torch.float64, requires_grad=True)
    taps = torch.randn(4, 48, generator=g, dtype=torch.float64, requires_grad=True)
    out = conv_features(x, taps, normalised, 8)
    heads = x.unflatten(-1, (6, 8)).transpose(1, 2)  # [B, 6, N, 8], weight [6, 8, K]
    ref = F.silu(causal_short_conv(heads, taps.t().unflatten(0, (6, 8))))
    ref = torch.cat([l2_normalised(ref[:, :normalised // 8]), ref[:, normalised // 8:]], dim=1)
    ref = ref.transpose(1, 2).flatten(2)
    torch.testing.assert_close(out, ref, atol=1e-12, rtol=1e-10)
    for got, want in zip(upstream_grads(out, [x, taps]), upstream_grads(ref, [x, taps])):
        torch.testing.assert_close(got, want, atol=1e-12, rtol=1e-10)


def test_the_bidirectional_form_reads_later_tokens_and_the_causal_one_does_not():
    torch.manual_seed(0)
    x = torch.randn(1, 20, 32, dtype=torch.float64)
    later = x.clone()
    later[:, 15:] += 1.0
    for causal in (True, False):
        layer = attention.build("deltanet", dim=32, heads=2, causal=causal).double()
        moved = (layer(later)[:, :15] - layer(x)[:, :15]).abs().max()
        assert (moved == 0) if causal else (moved > 1e-3)


def test_options_switch_the_papers_components():
    layer = attention.build("deltanet", dim=32, heads=2)
    names = {n for n, _ in layer.named_parameters()}
    assert {"conv_weight", "to_beta.weight", "norm_weight"} <= names and not any("to_gate" in n for n in names)
    bare = attention.build("deltanet", dim=32, heads=2, short_conv=False, sigmoid_beta=False, output_norm=False,
                           output_gate=True)
    names = {n for n, _ in bare.named_parameters()}
    assert "to_gate.weight" in names and not names & {"conv_weight", "to_beta.weight", "norm_weight"}
    assert not any("decay" in n for n in names)  # the decay is Gated DeltaNet's


@pytest.mark.parametrize("options, field", [({"conv_size": 0}, "conv_size"), ({"chunk_size": 0}, "chunk_size")])
def test_bad_options_raise_naming_the_field(options, field):
    with pytest.raises(AttentionError, match=field):
        attention.build("deltanet", dim=32, heads=2, **options)


def test_bad_functional_inputs_raise_clear_errors():
    q, k, v, beta = rule_inputs(9, gated=False)
    with pytest.raises(AttentionError, match="beta"):
        delta_rule_attention(q, k, v, beta=beta[:, :, :5])
    with pytest.raises(AttentionError, match="chunk_size"):
        delta_rule_attention(q, k, v, chunk_size=0)
    with pytest.raises(AttentionError, match="lengths"):
        delta_rule_attention(q[:, :, :4], k, v)
