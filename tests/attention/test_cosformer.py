"""cosFormer: linear (and chunked causal) fast path vs the plain N x N reference."""

import contextlib
import math

import pytest
import torch
from gpu_path_checks import assert_gpu_result_close, kernel_dtype, running_kernels

from longattn import attention
from longattn.attention import AttentionError, force_path
from longattn.attention.cosformer import (
    cosformer_attention,
    cosformer_attention_reference,
    cosformer_features,
)
from longattn.testing import LargestTensorRecorder, assert_forward_backward_close, random_qkv, scattered_mask

DIM, HEADS = 24, 3


@pytest.mark.parametrize("n", [1, 7, 259])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("reweight", [True, False])
@pytest.mark.parametrize("chunk_size", [4, 64])
@pytest.mark.parametrize("feature_map", ["relu", "elu"])
def test_functional_matches_reference_forward_and_backward(n, causal, reweight, chunk_size, feature_map):
    q, k, v = random_qkv(2, 3, n, 5)
    mask = scattered_mask(2, n)
    kwargs = dict(is_causal=causal, reweight=reweight, feature_map=feature_map)
    out = cosformer_attention(q, k, v, mask, chunk_size=chunk_size, **kwargs)
    ref = cosformer_attention_reference(q, k, v, mask, **kwargs)
    torch.testing.assert_close(out, ref)
    g = torch.randn_like(out)
    for got, want in zip(torch.autograd.grad(out, (q, k, v), g), torch.autograd.grad(ref, (q, k, v), g)):
        torch.testing.assert_close(got, want)


def test_max_positions_changes_the_reweighting_and_is_checked():
    q, k, v = random_qkv(1, 2, 11, 4)
    out = cosformer_attention(q, k, v, max_positions=40)
    torch.testing.assert_close(out, cosformer_attention_reference(q, k, v, max_positions=40))
    assert not torch.allclose(out, cosformer_attention(q, k, v))
    with pytest.raises(AttentionError, match="max_positions"):
        cosformer_attention(q, k, v, max_positions=10)


def test_features_decompose_the_cos_reweighting():
    # phi(q_i) . phi(k_j) = relu(q_i) . relu(k_j) * cos(pi/2 (i - j) / M)   (eqs. 9-10)
    x = torch.randn(1, 1, 6, 3, dtype=torch.float64)
    phi = cosformer_features(x, max_positions=8)[0, 0]
    relu = torch.relu(x)[0, 0]
    i = torch.arange(6, dtype=torch.float64)
    expected = relu @ relu.T * torch.cos(math.pi / 2 * (i[:, None] - i[None, :]) / 8)
    torch.testing.assert_close(phi @ phi.T, expected)


def test_causal_outputs_ignore_the_future():
    q, k, v = random_qkv(1, 2, 50, 4)
    out = cosformer_attention(q, k, v, is_causal=True, chunk_size=8, max_positions=50)
    k2, v2 = k.detach().clone(), v.detach().clone()
    k2[:, :, 30:] = torch.randn_like(k2[:, :, 30:])
    v2[:, :, 30:] = torch.randn_like(v2[:, :, 30:])
    out2 = cosformer_attention(q, k2, v2, is_causal=True, chunk_size=8, max_positions=50)
    torch.testing.assert_close(out2[:, :, :30], out[:, :, :30])
    assert not torch.allclose(out2[:, :, 30:], out[:, :, 30:])


@pytest.mark.parametrize("causal", [False, True])
def test_module_matches_reference(causal):
    torch.manual_seed(0)
    layer = attention.build("cosformer", dim=DIM, heads=HEADS, causal=causal).double()
    x = torch.randn(2, 97, DIM, dtype=torch.float64, requires_grad=True)
    mask = scattered_mask(2, 97)
    out = layer(x, mask)
    ref = layer.proj.out(cosformer_attention_reference(*layer.proj.qkv(x), mask, is_causal=causal))
    ref = ref * mask[..., None]
    assert_forward_backward_close(out, ref, [x, *layer.parameters()])


def test_causal_module_has_no_quadratic_intermediate():
    n = 4096
    torch.manual_seed(0)
    layer = attention.build("cosformer", dim=32, heads=1, causal=True)
    x = torch.randn(1, n, 32, requires_grad=True)
    with LargestTensorRecorder() as rec:
        layer(x).sum().backward()
    assert rec.max_numel <= n * n // 16, rec.max_shape


@pytest.mark.parametrize("bad", [{"max_positions": 0}, {"eps": 0.0}, {"chunk_size": 0}, {"feature_map": "exp"}])
def test_bad_options_raise(bad):
    with pytest.raises(AttentionError):
        attention.build("cosformer", dim=DIM, heads=HEADS, **bad)


# ----------------------------------------------------------------------------- GPU path (forced on CPU)


@pytest.mark.parametrize("kernels", [False, True])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("options", [dict(), dict(reweight=False, feature_map="elu"),
                                     dict(max_positions=60, chunk_size=5)])
def test_gpu_path_matches_reference_forward_and_backward(options, causal, kernels):
    """The cos / sin split through the shared scan (a chunk size that is no tile takes the kernels' own)."""
    dtype = kernel_dtype(kernels)
    q, k, v = random_qkv(2, 2, 37, 5, dtype=dtype)
    mask = scattered_mask(2, 37)
    g = torch.randn(2, 2, 37, 5, dtype=dtype)
    reference_options = {key: value for key, value in options.items() if key != "chunk_size"}
    with running_kernels() if kernels else contextlib.nullcontext("cpu") as device, force_path("gpu"):
        out = cosformer_attention(*(t.to(device) for t in (q, k, v, mask)), is_causal=causal, **options)
        got = torch.autograd.grad(out, (q, k, v), g.to(device))
    ref = cosformer_attention_reference(q, k, v, mask, is_causal=causal, **reference_options)
    assert_gpu_result_close(out.cpu(), got, ref, (q, k, v), g, dtype)


def test_gpu_path_angles_stay_exact_in_half_precision():
    """pi i / 2M in bfloat16 is off by up to 0.003 rad at 16k tokens; the GPU path takes cos / sin in float32."""
    q, k, v = (t.detach() for t in random_qkv(1, 1, 300, 4, seed=2))
    ref = cosformer_attention_reference(q, k, v, max_positions=20000)
    with force_path("gpu"):
        out = cosformer_attention(*(t.to(torch.bfloat16) for t in (q, k, v)), max_positions=20000)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.double(), ref, rtol=0.05, atol=0.05)
