"""The chunk-by-chunk forms of local, BigBird and Longformer attention (attention/chunked.py): module
forms (projections inside the chunks) and functional forms against the dense references, in float64,
odd lengths, padding, several chunks; dropout draws replayed exactly in backward."""

import pytest
import torch

from longattn import attention
from longattn.attention import bigbird, local, longformer
from longattn.attention.base import split_heads
from longattn.testing import assert_forward_backward_close

DIM, HEADS = 16, 2


def module_reference(layer, x, mask, reference, **options):
    """The module's computation through its dense functional reference."""
    q, k, v = layer.proj.qkv(x.masked_fill(~mask[..., None], 0.0))
    return layer.proj.out(reference(q, k, v, mask, **options)).masked_fill(~mask[..., None], 0.0)


def inputs(n, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(2, n, DIM, dtype=torch.float64, generator=g, requires_grad=True)
    mask = torch.rand(2, n, generator=g) > 0.2
    mask[1, n - 7:] = False
    return x, mask


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("n", [37, 101])
def test_local_module_over_several_chunks_matches_the_reference(monkeypatch, n, causal):
    monkeypatch.setattr(local, "LOCAL_CHUNK_TOKENS", 16)  # 2 blocks of 8 per chunk
    torch.manual_seed(0)
    layer = attention.build("local", dim=DIM, heads=HEADS, window_size=8, causal=causal).double()
    x, mask = inputs(n)
    ref = module_reference(layer, x, mask, local.local_attention_reference, window_size=8, is_causal=causal)
    assert_forward_backward_close(layer(x, mask), ref, [x, *layer.parameters()])


@pytest.mark.parametrize("exact", [True, False])
def test_local_functional_over_several_chunks_matches_the_reference(monkeypatch, exact):
    monkeypatch.setattr(local, "LOCAL_CHUNK_TOKENS", 16)
    torch.manual_seed(0)
    q, k, v = (torch.randn(2, HEADS, 53, 8, dtype=torch.float64, requires_grad=True) for _ in range(3))
    mask = torch.rand(2, 53) > 0.3
    kw = dict(window_size=8, exact_window=exact, look_backward=2)
    assert_forward_backward_close(local.local_attention(q, k, v, mask, **kw),
                                  local.local_attention_reference(q, k, v, mask, **kw), [q, k, v])


@pytest.mark.parametrize("n", [150, 161])
def test_bigbird_module_over_several_chunks_matches_the_reference(monkeypatch, n):
    monkeypatch.setattr(bigbird, "BIGBIRD_CHUNK_TOKENS", 16)  # 2 blocks of 8 per chunk
    torch.manual_seed(0)
    layer = attention.build("bigbird", dim=DIM, heads=HEADS, block_size=8, random_blocks=2).double()
    x, mask = inputs(n)
    ridx = layer.random_idx(-(-n // 8))
    ref = module_reference(layer, x, mask, bigbird.bigbird_attention_reference, random_idx=ridx, block_size=8)
    assert_forward_backward_close(layer(x, mask), ref, [x, *layer.parameters()])


@pytest.mark.parametrize("separate", [True, False])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("dilation", [1, 2])
def test_longformer_module_over_several_groups_matches_the_reference(monkeypatch, separate, causal, dilation):
    monkeypatch.setattr(longformer, "LONGFORMER_GROUP_TOKENS", 8)  # 2 window chunks of 4 per group
    torch.manual_seed(0)
    options = dict(attention_window=8, dilation=dilation, global_positions=(0, 20, 60))
    layer = attention.build("longformer", dim=DIM, heads=HEADS, causal=causal, separate_global_projections=separate,
                            **options).double()
    x, mask = inputs(53)
    xm = x.masked_fill(~mask[..., None], 0.0)
    gq, gk, gv = ((split_heads(layer.global_proj[name](xm), HEADS) for name in ("query", "key", "value"))
                  if separate else (None, None, None))
    ref = module_reference(layer, x, mask, longformer.longformer_attention_reference, is_causal=causal,
                           global_query=gq, global_key=gk, global_value=gv, **options)
    assert_forward_backward_close(layer(x, mask), ref, [x, *layer.parameters()])


@pytest.mark.parametrize("name", ["local", "longformer"])
def test_dropout_draws_are_replayed_exactly_in_backward(monkeypatch, name):
    """With attention dropout on, the chunked gradients equal autograd through the same chunks
    run one after another from the same random state."""
    monkeypatch.setattr(local, "LOCAL_CHUNK_TOKENS", 16)
    monkeypatch.setattr(longformer, "LONGFORMER_GROUP_TOKENS", 8)
    torch.manual_seed(0)
    n, options = 45, {"local": dict(window_size=8), "longformer": dict(attention_window=8)}[name]
    layer = attention.build(name, dim=DIM, heads=HEADS, dropout=0.3, **options).double().train()
    x, mask = inputs(n)

    def plain_autograd(core, chunks, x_, triples, heads, *, replay_random):
        from longattn.attention.chunked import _add_at  # the same placement of chunk outputs

        out = None
        for chunk in chunks:
            lq, lk, lv = triples[chunk.triple]
            xq = x_[:, chunk.rows] if isinstance(chunk.rows, slice) else x_.index_select(1, chunk.rows)
            xk = x_[:, chunk.keys] if isinstance(chunk.keys, slice) else x_.index_select(1, chunk.keys)
            part = core(chunk, split_heads(lq(xq), heads), split_heads(lk(xk), heads), split_heads(lv(xk), heads))
            placed = part.new_zeros(part.shape[0], n, *part.shape[1:2], part.shape[-1])
            _add_at(placed, 1, chunk.rows, part.transpose(1, 2))
            out = placed if out is None else out + placed
        return out.transpose(1, 2)

    torch.manual_seed(5)
    fast = layer(x, mask)
    module = {"local": local, "longformer": longformer}[name]
    monkeypatch.setattr(module, "chunked_projected_attention", plain_autograd)
    torch.manual_seed(5)
    slow = layer(x, mask)
    assert not torch.equal(fast, layer.eval()(x, mask))  # dropout did act
    assert_forward_backward_close(fast, slow, [x, *layer.parameters()])
