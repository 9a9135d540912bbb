import contextlib
import math

import pytest
import torch
from gpu_path_checks import KERNEL_DEVICE, needs_triton, running_kernels

from longattn import attention
from longattn.attention import AttentionError, force_path
from longattn.attention import informer as informer_module
from longattn.attention.informer import (
    probsparse_attention,
    probsparse_attention_reference,
    probsparse_counts,
    probsparse_slots,
    sample_informer_keys,
    sparsity_measure,
)
from longattn.attention.softmax import softmax_attention_reference
from longattn.testing import LargestTensorRecorder, random_qkv, scattered_mask


@pytest.mark.parametrize("factor", [1.0, 5.0])
@pytest.mark.parametrize("n", [1, 33, 301])
def test_fast_matches_reference_forward_and_backward(factor, n):
    q, k, v = random_qkv(2, 3, n, 8)
    mask = scattered_mask(2, n, seed=1)
    samples = sample_informer_keys(mask, 2, n, factor, torch.device("cpu"), torch.Generator().manual_seed(2))
    out = probsparse_attention(q, k, v, mask, factor=factor, key_samples=samples)
    ref = probsparse_attention_reference(q, k, v, mask, factor=factor, key_samples=samples)
    torch.testing.assert_close(out, ref)
    grad = torch.randn_like(out)
    for a, r in zip(torch.autograd.grad(out, (q, k, v), grad), torch.autograd.grad(ref, (q, k, v), grad)):
        torch.testing.assert_close(a, r)


def test_counts_are_c_times_ceil_ln_m_within_1_and_m():
    m = torch.tensor([0, 1, 2, 10, 1000, 4096])
    expected = [1, 1, 2, 10, 5 * math.ceil(math.log(1000)), 5 * math.ceil(math.log(4096))]
    assert probsparse_counts(m, 5.0).tolist() == expected


def test_keys_are_sampled_among_real_tokens_only():
    mask = scattered_mask(3, 200, seed=1)
    mask[2, :5] = True
    mask[2, 5:] = False
    samples = sample_informer_keys(mask, 3, 200, 5.0, torch.device("cpu"), torch.Generator().manual_seed(0))
    for b in range(3):
        assert mask[b][samples[b]].all()
    # every real key can be drawn (uniform over the real tokens)
    assert set(samples[2].flatten().tolist()) == set(range(5))


def test_all_queries_active_gives_exact_softmax_attention():
    n = 20  # factor * ceil(ln 20) = 30 >= 20: u = n
    q, k, v = (t.detach() for t in random_qkv(2, 2, n, 8))
    mask = torch.ones(2, n, dtype=torch.bool)
    mask[1, 15:] = False
    out = probsparse_attention(q, k, v, mask, factor=10.0)
    ref = softmax_attention_reference(q, k, v, mask)
    torch.testing.assert_close(out[mask[:, None, :].expand(2, 2, n)], ref[mask[:, None, :].expand(2, 2, n)])


def test_lazy_queries_get_the_mean_of_the_real_values():
    n = 50
    q, k, v = (t.detach() for t in random_qkv(1, 1, n, 4))
    mask = torch.ones(1, n, dtype=torch.bool)
    mask[0, 40:] = False
    out = probsparse_attention(q, k, v, mask, factor=0.1)  # u = 1 active query
    mean_v = v[0, 0, :40].mean(0)
    lazy = (out[0, 0, :40] - mean_v).abs().amax(-1) < 1e-12
    assert lazy.sum() == 39


def test_chunking_of_the_sampled_scores_does_not_change_the_result(monkeypatch):
    q, k, v = (t.detach() for t in random_qkv(2, 2, 97, 8))
    samples = sample_informer_keys(None, 2, 97, 5.0, torch.device("cpu"), torch.Generator().manual_seed(1))
    whole = probsparse_attention(q, k, v, factor=5.0, key_samples=samples)
    monkeypatch.setattr(informer_module, "_SAMPLE_CHUNK_ELEMENTS", 1000)
    torch.testing.assert_close(probsparse_attention(q, k, v, factor=5.0, key_samples=samples), whole)


def indexed_sparsity_measure(query, key, key_samples, sample_counts, m):
    """The pre-change computation of eq. 4's M_bar (sampled keys by advanced indexing, unchunked)."""
    b = query.shape[0]
    sampled_keys = key.transpose(1, 2)[torch.arange(b)[:, None, None], key_samples]  # [B, N, U, H, D]
    scores = torch.einsum("bhcd,bcuhd->bhcu", query, sampled_keys)
    valid = (torch.arange(key_samples.shape[-1])[None, :] < sample_counts[:, None])[:, None, None, :]
    top = scores.masked_fill(~valid, float("-inf")).amax(dim=-1)
    return top - scores.masked_fill(~valid, 0.0).sum(dim=-1) / m.clamp(min=1)[:, None, None].to(scores.dtype)


@pytest.mark.parametrize("n, chunk_elements", [(1, 1 << 20), (37, 1 << 20), (37, 1000)])
def test_row_gathered_measure_equals_the_indexed_one(monkeypatch, n, chunk_elements):
    """The same gathered keys and the same products: in one chunk the same numbers exactly (the ranking of the
    queries cannot change); padded sequences, keys not contiguous in [B, H, N, D]; chunked, up to rounding."""
    monkeypatch.setattr(informer_module, "_SAMPLE_CHUNK_ELEMENTS", chunk_elements)
    q, k, _ = (t.detach() for t in random_qkv(3, 2, n, 8))
    k = k.transpose(1, 2).contiguous().transpose(1, 2)  # token-major memory, as the projections give it
    mask = scattered_mask(3, n, seed=4)
    mask[:, 0] = True
    m = mask.sum(-1)
    counts = probsparse_counts(m, 5.0)
    samples = sample_informer_keys(mask, 3, n, 5.0, torch.device("cpu"), torch.Generator().manual_seed(3))
    exact = {} if chunk_elements < 3 * 2 * n * samples.shape[-1] * 8 else {"rtol": 0, "atol": 0}
    torch.testing.assert_close(sparsity_measure(q, k, samples, counts, m),
                               indexed_sparsity_measure(q, k, samples, counts, m), **exact)


def test_module_is_reproducible_under_a_seed_and_rejects_bad_options():
    assert attention.capabilities("informer").stochastic_eval
    layer = attention.build("informer", dim=16, heads=2).eval()
    x = torch.randn(2, 40, 16)
    torch.manual_seed(5)
    a = layer(x)
    torch.manual_seed(5)
    torch.testing.assert_close(layer(x), a)
    with pytest.raises(AttentionError, match="factor"):
        attention.build("informer", dim=16, heads=2, factor=0)
    q, k, v = (t.detach() for t in random_qkv(1, 1, 10, 4))
    with pytest.raises(AttentionError, match="key_samples"):
        probsparse_attention(q, k, v, key_samples=torch.zeros(1, 10, 1, dtype=torch.long))
    with pytest.raises(AttentionError, match="index keys"):
        probsparse_attention(q, k, v, key_samples=torch.full((1, 10, 10), 10, dtype=torch.long))


# ----------------------------------------------------------------------------- GPU path (forced on CPU)


@pytest.mark.parametrize("kernels", [False, True])
@pytest.mark.parametrize("n", [1, 37])
def test_gpu_path_matches_reference_forward_and_backward(n, kernels):
    """Given the key samples (the stochastic part), the GPU path is the reference's computation; with kernels,
    the sparsity measure runs in the Triton kernel (compiled on CUDA, else interpreted)."""
    dtype = torch.float32 if kernels else torch.float64  # the kernels' dtype on CUDA
    q, k, v = random_qkv(2, 3, n, 8, dtype=dtype)
    mask = scattered_mask(2, n, seed=1)
    mask[1, 20:] = False  # sequences of different m: different U_b and u_b in static slots
    samples = sample_informer_keys(mask, 2, n, 2.0, torch.device("cpu"), torch.Generator().manual_seed(2))
    with running_kernels() if kernels else contextlib.nullcontext("cpu") as device, force_path("gpu"):
        out = probsparse_attention(*(t.to(device) for t in (q, k, v, mask)), factor=2.0,
                                   key_samples=samples.to(device)).cpu()
    ref = probsparse_attention_reference(q, k, v, mask, factor=2.0, key_samples=samples)
    torch.testing.assert_close(out, ref)
    grad = torch.randn_like(out)
    for a, r in zip(torch.autograd.grad(out, (q, k, v), grad), torch.autograd.grad(ref, (q, k, v), grad)):
        torch.testing.assert_close(a, r)


def test_gpu_path_draws_static_slots_among_real_tokens_and_handles_empty_sequences():
    n = 60
    assert probsparse_slots(n, 5.0) == min(n, 5 * math.ceil(math.log(n)))
    assert probsparse_slots(1, 5.0) == 1
    q, k, v = random_qkv(3, 2, n, 4)
    mask = scattered_mask(3, n, seed=2)
    mask[1, 3:] = False
    mask[2] = False  # no real token: zeros, finite gradients
    torch.manual_seed(0)
    with force_path("gpu"):
        out = probsparse_attention(q, k, v, mask)
    assert torch.isfinite(out).all() and torch.all(out[2] == 0)
    out.square().sum().backward()
    assert all(torch.isfinite(t.grad).all() for t in (q, k, v))
    # sequence 1 has 3 real tokens: every one is active (u = m), so it is exact softmax attention
    real = mask[1]
    exact = softmax_attention_reference(q[1:2, :, real], k[1:2, :, real], v[1:2, :, real])
    torch.testing.assert_close(out[1:2, :, real], exact)


def test_gpu_measure_kernel_matches_its_reference():
    needs_triton()
    from longattn.attention._informer_triton import sparsity_measure as kernel_measure
    from longattn.attention._informer_triton import sparsity_measure_reference

    q, k, _ = (t.detach() for t in random_qkv(2, 2, 70, 12))
    mask = scattered_mask(2, 70, seed=4)
    mask[1, 20:] = False
    m = mask.sum(-1)
    counts = probsparse_counts(m, 5.0)
    samples = sample_informer_keys(mask, 2, 70, 5.0, torch.device("cpu"), torch.Generator().manual_seed(3))
    want = sparsity_measure_reference(q, k, samples, counts, m)
    torch.testing.assert_close(want, sparsity_measure(q, k, samples, counts, m))  # the CPU path's measure
    for dtype, tol in ((torch.float64, 1e-12), (torch.float32, 1e-5), (torch.float16, 1e-2)):
        if dtype == torch.float64 and KERNEL_DEVICE == "cuda":
            continue  # float64 kernels run only in the interpreter
        with running_kernels() as device:
            got = kernel_measure(*(t.to(device) for t in (q.to(dtype), k.to(dtype), samples, counts, m))).cpu()
        torch.testing.assert_close(got.double(), want, rtol=tol, atol=tol * want.abs().max().item())


def test_gpu_path_dropout_and_no_quadratic_intermediate():
    n = 1024
    q, k, v = random_qkv(1, 1, n, 16, dtype=torch.float32)
    with force_path("gpu"), LargestTensorRecorder() as rec:
        out = probsparse_attention(q, k, v, dropout_p=0.1)
        out.sum().backward()
    assert torch.isfinite(out).all()
    # the gathered sampled keys [N, U, Dh] (U = 5 ceil(ln N) = 35) without triton: linear in N
    assert rec.max_numel <= n * probsparse_slots(n, 5.0) * 16, (rec.max_shape, rec.max_op)


def test_gpu_path_without_padding_matches_reference():
    """No mask: the active queries' attention runs without one (the flash kernel's case on CUDA)."""
    q, k, v = random_qkv(2, 2, 37, 8)
    samples = sample_informer_keys(None, 2, 37, 2.0, torch.device("cpu"), torch.Generator().manual_seed(2))
    with force_path("gpu"):
        out = probsparse_attention(q, k, v, factor=2.0, key_samples=samples)
    ref = probsparse_attention_reference(q, k, v, factor=2.0, key_samples=samples)
    torch.testing.assert_close(out, ref)
    grad = torch.randn_like(out)
    for a, r in zip(torch.autograd.grad(out, (q, k, v), grad), torch.autograd.grad(ref, (q, k, v), grad)):
        torch.testing.assert_close(a, r)
