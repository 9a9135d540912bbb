"""GLA (gated linear attention): the functional form against flash-linear-attention's naive recurrence (float64,
padding, odd lengths), the chunked and batched scans against the token-by-token recurrence, the bidirectional form
against the parallel one, and the paper's components of the module form."""

import contextlib

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
from module_checks import assert_never_looks_ahead, assert_no_quadratic_intermediate

from longattn import attention
from longattn.attention import AttentionError, force_path
from longattn.attention.gla import gated_linear_attention, gated_linear_attention_reference
from longattn.attention.ops import gated_scan as gated_scan_ops
from longattn.attention.ops.gated_scan import (
    fla_runs_on,
    gated_scan_batched,
    gated_scan_chunked,
    gated_scan_reference,
)
from longattn.testing import random_qkv

DIM, HEADS = 32, 2


def log_decays(batch, heads, n, dk, seed=2, strength=1.0):
    """log alpha <= 0 per key channel, leaves that require gradients (strength scales how fast the state forgets)."""
    g = torch.randn(batch, heads, n, dk, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    return (F.logsigmoid(g) * strength).detach().requires_grad_()


@pytest.mark.parametrize("n", [1, 37, 130])
def test_equals_fla_naive_recurrence_in_float64_with_padding(n):
    """Padded tokens are skipped (no key, value or decay), so each row equals fla's naive_recurrent_gla on its real
    tokens alone; forward and gradients of q, k, v and the log decays, in float64 (KeepFloat64)."""
    naive = fla_naive("gla")

    def peer(q, k, v, g):
        return naive.naive_recurrent_gla(q, k, v, g)[0]

    assert_equals_fla_naive_with_padding(gated_linear_attention, peer, n, log_decays(2, 2, n, 8))


@pytest.mark.parametrize("scan", [gated_scan_chunked, gated_scan_batched], ids=["chunked", "batched"])
@pytest.mark.parametrize("chunk", [1, 16, 64])
@pytest.mark.parametrize("sub_chunk", [4, 8, 16])
def test_chunked_scan_equals_the_step_by_step_recurrence(monkeypatch, scan, chunk, sub_chunk):
    # N = 100 is not a multiple of 16 or 64; a strong decay: the exponents stay <= 0 all the same. Every sub-chunk
    # size of the secondary chunking (the CPU's, CUDA's and a smaller one) gives the same result
    monkeypatch.setattr(gated_scan_ops, "CPU_SUB_CHUNK", sub_chunk)
    assert_scan_equals_recurrence(scan, [*random_qkv(2, 2, 100, 8), log_decays(2, 2, 100, 8, strength=3.0)], chunk)


def test_a_chunked_scan_continues_from_a_state():
    q, k, v = random_qkv(1, 2, 40, 4)
    g = log_decays(1, 2, 40, 4)
    first, state = gated_scan_chunked(q[:, :, :23], k[:, :, :23], v[:, :, :23], g[:, :, :23], 16)
    second, _ = gated_scan_chunked(q[:, :, 23:], k[:, :, 23:], v[:, :, 23:], g[:, :, 23:], 16, state=state)
    torch.testing.assert_close(torch.cat([first, second], dim=2), gated_scan_reference(q, k, v, g)[0])


@pytest.mark.parametrize("path", ["cpu", "gpu"])
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("n", [1, 37])
def test_functional_form_equals_the_parallel_form(path, causal, n):
    assert_functional_equals_reference(gated_linear_attention, gated_linear_attention_reference, log_decays(2, 2, n, 8),
                                       causal, path)


def test_bidirectional_form_weighs_both_sides_with_the_decays_between():
    """o_i = sum_j (q_i . Diag(prod of alpha strictly after min(i, j) up to max(i, j)) k_j) v_j, written out."""
    q, k, v = (t.detach() for t in random_qkv(1, 1, 6, 3))
    g = log_decays(1, 1, 6, 3).detach()
    out = gated_linear_attention(q, k, v, g, is_causal=False, scale=1.0)
    i = 2
    expected = sum(((q[0, 0, i] * k[0, 0, j] * g[0, 0, min(i, j) + 1:max(i, j) + 1].sum(0).exp()).sum() * v[0, 0, j])
                   for j in range(6))
    torch.testing.assert_close(out[0, 0, i], expected)


def test_module_components_follow_section_4_4():
    torch.manual_seed(0)
    layer = attention.build("gla", dim=DIM, heads=HEADS, causal=True).double()
    x = torch.randn(2, 9, DIM, dtype=torch.float64)
    down, up = layer.to_gate  # rank-16 W_a1 (no bias) then W_a2 + b_a
    assert down.out_features == 16 and down.bias is None and up.bias is not None
    logits = x @ down.weight.T @ up.weight.T + up.bias
    expected = F.logsigmoid(logits) / 16.0
    torch.testing.assert_close(layer.log_decay(x), expected.view(2, 9, HEADS, -1).transpose(1, 2))
    # y = (LN(o) * Swish(x W_r + b_r)) W_O
    q, k, v = layer.proj.qkv(x)
    o = gated_linear_attention(q, k, v, layer.log_decay(x), is_causal=True)
    gate = F.silu(layer.to_output_gate(x)).view(2, 9, HEADS, -1).transpose(1, 2)
    want = layer.proj.to_out((F.layer_norm(o, (DIM // HEADS,), layer.head_norm.weight, layer.head_norm.bias) * gate)
                             .transpose(1, 2).reshape(2, 9, DIM))
    torch.testing.assert_close(layer(x), want)


@pytest.mark.parametrize("options", [{"gate_rank": None}, {"output_gate": False}, {"norm": False},
                                     {"gate_temperature": 1.0}, {"gate_rank": 4, "chunk_size": 5}])
def test_every_component_can_be_switched(options):
    layer = switched_layer("gla", options)
    if options == {"gate_rank": None}:
        assert isinstance(layer.to_gate, torch.nn.Linear)
    if options.get("output_gate") is False:
        assert layer.to_output_gate is None
    if options.get("norm") is False:
        assert layer.head_norm is None


def test_causal_module_never_looks_ahead():
    assert_never_looks_ahead("gla")


def test_bad_options_and_inputs_raise():
    for bad in ({"gate_rank": 0}, {"gate_temperature": 0.0}, {"scale": -1.0}, {"chunk_size": 0}):
        with pytest.raises(AttentionError, match=next(iter(bad))):
            attention.build("gla", dim=DIM, heads=HEADS, **bad)
    q, k, v = random_qkv(1, 2, 5, 4)
    with pytest.raises(AttentionError, match="log_decay"):
        gated_linear_attention(q, k, v, torch.zeros(1, 2, 5, 3, dtype=torch.float64))
    with pytest.raises(AttentionError, match="as many queries"):
        gated_linear_attention(q[:, :, :3], k, v, torch.zeros(1, 2, 5, 4, dtype=torch.float64))


def test_causal_form_builds_no_quadratic_intermediate():
    assert_no_quadratic_intermediate("gla", share=8)  # the contract test covers the bidirectional form


def test_bf16_autocast_trains_on_the_cpu_path():
    assert_trains_under_bf16_autocast("gla")


def test_fla_kernels_are_only_taken_on_cuda():
    q = torch.zeros(1, 1, 4, 4)
    with force_path("gpu") if not torch.cuda.is_available() else contextlib.nullcontext():
        assert not fla_runs_on(q) and not fla_runs_on(q.double())
