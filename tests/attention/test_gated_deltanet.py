"""Gated DeltaNet: the gated delta rule (attention/ops/delta_rule.py) against flash-linear-attention's naive
gated recurrence, the chunked paths against the step-by-step recurrence, and the decay's parametrisation.
Decoding, packing, padding, the GPU path's op count and accuracy, the HF bridge: the registry-wide tests."""

import pytest
import torch
from delta_rule_checks import HEAD_DIM, fla_peer, rule_inputs, upstream_grads

from longattn import attention
from longattn.attention.ops.delta_rule import delta_rule, delta_rule_attention, delta_rule_reference
from longattn.testing import scattered_mask

pytest.importorskip("fla", reason="fla-core (the 'peers' extra) holds the naive references")
SCALE = HEAD_DIM ** -0.5


@pytest.mark.parametrize("n", [1, 37, 101])
def test_chunked_paths_equal_fla_naive_gated_recurrence_with_padding(n, path):
    """Forward and gradients (g included) in float64 against fla's naive gated delta rule (float32 inside)."""
    q, k, v, beta, g = rule_inputs(n, gated=True)
    mask = scattered_mask(2, n)
    real = mask[:, None, :, None]
    ours = delta_rule_attention(q, k, v, mask, beta=beta, log_decay=g, is_causal=True, l2_norm=False,
                                chunk_size=16)
    # fla has no mask: a padded token is beta = 0 and g = 0 (it leaves the state alone), its output not compared
    keep = mask[:, None, :]
    peer = fla_peer(q, k, v, beta * keep, g * keep)[0].masked_fill(~real, 0.0)
    torch.testing.assert_close(ours, peer, atol=2e-6, rtol=1e-5)
    inputs = [q, k, v, beta, g]
    for got, want in zip(upstream_grads(ours, inputs), upstream_grads(peer, inputs)):
        torch.testing.assert_close(got, want, atol=2e-6, rtol=1e-5)


def test_float64_reference_equals_fla_naive_gated_recurrence():
    q, k, v, beta, g = rule_inputs(29, gated=True, seed=3)
    out, state = delta_rule_reference(q, k, v, beta, g, scale=SCALE)
    peer_out, peer_state = fla_peer(q, k, v, beta, g)
    torch.testing.assert_close(out, peer_out, atol=2e-6, rtol=1e-5)
    torch.testing.assert_close(state, peer_state.double(), atol=2e-6, rtol=1e-5)  # fla's state stays float32


@pytest.mark.parametrize("chunk", [1, 16, 64])
def test_chunked_equals_the_step_by_step_recurrence(chunk, path):
    """N = 101 is no multiple of 16 or 64; strong decays (g down to -3) too; float64, every gradient."""
    q, k, v, beta, g = rule_inputs(101, gated=True, seed=1)
    g = (g * 3).detach().requires_grad_()
    out, state = delta_rule(q, k, v, beta, g, scale=SCALE, chunk=chunk)
    ref, ref_state = delta_rule_reference(q, k, v, beta, g, scale=SCALE)
    torch.testing.assert_close(out, ref, atol=1e-12, rtol=1e-10)
    torch.testing.assert_close(state, ref_state, atol=1e-12, rtol=1e-10)
    inputs = [q, k, v, beta, g]
    for got, want in zip(upstream_grads(out, inputs), upstream_grads(ref, inputs)):
        torch.testing.assert_close(got, want, atol=1e-12, rtol=1e-10)


def test_the_decay_lies_in_zero_one_and_follows_the_token():
    torch.manual_seed(0)
    layer = attention.build("gated_deltanet", dim=32, heads=2, causal=True).double()
    x = torch.randn(2, 30, 32, dtype=torch.float64) * 3
    beta, g = layer._gates(x)
    assert g.shape == beta.shape == (2, 2, 30)
    assert (g < 0).all() and (g.exp() > 0).all()
    assert g.std(dim=-1).min() > 0  # data-dependent: it varies along the sequence


def test_gated_layer_has_the_output_gate_by_default_and_deltanet_does_not():
    gated = {n for n, _ in attention.build("gated_deltanet", dim=32, heads=2).named_parameters()}
    plain = {n for n, _ in attention.build("deltanet", dim=32, heads=2).named_parameters()}
    assert {"to_gate.weight", "to_decay.weight", "decay_log_scale", "decay_bias"} <= gated
    assert "to_gate.weight" not in plain and "decay_bias" not in plain
