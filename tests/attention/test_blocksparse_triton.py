"""The block-sparse flash-attention kernels (attention/_blocksparse_triton.py) in Triton's interpreter
on CPU tensors: kernel vs its plain reference vs each mechanism's float64 reference, forward and
gradients, odd lengths, padding, causal, dropout; small sizes (N <= 70, tiles of 16, 1-2 heads).
The interpreter cannot multiply bfloat16 (its tl.dot on bf16 is wrong), so half precision is fp16 here."""

import pytest
import torch

from longattn import attention
from longattn.attention import force_path
from longattn.attention._triton import interpret_triton, triton_installed, use_triton
from longattn.attention.bigbird import bigbird_attention, bigbird_attention_reference, gpu_tables, random_block_indices
from longattn.attention.chunked import Band, SparsePattern
from longattn.attention.local import local_attention, local_attention_reference
from longattn.attention.longformer import longformer_attention, longformer_attention_reference
from longattn.attention.transformer_ls import long_short_attention, long_short_attention_reference
from longattn.testing import DispatchCounter, scattered_mask

pytestmark = pytest.mark.skipif(not triton_installed(), reason="triton is not installed")


@pytest.fixture
def kernels(monkeypatch):
    from longattn.attention import _blocksparse_triton

    monkeypatch.setattr(_blocksparse_triton, "TILE", 16)
    monkeypatch.setattr(_blocksparse_triton, "EXTRA_TILES_PER_PROGRAM", 2)  # several programs per extra key tile
    with interpret_triton():
        yield _blocksparse_triton


def leaves(*shape, count=3, seed=0, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(*shape, generator=g, dtype=torch.float64).to(dtype).requires_grad_() for _ in range(count)]


def kernel_pattern(name, n, mask):
    """(pattern, number of extra keys) of each kind of rule the kernels evaluate."""
    if name == "window":
        return SparsePattern(Band(1, -9, 10), key_valid=mask), 0
    if name == "dilated":
        return SparsePattern(Band(1, -6, 7, dilation=2), key_valid=mask), 0
    if name == "segments+extras":  # Transformer-LS: blocked window, extra keys every query sees
        return SparsePattern(Band(8, -4, 12), key_valid=mask), 5
    if name == "causal+extras":  # Longformer, causal: extra keys seen from their position on
        pos = torch.tensor([0, 9, 30])
        return SparsePattern(Band(1, -5, 1), causal=True, key_valid=mask, extra_pos=pos, extra_valid=mask[:, pos]), 3
    # BigBird: queries from block 1 on, window band of blocks, random block lists, extra keys
    random_idx = random_block_indices(5, 2, 2, 1, torch.Generator().manual_seed(3))
    tables = gpu_tables(random_idx, 1, torch.device("cpu"))
    return SparsePattern(Band(16, 0, 16), key_valid=mask, query_offset=16, block_size=16, blocks=tables.random,
                         blocks_by_key=tables.random_by_key), 7


@pytest.mark.parametrize("name,n", [("window", 37), ("dilated", 41), ("segments+extras", 45), ("causal+extras", 53),
                                    ("lists", 70)])
def test_kernel_matches_its_reference(kernels, name, n):
    batch, heads = (1, 2) if name == "lists" else (2, 1) if name == "window" else (1, 1)
    mask = scattered_mask(batch, 2 * n)[:, ::2] if name == "window" else scattered_mask(batch, n)  # a strided view too
    pattern, extras = kernel_pattern(name, n, mask)
    rows = 3 * 16 if name == "lists" else n  # lists: the 3 middle blocks of 16 (BigBird's)
    q = leaves(batch, heads, rows, 5, count=1, seed=1)[0]
    k = leaves(batch, heads, n, 5, count=1, seed=2)[0]
    v = leaves(batch, heads, n, 7, count=1, seed=3)[0]  # another head dim for values
    ke, ve = (leaves(batch, heads, extras, d, count=1, seed=4 + d)[0] for d in (5, 7)) if extras else (None, None)
    inputs = [t for t in (q, k, v, ke, ve) if t is not None]
    ref = kernels.blocksparse_attention_reference(q, k, v, pattern, extra_key=ke, extra_value=ve)
    as32 = [t.detach().float().requires_grad_() for t in inputs]
    out = kernels.blocksparse_attention(*as32[:3], pattern, extra_key=as32[3] if extras else None,
                                        extra_value=as32[4] if extras else None)
    out = out[:, pattern.query_offset:].transpose(1, 2)  # output row = query row + query_offset
    torch.testing.assert_close(out.double(), ref, atol=1e-5, rtol=1e-4)
    upstream = torch.randn_like(ref)
    got = torch.autograd.grad(out, as32, upstream.float())
    want = torch.autograd.grad(ref, inputs, upstream)
    for a, r in zip(got, want):
        torch.testing.assert_close(a.double(), r, atol=1e-5, rtol=1e-4)


def test_kernel_dropout_matches_its_reference_with_the_same_draws(kernels):
    """The draws depend on (batch, head, query, key) only: one-hot values read them off the kernel."""
    n, p = 29, 0.3
    mask = scattered_mask(1, n)
    pattern, extras = kernel_pattern("segments+extras", n, mask)
    q, k, v = leaves(1, 1, n, 5, dtype=torch.float32)
    ke, ve = leaves(1, 1, extras, 5, count=2, seed=1, dtype=torch.float32)
    one_hot = torch.eye(n + extras)[None, None]
    torch.manual_seed(7)
    weights = kernels.blocksparse_attention(q, k, one_hot[:, :, :n], pattern, extra_key=ke,
                                            extra_value=one_hot[:, :, n:], dropout_p=p).transpose(1, 2)
    keep = weights != 0
    torch.manual_seed(7)
    out = kernels.blocksparse_attention(q, k, v, pattern, extra_key=ke, extra_value=ve, dropout_p=p).transpose(1, 2)
    ref = kernels.blocksparse_attention_reference(q, k, v, pattern, extra_key=ke, extra_value=ve, keep=keep,
                                                  dropout_p=p)
    seen = pattern.dense_mask(1, 1, n, n, extras)
    assert 0.5 * (1 - p) < keep[seen].float().mean() < 1.5 * (1 - p) and not keep[~seen].any()
    torch.testing.assert_close(out, ref)
    upstream = torch.randn_like(out)
    for a, r in zip(torch.autograd.grad(out, (q, k, v, ke, ve), upstream),
                    torch.autograd.grad(ref, (q, k, v, ke, ve), upstream)):
        torch.testing.assert_close(a, r)


def test_kernel_in_half_precision(kernels):
    n = 45
    mask = scattered_mask(1, n)
    pattern, extras = kernel_pattern("segments+extras", n, mask)
    q, k, v, ke, ve = (leaves(1, 1, n if i < 3 else extras, 16, count=1, seed=i)[0] for i in range(5))
    ref = kernels.blocksparse_attention_reference(q, k, v, pattern, extra_key=ke, extra_value=ve)
    half = [t.detach().half().requires_grad_() for t in (q, k, v, ke, ve)]
    out = kernels.blocksparse_attention(*half[:3], pattern, extra_key=half[3], extra_value=half[4]).transpose(1, 2)
    assert out.dtype == torch.float16
    upstream = torch.randn_like(ref)
    got = torch.autograd.grad(out, half, upstream.half())
    want = torch.autograd.grad(ref, (q, k, v, ke, ve), upstream)

    def ratio(a, b):
        return ((a.double() - b).square().mean().sqrt() / b.square().mean().sqrt()).item()

    assert ratio(out, ref) < 2e-3
    assert all(ratio(a, b) < 2e-3 for a, b in zip(got, want))


def assert_kernel_path_matches(fn, reference, inputs, mask, tolerance=1e-5, **options):
    """``fn`` through the kernels in float32 equals ``reference`` in float64, output and gradients."""
    ref = reference(*inputs[:3], mask, **options)
    upstream = torch.randn_like(ref)
    want = torch.autograd.grad(ref, inputs, upstream, allow_unused=True, materialize_grads=True)
    as32 = [t.detach().float().requires_grad_() for t in inputs]
    position = {id(t): i for i, t in enumerate(inputs)}
    swapped = {key: as32[position[id(value)]] if id(value) in position else value for key, value in options.items()}
    with force_path("gpu"):
        out = fn(*as32[:3], mask, **swapped)
    torch.testing.assert_close(out.double(), ref, atol=tolerance, rtol=10 * tolerance)
    got = torch.autograd.grad(out, as32, upstream.float(), allow_unused=True, materialize_grads=True)
    for a, r in zip(got, want):
        torch.testing.assert_close(a.double(), r, atol=tolerance, rtol=10 * tolerance)


@pytest.mark.parametrize("n,options", [(53, dict(is_causal=True)), (37, dict(exact_window=False, look_backward=2))])
def test_local(kernels, n, options):
    assert_kernel_path_matches(local_attention, local_attention_reference, leaves(1, 1, n, 8), scattered_mask(1, n),
                               window_size=8, **options)


@pytest.mark.parametrize("window_blocks,random_blocks", [(1, 2), (3, 0)])
def test_bigbird(kernels, window_blocks, random_blocks):
    n = 70
    random_idx = random_block_indices(5, 2, random_blocks, window_blocks, torch.Generator().manual_seed(1))
    assert_kernel_path_matches(bigbird_attention, bigbird_attention_reference, leaves(1, 2, n, 8),
                               scattered_mask(1, n), random_idx=random_idx, block_size=16, window_blocks=window_blocks)


@pytest.mark.parametrize("n,options", [(53, dict(attention_window=6, dilation=2, global_positions=(0, 5, 40))),
                                       (45, dict(attention_window=8, global_positions=(3,), is_causal=True))])
def test_longformer(kernels, n, options):
    q, k, v, gq, gk, gv = leaves(1, 1, n, 5, count=6)
    assert_kernel_path_matches(longformer_attention, longformer_attention_reference, [q, k, v, gq, gk, gv],
                               scattered_mask(1, n), global_query=gq, global_key=gk, global_value=gv, **options)


@pytest.mark.parametrize("n,options", [(53, dict(window_size=5)), (45, dict(window_size=6, is_causal=True,
                                                                             chunk_size=4))])
def test_transformer_ls(kernels, n, options):
    q, k, v = leaves(1, 1, n, 5)
    logits = leaves(1, 1, n, 3, count=1, seed=1)[0]
    assert_kernel_path_matches(long_short_attention, long_short_attention_reference, [q, k, v, logits],
                               scattered_mask(1, n), projection_logits=logits, **options)


@pytest.mark.parametrize("name,options", [("bigbird", dict(block_size=16, random_blocks=0, window_blocks=1)),
                                          ("longformer", dict(attention_window=8, global_positions=(0, 20))),
                                          ("transformer_ls", dict(window_size=4, rank=3, causal=True, chunk_size=8))])
def test_module_kernel_path_equals_cpu_path(kernels, name, options):
    torch.manual_seed(0)
    layer = attention.build(name, dim=16, heads=2, **options)
    x = torch.randn(1, 53, 16, requires_grad=True)
    mask = scattered_mask(1, 53)
    reference = attention.build(name, dim=16, heads=2, **options).double()
    reference.load_state_dict(layer.state_dict())
    x64 = x.detach().double().requires_grad_()
    ref = reference(x64, mask)
    with force_path("gpu"):
        out = layer(x, mask)
    torch.testing.assert_close(out.double(), ref, atol=1e-5, rtol=1e-4)
    upstream = torch.randn_like(ref)
    got = torch.autograd.grad(out, [x, *layer.parameters()], upstream.float())
    want = torch.autograd.grad(ref, [x64, *reference.parameters()], upstream)
    for a, r in zip(got, want):
        torch.testing.assert_close(a.double(), r, atol=1e-5, rtol=1e-4)


def test_op_count_around_the_kernels_does_not_grow_with_length_or_batch(kernels):
    def count(n, batch):
        q, k, v = leaves(batch, 1, n, 4, dtype=torch.float32)
        with force_path("gpu"), DispatchCounter() as ops:
            local_attention(q, k, v, torch.ones(batch, n, dtype=torch.bool), window_size=8).sum().backward()
        return ops.total

    assert count(16, 1) == count(48, 1) == count(16, 2)


def test_use_triton_false_runs_the_pytorch_path(kernels, monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("the kernel ran")

    monkeypatch.setattr(kernels, "blocksparse_attention", refuse)
    q, k, v = leaves(1, 1, 20, 4, dtype=torch.float32)
    with force_path("gpu"):
        with pytest.raises(AssertionError, match="the kernel ran"):
            local_attention(q, k, v, window_size=4)
        with use_triton(False):
            local_attention(q, k, v, window_size=4)
