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
