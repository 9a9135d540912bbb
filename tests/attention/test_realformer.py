"""RealFormer: fast path vs plain residual-attention equations, scores carried through layer_state."""

import pytest
import torch
from torch import nn

from longattn import attention
from longattn.attention import AttentionError
from longattn.attention.realformer import SCORES_KEY, realformer_attention, realformer_attention_reference
from longattn.attention.softmax import softmax_attention
from longattn.testing import scattered_mask

B, H, DH = 2, 3, 4


def qkv(n, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(B, H, n, DH, generator=g, dtype=torch.float64) * 2).requires_grad_() for _ in range(3)]


@pytest.mark.parametrize("n", [1, 37, 129])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("with_prev", [False, True])
def test_fast_path_matches_reference_forward_and_backward(n, causal, with_prev, path):
    q, k, v = qkv(n)
    mask = scattered_mask(B, n)
    prev = torch.randn(B, H, n, n, dtype=torch.float64, requires_grad=True) if with_prev else None
    fast = realformer_attention(q, k, v, mask, prev_scores=prev, is_causal=causal)
    ref = realformer_attention_reference(q, k, v, mask, prev_scores=prev, is_causal=causal)
    real = mask[:, None, :, None]  # padded query rows are the module's zeros; compare real rows
    torch.testing.assert_close(fast[0] * real, ref[0] * real)
    torch.testing.assert_close(fast[1], ref[1])
    inputs = [q, k, v] + ([prev] if with_prev else [])
    g_out, g_scores = torch.randn_like(fast[0]) * real, torch.randn_like(fast[1])
    grads_fast = torch.autograd.grad((fast[0] * g_out).sum() + (fast[1] * g_scores).sum(), inputs)
    grads_ref = torch.autograd.grad((ref[0] * g_out).sum() + (ref[1] * g_scores).sum(), inputs)
    for a, b in zip(grads_fast, grads_ref):
        torch.testing.assert_close(a, b)


def test_first_layer_is_softmax_attention():
    q, k, v = qkv(41)
    mask = scattered_mask(B, 41)
    out, _ = realformer_attention(q, k, v, mask, is_causal=True)
    real = mask[:, None, :, None]
    torch.testing.assert_close(out * real, softmax_attention(q, k, v, mask, is_causal=True) * real)


class Stack(nn.Module):
    def __init__(self, layers):
        super().__init__()
        self.layers = nn.ModuleList(layers)

    def forward(self, x, mask):
        state = {}
        for layer in self.layers:
            x = x + layer(x, mask, state)
        return x, state


def test_second_layer_adds_the_first_layers_raw_scores():
    torch.manual_seed(0)
    first, second = (attention.build("realformer", dim=12, heads=H).double() for _ in range(2))
    x = torch.randn(B, 19, 12, dtype=torch.float64)
    mask = scattered_mask(B, 19)
    out, state = Stack([first, second])(x, mask)
    # by hand: layer 1's scores S_1 from its own q, k; layer 2 uses S_1 + its own
    q1, k1, v1 = first.proj.qkv(x)
    o1, s1 = realformer_attention_reference(q1, k1, v1, mask)
    h = x + first.proj.out(o1) * mask[..., None]
    q2, k2, v2 = second.proj.qkv(h)
    o2, s2 = realformer_attention_reference(q2, k2, v2, mask, prev_scores=s1)
    torch.testing.assert_close(out, h + second.proj.out(o2) * mask[..., None])
    torch.testing.assert_close(state[SCORES_KEY], s2)
    # and the residual matters: without it the second layer computes something else
    second.residual_scores = False
    plain, plain_state = Stack([first, second])(x, mask)
    assert not torch.allclose(plain[mask], out[mask])
    torch.testing.assert_close(plain_state[SCORES_KEY], s1)  # only the first layer wrote


def test_mismatched_scores_raise_a_clear_error():
    layer = attention.build("realformer", dim=12, heads=H)
    state = {SCORES_KEY: torch.zeros(1, H, 5, 5)}
    with pytest.raises(AttentionError, match="same batch, heads and length"):
        layer(torch.randn(1, 6, 12), layer_state=state)


def test_half_inputs_keep_float32_scores():
    layer = attention.build("realformer", dim=12, heads=H).to(torch.bfloat16)
    state = {}
    layer(torch.randn(1, 6, 12, dtype=torch.bfloat16), layer_state=state)
    assert state[SCORES_KEY].dtype == torch.float32


def test_a_query_without_any_key_gets_zeros_not_nan():
    q, k, v = qkv(6)
    mask = torch.ones(B, 6, dtype=torch.bool)
    mask[0, :3] = False  # causal: queries 0-2 of sequence 0 have no real key before them
    mask[1, :] = False  # no real token at all
    out, scores = realformer_attention(q, k, v, mask, is_causal=True)
    ref, _ = realformer_attention_reference(q, k, v, mask, is_causal=True)
    assert torch.isfinite(out).all() and torch.isfinite(scores).all()
    assert torch.all(out[0, :, :3] == 0) and torch.all(out[1] == 0)
    torch.testing.assert_close(out[0, :, 3:], ref[0, :, 3:])
    out.sum().backward()
    assert all(torch.isfinite(t.grad).all() for t in (q, k, v))
