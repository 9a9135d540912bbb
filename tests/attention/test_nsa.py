"""NSA: the chunked and GPU paths against the float64 reference (every branch, learned compressors and gates), fla's
naive references for the compressed branch, the top-n selection and the selected branch, the selection as data
(keys outside it have no effect and no gradient), decoding, packing and bf16 autocast training."""

import pytest
import torch
from module_checks import assert_decoding_equals_forward, assert_no_quadratic_intermediate, bf16_autocast_losses
from selection_checks import DIM, HEADS, assert_packed_equals_padded

from longattn import attention
from longattn.attention import AttentionError
from longattn.attention.nsa import (BRANCHES, BlockCompressor, NsaOptions, block_importance, nsa_attention,
                                    nsa_attention_reference)
from longattn.attention.ops import block_select
from longattn.testing import assert_forward_backward_close, random_qkv

SMALL = dict(compress_block=8, compress_stride=4, select_block=8, select_count=3, window=6, local_blocks=1)


def trained_compressor(block, d, seed):
    torch.manual_seed(seed)
    compressor = BlockCompressor(block, d).double()
    with torch.no_grad():
        for p in compressor.parameters():
            p.add_(torch.randn_like(p) * 0.2)
    return compressor


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("n, masked", [(1, True), (37, False), (53, True)])
def test_fast_paths_equal_the_float64_reference(path, causal, n, masked, monkeypatch):
    monkeypatch.setattr(block_select, "CHUNK_SCORES", 16 * 48)  # chunks of 16 queries, recomputed in backward
    q, k, v = random_qkv(2, 4, n, 8)
    gates = torch.rand(2, 4, n, 3, dtype=torch.float64, generator=torch.Generator().manual_seed(2)).requires_grad_()
    mask = (torch.rand(2, n, generator=torch.Generator().manual_seed(1)) > 0.3) if masked else None
    compressors = trained_compressor(8, 8, 0), trained_compressor(8, 8, 1)
    options = dict(SMALL, select_block=16, selection_group=2, is_causal=causal, gates=gates,
                   key_compressor=compressors[0], value_compressor=compressors[1])
    leaves = [q, k, v, gates, *compressors[0].parameters(), *compressors[1].parameters()]
    assert_forward_backward_close(nsa_attention(q, k, v, mask, **options),
                                  nsa_attention_reference(q, k, v, mask, **options), leaves)


@pytest.mark.parametrize("branches", [("compressed",), ("selected",), ("window",), ("selected", "window")])
def test_each_branch_alone_equals_the_reference(branches):
    q, k, v = random_qkv(2, 4, 29, 8)
    options = dict(SMALL, branches=branches, is_causal=True)
    torch.testing.assert_close(nsa_attention(q, k, v, **options), nsa_attention_reference(q, k, v, **options))


def fla_layout(t):
    return t.detach().transpose(1, 2)  # [B, H, T, D] -> fla's [B, T, H, D]


def test_branches_equal_fla_naive_references():
    """fla's naive compression, top-n and selection (float32 inside, hence the tolerance): mean pooling with the
    stride equal to the block, blocks of one size for compression and selection, block 0 and the query's own
    and previous blocks forced, the heads of a GQA group sharing the selection (fla averages their
    probabilities, NSA's eq. 10 sums them: the same ranking)."""
    naive = pytest.importorskip("fla.ops.nsa.naive", reason="peer package fla-core not installed")
    b, kv_heads, group, n, d, block, count = 1, 2, 2, 45, 8, 8, 3
    g = torch.Generator().manual_seed(0)
    q = torch.randn(b, kv_heads * group, n, d, dtype=torch.float64, generator=g)
    k, v = (torch.randn(b, kv_heads, n, d, dtype=torch.float64, generator=g) for _ in range(2))
    k_heads, v_heads = (t.repeat_interleave(group, 1) for t in (k, v))  # each query head its group's keys
    options = dict(compress_block=block, compress_stride=block, select_block=block, select_count=count,
                   initial_blocks=1, local_blocks=2, selection_group=group, is_causal=True, scale=d ** -0.5)
    blocks = -(-n // block)
    pooled = [torch.stack([t[:, :, i * block:(i + 1) * block].mean(2) for i in range(blocks)], 2) for t in (k, v)]
    theirs_cmp, _ = naive.naive_nsa_compression(fla_layout(q), fla_layout(pooled[0]), fla_layout(pooled[1]),
                                                block_size=block, scale=d ** -0.5)
    ours_cmp = nsa_attention(q, k_heads, v_heads, branches=("compressed",), **options)
    torch.testing.assert_close(ours_cmp, theirs_cmp.transpose(1, 2).double(), atol=1e-5, rtol=1e-5)
    indices = naive.naive_nsa_topk(fla_layout(q).float(), fla_layout(pooled[0]).float(), count, block, d ** -0.5)
    theirs_slc = naive.naive_nsa_selection(fla_layout(q), fla_layout(k), fla_layout(v), indices, block_size=block)
    ours_slc = nsa_attention(q, k_heads, v_heads, branches=("selected",), **options)
    torch.testing.assert_close(ours_slc, theirs_slc.transpose(1, 2).double(), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("causal", [False, True])
def test_keys_outside_the_selection_have_no_effect_and_no_gradient(causal):
    """With the selected branch alone, a query's output reads the keys of its n blocks only: the others' values
    do not change it and their keys and values get no gradient (the compressed scores that chose the blocks
    are a discrete choice)."""
    n, t = 64, 45
    q, k, v = random_qkv(1, 1, n, 8)
    options = dict(SMALL, select_count=3, branches=("selected",), is_causal=causal)
    out = nsa_attention(q, k, v, **options)
    grads = torch.autograd.grad(out[0, 0, t].sum(), (k, v))
    read = (grads[1][0, 0].abs().sum(-1) > 0)
    blocks_read = {i // 8 for i in range(n) if read[i]}
    assert len(blocks_read) == 3  # the selection: 3 blocks of 8 keys
    outside = torch.tensor([i // 8 not in blocks_read for i in range(n)])
    assert outside.sum() == n - 24 and torch.all(grads[0][0, 0, outside] == 0)
    changed = v.detach().clone()
    changed[0, 0, outside] = torch.randn(int(outside.sum()), 8, dtype=torch.float64) * 100
    torch.testing.assert_close(nsa_attention(q, k, changed, **options)[0, 0, t], out[0, 0, t])


def test_no_quadratic_intermediate_in_the_causal_form():
    assert_no_quadratic_intermediate("nsa")


@pytest.mark.parametrize("causal", [False, True])
def test_packed_sequences_equal_the_padded_batch(causal):
    torch.manual_seed(0)
    assert_packed_equals_padded(attention.build("nsa", dim=DIM, heads=HEADS, causal=causal, **SMALL).double(),
                                [21, 6, 14])


@pytest.mark.parametrize("options", [dict(SMALL, compressor="mean", gated=False),
                                     dict(SMALL, compress_block=6, compress_stride=3, select_block=4, select_count=4,
                                          initial_blocks=0, local_blocks=2, branches=("compressed", "selected"))])
def test_decoding_equals_the_causal_forward(options):
    torch.manual_seed(0)
    layer = attention.build("nsa", dim=DIM, heads=HEADS, causal=True, **options).double().eval()
    with torch.no_grad():
        for p in layer.parameters():
            p.add_(torch.randn_like(p) * 0.3)
    state = assert_decoding_equals_forward(layer, n=30, prompt=7)
    block, stride = options["compress_block"], options["compress_stride"]
    assert state.summaries[0].shape[2] == (30 - block) // stride + 1  # the completed compression blocks


def test_bf16_autocast_trains():
    torch.manual_seed(0)
    layer = attention.build("nsa", dim=DIM, heads=HEADS, causal=True, **SMALL)
    losses = bf16_autocast_losses(layer)
    assert losses[-1] < losses[0]
    assert layer.key_compressor.position.grad.abs().sum() > 0 and layer.gate.weight.grad.abs().sum() > 0


def test_the_compressor_starts_as_the_mean():
    compressor = BlockCompressor(4, 8).double()
    blocks = torch.randn(2, 3, 5, 4, 8, dtype=torch.float64)
    torch.testing.assert_close(compressor(blocks, torch.ones(2, 5, 4, dtype=torch.bool)), blocks.mean(3))


@pytest.mark.parametrize("bad, match", [
    (dict(compress_stride=64), "compress_stride"), (dict(select_count=2), "initial_blocks"),
    (dict(window=0), "window"), (dict(branches=("dense",)), "branches"), (dict(compressor="max"), "compressor"),
    (dict(selection_group=3), "selection_group")])
def test_bad_options_raise_clear_errors(bad, match):
    with pytest.raises(AttentionError, match=match):
        attention.build("nsa", dim=DIM, heads=HEADS, **bad)


def test_bad_gates_raise_a_clear_error():
    q, k, v = random_qkv(2, 4, 8, 8)
    with pytest.raises(AttentionError, match="gates"):
        nsa_attention(q, k, v, gates=torch.ones(2, 4, 8, 2, dtype=torch.float64))


@pytest.mark.parametrize("block, stride, select", [(8, 4, 8), (32, 16, 64), (6, 3, 4), (5, 2, 3), (4, 4, 1)])
def test_block_importance_sums_the_overlapping_compression_blocks(block, stride, select):
    """Eq. 9 by its windows (a strided view where l' is a multiple of d, gathers otherwise) against the sum over
    every compression block i whose positions [i d, i d + l) meet selection block j's [j l', (j + 1) l')."""
    options = NsaOptions(block, stride, select, 1, 1, 0, 0, 1, BRANCHES, True, 1.0)
    for compressed, selection in ((13, 9), (3, 9), (40, 2)):
        probs = torch.rand(2, 3, 4, compressed, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
        expected = torch.zeros(2, 3, 4, selection, dtype=torch.float64)
        for j in range(selection):
            for i in range(compressed):
                if i * stride < (j + 1) * select and j * select < i * stride + block:
                    expected[..., j] += probs[..., i]
        torch.testing.assert_close(block_importance(probs, options, selection), expected)
