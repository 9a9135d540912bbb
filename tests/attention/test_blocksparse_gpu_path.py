"""The GPU path of local, BigBird, Longformer and Transformer-LS (all blocks at once), forced on CPU
tensors with force_path("gpu"): without Triton's interpreter the kernels do not run, so this is the
batched PyTorch path (chunked.windowed_attention, BigBird's one gather). Against the float64
references, forward and gradients, odd lengths, scattered padding, causal; autocast; the ops one
forward+backward dispatches (the same at N = 1k and 64k, batch 2 and 64); no N x N tensor and no
[B, H, N, window] score buffer kept for backward. The Triton kernels: test_blocksparse_triton.py."""

import pytest
import torch

from longattn import attention
from longattn.attention import force_path
from longattn.attention.bigbird import bigbird_attention, bigbird_attention_reference, random_block_indices
from longattn.attention.local import local_attention, local_attention_reference
from longattn.attention.longformer import longformer_attention, longformer_attention_reference
from longattn.attention.transformer_ls import long_short_attention, long_short_attention_reference
from longattn.testing import DispatchCounter, LargestTensorRecorder, scattered_mask

DIM, HEADS = 16, 2


def leaves(*shape, count=3, seed=0, scale=1.0):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(*shape, generator=g, dtype=torch.float64) * scale).requires_grad_() for _ in range(count)]


def assert_gpu_path_matches(fn, reference, inputs, mask, **options):
    """``fn`` on the GPU path equals ``reference``, output and the gradients of ``inputs``."""
    with force_path("gpu"):
        out = fn(*inputs[:3], mask, **options)
    ref = reference(*inputs[:3], mask, **options)
    torch.testing.assert_close(out, ref)
    upstream = torch.randn_like(ref)
    got = torch.autograd.grad(out, inputs, upstream, allow_unused=True, materialize_grads=True)
    want = torch.autograd.grad(ref, inputs, upstream, allow_unused=True, materialize_grads=True)
    for a, r in zip(got, want):
        assert a.isfinite().all()
        torch.testing.assert_close(a, r)


@pytest.mark.parametrize("exact", [True, False])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("n", [1, 37, 101])
def test_local(exact, causal, n):
    assert_gpu_path_matches(local_attention, local_attention_reference, leaves(2, HEADS, n, 8),
                            scattered_mask(2, n), window_size=16, exact_window=exact, is_causal=causal)


def test_local_look_backward_two_blocks_and_no_look_forward():
    assert_gpu_path_matches(local_attention, local_attention_reference, leaves(2, HEADS, 53, 8), scattered_mask(2, 53),
                            window_size=8, look_backward=2, look_forward=0)


@pytest.mark.parametrize("n,block,random_blocks", [(97, 16, 2), (161, 16, 3), (150, 8, 2), (150, 24, 1)])
def test_bigbird(n, block, random_blocks):
    nb = -(-n // block)
    random_idx = random_block_indices(nb, HEADS, random_blocks, 3, torch.Generator().manual_seed(n))
    assert_gpu_path_matches(bigbird_attention, bigbird_attention_reference, leaves(2, HEADS, n, 8),
                            scattered_mask(2, n), random_idx=random_idx, block_size=block)


@pytest.mark.parametrize("n", [1, 7, 53])
@pytest.mark.parametrize("window,dilation", [(4, 1), (6, 2)])
@pytest.mark.parametrize("globals_", [(), (0, 5, 40)])
@pytest.mark.parametrize("causal", [False, True])
def test_longformer(n, window, dilation, globals_, causal):
    q, k, v, gq, gk, gv = leaves(2, 3, n, 5, count=6)
    assert_gpu_path_matches(longformer_attention, longformer_attention_reference, [q, k, v, gq, gk, gv],
                            scattered_mask(2, n), attention_window=window, dilation=dilation, global_positions=globals_,
                            global_query=gq, global_key=gk, global_value=gv, is_causal=causal)


@pytest.mark.parametrize("n", [1, 13, 259])
@pytest.mark.parametrize("window", [1, 5, 6])
@pytest.mark.parametrize("causal_chunk", [None, 4])
def test_transformer_ls(n, window, causal_chunk):
    q, k, v = leaves(2, 3, n, 5)
    logits = leaves(2, 3, n, 2, count=1, seed=1, scale=3.0)[0]
    torch.manual_seed(1)
    norms = [torch.nn.LayerNorm(5).double() for _ in range(2)]
    with torch.no_grad():  # non-trivial affine parameters so the two norms really differ
        for norm in norms:
            norm.weight.normal_()
            norm.bias.normal_()
    options = dict(projection_logits=logits, window_size=window, short_norm=norms[0], long_norm=norms[1])
    if causal_chunk:
        options.update(is_causal=True, chunk_size=causal_chunk)
    assert_gpu_path_matches(long_short_attention, long_short_attention_reference,
                            [q, k, v, logits, *norms[0].parameters(), *norms[1].parameters()],
                            scattered_mask(2, n), **options)


MODULES = [
    ("local", dict(window_size=8)),
    ("local", dict(window_size=8, causal=True, look_backward=2)),
    ("bigbird", dict(block_size=16, random_blocks=2)),
    ("longformer", dict(attention_window=8, global_positions=(0, 30), bias=False)),
    ("longformer", dict(attention_window=6, dilation=2, causal=True, separate_global_projections=False)),
    ("transformer_ls", dict(window_size=4, rank=6)),
    ("transformer_ls", dict(window_size=3, rank=5, dual_ln=False, bias=False)),
    ("transformer_ls", dict(window_size=4, causal=True, chunk_size=8, chunk_rank=2)),
]


@pytest.mark.parametrize("name,options", MODULES)
def test_module_gpu_path_equals_cpu_path(name, options):
    torch.manual_seed(0)
    layer = attention.build(name, dim=DIM, heads=HEADS, **options).double()
    x = leaves(2, 173, DIM, count=1)[0]
    mask = scattered_mask(2, 173)
    with force_path("gpu"):
        out = layer(x, mask)
    ref = layer(x, mask)
    torch.testing.assert_close(out, ref)
    upstream = torch.randn_like(ref)
    wrt = [x, *layer.parameters()]
    for a, r in zip(torch.autograd.grad(out, wrt, upstream), torch.autograd.grad(ref, wrt, upstream)):
        torch.testing.assert_close(a, r)


def test_rows_that_see_no_key_are_zeros_with_finite_gradients():
    n = 161
    random_idx = random_block_indices(11, HEADS, 2, 3, torch.Generator().manual_seed(1))
    mask = torch.zeros(2, n, dtype=torch.bool)
    mask[0, 80:96] = True  # only block 5 is real: most middle blocks see nothing, batch 1 sees nothing at all
    q, k, v = leaves(2, HEADS, n, 8)
    core, core_reference = bigbird_attention.__wrapped__, bigbird_attention_reference.__wrapped__  # no padding_safe
    options = dict(random_idx=random_idx, block_size=16)
    assert_gpu_path_matches(core, core_reference, [q, k, v], mask, **options)
    with force_path("gpu"):
        blind = core(q, k, v, mask, **options).abs().sum(-1) == 0
    assert blind[1].all() and 0 < blind[0].sum() < n
    mask = torch.ones(2, 61, dtype=torch.bool)
    mask[0, :40] = False  # a padded run longer than the window, the global token padded too
    assert_gpu_path_matches(longformer_attention.__wrapped__, longformer_attention_reference.__wrapped__,
                            leaves(2, 3, 61, 5), mask, attention_window=6, global_positions=(0, 23))


@pytest.mark.parametrize("name,options", [("local", dict(window_size=8, dropout=0.5)),
                                          ("longformer", dict(attention_window=8, dropout=0.5)),
                                          ("transformer_ls", dict(window_size=4, rank=4, dropout=0.5))])
def test_dropout_averages_to_the_output_without_it(name, options):
    torch.manual_seed(0)
    layer = attention.build(name, dim=DIM, heads=HEADS, **options).double()
    x = leaves(1, 40, DIM, count=1)[0]
    with force_path("gpu"):
        expected = layer.eval()(x)
        layer.train()
        draws = torch.stack([layer(x) for _ in range(100)])
        draws[0].square().sum().backward()
    assert not torch.allclose(draws[0], draws[1])
    assert x.grad.isfinite().all()
    # each output is a mean of weights / (1 - p) masks: 100 draws average to within several percent
    error = (draws.mean(0) - expected).abs().mean() / expected.abs().mean()
    assert error < 0.1, error


# The stated accuracy under autocast: RMS(error) / RMS(float64 reference), output and input gradient.
AUTOCAST_RATIO = {torch.bfloat16: 1e-2, torch.float16: 2e-3}


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("name,options", MODULES)
def test_autocast_output_dtype_and_accuracy(name, options, dtype):
    torch.manual_seed(0)
    layer = attention.build(name, dim=64, heads=4, **options)
    reference = attention.build(name, dim=64, heads=4, **options).double()
    reference.load_state_dict(layer.state_dict())
    x = torch.randn(2, 150, 64, requires_grad=True)
    mask = scattered_mask(2, 150)
    x64 = x.detach().double().requires_grad_()
    ref = reference(x64, mask)
    upstream = torch.randn_like(ref)
    ref.backward(upstream)
    with force_path("gpu"), torch.autocast("cpu", dtype=dtype):
        out = layer(x, mask)
    out.backward(upstream.to(out.dtype))
    assert out.dtype == dtype

    def ratio(a, b):
        return ((a.double() - b).square().mean().sqrt() / b.square().mean().sqrt()).item()

    assert ratio(out, ref) < AUTOCAST_RATIO[dtype]
    assert ratio(x.grad, x64.grad) < AUTOCAST_RATIO[dtype]


OP_COUNT_CASES = [
    ("local", dict()), ("local", dict(causal=True)), ("bigbird", dict()), ("longformer", dict()),
    ("longformer", dict(causal=True, global_positions=(0, 100))), ("transformer_ls", dict()),
    ("transformer_ls", dict(causal=True)),
]


def ops_of_one_step(name, options, n, batch, masked, warm):
    torch.manual_seed(0)
    layer = attention.build(name, dim=64, heads=2, **options).to("meta")
    x = torch.randn(batch, n, 64, device="meta", requires_grad=True)
    mask = torch.ones(batch, n, dtype=torch.bool, device="meta") if masked else None
    with force_path("gpu"):
        if warm:
            layer(x, mask)
        with DispatchCounter() as ops:
            layer(x, mask).sum().backward()
    return ops.total


@pytest.mark.parametrize("masked", [False, True])
@pytest.mark.parametrize("name,options", OP_COUNT_CASES)
def test_op_count_does_not_grow_with_length_or_batch(name, options, masked):
    # a fresh layer, and for BigBird (which builds its pattern's tables on its first call for a length) a warm one
    for warm in (False, True) if name == "bigbird" else (False,):
        counts = {(n, batch): ops_of_one_step(name, options, n, batch, masked, warm)
                  for n, batch in [(1024, 2), (65536, 2), (1024, 64)]}
        assert len(set(counts.values())) == 1, counts


# causal Transformer-LS sees N r / l projected tokens per query (the paper's autoregressive form), not linear
@pytest.mark.parametrize("name,options", OP_COUNT_CASES[:-1])
def test_no_quadratic_intermediate_forward_or_backward(name, options):
    def largest(n):
        torch.manual_seed(0)
        layer = attention.build(name, dim=32, heads=1, **options)
        x = torch.randn(1, n, 32, requires_grad=True)
        mask = torch.ones(1, n, dtype=torch.bool)
        mask[0, -5:] = False
        with force_path("gpu"), LargestTensorRecorder() as rec:
            layer(x, mask).sum().backward()
        return rec

    big, small = largest(4096), largest(2048)
    assert big.max_numel <= 4096 * 4096 // 4, (big.max_shape, big.max_op)
    assert big.max_numel <= 2.5 * small.max_numel, (big.max_shape, small.max_shape)


@pytest.mark.parametrize("name,options,keys", [
    ("local", dict(window_size=64), 129), ("bigbird", dict(block_size=32, random_blocks=1), 6 * 32),
    ("longformer", dict(attention_window=128), 129), ("transformer_ls", dict(window_size=32, rank=16), 80)])
def test_no_score_buffer_is_kept_for_backward(name, options, keys):
    """Nothing the size of [B, H, N, keys per query] in floats is saved for backward (8 heads of 4
    dims: such a buffer would be far larger than q, k or v, their window copies, or SDPA's float
    form of the boolean mask, which is [B, 1, N, keys] shared by the heads)."""
    b, n, heads = 2, 1024, 8
    torch.manual_seed(0)
    layer = attention.build(name, dim=32, heads=heads, **options)
    x = torch.randn(b, n, 32, requires_grad=True)
    saved = []

    def pack(t):
        if t.is_floating_point():
            saved.append((t.numel(), tuple(t.shape)))
        return t

    with force_path("gpu"), torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        layer(x, scattered_mask(b, n)).sum().backward()
    assert max(saved)[0] < b * heads * n * keys / 2, max(saved)
