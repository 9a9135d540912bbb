"""Skeleton attention's GPU path (PyTorch form), run on CPU tensors with force_path("gpu"): the same numbers as
the float64 reference and as the CPU paths, autocast-native, a fixed number of operations, no n x n tensor."""

import copy
import math

import pytest
import torch

from longattn import attention
from longattn.attention import force_path
from longattn.attention.base import full_float32
from longattn.attention.skeleton import skeleton_attention, skeleton_attention_reference
from longattn.attention.smoother import Smoother
from longattn.testing import DispatchCounter, LargestTensorRecorder, scattered_mask

DIM, HEADS, MAX_LEN = 32, 2, 50

ABLATIONS = [
    {},
    {"row_attention": False},
    {"column_attention": False},
    {"bias": False},
    {"mask_padded_samples": False},
    {"column_scale": "valid"},
    {"column_scale": 2.5, "row_scale": 0.3},
    {"smoother": False},
    {"fourier_conv": False},
    {"conv_stem": False},
    {"smoother_segment_average": False, "smoother_kernel_size": 1, "smoother_activation": "elu"},
    {"smoother_batchnorm_over": "features", "smoother_activation": "gelu", "smoother_kernel_size": 5},
]


def build(seed=5, **options):
    torch.manual_seed(seed)
    layer = attention.build("skeleton", dim=DIM, heads=HEADS, max_len=MAX_LEN, s1=12, **options).double()
    if layer.smoother is not None and hasattr(layer.smoother, "stem_norm"):
        with torch.no_grad():  # away from the identity, so that their gradients are exercised
            layer.smoother.stem_norm.weight.uniform_(0.5, 1.5)
            layer.smoother.stem_norm.bias.uniform_(-0.5, 0.5)
    return layer


def padded_input(batch=3, length=45, seed=0):
    """x [B, N, DIM] float64 with scattered padding holding NaN."""
    x = torch.randn(batch, length, DIM, dtype=torch.float64, generator=torch.Generator().manual_seed(seed))
    mask = scattered_mask(batch, length, seed=seed + 1)
    x[~mask] = float("nan")
    return x.requires_grad_(), mask


def reference_layer(layer, x, mask):
    """The layer from its parts: the Smoother's module-by-module path, full Q/K/V projections, the dense
    formulas of skeleton_attention_reference (explicit P1, P2), the output projection."""
    smoothed = x.masked_fill(~mask[..., None], 0)
    if layer.smoother is not None:
        layer.smoother.fused = False
        smoothed = layer.smoother(smoothed, mask)
    q, k, v = layer.proj.qkv(smoothed)
    if layer.column_scale == "valid":
        column_scale = mask.sum(-1).to(x.dtype).rsqrt()
    else:
        column_scale = 1 / math.sqrt(MAX_LEN) if layer.column_scale == "max_len" else layer.column_scale
    norms = {name: None if getattr(layer, name) is None else (getattr(layer, name).weight, getattr(layer, name).bias)
             for name in ("row_norm", "column_norm")}
    core = skeleton_attention_reference(
        q, k, v, mask, row_indices=layer.row_indices, column_indices=layer.column_indices, row_scale=layer.row_scale,
        column_scale=column_scale, mask_padded_samples=layer.mask_padded_samples, row_attention=layer.row_attention,
        column_attention=layer.column_attention, **norms)
    return layer.proj.out(core).masked_fill(~mask[..., None], 0)


def gradients(out, layer, x, upstream):
    return torch.autograd.grad(out, [x, *layer.parameters()], upstream, allow_unused=True)


def assert_same(grads, expected, names):
    for name, got, want in zip(names, grads, expected):
        want = torch.zeros_like(got) if want is None else want
        torch.testing.assert_close(got, want, msg=lambda m: f"{name}: {m}")


@pytest.mark.parametrize("training", [True, False])
@pytest.mark.parametrize("options", ABLATIONS, ids=lambda o: ",".join(f"{k}={v}" for k, v in o.items()) or "paper")
def test_gpu_path_matches_the_float64_reference(options, training):
    """Forced GPU path against the dense float64 reference: output and the gradients of the input and every
    parameter, odd length (45 of max_len 50), scattered padding holding NaN, every ablation and option; in
    training (batch statistics) and eval (running statistics). Dropout off here (see the next test)."""
    layer = build(dropout=0.0, smoother_dropout=0.0, **options).train(training)
    if not training and layer.smoother is not None and hasattr(layer.smoother, "stem_norm"):
        with torch.no_grad():
            layer.smoother.stem_norm.running_mean.uniform_(-0.2, 0.2)
            layer.smoother.stem_norm.running_var.uniform_(0.5, 1.5)
    reference = copy.deepcopy(layer)
    x, mask = padded_input()
    with force_path("gpu"):
        out = layer(x, mask)
    expected = reference_layer(reference, x, mask)
    torch.testing.assert_close(out, expected)
    upstream = torch.randn_like(out)
    names = ["x"] + [n for n, _ in layer.named_parameters()]
    assert_same(gradients(out, layer, x, upstream), gradients(expected, reference, x, upstream), names)
    if training and layer.smoother is not None and hasattr(layer.smoother, "stem_norm"):
        for name in ("running_mean", "running_var"):  # the BatchNorm's running statistics move the same way
            torch.testing.assert_close(getattr(layer.smoother.stem_norm, name),
                                       getattr(reference.smoother.stem_norm, name))


@pytest.mark.parametrize("options", [{}, {"mask_padded_samples": False, "column_scale": "valid"},
                                     {"resample_each_step": True}, {"smoother_activation": "elu"}])
def test_gpu_path_with_dropout_equals_the_cpu_paths(options):
    """Every dropout on: the GPU path draws its masks as whole tensors in the CPU paths' order, so with the same
    seed it gives the CPU paths' numbers (float64: tiled core + fused stem, and module by module)."""
    x, mask = padded_input(batch=2, length=47)
    upstream = torch.randn(2, 47, DIM, dtype=torch.float64)
    results = []
    for path, fused in (("gpu", True), ("cpu", True), ("cpu", False)):
        layer = build(dropout=0.2, smoother_dropout=0.3, **options).train()
        layer.fused = layer.smoother.fused = fused
        torch.manual_seed(11)
        with force_path(path):
            out = layer(x, mask)
        results.append((out, gradients(out, layer, x, upstream), layer.row_indices.clone()))
    names = ["x"] + [n for n, _ in layer.named_parameters()]
    (out, grads, rows), *others = results
    for other_out, other_grads, other_rows in others:
        assert torch.equal(rows, other_rows)
        torch.testing.assert_close(out, other_out)
        assert_same(grads, other_grads, names)


def test_gpu_path_short_sequence_equals_the_same_sequence_padded_to_max_len():
    layer = build(dropout=0.0, smoother_dropout=0.0).eval()
    x = torch.randn(2, 37, DIM, dtype=torch.float64)
    mask = torch.zeros(2, MAX_LEN, dtype=torch.bool)
    mask[:, :37] = True
    with force_path("gpu"):
        torch.testing.assert_close(layer(x), layer(torch.nn.functional.pad(x, (0, 0, 0, MAX_LEN - 37)), mask)[:, :37])


@pytest.mark.parametrize("branches", [{}, {"row_attention": False}, {"column_attention": False}])
def test_functional_form_on_the_gpu_path(branches):
    """skeleton_attention on [B, H, N, Dh] through the GPU core: the dense formulas, forward and gradients."""
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(2, 3, 19, 8, dtype=torch.float64, generator=g).requires_grad_() for _ in range(3))
    mask = scattered_mask(2, 19)
    options = dict(row_indices=torch.tensor([0, 3, 5, 18, 23]), column_indices=torch.tensor([1, 2, 6]),
                   row_norm=(1 + 0.3 * torch.randn(24, dtype=torch.float64), 0.3 * torch.randn(24, dtype=torch.float64)),
                   column_norm=(torch.ones(24, dtype=torch.float64), torch.zeros(24, dtype=torch.float64)), **branches)
    with force_path("gpu"):
        out = skeleton_attention(q, k, v, mask, **options)
    ref = skeleton_attention_reference(q, k, v, mask, **options)
    torch.testing.assert_close(out, ref)
    upstream = torch.randn_like(out)
    for got, want in zip(torch.autograd.grad(out, (q, k, v), upstream), torch.autograd.grad(ref, (q, k, v), upstream)):
        torch.testing.assert_close(got, want)


def rms_ratio(got, want):
    return ((got.double() - want).square().mean().sqrt() / want.square().mean().sqrt()).item()


# RMS(error) / RMS(float64 result) allowed under autocast (bfloat16 keeps 8 bits, float16 11): output, gradients,
# and the gradients of the position-wise BatchNorm's affine parameters. Measured here: bfloat16 4.9e-3, 4.8e-2,
# 7.3e-2; float16 6.4e-4, 9.2e-3, 1.5e-2 (the module-by-module CPU path under the same autocast: 5.1e-3, 4.7e-2,
# 7.1e-2 and, its output and the gradient it receives staying float32, 6.8e-4, 2.6e-3, 1.4e-3). The Smoother's
# gradients carry the rounding of the half-precision gradient the layer receives through a BatchNorm backward
# that subtracts per-position means of it: where a position's conv outputs vary little, that cancels.
AUTOCAST_RATIOS = {torch.bfloat16: (1e-2, 8e-2, 1.5e-1), torch.float16: (2e-3, 2.5e-2, 5e-2)}


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_gpu_path_under_autocast_returns_the_autocast_dtype_within_the_stated_ratio(dtype):
    torch.manual_seed(3)
    layer = attention.build("skeleton", dim=64, heads=4, max_len=200, dropout=0.0, smoother_dropout=0.0, s1=16).train()
    x = torch.randn(2, 181, 64)
    mask = scattered_mask(2, 181, pad_fraction=0.2)
    reference = copy.deepcopy(layer).double()
    x64 = x.double().requires_grad_()
    expected = reference(x64, mask)
    upstream = torch.randn_like(expected)
    expected_grads = gradients(expected, reference, x64, upstream)
    x32 = x.clone().requires_grad_()
    with force_path("gpu"), torch.autocast("cpu", dtype=dtype):
        out = layer(x32, mask)
        grads = gradients(out, layer, x32, upstream.to(dtype))
    assert out.dtype == dtype
    output_ratio, gradient_ratio, batchnorm_ratio = AUTOCAST_RATIOS[dtype]
    assert rms_ratio(out, expected) < output_ratio
    names = ["x"] + [n for n, _ in layer.named_parameters()]
    for name, got, want in zip(names, grads, expected_grads):
        assert rms_ratio(got, want) < (batchnorm_ratio if "stem_norm" in name else gradient_ratio), name


def test_gpu_path_in_float32_without_autocast_is_float32_exact():
    torch.manual_seed(4)
    layer = attention.build("skeleton", dim=32, heads=2, max_len=64, dropout=0.0, smoother_dropout=0.0).train()
    x = torch.randn(2, 61, 32)
    mask = scattered_mask(2, 61)
    reference = copy.deepcopy(layer).double()
    with force_path("gpu"):
        out = layer(x, mask)
    assert out.dtype == torch.float32
    assert rms_ratio(out, reference(x.double(), mask)) < 1e-6


def test_reduced_precision_option_on_the_gpu_path_returns_float32_close_to_full_precision():
    torch.manual_seed(6)
    full = attention.build("skeleton", dim=64, heads=2, max_len=128, dropout=0.0, smoother_dropout=0.0).train()
    reduced = attention.build("skeleton", dim=64, heads=2, max_len=128, dropout=0.0, smoother_dropout=0.0,
                              precision="bf16").train()
    reduced.load_state_dict(full.state_dict())
    x = torch.randn(2, 128, 64)
    with force_path("gpu"):
        out_full, out_reduced = full(x), reduced(x)
    assert out_reduced.dtype == torch.float32
    assert 0 < rms_ratio(out_reduced, out_full.double()) < 2e-2


def meta_layer_run(length, batch, training=True, **options):
    """One forward+backward of the GPU path on meta tensors (shapes only), counted and size-recorded."""
    with torch.device("meta"):
        layer = attention.build("skeleton", dim=512, heads=8, max_len=length, **options).train(training)
    x = torch.randn(batch, length, 512, device="meta", requires_grad=True)
    mask = torch.ones(batch, length, dtype=torch.bool, device="meta")
    with force_path("gpu"), DispatchCounter() as ops, LargestTensorRecorder() as sizes:
        layer(x, mask).sum().backward()
    return ops, sizes


@pytest.mark.parametrize("options", [{}, {"row_attention": False}, {"smoother": False}])
def test_gpu_path_op_count_does_not_grow_with_length_or_batch(options):
    """The operations one forward+backward dispatches (each at least one kernel launch on a GPU) are the same at
    N = 1k and 64k, batch 2 and 64: no loop over tokens, tiles, batch or heads. On meta tensors, where any host
    synchronisation (``bool(mask.all())``, ``.item()``) would raise: the GPU path has none."""
    counts = {(length, batch): meta_layer_run(length, batch, **options)[0].counts
              for length, batch in ((1024, 2), (65536, 2), (1024, 64))}
    assert len({tuple(sorted(c.items())) for c in counts.values()}) == 1, counts
    assert sum(counts[1024, 2].values()) < 600


def test_gpu_path_has_no_n_by_n_tensor_forward_or_backward():
    n = 16384  # the largest tensors hold a few dim = 512 entries per token
    _, sizes = meta_layer_run(n, 1)
    assert sizes.max_numel < n * n / 8, (sizes.max_shape, sizes.max_op)


def test_smoother_gpu_path_matches_its_module_path_with_dropout_and_padding():
    """The Smoother alone (it is also used by the LRA encoder and the forecaster): the GPU path draws the CPU
    paths' dropout, masks NaN padding, and updates the running statistics the same way."""
    for options in ({}, {"batchnorm_over": "features", "kernel_size": 1, "activation": "elu"}):
        torch.manual_seed(2)
        plain = Smoother(16, 23, dropout=0.3, **options).double().train()
        plain.fused = False
        gpu = copy.deepcopy(plain)
        x = torch.randn(3, 21, 16, dtype=torch.float64, requires_grad=True)
        mask = scattered_mask(3, 21)
        x.data[~mask] = float("nan")
        outs = []
        for layer, path in ((plain, "cpu"), (gpu, "gpu")):
            torch.manual_seed(1)
            with force_path(path):
                out = layer(x, mask)
            outs.append((out, gradients(out, layer, x, torch.ones_like(out))))
        torch.testing.assert_close(outs[0][0], outs[1][0])
        assert_same(outs[1][1], outs[0][1], ["x"] + [n for n, _ in plain.named_parameters()])
        torch.testing.assert_close(gpu.stem_norm.running_var, plain.stem_norm.running_var)


class _MatmulPrecision(torch.utils._python_dispatch.TorchDispatchMode):
    """Records, for every matrix product dispatched, whether CUDA's TF32 switches were off at that moment."""

    def __init__(self):
        super().__init__()
        self.tf32_off = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.overloadpacket in (torch.ops.aten.mm, torch.ops.aten.addmm, torch.ops.aten.bmm):
            self.tf32_off.append(not (torch.backends.cuda.matmul.allow_tf32 or torch.backends.cudnn.allow_tf32))
        return func(*args, **(kwargs or {}))


def test_float32_smoother_convolution_runs_with_tf32_off_forward_and_backward():
    """On CUDA cuDNN convolutions default to TF32 (float32 factors rounded to 10 bits): the GPU path computes the
    stem's convolution as float32 GEMMs inside full_float32(), forward and backward, whatever the global
    switches say; full_float32() restores them."""
    # set and restored by hand: the flags are properties of torch's backend modules, which pytest's
    # monkeypatch fails to restore under pytest 9.2 ("'cuBLASModule' object has no attribute 'allow_tf32'")
    saved = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = True
    try:
        smoother = Smoother(16, 20, dropout=0.0).train()
        x = torch.randn(2, 20, 16, requires_grad=True)
        with force_path("gpu"), _MatmulPrecision() as products:
            smoother(x).square().sum().backward()
        assert products.tf32_off.count(True) == 3  # the stem: one GEMM forward, two backward
        assert torch.backends.cuda.matmul.allow_tf32 and torch.backends.cudnn.allow_tf32
        with full_float32():
            assert not (torch.backends.cuda.matmul.allow_tf32 or torch.backends.cudnn.allow_tf32)
        assert torch.backends.cuda.matmul.allow_tf32 and torch.backends.cudnn.allow_tf32
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved
