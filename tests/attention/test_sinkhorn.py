"""Sparse Sinkhorn attention: block-wise fast path vs the dense kron(S, I) reference, balancing, sorting."""

import pytest
import torch

from longattn import attention
from longattn.attention import AttentionError
from longattn.attention.sinkhorn import (
    gumbel_noise,
    sinkhorn_attention,
    sinkhorn_attention_reference,
    sinkhorn_balance,
)
from longattn.attention.softmax import softmax_attention_reference
from longattn.testing import assert_forward_backward_close, scattered_mask

DIM, HEADS = 24, 3


@pytest.mark.parametrize("n", [1, 7, 45])
@pytest.mark.parametrize("local", ["sum", "joint", "none"])
@pytest.mark.parametrize("with_noise", [False, True])
@pytest.mark.parametrize("sortcut", [None, 2])
def test_functional_matches_reference_forward_and_backward(n, local, with_noise, sortcut, path):
    b, h, d, block = 2, 3, 5, 4
    blocks = -(-n // block)
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(b, h, n, d, generator=g, dtype=torch.float64).requires_grad_() for _ in range(3))
    logits = (2 * torch.randn(b, h, blocks, blocks, generator=g, dtype=torch.float64)).requires_grad_()
    noise = gumbel_noise(logits.shape, logits) if with_noise else None
    mask = scattered_mask(b, n)
    kwargs = dict(sort_logits=logits, block_size=block, local_attention=local, noise=noise, sinkhorn_iters=3,
                  sortcut_blocks=sortcut)
    out = sinkhorn_attention(q, k, v, mask, **kwargs)
    ref = sinkhorn_attention_reference(q, k, v, mask, **kwargs)
    torch.testing.assert_close(out, ref)
    grad_out = torch.randn_like(out)
    wrt = (q, k, v, logits)
    for got, want in zip(torch.autograd.grad(out, wrt, grad_out), torch.autograd.grad(ref, wrt, grad_out)):
        torch.testing.assert_close(got, want)


def test_balancing_converges_to_doubly_stochastic():
    logits = torch.randn(2, 6, 6, dtype=torch.float64)
    s = sinkhorn_balance(logits, iterations=200, temperature=0.75)
    ones = torch.ones(2, 6, dtype=torch.float64)
    torch.testing.assert_close(s.sum(-1), ones)
    torch.testing.assert_close(s.sum(-2), ones)
    torch.testing.assert_close(sinkhorn_balance(logits, 0, 0.5), torch.exp(logits / 0.5))


def test_sharp_sorting_attends_to_the_permuted_block():
    # R = 50 * permutation matrix: S is (numerically) that permutation, so with local_attention="none"
    # query block i attends exactly to key block perm[i]
    n, block, d = 12, 4, 3
    perm = torch.tensor([2, 0, 1])
    logits = (50.0 * torch.eye(3, dtype=torch.float64)[perm]).view(1, 1, 3, 3)
    q, k, v = (torch.randn(1, 1, n, d, dtype=torch.float64) for _ in range(3))
    out = sinkhorn_attention(q, k, v, sort_logits=logits, block_size=block, local_attention="none")
    for i, j in enumerate(perm.tolist()):
        rows, cols = slice(i * block, (i + 1) * block), slice(j * block, (j + 1) * block)
        expected = softmax_attention_reference(q[..., rows, :], k[..., cols, :], v[..., cols, :])
        torch.testing.assert_close(out[..., rows, :], expected)


def test_sortcut_queries_all_see_the_first_sorted_blocks():
    # sharp permutation: sorted blocks are key blocks perm[0], perm[1]; with n_cut = 2 and no local
    # block every query attends to exactly those 2 blocks
    n, block, d = 16, 4, 3
    perm = torch.tensor([3, 1, 0, 2])
    logits = (50.0 * torch.eye(4, dtype=torch.float64)[perm]).view(1, 1, 4, 4)
    q, k, v = (torch.randn(1, 1, n, d, dtype=torch.float64) for _ in range(3))
    out = sinkhorn_attention(q, k, v, sort_logits=logits, block_size=block, local_attention="none", sortcut_blocks=2)
    cols = torch.cat([torch.arange(j * block, (j + 1) * block) for j in (3, 1)])
    torch.testing.assert_close(out, softmax_attention_reference(q, k[..., cols, :], v[..., cols, :]))


def test_local_modes_combine_the_two_attentions_as_documented():
    n, block, d = 12, 4, 3
    perm = torch.tensor([2, 0, 1])
    logits = (50.0 * torch.eye(3, dtype=torch.float64)[perm]).view(1, 1, 3, 3)
    q, k, v = (torch.randn(1, 1, n, d, dtype=torch.float64) for _ in range(3))
    run = lambda mode: sinkhorn_attention(q, k, v, sort_logits=logits, block_size=block, local_attention=mode)
    rows = slice(4, 8)  # query block 1: sorted block = key block 0, local block = key block 1
    sorted_cols, local_cols = slice(0, 4), slice(4, 8)
    sorted_out = softmax_attention_reference(q[..., rows, :], k[..., sorted_cols, :], v[..., sorted_cols, :])
    local_out = softmax_attention_reference(q[..., rows, :], k[..., local_cols, :], v[..., local_cols, :])
    torch.testing.assert_close(run("sum")[..., rows, :], sorted_out + local_out)
    both = torch.cat([torch.arange(0, 4), torch.arange(4, 8)])
    joint = softmax_attention_reference(q[..., rows, :], k[..., both, :], v[..., both, :])
    torch.testing.assert_close(run("joint")[..., rows, :], joint)


def build(max_len=40, **options):
    torch.manual_seed(0)
    layer = attention.build("sinkhorn", dim=DIM, heads=HEADS, max_len=max_len, block_size=4, **options).double()
    with torch.no_grad():
        layer.sort_out.weight.mul_(5.0)  # non-uniform sorting so that mistakes show
    return layer


@pytest.mark.parametrize("n", [7, 37])
@pytest.mark.parametrize("sortcut", [None, 3])
def test_module_matches_reference(n, sortcut, path):
    layer = build(sortcut_blocks=sortcut).eval()
    x = torch.randn(2, n, DIM, dtype=torch.float64, requires_grad=True)
    mask = scattered_mask(2, n)
    out = layer(x, mask)
    ref = sinkhorn_attention_reference(
        *layer.proj.qkv(x), mask, sort_logits=layer.sort_logits(x, mask), block_size=4, sortcut_blocks=sortcut
    )
    ref = layer.proj.out(ref) * mask[..., None]
    assert_forward_backward_close(out, ref, [x, *layer.parameters()])


def test_sorting_network_sums_real_tokens_of_each_block():
    layer = build()
    x = torch.randn(1, 10, DIM, dtype=torch.float64)
    mask = torch.tensor([[True] * 6 + [False] * 4])
    logits = layer.sort_logits(x, mask)
    assert logits.shape == (1, HEADS, 3, 3)
    summary = torch.stack([x[0, :4].sum(0), x[0, 4:6].sum(0), torch.zeros(DIM, dtype=torch.float64)])
    expected = layer.sort_out(torch.relu(layer.sort_hidden(summary))).view(3, HEADS, 10)[..., :3]
    torch.testing.assert_close(logits[0], expected.transpose(0, 1))


def test_gumbel_noise_only_while_training():
    layer = build()
    x = torch.randn(1, 20, DIM, dtype=torch.float64)
    layer.train()
    assert not torch.allclose(layer(x), layer(x))
    layer.eval()
    torch.testing.assert_close(layer(x), layer(x))
    no_noise = build(gumbel=False).train()
    torch.testing.assert_close(no_noise(x), no_noise(x))


def test_bad_inputs_raise():
    with pytest.raises(AttentionError, match="block_size"):
        attention.build("sinkhorn", dim=DIM, heads=HEADS, max_len=8, block_size=0)
    with pytest.raises(AttentionError, match="local_attention"):
        attention.build("sinkhorn", dim=DIM, heads=HEADS, max_len=8, local_attention="both")
    with pytest.raises(AttentionError, match="sortcut_blocks"):
        attention.build("sinkhorn", dim=DIM, heads=HEADS, max_len=8, sortcut_blocks=0)
    with pytest.raises(AttentionError, match="temperature"):
        attention.build("sinkhorn", dim=DIM, heads=HEADS, max_len=8, temperature=0.0)
    q = torch.randn(1, 2, 9, 4)
    with pytest.raises(AttentionError, match="sort_logits"):
        sinkhorn_attention(q, q, q, sort_logits=torch.randn(1, 2, 2, 2), block_size=4)
    layer = attention.build("sinkhorn", dim=DIM, heads=HEADS, max_len=8)
    assert (layer.block_size, layer.sinkhorn_iters, layer.temperature) == (64, 5, 0.75)


def test_gumbel_noise_is_finite_and_standard():
    like = torch.zeros((), dtype=torch.float64)
    torch.manual_seed(3)
    noise = gumbel_noise((20000,), like)
    assert torch.isfinite(noise).all()
    # Gumbel(0, 1): mean = Euler-Mascheroni constant 0.5772, variance pi^2 / 6
    assert abs(noise.mean().item() - 0.5772) < 0.05
    assert abs(noise.var().item() - 1.6449) < 0.1


@pytest.mark.parametrize("local", ["sum", "joint", "none"])
def test_fully_padded_sequence_gives_zeros(local):
    q, k, v = (torch.randn(2, 1, 8, 3, dtype=torch.float64) for _ in range(3))
    mask = torch.ones(2, 8, dtype=torch.bool)
    mask[0] = False
    logits = torch.randn(2, 1, 2, 2, dtype=torch.float64)
    out = sinkhorn_attention(q, k, v, mask, sort_logits=logits, block_size=4, local_attention=local)
    assert torch.all(out[0] == 0) and torch.isfinite(out).all()
    torch.testing.assert_close(
        out, sinkhorn_attention_reference(q, k, v, mask, sort_logits=logits, block_size=4, local_attention=local)
    )
