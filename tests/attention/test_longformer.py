"""Longformer: chunked sliding window + global tokens vs the plain N x N reference."""

import pytest
import torch

from longattn import attention
from longattn.attention import AttentionError
from longattn.attention.longformer import longformer_attention, longformer_attention_reference
from longattn.testing import assert_forward_backward_close, scattered_mask

DIM, HEADS = 24, 3


def tensors(n, count, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(2, 3, n, 5, generator=g, dtype=torch.float64).requires_grad_() for _ in range(count)]


@pytest.mark.parametrize("n", [1, 7, 53])
@pytest.mark.parametrize("window,dilation", [(4, 1), (6, 2)])
@pytest.mark.parametrize("globals_", [(), (0,), (0, 5, 40)])
@pytest.mark.parametrize("causal", [False, True])
def test_functional_matches_reference_forward_and_backward(n, window, dilation, globals_, causal):
    q, k, v, gq, gk, gv = tensors(n, 6)
    mask = scattered_mask(2, n)
    kwargs = dict(
        attention_window=window, dilation=dilation, global_positions=globals_,
        global_query=gq, global_key=gk, global_value=gv, is_causal=causal,
    )
    out = longformer_attention(q, k, v, mask, **kwargs)
    ref = longformer_attention_reference(q, k, v, mask, **kwargs)
    torch.testing.assert_close(out, ref)
    grad_out = torch.randn_like(out)
    wrt = (q, k, v, gq, gk, gv)
    got = torch.autograd.grad(out, wrt, grad_out, allow_unused=True, materialize_grads=True)
    want = torch.autograd.grad(ref, wrt, grad_out, allow_unused=True, materialize_grads=True)
    for a, r in zip(got, want):
        torch.testing.assert_close(a, r)


@pytest.mark.parametrize("mask_kind", ["none", "all_real", "padded_run"])
@pytest.mark.parametrize("globals_", [(), (0, 23)])
@pytest.mark.parametrize("causal", [False, True])
def test_unpadded_chunks_and_queries_that_see_no_key(mask_kind, globals_, causal):
    # without padding most chunks share the window-band mask and the ends get their own; a padded run
    # longer than the window (global 0 padded too) leaves queries with no visible key: zeros
    n = 61
    q, k, v, gq, gk, gv = tensors(n, 6, seed=3)
    mask = None if mask_kind == "none" else torch.ones(2, n, dtype=torch.bool)
    if mask_kind == "padded_run":
        mask[0, :40] = False
        mask[1] = False
    kwargs = dict(
        attention_window=6, global_positions=globals_,
        global_query=gq, global_key=gk, global_value=gv, is_causal=causal,
    )
    out = longformer_attention(q, k, v, mask, **kwargs)
    ref = longformer_attention_reference(q, k, v, mask, **kwargs)
    torch.testing.assert_close(out, ref)
    if mask_kind == "padded_run":
        assert (out[0, :, 5:20] == 0).all() and (out[1] == 0).all()
    grad_out = torch.randn_like(out)
    wrt = (q, k, v, gq, gk, gv)
    got = torch.autograd.grad(out, wrt, grad_out, allow_unused=True, materialize_grads=True)
    want = torch.autograd.grad(ref, wrt, grad_out, allow_unused=True, materialize_grads=True)
    for a, r in zip(got, want):
        assert a.isfinite().all()
        torch.testing.assert_close(a, r)


def test_receptive_fields():
    n = 40
    q, k, v = tensors(n, 3)
    out = longformer_attention(q, k, v, attention_window=4, global_positions=(3,))
    touched = lambda row: torch.autograd.grad(out[0, 0, row].sum(), k, retain_graph=True)[0][0, 0].abs().sum(-1) > 0
    # local token 20: keys 18..22 and the global token 3
    expected = torch.zeros(n, dtype=torch.bool)
    expected[18:23] = True
    expected[3] = True
    assert torch.equal(touched(20), expected)
    # global token 3: every key
    assert touched(3).all()
    # dilation 2: token 20 sees 16, 18, 20, 22, 24
    out = longformer_attention(q, k, v, attention_window=4, dilation=2, global_positions=())
    seen = torch.autograd.grad(out[0, 0, 20].sum(), k)[0][0, 0].abs().sum(-1) > 0
    assert seen.nonzero().flatten().tolist() == [16, 18, 20, 22, 24]


def test_global_positions_beyond_the_sequence_are_ignored():
    q, k, v = tensors(10, 3)
    a = longformer_attention(q, k, v, attention_window=4, global_positions=(0, 50))
    b = longformer_attention(q, k, v, attention_window=4, global_positions=(0,))
    torch.testing.assert_close(a, b)


@pytest.mark.parametrize("separate", [True, False])
@pytest.mark.parametrize("causal", [False, True])
def test_module_matches_reference(separate, causal):
    torch.manual_seed(0)
    layer = attention.build(
        "longformer", dim=DIM, heads=HEADS, attention_window=6, global_positions=(0, 9),
        separate_global_projections=separate, causal=causal,
    ).double()
    x = torch.randn(2, 41, DIM, dtype=torch.float64, requires_grad=True)
    mask = scattered_mask(2, 41)
    out = layer(x, mask)
    gq, gk, gv = layer.global_qkv(x)
    ref = longformer_attention_reference(
        *layer.proj.qkv(x), mask, attention_window=6, global_positions=(0, 9),
        global_query=gq, global_key=gk, global_value=gv, is_causal=causal,
    )
    ref = layer.proj.out(ref) * mask[..., None]
    assert_forward_backward_close(out, ref, [x, *layer.parameters()])


def test_defaults_and_bad_options():
    layer = attention.build("longformer", dim=DIM, heads=HEADS)
    assert (layer.attention_window, layer.dilation, layer.global_positions) == (512, 1, (0,))
    assert layer.global_proj is not None
    for bad in ({"attention_window": 5}, {"dilation": 0}, {"global_positions": (-1,)},
                {"global_positions": (2, 2)}, {"global_positions": "0"}):
        with pytest.raises(AttentionError):
            attention.build("longformer", dim=DIM, heads=HEADS, **bad)
