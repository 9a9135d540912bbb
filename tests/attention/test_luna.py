"""Luna: nested pack/unpack vs the plain reference, P through layer_state, padding."""

import pytest
import torch

from longattn import attention
from longattn.attention import AttentionError, merge_heads, split_heads
from longattn.attention.luna import (
    P_KEY,
    luna_attention,
    luna_attention_reference,
    luna_causal_attention,
    luna_causal_attention_reference,
)
from longattn.attention.softmax import softmax_attention_reference
from longattn.testing import LargestTensorRecorder, scattered_mask

DIM, HEADS = 24, 3


@pytest.mark.parametrize("n", [1, 7, 259])
@pytest.mark.parametrize("with_unpack_kv", [False, True])
@pytest.mark.parametrize("pack_batch", [1, 2])
def test_functional_matches_reference_forward_and_backward(n, with_unpack_kv, pack_batch, path):
    b, h, d, l = 2, 3, 5, 4
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(b, h, n, d, generator=g, dtype=torch.float64).requires_grad_() for _ in range(3))
    pq = torch.randn(pack_batch, h, l, d, generator=g, dtype=torch.float64).requires_grad_()
    wk = torch.randn(d, d, generator=g, dtype=torch.float64).requires_grad_()
    wv = torch.randn(d, d, generator=g, dtype=torch.float64).requires_grad_()
    unpack_kv = (lambda packed: (packed @ wk, packed @ wv)) if with_unpack_kv else None
    mask = scattered_mask(b, n)
    out = luna_attention(q, k, v, mask, pack_query=pq, unpack_kv=unpack_kv)
    ref = luna_attention_reference(q, k, v, mask, pack_query=pq, unpack_kv=unpack_kv)
    torch.testing.assert_close(out, ref)
    wrt = [q, k, v, pq, wk, wv] if with_unpack_kv else [q, k, v, pq]
    grad_out = torch.randn_like(out)
    for got, want in zip(torch.autograd.grad(out, wrt, grad_out), torch.autograd.grad(ref, wrt, grad_out)):
        torch.testing.assert_close(got, want)


def module_reference(layer, x, mask, p_in=None):
    """The module through softmax_attention_reference (full score matrices), and its P'."""
    b = x.shape[0]
    p_in = layer.p.expand(b, -1, -1) if p_in is None else p_in
    ph = layer.pack_heads
    pack_v = layer.pack_k if layer.tie_kv else layer.pack_v
    packed = softmax_attention_reference(
        split_heads(layer.pack_q(p_in), ph), split_heads(layer.pack_k(x), ph),
        split_heads(pack_v(x), ph), mask,
    )
    y_p = merge_heads(packed)
    unpack_v = layer.unpack_k if layer.tie_kv else layer.unpack_v
    out = softmax_attention_reference(
        split_heads(layer.unpack_q(x), HEADS), split_heads(layer.unpack_k(y_p), HEADS),
        split_heads(unpack_v(y_p), HEADS),
    )
    out = layer.to_out(merge_heads(out)) * mask[..., None]
    return out, layer.p_norm(y_p + p_in)


def build(seed=0, **options):
    torch.manual_seed(seed)
    layer = attention.build("luna", dim=DIM, heads=HEADS, pack_length=5, **options).double()
    with torch.no_grad():  # sharper scores so that mistakes show
        layer.pack_q.weight.mul_(3.0)
        layer.unpack_q.weight.mul_(3.0)
    return layer


@pytest.mark.parametrize("n", [7, 301])
@pytest.mark.parametrize("options", [{}, {"tie_kv": False}, {"pack_heads": 2}])
def test_module_matches_reference_forward_and_backward(n, options, path):
    layer = build(**options)
    x = torch.randn(2, n, DIM, dtype=torch.float64, requires_grad=True)
    mask = scattered_mask(2, n)
    state = {}
    out = layer(x, mask, state)
    ref, p_next = module_reference(layer, x, mask)
    torch.testing.assert_close(out, ref)
    torch.testing.assert_close(state[P_KEY], p_next)
    params = [x, *[p for name, p in layer.named_parameters() if not name.startswith("p_norm")]]
    g = torch.randn_like(out)
    for got, want in zip(torch.autograd.grad(out, params, g), torch.autograd.grad(ref, params, g)):
        torch.testing.assert_close(got, want)


def test_p_flows_through_layers_via_layer_state():
    first, second = build(seed=1), build(seed=2)
    x = torch.randn(2, 31, DIM, dtype=torch.float64)
    mask = scattered_mask(2, 31)
    state = {}
    y1 = first(x, mask, state)
    y2 = second(x + y1, mask, state)  # residual stack
    ref1, p1 = module_reference(first, x, mask)
    ref2, p2 = module_reference(second, x + ref1, mask, p_in=p1)
    torch.testing.assert_close(y2, ref2)
    torch.testing.assert_close(state[P_KEY], p2)
    # the second layer used the first layer's P', not its own parameter ...
    assert (second(x + y1, mask) - y2).abs().max() > 1e-3
    grads = torch.autograd.grad(y2.sum(), [first.p_norm.weight, second.p], allow_unused=True)
    assert grads[0] is not None and grads[0].abs().sum() > 0  # ... so gradients reach layer 1's LN
    assert grads[1] is None
    # pass_p=False: every layer packs with its own P, even with a layer_state
    alone = build(seed=2, pass_p=False)
    alone.load_state_dict(second.state_dict())
    torch.testing.assert_close(alone(x + y1, mask, {P_KEY: p1}), second(x + y1, mask))


def test_packing_ignores_padding_and_empty_sequence_is_zero():
    layer = build()
    x = torch.randn(2, 9, DIM, dtype=torch.float64, requires_grad=True)
    mask = torch.ones(2, 9, dtype=torch.bool)
    mask[0] = False
    mask[1, 4:] = False
    state = {}
    out = layer(x, mask, state)
    assert torch.all(out[0] == 0) and torch.isfinite(out).all() and torch.isfinite(state[P_KEY]).all()
    out.square().sum().backward()
    assert torch.isfinite(x.grad).all()
    assert torch.all(x.grad[1, 4:] == 0)  # padded tokens never reach real outputs


def test_bad_layer_state_and_options_raise():
    layer = build()
    x = torch.randn(2, 9, DIM, dtype=torch.float64)
    with pytest.raises(AttentionError, match="pack_length"):
        layer(x, None, {P_KEY: torch.zeros(2, 4, DIM, dtype=torch.float64)})
    with pytest.raises(AttentionError, match="pack_length"):
        attention.build("luna", dim=DIM, heads=HEADS, pack_length=0)
    with pytest.raises(AttentionError, match="pack_heads"):
        attention.build("luna", dim=DIM, heads=HEADS, pack_heads=5)
    q = torch.randn(1, 3, 9, 8)
    with pytest.raises(AttentionError, match="pack_query"):
        luna_attention(q, q, q, pack_query=torch.randn(1, 2, 4, 8))


def test_defaults_and_tied_projections():
    layer = attention.build("luna", dim=DIM, heads=HEADS)
    assert layer.p.shape == (16, DIM) and layer.pack_heads == HEADS and layer.tie_kv
    assert layer.pack_v is None and layer.unpack_v is None
    untied = attention.build("luna", dim=DIM, heads=HEADS, tie_kv=False)
    assert untied.pack_v is not None and untied.unpack_v is not None


# ----------------------------------------------------------------------------- causal Luna


@pytest.mark.parametrize("n", [1, 7, 45])
@pytest.mark.parametrize("chunk_size", [4, 64])
@pytest.mark.parametrize("masked", [False, True])
def test_causal_functional_matches_reference_forward_and_backward(n, chunk_size, masked, path):
    b, h, d, l = 2, 3, 5, 4
    g = torch.Generator().manual_seed(1)
    q, k, v, pk = (torch.randn(b, h, n, d, generator=g, dtype=torch.float64).requires_grad_() for _ in range(4))
    pq = torch.randn(1, h, l, d, generator=g, dtype=torch.float64).requires_grad_()
    mask = scattered_mask(b, n) if masked else None
    out = luna_causal_attention(q, k, v, mask, pack_key=pk, pack_query=pq, chunk_size=chunk_size)
    ref = luna_causal_attention_reference(q, k, v, mask, pack_key=pk, pack_query=pq)
    torch.testing.assert_close(out, ref)
    wrt = (q, k, v, pk, pq)
    grad_out = torch.randn_like(out)
    for got, want in zip(torch.autograd.grad(out, wrt, grad_out), torch.autograd.grad(ref, wrt, grad_out)):
        torch.testing.assert_close(got, want)


def test_causal_outputs_ignore_the_future_and_padding():
    torch.manual_seed(0)
    layer = attention.build("luna", dim=DIM, heads=HEADS, pack_length=5, causal=True, chunk_size=8).double()
    x = torch.randn(2, 40, DIM, dtype=torch.float64)
    out = layer(x)
    x2 = x.clone()
    x2[:, 25:] = torch.randn_like(x2[:, 25:])
    out2 = layer(x2)
    torch.testing.assert_close(out2[:, :25], out[:, :25])
    assert not torch.allclose(out2[:, 25:], out[:, 25:])
    mask = scattered_mask(2, 40)
    x3 = torch.where(mask[..., None], x, 100 * torch.randn_like(x))
    torch.testing.assert_close(layer(x3, mask), layer(x, mask))


def test_causal_module_matches_reference_and_reads_but_never_writes_p(path):
    torch.manual_seed(0)
    layer = attention.build("luna", dim=DIM, heads=HEADS, pack_length=5, causal=True, tie_kv=False).double()
    assert layer.p_norm is None and layer.pack_v is None
    x = torch.randn(2, 19, DIM, dtype=torch.float64, requires_grad=True)
    mask = scattered_mask(2, 19)
    p_in = torch.randn(2, 5, DIM, dtype=torch.float64)
    state = {P_KEY: p_in}
    out = layer(x, mask, state)
    assert state[P_KEY] is p_in
    ref = luna_causal_attention_reference(
        split_heads(layer.unpack_q(x), HEADS), split_heads(layer.unpack_k(x), HEADS),
        split_heads(layer.unpack_v(x), HEADS), mask,
        pack_key=split_heads(layer.pack_k(x), HEADS), pack_query=split_heads(layer.pack_q(p_in), HEADS),
    )
    ref = layer.to_out(merge_heads(ref)) * mask[..., None]
    torch.testing.assert_close(out, ref)
    params = [x, *[p for name, p in layer.named_parameters() if name != "p"]]
    g = torch.randn_like(out)
    for got, want in zip(torch.autograd.grad(out, params, g), torch.autograd.grad(ref, params, g)):
        torch.testing.assert_close(got, want)


def test_causal_has_no_quadratic_intermediate():
    n = 4096
    torch.manual_seed(0)
    layer = attention.build("luna", dim=32, heads=1, causal=True)
    x = torch.randn(1, n, 32, requires_grad=True)
    with LargestTensorRecorder() as rec:
        layer(x).sum().backward()
    assert rec.max_numel <= n * n // 16, rec.max_shape
