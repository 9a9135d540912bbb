"""Transformer-LS: segment-wise fast path vs the plain band-masked reference, DualLN, projection."""

import pytest
import torch

from longattn import attention
from longattn.attention import AttentionError
from longattn.attention.transformer_ls import (
    dynamic_projection,
    long_short_attention,
    long_short_attention_reference,
)
from longattn.testing import assert_forward_backward_close, scattered_mask

DIM, HEADS = 24, 3


def inputs(b, h, n, d, r, seed=0):
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(b, h, n, d, generator=g, dtype=torch.float64).requires_grad_() for _ in range(3))
    logits = (3 * torch.randn(b, h, n, r, generator=g, dtype=torch.float64)).requires_grad_()
    return q, k, v, logits


@pytest.mark.parametrize("n", [1, 7, 13, 259])
@pytest.mark.parametrize("window", [1, 2, 5, 6])
@pytest.mark.parametrize("dual_ln", [False, True])
@pytest.mark.parametrize("causal_chunk", [None, 3, 4])
def test_functional_matches_reference_forward_and_backward(n, window, dual_ln, causal_chunk):
    q, k, v, logits = inputs(2, 3, n, 5, 2 if causal_chunk else 4)
    mask = scattered_mask(2, n)
    norms = {}
    params = []
    if dual_ln:
        torch.manual_seed(1)
        ln_s, ln_l = torch.nn.LayerNorm(5).double(), torch.nn.LayerNorm(5).double()
        with torch.no_grad():  # non-trivial affine parameters so the two norms really differ
            for ln in (ln_s, ln_l):
                ln.weight.normal_()
                ln.bias.normal_()
        norms = {"short_norm": ln_s, "long_norm": ln_l}
        params = [*ln_s.parameters(), *ln_l.parameters()]
    kwargs = dict(projection_logits=logits, window_size=window, **norms)
    if causal_chunk:
        kwargs.update(is_causal=True, chunk_size=causal_chunk)
    out = long_short_attention(q, k, v, mask, **kwargs)
    ref = long_short_attention_reference(q, k, v, mask, **kwargs)
    torch.testing.assert_close(out, ref)
    g = torch.randn_like(out)
    wrt = [q, k, v, logits, *params]
    for got, want in zip(torch.autograd.grad(out, wrt, g), torch.autograd.grad(ref, wrt, g)):
        torch.testing.assert_close(got, want)


def test_without_mask_matches_all_true_mask():
    q, k, v, logits = inputs(1, 2, 21, 4, 3)
    a = long_short_attention(q, k, v, projection_logits=logits, window_size=4)
    b = long_short_attention(q, k, v, torch.ones(1, 21, dtype=torch.bool), projection_logits=logits, window_size=4)
    torch.testing.assert_close(a, b)


def test_short_term_span_is_segment_plus_half_window_each_side():
    # w = 4: query 9 lives in segment [8, 12) and must see exactly keys 6..13 directly. The
    # projection puts all its weight on token 0, so every other key reaches query 9 only through
    # the window and its gradient must vanish outside the span.
    n, w = 20, 4
    q, k, v, logits = inputs(1, 1, n, 3, 2)
    logits = torch.full_like(logits, -1e4)
    logits[..., 0, :] = 0.0
    out = long_short_attention(q, k, v, projection_logits=logits, window_size=w)
    (grad_k,) = torch.autograd.grad(out[0, 0, 9].sum(), k)
    touched = grad_k[0, 0].abs().sum(-1) > 0
    expected = torch.zeros(n, dtype=torch.bool)
    expected[6:14] = True
    expected[0] = True  # the projected (long-term) key is token 0
    assert torch.equal(touched, expected)


def test_causal_span_and_chunks():
    # w = 4, l = 5: query 12 sees keys 9..12 in its window and the chunks [0, 5) and [5, 10)
    # (complete by 12) through their projections; chunk [10, 15) is not complete yet
    n = 20
    q, k, v, logits = inputs(1, 1, n, 3, 1)
    out = long_short_attention(q, k, v, projection_logits=logits, window_size=4, is_causal=True, chunk_size=5)

    def keys_seen_by(row):
        (grad_k,) = torch.autograd.grad(out[0, 0, row].sum(), k, retain_graph=True)
        return (grad_k[0, 0].abs().sum(-1) > 0).nonzero().flatten().tolist()

    assert keys_seen_by(12) == list(range(13))
    assert keys_seen_by(11) == list(range(12))  # window 8..11 + chunks [0, 10)
    assert keys_seen_by(8) == list(range(9))  # window 5..8, chunk [0, 5); chunk [5, 10) not complete
    assert keys_seen_by(6) == [0, 1, 2, 3, 4, 5, 6]  # window 3..6, chunk [0, 5)
    assert keys_seen_by(3) == [0, 1, 2, 3]  # window only
    # query 17: window 14..17 and the three complete chunks [0, 15)
    assert keys_seen_by(17) == list(range(18))


def test_causal_outputs_ignore_the_future():
    n = 30
    q, k, v, logits = inputs(1, 2, n, 3, 1)
    kwargs = dict(window_size=4, is_causal=True, chunk_size=4)
    out = long_short_attention(q, k, v, projection_logits=logits, **kwargs)
    k2, v2, l2 = k.detach().clone(), v.detach().clone(), logits.detach().clone()
    for t in (k2, v2, l2):
        t[:, :, 17:] = torch.randn_like(t[:, :, 17:])
    out2 = long_short_attention(q, k2, v2, projection_logits=l2, **kwargs)
    torch.testing.assert_close(out2[:, :, :17], out[:, :, :17])
    assert not torch.allclose(out2[:, :, 17:], out[:, :, 17:])


def test_projection_ignores_padding():
    logits = torch.randn(2, 1, 9, 3, dtype=torch.float64)
    mask = torch.ones(2, 9, dtype=torch.bool)
    mask[1, 5:] = False
    proj = dynamic_projection(logits, mask)
    assert torch.all(proj[1, :, 5:] == 0)
    torch.testing.assert_close(proj.sum(2), torch.ones(2, 1, 3, dtype=torch.float64))


@pytest.mark.parametrize("n", [7, 301])
@pytest.mark.parametrize("causal", [False, True])
def test_module_matches_reference(n, causal):
    torch.manual_seed(0)
    layer = attention.build(
        "transformer_ls", dim=DIM, heads=HEADS, window_size=4, rank=5, causal=causal, chunk_size=6, chunk_rank=2
    ).double()
    x = torch.randn(2, n, DIM, dtype=torch.float64, requires_grad=True)
    mask = scattered_mask(2, n)
    out = layer(x, mask)
    q, k, v = layer.proj.qkv(x)
    ref = long_short_attention_reference(
        q, k, v, mask, projection_logits=layer.projection_logits(x), window_size=4,
        short_norm=layer.short_norm, long_norm=layer.long_norm, is_causal=causal, chunk_size=6,
    )
    ref = layer.proj.out(ref) * mask[..., None]
    assert_forward_backward_close(out, ref, [x, *layer.parameters()])


def test_dual_ln_normalises_each_token_over_all_heads():
    layer = attention.build("transformer_ls", dim=DIM, heads=HEADS).double()
    t = torch.randn(2, HEADS, 5, DIM // HEADS, dtype=torch.float64)
    merged = layer.short_norm(t).transpose(1, 2).reshape(2, 5, DIM)
    torch.testing.assert_close(merged.mean(-1), torch.zeros(2, 5, dtype=torch.float64))
    torch.testing.assert_close(merged.var(-1, unbiased=False), torch.ones(2, 5, dtype=torch.float64), rtol=1e-4, atol=1e-4)


def test_dual_ln_switch_and_defaults():
    layer = attention.build("transformer_ls", dim=DIM, heads=HEADS)
    assert layer.window_size == 8 and layer.rank == 32
    assert isinstance(layer.norm_short, torch.nn.LayerNorm) and isinstance(layer.norm_long, torch.nn.LayerNorm)
    off = attention.build("transformer_ls", dim=DIM, heads=HEADS, dual_ln=False)
    assert isinstance(off.norm_short, torch.nn.Identity)


@pytest.mark.parametrize(
    "bad", [{"window_size": 0}, {"window_size": 2.0}, {"rank": 0}, {"chunk_size": 0}, {"chunk_rank": 0}, {"dropout": 1.0}]
)
def test_bad_options_raise(bad):
    with pytest.raises(AttentionError):
        attention.build("transformer_ls", dim=DIM, heads=HEADS, **bad)


def test_bad_projection_logits_raise():
    q, k, v, logits = inputs(1, 2, 8, 4, 3)
    with pytest.raises(AttentionError, match="projection_logits"):
        long_short_attention(q, k, v, projection_logits=logits[:, :1], window_size=4)
    with pytest.raises(AttentionError, match="window_size"):
        long_short_attention(q, k, v, projection_logits=logits, window_size=0)


@pytest.mark.parametrize("causal", [False, True], ids=["bidirectional", "causal"])
def test_trains_under_aot_autograd(causal):
    """torch.compile's training step traces forward and backward with AOT autograd (issue 56): LN_L's backward
    once got a transposed gradient, whose strides on CPU differ from those traced, and a view after it failed.
    AOT autograd alone (no dynamo: a second) gives the eager output and gradients (without a mask: the
    layout that failed)."""
    from functorch.compile import aot_module, nop

    torch.manual_seed(0)
    layer = attention.build("transformer_ls", dim=16, heads=2, max_len=19, causal=causal, chunk_size=4)
    x = torch.randn(2, 19, 16, requires_grad=True)
    expected = layer(x)
    expected_grad, = torch.autograd.grad(expected.square().sum(), x)
    out = aot_module(layer, fw_compiler=nop, bw_compiler=nop)(x)
    grad, = torch.autograd.grad(out.square().sum(), x)
    torch.testing.assert_close(out, expected)
    torch.testing.assert_close(grad, expected_grad)
