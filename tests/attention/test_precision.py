"""What float32 means on CUDA (exact_float32, allow_tf32) and the CUDA autocast rules the CPU tests emulate."""

import pytest
import torch

from longattn.attention import allow_tf32, exact_float32, exact_float32_op, force_path
from longattn.testing import CudaAutocastOnCPU


@pytest.fixture
def cudnn_flags():
    """The process-wide cuDNN TF32 flags, as they were, after the test whatever it did."""
    cudnn = torch.backends.cudnn
    saved = cudnn.allow_tf32, cudnn.conv.fp32_precision, cudnn.rnn.fp32_precision
    yield cudnn
    cudnn.conv.fp32_precision, cudnn.rnn.fp32_precision = saved[1], saved[2]
    cudnn.allow_tf32 = saved[0]


def test_exact_float32_turns_convolution_tf32_off_only_for_float32_on_the_gpu_path(cudnn_flags):
    x = torch.zeros(2)
    assert cudnn_flags.allow_tf32  # cuDNN's default
    with exact_float32(x):
        assert cudnn_flags.allow_tf32  # the CPU path: nothing to do
    with force_path("gpu"):
        with exact_float32(x):
            assert not cudnn_flags.allow_tf32
        assert cudnn_flags.allow_tf32
        with exact_float32(x.bfloat16()), allow_tf32():
            assert cudnn_flags.allow_tf32
        with allow_tf32(), exact_float32(x):
            assert cudnn_flags.allow_tf32


def test_exact_float32_uses_the_per_operator_flag_when_the_user_set_that_one(cudnn_flags):
    cudnn_flags.conv.fp32_precision = "tf32"
    cudnn_flags.rnn.fp32_precision = "ieee"  # mixed: the legacy flag can no longer be read
    with pytest.raises(RuntimeError):
        cudnn_flags.allow_tf32
    with force_path("gpu"), exact_float32(torch.zeros(1)):
        assert cudnn_flags.conv.fp32_precision == "ieee"
    assert cudnn_flags.conv.fp32_precision == "tf32"


def test_exact_float32_op_covers_forward_and_backward_and_keeps_the_gradient(cudnn_flags):
    seen = []

    def conv(x, weight):
        seen.append(("forward", cudnn_flags.allow_tf32))
        out = torch.nn.functional.conv1d(x, weight, padding=1)
        out.register_hook(lambda g: seen.append(("backward", cudnn_flags.allow_tf32)))
        return out

    x = torch.randn(2, 3, 9, requires_grad=True)
    weight = torch.randn(3, 3, 3, requires_grad=True)
    plain = conv(x, weight)
    want = torch.autograd.grad(plain.square().sum(), (x, weight))
    seen.clear()
    with force_path("gpu"):
        out = exact_float32_op(conv, x, weight)
    got = torch.autograd.grad(out.square().sum(), (x, weight))
    assert seen == [("forward", False), ("backward", False)]
    assert cudnn_flags.allow_tf32
    torch.testing.assert_close(out, plain)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b)
    assert exact_float32_op(conv, x, weight).grad_fn.name() == "ConvolutionBackward0"  # CPU path: a plain call


def test_cuda_autocast_rules_on_cpu():
    x = torch.randn(4, 8)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        h = x @ x.T  # a GEMM: bfloat16 on both devices
        assert torch.softmax(h, -1).dtype == torch.bfloat16 == h.sum().dtype  # CPU autocast's rules
        with CudaAutocastOnCPU():
            assert h.dtype == torch.bfloat16
            assert torch.softmax(h, -1).dtype == h.sum().dtype == torch.exp(h).dtype == torch.float32
            assert torch.nn.functional.layer_norm(h, (4,)).dtype == torch.float32
            assert torch.mv(x, x[0]).dtype == torch.bfloat16  # CUDA autocasts matrix-vector products too
            assert torch.sum(h, -1, out=torch.empty(4, dtype=torch.bfloat16)).dtype == torch.bfloat16  # out=: no
            with pytest.raises(RuntimeError, match="cuFFT"):
                torch.fft.rfft(h)
            # the class of bug CPU autocast hides: a bfloat16 buffer and a float32 source
            with pytest.raises(RuntimeError, match="same scalar type"):
                torch.zeros(4, dtype=torch.bfloat16).index_add_(0, torch.arange(4), torch.exp(h[0]))
    with CudaAutocastOnCPU():
        assert torch.softmax(x.bfloat16(), -1).dtype == torch.bfloat16  # outside autocast: nothing
