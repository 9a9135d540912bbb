"""Singularformer: fast path vs the plain n x n reference, losses (eqs. 15-17), cross-layer residual."""

import math

import pytest
import torch
from torch import nn

from longattn import attention
from longattn.attention import AttentionError, collect_aux_losses, merge_heads, split_heads
from longattn.attention.singular import (
    SCORES_KEY,
    diagonal_loss,
    orthogonal_loss,
    singular_attention,
    singular_attention_reference,
    singular_factors,
)
from longattn.testing import LargestTensorRecorder, assert_forward_backward_close, scattered_mask

DIM, HEADS = 24, 3  # head dim 8 = default rank


def build(seed=0, **options):
    torch.manual_seed(seed)
    layer = attention.build("singular", dim=DIM, heads=HEADS, **options).double()
    with torch.no_grad():
        # At init f(X) is tiny, so every alpha is nearly uniform and all pseudo tokens nearly equal:
        # sharpen factors and scores so that comparisons and the residual test can actually fail.
        layer.to_factors.weight.mul_(10.0)
        layer.to_q.weight.mul_(4.0)
        layer.to_k.weight.mul_(4.0)
    return layer


def module_reference(layer, x, mask, prev_scores=None):
    """The module through the plain reference: per-token Q, K, V, the full n x n matrix, W_Z."""
    q, k, v = (split_heads(proj(x), HEADS) for proj in (layer.to_q, layer.to_k, layer.to_v))
    out, scores = singular_attention_reference(
        q, k, v, mask, factor_logits=layer.factor_logits(x), prev_scores=prev_scores, return_scores=True
    )
    out = layer.to_out(merge_heads(out))
    return out * mask.unsqueeze(-1).to(out.dtype), scores


class Stack(nn.Module):
    """A minimal multi-layer model: one layer_state dict per forward, handed to every layer in order."""

    def __init__(self, layers):
        super().__init__()
        self.layers = nn.ModuleList(layers)

    def forward(self, x, mask):
        state = {}
        for layer in self.layers:
            x = x + layer(x, mask, state)
        return x


# ----------------------------------------------------------------------------- fast path vs reference


@pytest.mark.parametrize("n", [1, 7, 259])
@pytest.mark.parametrize("shared", [True, False])
def test_functional_matches_reference_forward_and_backward(n, shared, path):
    b, h, d, r = 2, 3, 5, 4
    q, k, v = (torch.randn(b, h, n, d, dtype=torch.float64, requires_grad=True) for _ in range(3))
    logits_shape = (b, n, r) if shared else (b, n, 4, r)
    logits = torch.randn(logits_shape, dtype=torch.float64, requires_grad=True)
    prev = torch.randn(b, h, r, r, dtype=torch.float64, requires_grad=True)
    mask = scattered_mask(b, n)
    inputs = (q, k, v, logits, prev)
    out, scores = singular_attention(
        q, k, v, mask, factor_logits=logits, prev_scores=prev, return_scores=True
    )
    ref, ref_scores = singular_attention_reference(
        q, k, v, mask, factor_logits=logits, prev_scores=prev, return_scores=True
    )
    torch.testing.assert_close(out, ref)
    torch.testing.assert_close(scores, ref_scores)
    g_out, g_scores = torch.randn_like(out), torch.randn_like(scores)
    grads = torch.autograd.grad((out, scores), inputs, (g_out, g_scores))
    grads_ref = torch.autograd.grad((ref, ref_scores), inputs, (g_out, g_scores))
    for got, want in zip(grads, grads_ref):
        torch.testing.assert_close(got, want)


@pytest.mark.parametrize("n", [7, 1023])
@pytest.mark.parametrize("shared", [True, False])
def test_module_fast_path_matches_reference_forward_and_backward(n, shared, path):
    # the module merges X into pseudo tokens *before* projecting (alpha^T X W): check it equals
    # eq. 8 with per-token projections, in values and in every parameter's gradient
    layer = build(shared_factors=shared)
    x = torch.randn(2, n, DIM, dtype=torch.float64, requires_grad=True)
    mask = scattered_mask(2, n)
    out = layer(x, mask)
    ref, _ = module_reference(layer, x, mask)
    assert_forward_backward_close(out, ref, [x, *layer.parameters()])


def test_pseudo_tokens_ignore_padding_and_empty_sequences_give_zeros():
    layer = build()
    x = torch.randn(2, 9, DIM, dtype=torch.float64, requires_grad=True)
    mask = torch.ones(2, 9, dtype=torch.bool)
    mask[0] = False  # a sequence with no real token at all
    mask[1, 4:] = False
    factors = singular_factors(layer.factor_logits(x), mask)
    assert torch.all(factors.alpha_v_t[:, :, ~mask[1]][1] == 0)
    torch.testing.assert_close(factors.alpha_v_t[1].sum(-1), torch.ones(layer.rank, dtype=torch.float64))
    out = layer(x, mask)
    assert torch.all(out[0] == 0) and torch.isfinite(out).all()
    out.square().sum().backward()
    assert torch.isfinite(x.grad).all()


# ----------------------------------------------------------------------------- losses (eqs. 15-17)


def test_losses_are_zero_for_orthogonal_and_diagonal_factors():
    n, r = 6, 3
    # alpha_U: every token picks one of r columns -> columns with disjoint supports
    alpha_u = torch.eye(r, dtype=torch.float64)[torch.arange(n) % r].unsqueeze(0)
    # alpha_V^T: row j averages tokens j and j + r -> disjoint rows
    alpha_v_t = alpha_u.transpose(1, 2) / 2
    assert orthogonal_loss(alpha_u, alpha_v_t) == 0
    assert diagonal_loss(torch.eye(r, dtype=torch.float64).expand(2, 4, r, r)) == 0


def test_losses_match_hand_computed_values_for_uniform_factors():
    b, n, r = 2, 10, 4
    alpha_u = torch.full((b, n, r), 1 / r, dtype=torch.float64)
    alpha_v_t = torch.full((b, r, n), 1 / n, dtype=torch.float64)
    # Gram entries: n / r^2 (alpha_U), 1 / n (alpha_V); r (r - 1) off-diagonal entries, / r^2
    expected = r * (r - 1) * ((n / r**2) ** 2 + (1 / n) ** 2) / r**2
    torch.testing.assert_close(
        orthogonal_loss(alpha_u, alpha_v_t), torch.tensor(expected, dtype=torch.float64)
    )
    a_prime = torch.full((b, 3, r, r), 1 / r, dtype=torch.float64)
    torch.testing.assert_close(diagonal_loss(a_prime), torch.tensor((r - 1) / r**3, dtype=torch.float64))


def test_orthogonal_loss_ignores_padded_rows():
    alpha_u = torch.softmax(torch.randn(1, 8, 3, dtype=torch.float64), -1)
    mask = torch.tensor([[True] * 5 + [False] * 3])
    alpha_v_t = torch.softmax(torch.randn(1, 3, 5, dtype=torch.float64), -1)
    alpha_v_t = torch.cat([alpha_v_t, torch.zeros(1, 3, 3, dtype=torch.float64)], -1)
    torch.testing.assert_close(
        orthogonal_loss(alpha_u, alpha_v_t, mask), orthogonal_loss(alpha_u[:, :5], alpha_v_t[:, :, :5])
    )


def test_aux_losses_only_while_training():
    layer = build()
    x = torch.randn(2, 11, DIM, dtype=torch.float64)
    layer.eval()
    layer(x)
    assert collect_aux_losses(layer) == {}
    layer.train()
    layer(x)
    losses = collect_aux_losses(layer)
    assert set(losses) == {"singular_orthogonal", "singular_diagonal"}
    assert all(v.requires_grad and v > 0 for v in losses.values())
    off = build(gamma_orthogonal=0.0, gamma_diagonal=0.0).train()
    off(x)
    assert collect_aux_losses(off) == {}  # disabled terms record nothing


def test_aux_losses_are_summed_exactly_once_per_layer():
    torch.manual_seed(0)
    layers = [attention.build("singular", dim=DIM, heads=HEADS, gamma_orthogonal=0.3, gamma_diagonal=0.7)
              for _ in range(3)]
    model = Stack(layers).double().train()
    x = torch.randn(2, 13, DIM, dtype=torch.float64)
    mask = scattered_mask(2, 13)

    # expected: gamma * eq. 15/16 per layer, recomputed through the plain reference, summed once
    expected_ortho, expected_diag = 0.0, 0.0
    h, prev = x, None
    for layer in layers:
        factors = singular_factors(layer.factor_logits(h), mask)
        expected_ortho += 0.3 * orthogonal_loss(factors.alpha_u, factors.alpha_v_t, mask)
        out, prev = module_reference(layer, h, mask, prev)
        expected_diag += 0.7 * diagonal_loss(torch.softmax(prev, -1))
        h = h + out

    model(x, mask)
    model(x, mask)  # a second pass replaces, never accumulates, each layer's losses
    losses = collect_aux_losses(model)
    torch.testing.assert_close(losses["singular_orthogonal"], expected_ortho)
    torch.testing.assert_close(losses["singular_diagonal"], expected_diag)
    assert collect_aux_losses(model) == {}  # collecting clears


# ----------------------------------------------------------------------------- cross-layer residual


def test_cross_layer_residual_scores_flow_forward_and_backward():
    first, second = build(seed=1), build(seed=2)
    x = torch.randn(2, 31, DIM, dtype=torch.float64)
    mask = scattered_mask(2, 31)
    state = {}
    y1 = first(x, mask, state)
    y2 = second(y1, mask, state)

    ref1, scores1 = module_reference(first, x, mask)
    ref2, scores2 = module_reference(second, ref1, mask, prev_scores=scores1)
    torch.testing.assert_close(y2, ref2)
    torch.testing.assert_close(state[SCORES_KEY], scores2)  # cumulative, as in RealFormer
    # the residual really changes the second layer ...
    assert not torch.allclose(second(y1, mask), y2)
    # ... and gradients reach the first layer's query/key maps through it
    names, params = zip(*first.named_parameters())
    got = dict(zip(names, torch.autograd.grad(y2.sum(), params)))
    want = dict(zip(names, torch.autograd.grad(ref2.sum(), params)))
    for name in names:
        torch.testing.assert_close(got[name], want[name])
    # without the residual path, the first layer's W_Q gets a different gradient
    no_res = module_reference(second, module_reference(first, x, mask)[0], mask)[0]
    no_res_grad = torch.autograd.grad(no_res.sum(), first.to_q.weight)[0]
    assert not torch.allclose(no_res_grad, got["to_q.weight"])


def test_residual_scores_can_be_switched_off():
    first, second = build(seed=1, residual_scores=False), build(seed=2, residual_scores=False)
    x = torch.randn(1, 9, DIM, dtype=torch.float64)
    state = {}
    y2 = second(first(x, None, state), None, state)
    assert state == {}
    torch.testing.assert_close(y2, second(first(x)))


def test_residual_needs_matching_shapes():
    state = {}
    build(rank=4)(torch.randn(1, 9, DIM, dtype=torch.float64), None, state)
    with pytest.raises(AttentionError, match="residual"):
        build(rank=5)(torch.randn(1, 9, DIM, dtype=torch.float64), None, state)


# ----------------------------------------------------------------------------- options


def test_rank_defaults_to_head_dim_and_sets_the_number_of_pseudo_tokens():
    assert build().rank == DIM // HEADS
    layer = build(rank=5)
    state = {}
    layer(torch.randn(2, 9, DIM, dtype=torch.float64), None, state)
    assert state[SCORES_KEY].shape == (2, HEADS, 5, 5)
    assert layer.to_factors.out_features == 5
    assert build(rank=5, shared_factors=False).to_factors.out_features == 20


@pytest.mark.parametrize(
    "options", [{"rank": 0}, {"rank": 2.5}, {"gamma_orthogonal": -1}, {"dropout": 1.0}, {"scale": 0.0}]
)
def test_bad_options_raise(options):
    with pytest.raises(AttentionError):
        build(**options)


def test_dropout_only_while_training():
    layer = build(dropout=0.5)
    x = torch.randn(1, 17, DIM, dtype=torch.float64)
    assert not torch.allclose(layer.train()(x), layer(x))
    torch.testing.assert_close(layer.eval()(x), layer(x))


def test_unshared_factors_stay_linear_in_memory():
    n = 2048
    torch.manual_seed(0)
    layer = attention.build("singular", dim=32, heads=1, shared_factors=False).train()
    x = torch.randn(1, n, 32, requires_grad=True)
    with LargestTensorRecorder() as rec:
        out = layer(x)
        (out.sum() + sum(collect_aux_losses(layer).values())).backward()
    assert rec.max_numel <= n * 32 * 4, rec.max_shape


def test_default_scale_is_inverse_sqrt_head_dim():
    assert build().scale == pytest.approx(1 / math.sqrt(DIM // HEADS))


def test_functional_rejects_bad_factor_logits():
    q = torch.randn(1, 2, 7, 4)
    with pytest.raises(AttentionError, match="factor_logits"):
        singular_attention(q, q, q, factor_logits=torch.randn(1, 6, 3))
    with pytest.raises(AttentionError, match="4, r"):
        singular_attention(q, q, q, factor_logits=torch.randn(1, 7, 3, 3))
    with pytest.raises(AttentionError, match="dtype"):
        singular_attention(q, q, q, factor_logits=torch.randn(1, 7, 3, dtype=torch.float64))
    with pytest.raises(AttentionError, match="self-attention"):
        singular_attention(q[:, :, :5], q, q, factor_logits=torch.randn(1, 7, 3))
