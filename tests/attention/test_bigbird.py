import pytest
import torch

from longattn.attention import build
from longattn.attention.bigbird import bigbird_attention, bigbird_attention_reference, key_block_indices, random_block_indices


@pytest.mark.parametrize("n", [97, 128, 161])
def test_sparse_matches_dense_pattern_forward_and_backward(n):
    bs, h = 16, 2
    nb = -(-n // bs)
    ridx = random_block_indices(nb, h, 2, 3, torch.Generator().manual_seed(n))
    q, k, v = (torch.randn(2, h, n, 8, dtype=torch.float64, requires_grad=True) for _ in range(3))
    mask = torch.rand(2, n) > 0.25
    kw = dict(random_idx=ridx, block_size=bs, window_blocks=3)
    out, ref = bigbird_attention(q, k, v, mask, **kw), bigbird_attention_reference(q, k, v, mask, **kw)
    torch.testing.assert_close(out, ref)
    g = torch.randn_like(out)
    for a, r in zip(torch.autograd.grad(out, (q, k, v), g), torch.autograd.grad(ref, (q, k, v), g)):
        torch.testing.assert_close(a, r)


def test_queries_that_see_no_key_output_zeros_with_finite_gradients():
    n, bs, h = 161, 16, 2
    nb = -(-n // bs)
    ridx = random_block_indices(nb, h, 2, 3, torch.Generator().manual_seed(1))
    q, k, v = (torch.randn(2, h, n, 8, dtype=torch.float64, requires_grad=True) for _ in range(3))
    mask = torch.zeros(2, n, dtype=torch.bool)
    mask[0, 80:96] = True  # only block 5 is real: global rows see it, most middle blocks see nothing
    kw = dict(random_idx=ridx, block_size=bs, window_blocks=3)
    # the cores without padding_safe, which would zero every padded query row anyway
    core, core_reference = bigbird_attention.__wrapped__, bigbird_attention_reference.__wrapped__
    out, ref = core(q, k, v, mask, **kw), core_reference(q, k, v, mask, **kw)
    torch.testing.assert_close(out, ref)
    blind = out.abs().sum(-1) == 0
    assert blind[1].all() and 0 < blind[0].sum() < n  # batch 1 is all padding
    g = torch.randn_like(out)
    for a, r in zip(torch.autograd.grad(out, (q, k, v), g), torch.autograd.grad(ref, (q, k, v), g)):
        assert a.isfinite().all()
        torch.testing.assert_close(a, r)


def test_random_blocks_avoid_window_and_global_and_never_repeat():
    nb = 12
    ridx = random_block_indices(nb, 4, 3, 3, torch.Generator().manual_seed(0))
    assert ridx.shape == (4, nb - 2, 3)
    query = torch.arange(1, nb - 1)[None, :, None]
    assert ((ridx - query).abs() > 1).all() and (ridx > 0).all() and (ridx < nb - 1).all()
    assert all(len(set(row.tolist())) == 3 for row in ridx.flatten(0, 1))


def test_duplicate_blocks_are_counted_once():
    idx, keep = key_block_indices(6, torch.full((1, 4, 1), 3), window_blocks=3)
    # query block 1: globals {0, 5}, window {0, 1, 2}, random {3}: block 0 listed twice, kept once
    kept = idx[0, 0][keep[0, 0]].tolist()
    assert sorted(kept) == [0, 1, 2, 3, 5]


def test_pattern_is_fixed_per_layer_and_saved_with_the_model():
    torch.manual_seed(0)
    a = build("bigbird", dim=32, heads=2, block_size=16).eval()
    b = build("bigbird", dim=32, heads=2, block_size=16).eval()
    x = torch.randn(1, 300, 32)
    torch.testing.assert_close(a(x), a(x))
    b.load_state_dict(a.state_dict())
    torch.testing.assert_close(b(x), a(x))


def test_short_sequences_use_full_attention():
    from longattn.attention.softmax import softmax_attention

    torch.manual_seed(0)
    layer = build("bigbird", dim=32, heads=2, block_size=64).double()
    x = torch.randn(1, 100, 32, dtype=torch.float64)
    q, k, v = layer.proj.qkv(x)
    torch.testing.assert_close(layer(x), layer.proj.out(softmax_attention(q, k, v)))


def test_functional_form_rejects_patterns_that_do_not_fit_the_length():
    from longattn.attention.base import AttentionError

    with pytest.raises(AttentionError, match="too few"):
        random_block_indices(7, heads=2, random_blocks=3, window_blocks=3, generator=torch.Generator())  # 8 needed
    q = torch.randn(1, 2, 100, 8)
    idx = random_block_indices(9, heads=2, random_blocks=3, window_blocks=3, generator=torch.Generator())
    for n in (100, 9 * 16):  # 1 block of 64, then 9 blocks of 16 but the pattern is for block 64
        with pytest.raises(AttentionError, match="random_idx"):
            x = torch.randn(1, 2, n, 8)
            bigbird_attention(x, x, x, random_idx=idx, block_size=64)
    assert bigbird_attention(q.repeat(1, 1, 6, 1)[:, :, :9 * 64 - 5], q.repeat(1, 1, 6, 1)[:, :, :9 * 64 - 5],
                             q.repeat(1, 1, 6, 1)[:, :, :9 * 64 - 5], random_idx=idx).shape == (1, 2, 571, 8)
