import contextlib

import pytest
import torch
from gpu_path_checks import assert_gpu_result_close, kernel_dtype, running_kernels
from module_checks import assert_never_looks_ahead, largest_intermediate

from longattn import attention
from longattn.attention import AttentionError, force_path
from longattn.attention.linear import linear_attention, linear_attention_reference
from longattn.attention.ops.linear_scan import causal_kernel_attention, elu_feature_map
from longattn.testing import random_qkv, scattered_mask


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("n", [1, 63, 333])
def test_fast_matches_reference_forward_and_backward(causal, n):
    q, k, v = random_qkv(2, 3, n, 8)
    mask = torch.rand(2, n, generator=torch.Generator().manual_seed(1)) > 0.3
    mask[:, 0] = True
    out = linear_attention(q, k, v, mask, is_causal=causal)
    ref = linear_attention_reference(q, k, v, mask, is_causal=causal)
    torch.testing.assert_close(out, ref)
    g = torch.randn_like(out)
    for a, r in zip(torch.autograd.grad(out, (q, k, v), g), torch.autograd.grad(ref, (q, k, v), g)):
        torch.testing.assert_close(a, r)


def test_causal_chunking_does_not_change_the_result():
    q, k, v = random_qkv(1, 2, 100, 4)
    phi_q, phi_k = elu_feature_map(q), elu_feature_map(k)
    a = causal_kernel_attention(phi_q, phi_k, v, 1e-6, chunk=7)
    b = causal_kernel_attention(phi_q, phi_k, v, 1e-6, chunk=128)
    torch.testing.assert_close(a, b)


def test_causal_module_never_looks_ahead():
    assert_never_looks_ahead("linear")


def test_matches_the_definition_with_the_elu_feature_map():
    # eq. 4 written out for one query: sum_j phi(q).phi(k_j) v_j / sum_j phi(q).phi(k_j)
    q, k, v = (t.detach() for t in random_qkv(1, 1, 5, 3))
    out = linear_attention(q, k, v)
    phi = lambda t: torch.where(t > 0, t + 1, torch.exp(t))  # elu(x) + 1
    sims = (phi(q[0, 0, 2]) * phi(k[0, 0])).sum(-1)
    expected = (sims[:, None] * v[0, 0]).sum(0) / (sims.sum() + 1e-6)
    torch.testing.assert_close(out[0, 0, 2], expected)


def test_all_padded_sequence_gives_zeros_and_bad_option_errors():
    q, k, v = (t.detach() for t in random_qkv(1, 1, 6, 4))
    out = linear_attention(q, k, v, torch.zeros(1, 6, dtype=torch.bool), is_causal=True)
    assert torch.all(out == 0)
    with pytest.raises(AttentionError, match="eps"):
        attention.build("linear", dim=8, heads=2, eps=-1.0)


@pytest.mark.parametrize("name", ["linear", "performer"])
def test_causal_form_builds_no_quadratic_intermediate(name):
    n = 4096
    assert largest_intermediate(name, n) <= n * n // 8


# ----------------------------------------------------------------------------- GPU path (forced on CPU)


@pytest.mark.parametrize("kernels", [False, True])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("n", [1, 37])
def test_gpu_path_matches_reference_forward_and_backward(n, causal, kernels):
    """Batched GEMMs, the causal sums by the chunked scan: PyTorch, or the Triton kernels (compiled on CUDA in
    float32, else interpreted in float64)."""
    dtype = kernel_dtype(kernels)
    q, k, v = random_qkv(2, 2, n, 8, dtype=dtype)
    mask = scattered_mask(2, n)
    g = torch.randn(2, 2, n, 8, dtype=dtype)
    with running_kernels() if kernels else contextlib.nullcontext("cpu") as device, force_path("gpu"):
        out = linear_attention(*(t.to(device) for t in (q, k, v, mask)), is_causal=causal)
        got = torch.autograd.grad(out, (q, k, v), g.to(device))
    ref = linear_attention_reference(q, k, v, mask, is_causal=causal)
    assert_gpu_result_close(out.cpu(), got, ref, (q, k, v), g, dtype)
