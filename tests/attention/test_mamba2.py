"""Mamba-2 (SSD): the scan against flash-linear-attention's naive simple-GLA recurrence (the same scalar-decay
recurrence; float64, padding, odd lengths), the chunked and batched scans against the token-by-token recurrence,
the bidirectional form against the quadratic one, and the block's components (Figure 6)."""

import pytest
import torch
import torch.nn.functional as F
from gated_scan_checks import (
    assert_equals_fla_naive_with_padding,
    assert_functional_equals_reference,
    assert_scan_equals_recurrence,
    assert_trains_under_bf16_autocast,
    fla_naive,
    switched_layer,
)
from module_checks import assert_decoding_equals_forward, assert_never_looks_ahead, assert_no_quadratic_intermediate

from longattn import attention
from longattn.attention import AttentionError
from longattn.attention.mamba2 import ssd_attention, ssd_attention_reference
from longattn.attention.ops.gated_scan import gated_scan_batched, gated_scan_chunked
from longattn.testing import random_qkv

DIM, HEADS = 32, 2


def ssd_decays(batch, heads, n, seed=2, strength=1.0):
    """dt A <= 0, one per head and token: [B, H, N, 1] leaves that require gradients."""
    dt = F.softplus(torch.randn(batch, heads, n, 1, generator=torch.Generator().manual_seed(seed), dtype=torch.float64))
    return (-dt * strength).detach().requires_grad_()


@pytest.mark.parametrize("n", [1, 37, 130])
def test_equals_fla_naive_simple_gla_recurrence_in_float64_with_padding(n):
    """C, B, dt x and dt A as fla's q, k, v and g (scale 1): each row equals naive_recurrent_simple_gla on its real
    tokens alone; forward and gradients, in float64 (KeepFloat64)."""
    naive = fla_naive("simple_gla")

    def peer(q, k, v, g):  # fla's g: one per head and token, [B, N, H]
        return naive.naive_recurrent_simple_gla(q, k, v, g[..., 0], scale=1.0)[0]

    assert_equals_fla_naive_with_padding(ssd_attention, peer, n, ssd_decays(2, 2, n))


@pytest.mark.parametrize("scan", [gated_scan_chunked, gated_scan_batched], ids=["chunked", "batched"])
@pytest.mark.parametrize("chunk", [1, 16, 64])
def test_chunked_scan_with_a_scalar_decay_equals_the_step_by_step_recurrence(scan, chunk):
    # N = 100 is not a multiple of 16 or 64; a strong decay: the exponents stay <= 0 all the same
    assert_scan_equals_recurrence(scan, [*random_qkv(2, 2, 100, 8), ssd_decays(2, 2, 100, strength=4.0)], chunk)


@pytest.mark.parametrize("path", ["cpu", "gpu"])
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("n", [1, 37])
def test_functional_form_equals_the_quadratic_form(path, causal, n):
    assert_functional_equals_reference(ssd_attention, ssd_attention_reference, ssd_decays(2, 2, n), causal, path)


def test_block_follows_figure_6():
    """conv + SiLU on C, B, x; dt = softplus(x W_dt + dt_bias); y = SSD(C, B, dt x, dt A) + D x;
    RMSNorm(y * SiLU(z)); the output projection."""
    torch.manual_seed(0)
    layer = attention.build("mamba2", dim=DIM, heads=HEADS, causal=True).double()
    with torch.no_grad():
        layer.d_skip.add_(torch.randn(HEADS, dtype=torch.float64))
    x = torch.randn(2, 9, DIM, dtype=torch.float64)
    split = lambda t: t.view(2, 9, HEADS, -1).transpose(1, 2)  # noqa: E731
    channels = torch.cat([layer.proj.to_q(x), layer.proj.to_k(x), layer.proj.to_v(x)], dim=-1)
    convolved = F.silu(F.conv1d(F.pad(channels.transpose(1, 2), (3, 0)), layer.conv.weight, layer.conv.bias,
                                groups=3 * DIM)).transpose(1, 2)
    c, b, values = (split(t) for t in convolved.chunk(3, dim=-1))
    dt = F.softplus(layer.to_dt(x)).transpose(1, 2)[..., None]
    y = ssd_attention(c, b, values * dt, -layer.a_log.exp()[:, None, None] * dt, is_causal=True)
    y = y + layer.d_skip[:, None, None] * values
    gated = y * split(F.silu(layer.to_output_gate(x)))
    normed = gated * torch.rsqrt(gated.square().mean(-1, keepdim=True) + 1e-5) * layer.head_norm.weight
    torch.testing.assert_close(layer(x), layer.proj.to_out(normed.transpose(1, 2).reshape(2, 9, DIM)))


def test_dt_and_a_start_in_their_ranges():
    layer = attention.build("mamba2", dim=64, heads=8, dt_range=(1e-2, 2e-2), a_range=(2.0, 3.0))
    dt = F.softplus(layer.to_dt.bias)
    assert bool(((dt > 1e-2 - 1e-6) & (dt < 2e-2 + 1e-6)).all())
    assert bool(((layer.a_log.exp() >= 2.0 - 1e-6) & (layer.a_log.exp() <= 3.0 + 1e-6)).all())


@pytest.mark.parametrize("options", [{"conv_size": None}, {"conv_size": 1}, {"d_skip": False},
                                     {"output_gate": False}, {"norm": False}, {"chunk_size": 5, "conv_size": 2}])
def test_every_component_can_be_switched(options):
    layer = switched_layer("mamba2", options)
    assert (layer.conv is None) == (options.get("conv_size", 4) is None)
    assert (layer.d_skip is None) == (options.get("d_skip") is False)
    assert (layer.to_output_gate is None) == (options.get("output_gate") is False)
    assert (layer.head_norm is None) == (options.get("norm") is False)


@pytest.mark.parametrize("conv_size", [None, 1, 4])
def test_decoding_continues_the_convolution(conv_size):
    """prefill + steps equal the causal forward with every convolution width (the state keeps its last inputs)."""
    torch.manual_seed(0)
    layer = attention.build("mamba2", dim=DIM, heads=HEADS, causal=True, conv_size=conv_size).double().eval()
    assert_decoding_equals_forward(layer, n=12, prompt=2)


def test_causal_module_never_looks_ahead():
    assert_never_looks_ahead("mamba2")


def test_bad_options_raise():
    for bad in ({"conv_size": 0}, {"dt_range": (0.0, 1.0)}, {"a_range": (2.0, 1.0)}, {"chunk_size": -1}):
        with pytest.raises(AttentionError, match=next(iter(bad))):
            attention.build("mamba2", dim=DIM, heads=HEADS, **bad)


def test_causal_form_builds_no_quadratic_intermediate():
    assert_no_quadratic_intermediate("mamba2", share=8)  # the contract test covers the bidirectional form


def test_bf16_autocast_trains_on_the_cpu_path():
    assert_trains_under_bf16_autocast("mamba2")