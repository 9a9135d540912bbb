"""The causal scan of the linear-attention family: naive (N x N), recurrent (a decoder's running sums), chunked
PyTorch (the GPU path without triton) and the Triton kernels (compiled on CUDA, else interpreted) give the same
sums, forward and gradients, on odd lengths, several K blocks and values narrower than a tile."""

import pytest
import torch
from gpu_path_checks import assert_close_rms, needs_triton, running_kernels, skip_float64_kernels_on_cuda

from longattn.attention.ops.linear_scan import causal_scan, causal_scan_chunked


def features(n, k_dim=20, v_dim=9, dtype=torch.float64, seed=0, batch=1, heads=2):
    g = torch.Generator().manual_seed(seed)
    q, k = (torch.rand(batch, heads, n, k_dim, generator=g, dtype=torch.float64).to(dtype).requires_grad_()
            for _ in range(2))
    v = torch.randn(batch, heads, n, v_dim, generator=g, dtype=torch.float64).to(dtype).requires_grad_()
    return q, k, v


def grads(outputs, inputs, seed=1):
    g = torch.Generator().manual_seed(seed)
    upstream = [torch.randn(t.shape, generator=g, dtype=torch.float64).to(t.dtype).to(t.device) for t in outputs]
    loss = sum((t * u).sum() for t, u in zip(outputs, upstream))
    return torch.autograd.grad(loss, inputs)


def kernel_scan(q, k, v, chunk=16):
    """The kernels' (o, z) and the gradients of the CPU leaves q, k, v."""
    with running_kernels() as device:
        out = causal_scan(*(t.to(device) for t in (q, k, v)), chunk=chunk)
        return [t.cpu() for t in out], grads(out, (q, k, v))


def test_naive_recurrent_and_chunked_forms_agree():
    needs_triton()
    from longattn.attention._linear_scan_triton import causal_scan_naive, causal_scan_recurrent

    q, k, v = features(37)
    naive = causal_scan_naive(q, k, v)
    naive_grads = grads(naive, (q, k, v))
    for other in (causal_scan_recurrent(q, k, v), causal_scan_chunked(q, k, v, chunk=16),
                  causal_scan_chunked(q, k, v, chunk=64)):
        for a, b in zip(other, naive):
            torch.testing.assert_close(a, b)
        for a, b in zip(grads(other, (q, k, v)), naive_grads):
            torch.testing.assert_close(a, b)


@pytest.mark.parametrize("n, k_dim, v_dim", [(37, 20, 9), (16, 80, 16), (5, 3, 2)])
def test_kernels_match_the_naive_form_in_float64(n, k_dim, v_dim):
    """Odd lengths (a partial last chunk), two K blocks (80 = 64 + 16), tiles wider than the features."""
    skip_float64_kernels_on_cuda(torch.float64)
    from longattn.attention._linear_scan_triton import causal_scan_naive

    q, k, v = features(n, k_dim, v_dim)
    out, got = kernel_scan(q, k, v)
    naive = causal_scan_naive(q, k, v)
    for a, b in zip(out, naive):
        torch.testing.assert_close(a, b)
    for a, b in zip(got, grads(naive, (q, k, v))):
        torch.testing.assert_close(a, b)


@pytest.mark.parametrize("dtype, ratio", [(torch.float32, 1e-6), (torch.float16, 2e-3), (torch.bfloat16, 1.5e-2)])
def test_kernels_in_float32_and_half_precision(dtype, ratio):
    """o in the input dtype and z in float32 (the accumulation dtype); RMS ratios against float64: float32 1e-6,
    float16 2e-3, bfloat16 1.5e-2 (the intra-chunk product, the chunk states and o are rounded to the input
    dtype). Triton's interpreter gets bfloat16 tl.dot wrong: bfloat16 runs only on CUDA."""
    from gpu_path_checks import KERNEL_DEVICE
    from longattn.attention._linear_scan_triton import causal_scan_naive

    if dtype == torch.bfloat16 and KERNEL_DEVICE == "cpu":
        pytest.skip("bfloat16 kernels run only on CUDA")
    q, k, v = features(37, dtype=dtype)
    out, got = kernel_scan(q, k, v)
    assert (out[0].dtype, out[1].dtype) == (dtype, torch.float32)
    assert [t.dtype for t in got] == [dtype] * 3
    exact = [t.detach().double().requires_grad_() for t in (q, k, v)]
    naive = causal_scan_naive(*exact)
    for a, b in zip(out, naive):
        assert_close_rms(a, b, ratio, "forward")
    for a, b in zip(got, grads(naive, exact)):
        assert_close_rms(a, b, ratio, "gradient")


def test_kernels_with_only_the_normaliser_used():
    """A loss of z alone: the kernels' backward pass gets no gradient for o."""
    needs_triton()
    from longattn.attention._linear_scan_triton import causal_scan_naive

    q, k, v = features(21, dtype=torch.float32)
    with running_kernels() as device:
        _, z = causal_scan(*(t.to(device) for t in (q, k, v)), chunk=16)
        got = torch.autograd.grad(z.sum(), (q, k))
    want = torch.autograd.grad(causal_scan_naive(q, k, v)[1].sum(), (q, k))
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
