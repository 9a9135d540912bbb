"""The Triton kernels of skeleton attention and its Smoother against their plain PyTorch references and the float64
formulas, forward and gradients, odd lengths, padding: compiled on CUDA where there is a GPU, else in Triton's
interpreter on CPU tensors (kept small: the interpreter runs each program in Python)."""

import collections
import contextlib
import copy
import os
import subprocess
import sys

import pytest
import torch

from longattn import attention
from longattn.attention import force_path
from longattn.attention._triton import interpret_triton, triton_installed, use_triton
from longattn.attention.skeleton import gpu_core_torch
from longattn.attention.smoother import Smoother
from longattn.testing import DispatchCounter, scattered_mask

pytestmark = pytest.mark.skipif(not triton_installed(), reason="triton is not installed")

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


@pytest.fixture(autouse=True)
def _bfloat16_rounding_as_on_a_gpu(monkeypatch):
    """Triton's interpreter (3.9) converts float32 to bfloat16 by truncation, where a GPU rounds to nearest even:
    a bias toward zero that no GPU run has. Tests of bfloat16 kernels round as the GPU does."""
    try:
        import numpy as np
        import triton.language as tl
        import triton.runtime.interpreter as interpreter
    except ImportError:
        return
    convert = getattr(interpreter, "_convert_float", None)
    if convert is None:
        return

    def round_to_nearest_even(values, input_dtype, output_dtype, rounding_mode):
        if input_dtype != tl.float32 or output_dtype != tl.bfloat16:
            return convert(values, input_dtype, output_dtype, rounding_mode)
        bits = np.frombuffer(values.tobytes(), dtype=np.uint32).astype(np.uint64)
        rounded = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype(np.uint16)
        rounded[np.isnan(np.frombuffer(values.tobytes(), dtype=np.float32))] = 0x7FC0
        return rounded.reshape(values.shape)

    monkeypatch.setattr(interpreter, "_convert_float", round_to_nearest_even)


@contextlib.contextmanager
def kernels_run():
    """The kernels run compiled on CUDA, or in Triton's interpreter on CPU tensors."""
    with contextlib.ExitStack() as stack:
        if DEVICE.type == "cpu":
            stack.enter_context(interpret_triton())
        yield


def core_inputs(batch, length, heads=2, head_dim=8, s1=5, s2=3, rows=True, columns=True, dropout=True, seed=0):
    """Float64 inputs of skeleton_core: sequence 0 has no real sampled token (its row branch is zero)."""
    g = torch.Generator().manual_seed(seed)

    def randn(*shape):
        return torch.randn(*shape, generator=g, dtype=torch.float64)

    valid = torch.rand(batch, s1, generator=g) > 0.3
    valid[0] = False
    return dict(
        query=randn(batch, length, heads * head_dim),
        column_values=randn(batch, length, heads * s2) if columns else None,
        row_keys=0.5 * randn(batch, heads, s1, head_dim) if rows else None,
        row_values=randn(batch, heads, s1, head_dim) if rows else None,
        column_weights=torch.softmax(randn(batch, heads, head_dim, s2), -1) if columns else None,
        norms=tuple((1 + 0.3 * randn(heads * head_dim), 0.3 * randn(heads * head_dim)) for _ in range(2)),
        row_valid=valid,
        row_keep=torch.rand(batch, length, heads, s1, generator=g) > 0.2 if dropout and rows else None,
        keep_scale=1.25, eps=1e-5)


def run_core(fn, inputs, dtype, mask_padded_samples, upstream, device=torch.device("cpu")):
    """fn's output and the gradients of every differentiable input, computed in ``dtype`` on ``device`` (returned
    on the CPU in float64)."""
    leaves = []

    def leaf(t):
        if t is None:
            return None
        t = t.detach().to(device, dtype).requires_grad_()
        leaves.append(t)
        return t

    args = {name: leaf(inputs[name]) for name in ("query", "column_values", "row_keys", "row_values", "column_weights")}
    norms = tuple((leaf(w), leaf(b)) for w, b in inputs["norms"])
    keep = None if inputs["row_keep"] is None else inputs["row_keep"].to(device)
    out = fn(**args, norms=norms, row_valid=inputs["row_valid"].to(device), row_keep=keep,
             keep_scale=inputs["keep_scale"], eps=inputs["eps"], mask_padded_samples=mask_padded_samples)
    grads = torch.autograd.grad(out, leaves, upstream.to(device, out.dtype), allow_unused=True)
    return out.cpu().double(), [None if g is None else g.cpu().double() for g in grads]


def check_core(inputs, mask_padded_samples, dtype=torch.float32, tolerance=None):
    from longattn.attention import _skeleton_triton as kernels

    upstream = torch.randn(inputs["query"].shape, dtype=torch.float64, generator=torch.Generator().manual_seed(9))
    reference = run_core(kernels.core_reference, inputs, torch.float64, mask_padded_samples, upstream)
    with kernels_run():
        kernel = run_core(kernels.skeleton_core, inputs, dtype, mask_padded_samples, upstream, DEVICE)
    batched = run_core(gpu_core_torch, inputs, dtype, mask_padded_samples, upstream)
    tolerance = tolerance or dict(rtol=2e-5, atol=2e-5)
    for got in (kernel, batched):
        torch.testing.assert_close(got[0], reference[0], **tolerance)
        for grad, expected in zip(got[1], reference[1]):
            assert (grad is None) == (expected is None)  # a disabled branch's LayerNorm takes no gradient
            if grad is not None:
                torch.testing.assert_close(grad, expected, **tolerance)


@pytest.mark.parametrize("mask_padded_samples", [True, False])
def test_core_kernel_matches_the_reference_with_padding_and_dropout(mask_padded_samples):
    """Both branches, an odd length, a sequence with no real sampled token, row dropout: forward and every gradient
    (queries, sampled columns, sampled keys and values, column weights, LayerNorm weights and biases)."""
    check_core(core_inputs(2, 19), mask_padded_samples)


@pytest.mark.parametrize("branches", [{"rows": False}, {"columns": False, "dropout": False}])
def test_core_kernel_with_one_branch(branches):
    check_core(core_inputs(1, 13, **branches), mask_padded_samples=True)


def test_core_kernel_with_unpadded_shapes_and_several_blocks_per_backward_program(monkeypatch):
    """Head dim, s1 and s2 that are not powers of two (padded blocks), and a backward program that walks over
    several token blocks (its parts of the summed gradients accumulate across them)."""
    from longattn.attention import _skeleton_triton as kernels

    monkeypatch.setattr(kernels, "BLOCK_TOKENS", 16)
    monkeypatch.setattr(kernels, "BACKWARD_PROGRAMS", 1)
    check_core(core_inputs(1, 33, head_dim=24, s1=17, s2=9), mask_padded_samples=True)


def test_core_kernel_in_bfloat16_stays_within_bfloat16_rounding():
    check_core(core_inputs(1, 17), mask_padded_samples=True, dtype=torch.bfloat16,
               tolerance=dict(rtol=3e-2, atol=5e-2))


SMOOTHER_OPTIONS = [
    {},
    {"batchnorm_over": "features", "activation": "gelu", "kernel_size": 5},
    {"segment_average": False, "kernel_size": 1, "activation": "elu", "fourier": False},
]


@pytest.mark.parametrize("options", SMOOTHER_OPTIONS, ids=["paper", "features-gelu-k5", "lra-no-fourier"])
def test_smoother_kernels_match_the_pytorch_steps(options):
    """The Smoother's kernels (segment means, stem input, shift-sum with the BatchNorm moments, normalisation,
    and their backward) against TorchStemSteps: training with dropout, then eval, NaN padding, float32."""
    torch.manual_seed(0)
    smoother = Smoother(16, 23, dropout=0.3, **options).to(DEVICE)
    with torch.no_grad():
        smoother.stem_norm.weight.uniform_(0.5, 1.5)
        smoother.stem_norm.bias.uniform_(-0.5, 0.5)
    mask = scattered_mask(2, 21).to(DEVICE)
    x = torch.randn(2, 21, 16, device=DEVICE).masked_fill(~mask[..., None], float("nan")).requires_grad_()
    for training in (True, False) if not options else (True,):  # eval (running statistics) once
        results = []
        for kernels in (False, True):
            layer = copy.deepcopy(smoother).train(training)
            torch.manual_seed(1)
            with force_path("gpu"), kernels_run(), use_triton(kernels):
                out = layer(x, mask)
                upstream = torch.linspace(-1, 1, out.numel(), device=DEVICE).view(out.shape)
                grads = torch.autograd.grad(out, [x, *layer.parameters()], upstream)
            results.append((out, grads, layer.stem_norm.running_var))
        (out, grads, running), (kernel_out, kernel_grads, kernel_running) = results
        torch.testing.assert_close(kernel_out, out)
        for name, got, want in zip(["x"] + [n for n, _ in smoother.named_parameters()], kernel_grads, grads):
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5, msg=lambda m: f"{name}: {m}")
        torch.testing.assert_close(kernel_running, running)


def test_layer_through_the_kernels_matches_the_float64_reference():
    """The whole layer (Smoother kernels, projections, core kernel) against the same layer in float64."""
    torch.manual_seed(5)
    layer = attention.build("skeleton", dim=32, heads=2, max_len=40, dropout=0.0, smoother_dropout=0.0, s1=6).train()
    reference = copy.deepcopy(layer).double()
    x = torch.randn(1, 29, 32)
    mask = scattered_mask(1, 29)
    x64 = x.double().requires_grad_()
    expected = reference(x64, mask)
    upstream = torch.randn_like(expected)
    expected_grads = torch.autograd.grad(expected, [x64, *reference.parameters()], upstream)
    layer.to(DEVICE)
    x32 = x.to(DEVICE).requires_grad_()
    with force_path("gpu"), kernels_run():
        out = layer(x32, mask.to(DEVICE))
        grads = torch.autograd.grad(out, [x32, *layer.parameters()], upstream.to(DEVICE, torch.float32))
    torch.testing.assert_close(out.cpu().double(), expected, rtol=1e-5, atol=1e-5)
    for name, got, want in zip(["x"] + [n for n, _ in layer.named_parameters()], grads, expected_grads):
        torch.testing.assert_close(got.cpu().double(), want, rtol=1e-4, atol=1e-4, msg=lambda m: f"{name}: {m}")


def test_layer_through_the_kernels_under_bfloat16_autocast():
    """Every kernel with bfloat16 storage and products: the autocast dtype out, within the ratios the PyTorch form
    of the GPU path meets (test_skeleton_gpu.AUTOCAST_RATIOS; measured here: output 5.6e-3, gradients 2.1e-2,
    the position-wise BatchNorm's parameters 2.5e-2)."""
    torch.manual_seed(5)
    layer = attention.build("skeleton", dim=32, heads=2, max_len=40, dropout=0.0, smoother_dropout=0.0, s1=6).train()
    reference = copy.deepcopy(layer).double()
    x = torch.randn(1, 29, 32)
    mask = scattered_mask(1, 29)
    x64 = x.double().requires_grad_()
    expected = reference(x64, mask)
    upstream = torch.randn_like(expected)
    expected_grads = torch.autograd.grad(expected, [x64, *reference.parameters()], upstream)
    layer.to(DEVICE)
    x16 = x.to(DEVICE).requires_grad_()
    with force_path("gpu"), kernels_run(), torch.autocast(DEVICE.type, dtype=torch.bfloat16):
        out = layer(x16, mask.to(DEVICE))
        grads = torch.autograd.grad(out, [x16, *layer.parameters()], upstream.to(DEVICE, torch.bfloat16))
    assert out.dtype == torch.bfloat16

    def ratio(got, want):
        return ((got.cpu().double() - want).square().mean().sqrt() / want.square().mean().sqrt()).item()

    assert ratio(out, expected) < 1e-2
    for name, got, want in zip(["x"] + [n for n, _ in layer.named_parameters()], grads, expected_grads):
        assert ratio(got, want) < (1.5e-1 if "stem_norm" in name else 8e-2), name


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="records the interpreter's launches")
def test_kernel_path_dispatches_a_fixed_number_of_operations(monkeypatch):
    """With the kernels' launches recorded instead of run (their outputs are then garbage, the shapes are right),
    the Triton path's aten operations and kernel launches are the same at N = 1k and 64k, batch 2 and 64. In
    bfloat16: meta tensors stand for a GPU's, where float32 takes the core's PyTorch path."""
    import triton.runtime.interpreter as interpreter

    import longattn.attention.skeleton as skeleton_module
    import longattn.attention.smoother as smoother_module

    launches = collections.Counter()
    monkeypatch.setattr(interpreter.InterpretedFunction, "run",
                        lambda self, *args, **kwargs: launches.update([self.fn.__name__]))
    for module in (skeleton_module, smoother_module):  # kernels "run" on meta tensors
        monkeypatch.setattr(module, "triton_runs_on", lambda t: True)
    seen = set()
    for length, batch in ((1024, 2), (65536, 2), (1024, 64)):
        launches.clear()
        with torch.device("meta"):
            layer = attention.build("skeleton", dim=512, heads=8, max_len=length).train().to(torch.bfloat16)
        x = torch.randn(batch, length, 512, device="meta", dtype=torch.bfloat16, requires_grad=True)
        with force_path("gpu"), DispatchCounter() as ops:
            layer(x, torch.ones(batch, length, dtype=torch.bool, device="meta")).sum().backward()
        seen.add((tuple(sorted(ops.counts.items())), tuple(sorted(launches.items()))))
    assert len(seen) == 1
    (counts, kernel_launches), = seen
    assert sum(n for _, n in kernel_launches) == 11  # 8 in the Smoother, 3 in the core


@pytest.mark.skipif(os.environ.get("LONGATTN_COMPILE_KERNELS") != "1",
                    reason="compiles every kernel for sm_90 (about a minute): set LONGATTN_COMPILE_KERNELS=1")
def test_kernels_compile_for_hopper_without_a_gpu():
    """Triton's interpreter accepts code its compiler rejects (non-constexpr globals, branch-dependent return types):
    compile every kernel for an H100 (sm_90) with the nvidia backend bundled in triton, no GPU needed. In a fresh
    process: with TRITON_INTERPRET=1 (this one) the kernels are interpreter objects the compiler cannot take."""
    import longattn

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([os.path.dirname(os.path.dirname(longattn.__file__)), env.get("PYTHONPATH", "")])
    done = subprocess.run([sys.executable, __file__], env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.split() == ["compiled", "11"], done.stdout


def compile_for_hopper() -> int:
    """Compile every kernel (one configuration each, both core backward launches) for sm_90; returns the count."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource, compile

    from longattn.attention import _skeleton_triton as core
    from longattn.attention import _smoother_triton as stem

    half_pointers = {"q_ptr", "vc_ptr", "k_ptr", "v_ptr", "out_ptr", "dq_ptr", "dvc_ptr", "go_ptr", "h_ptr", "y_ptr",
                     "shifted_ptr", "inp_ptr", "g_ptr"}

    def kind(name, constants):
        if name in constants:
            return "constexpr"
        if name in ("keep_ptr", "mask_ptr"):
            return "*u8"
        if name.endswith("_ptr"):
            return "*bf16" if name in half_pointers else "*fp32"
        return "fp32" if name in ("keep_scale", "eps") else "i32"

    flags = dict(MASK_SAMPLES=True, DROPOUT=True, UPCAST=False, IEEE=False, BT=32, S1P=16, S2P=16, DHP=64)
    stem_flags = dict(HAS_MASK=True, HAS_KEEP=True, BR=8, BD=512)
    jobs = [(core._core_fwd_kernel, dict(flags, ROW=True, COLUMN=True))]
    jobs += [(core._core_bwd_kernel, dict(flags, ROW=row, COLUMN=not row)) for row in (True, False)]
    jobs += [(stem._shift_sum_kernel, dict(HAS_MASK=True, TRAINING=True, PER_POSITION=True, BR=8, BD=512)),
             (stem._normalise_kernel, dict(stem_flags, ACT=2, PER_POSITION=True)),
             (stem._backward_sums_kernel, dict(stem_flags, ACT=1, PER_POSITION=False)),
             (stem._backward_input_kernel, dict(stem_flags, ACT=0, PER_POSITION=True, TRAINING=True)),
             (stem._stem_input_fwd, dict(HAS_SMOOTHED=True, HAS_MASK=True, BR=8, BD=512)),
             (stem._stem_input_bwd, dict(HAS_SMOOTHED=True, HAS_MASK=True, BR=8, BD=512)),
             (stem._segment_mean_fwd, dict(HAS_MASK=True, BR=8, RP=8, WP=64)),
             (stem._segment_mean_bwd, dict(HAS_MASK=True, BR=8, RP=8, WP=64))]
    for fn, constants in jobs:
        source = ASTSource(fn=fn, signature={name: kind(name, constants) for name in fn.arg_names},
                           constexprs={(fn.arg_names.index(k),): v for k, v in constants.items()})
        compile(source, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=8, num_stages=1))
    return len(jobs)


if __name__ == "__main__":  # the subprocess of test_kernels_compile_for_hopper_without_a_gpu
    print("compiled", compile_for_hopper())
