"""FLASH: mixed chunk attention's fast path vs the plain per-chunk loops, GAU structure, RoPE, causality."""

import pytest
import torch

from longattn import attention
from longattn.attention import AttentionError
from longattn.attention.flash import mixed_chunk_attention, mixed_chunk_attention_reference, rotary
from longattn.testing import scattered_mask

B, H, S, E = 2, 1, 6, 5


def inputs(n, seed=0):
    g = torch.Generator().manual_seed(seed)
    make = lambda w: torch.randn(B, H, n, w, generator=g, dtype=torch.float64).requires_grad_()  # noqa: E731
    return {"query": make(S), "key": make(S), "value": make(E), "linear_query": make(S), "linear_key": make(S)}


def call(fn, t, mask, **options):
    return fn(t["query"], t["key"], t["value"], mask, linear_query=t["linear_query"], linear_key=t["linear_key"],
              **options)


@pytest.mark.parametrize("n", [1, 7, 37, 64])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("scaling", ["length", "none"])
@pytest.mark.parametrize("with_bias", [False, True])
def test_fast_path_matches_reference_forward_and_backward(n, causal, scaling, with_bias, path):
    chunk_size = 8  # several chunks, the last one partial for odd n
    t = inputs(n)
    bias = torch.randn(2 * chunk_size - 1, dtype=torch.float64, requires_grad=True) if with_bias else None
    mask = scattered_mask(B, n)
    options = dict(chunk_size=chunk_size, causal=causal, position_bias=bias, scaling=scaling)
    fast = call(mixed_chunk_attention, t, mask, **options)
    ref = call(mixed_chunk_attention_reference, t, mask, **options)
    torch.testing.assert_close(fast, ref)
    leaves = list(t.values()) + ([bias] if with_bias else [])
    grad = torch.randn_like(fast)
    for a, b in zip(torch.autograd.grad(fast, leaves, grad, allow_unused=True, materialize_grads=True),
                    torch.autograd.grad(ref, leaves, grad, allow_unused=True, materialize_grads=True)):
        torch.testing.assert_close(a, b)


def test_one_chunk_is_quadratic_plus_full_linear_attention():
    """N <= c: eq. 6 over the whole sequence plus eq. 7 = Q^lin K^lin^T V / n, both written densely."""
    t = inputs(9)
    out = call(mixed_chunk_attention, t, None, chunk_size=256)
    q, k, v, ql, kl = t["query"], t["key"], t["value"], t["linear_query"], t["linear_key"]
    quad = torch.relu(q @ k.transpose(-1, -2) / S**0.5) ** 2 / 9 @ v
    lin = ql @ kl.transpose(-1, -2) @ v / 9
    torch.testing.assert_close(out, quad + lin)


def test_causal_output_ignores_the_future():
    t = inputs(30)
    out = call(mixed_chunk_attention, t, None, chunk_size=8, causal=True)
    changed = {k: v.detach().clone() for k, v in t.items()}
    for name in ("key", "value", "linear_key", "query", "linear_query"):
        changed[name][:, :, 17:] += 5.0
    again = call(mixed_chunk_attention, changed, None, chunk_size=8, causal=True)
    torch.testing.assert_close(again[:, :, :17], out[:, :, :17])
    assert not torch.allclose(again[:, :, 17:], out[:, :, 17:])


def test_rotary_depends_only_on_relative_positions():
    x = torch.randn(2, 12, 8, dtype=torch.float64)
    y = torch.randn(2, 12, 8, dtype=torch.float64)
    scores = rotary(x) @ rotary(y).transpose(-1, -2)
    shifted = rotary(torch.cat([torch.zeros(2, 3, 8, dtype=torch.float64), x], 1))[:, 3:]
    shifted_y = rotary(torch.cat([torch.zeros(2, 3, 8, dtype=torch.float64), y], 1))[:, 3:]
    torch.testing.assert_close(shifted @ shifted_y.transpose(-1, -2), scores)
    torch.testing.assert_close(rotary(x).norm(dim=-1), x.norm(dim=-1))


def test_module_is_the_gated_unit_over_mixed_chunk_attention(path):
    torch.manual_seed(0)
    layer = attention.build("flash", dim=16, heads=4, chunk_size=8, query_key_dim=12).double()
    with torch.no_grad():
        layer.gamma.mul_(50.0)  # the paper's N(0, 0.02) init makes A ~ 0: sharpen to compare
        layer.position_bias.normal_()
    x = torch.randn(2, 21, 16, dtype=torch.float64)
    mask = scattered_mask(B, 21)
    u, v, (qq, kq, ql, kl) = layer.gates_and_queries(x)
    mixed = mixed_chunk_attention_reference(qq, kq, v.unsqueeze(1), mask, linear_query=ql, linear_key=kl,
                                            chunk_size=8, position_bias=layer.position_bias)
    expected = layer.to_out(u * mixed[:, 0]) * mask[..., None]  # eq. 9
    torch.testing.assert_close(layer(x, mask), expected)
    assert u.shape[-1] == 32 and qq.shape[-1] == 12  # e = 2 * dim, s = query_key_dim


def test_single_head_parameters_do_not_depend_on_heads():
    count = lambda m: sum(p.numel() for p in m.parameters())  # noqa: E731
    a, b = attention.build("flash", dim=16, heads=1), attention.build("flash", dim=16, heads=4)
    assert count(a) == count(b) == (16 + 1) * (2 * 32 + 128) + 2 * 4 * 128 + (2 * 256 - 1) + (32 + 1) * 16
    assert attention.capabilities("flash").replaces_ffn


def test_bad_options_raise():
    t = inputs(5)
    with pytest.raises(AttentionError, match="scaling"):
        attention.build("flash", dim=8, heads=2, scaling="softmax")
    with pytest.raises(AttentionError, match="chunk_size"):
        attention.build("flash", dim=8, heads=2, chunk_size=0)
    with pytest.raises(AttentionError, match="position_bias"):
        call(mixed_chunk_attention, t, None, chunk_size=4, position_bias=torch.zeros(3, dtype=torch.float64))
    with pytest.raises(AttentionError, match="linear_query"):
        mixed_chunk_attention(t["query"], t["key"], t["value"], linear_query=t["query"][..., :2],
                              linear_key=t["linear_key"])
