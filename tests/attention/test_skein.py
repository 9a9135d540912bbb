"""Skeinformer (`skein`): the fast path against eq. (6) computed densely, paper limits, padding, stability."""

import itertools
import math

import pytest
import torch
from gpu_path_checks import running_kernels

from longattn import attention
from longattn.attention import AttentionError, force_path
from longattn.attention.skein import (
    SkeinSample,
    _draw_columns,
    gpu_slots,
    sample_counts_for,
    skein_attention,
    skein_attention_from_sample,
    skein_attention_reference,
    skein_sample,
)
from longattn.attention.softmax import softmax_attention
from longattn.attention._triton import use_triton
from longattn.testing import LargestTensorRecorder

OPTIONS = list(itertools.product(["adaptive", "simple", "none"], [True, False], ["importance", "uniform"]))


def qkv(b, h, n, p, dtype=torch.float64, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(b, h, n, p, generator=g, dtype=dtype).requires_grad_() for _ in range(3)]


def scattered_mask(b, n, keep=0.7, seed=1):
    g = torch.Generator().manual_seed(seed)
    mask = torch.rand(b, n, generator=g) < keep
    mask[:, 0] = True  # at least one real token per sequence
    return mask


def real_rows(mask, like):
    return mask[:, None, :, None].expand_as(like)


def grads_on_real_rows(out, mask, inputs, seed=2):
    # padded query rows are unspecified in the functional form: only real rows enter the loss
    g = torch.Generator().manual_seed(seed)
    weight = torch.randn(out.shape, generator=g, dtype=out.dtype) * real_rows(mask, out)
    return torch.autograd.grad(out, inputs, weight)


@pytest.mark.parametrize("path, n", [("cpu", 37), ("cpu", 101), ("gpu", 37)])
@pytest.mark.parametrize("row_normalization, pilot_reuse, column_sampling", OPTIONS)
def test_fast_path_matches_dense_eq6_forward_and_backward(path, n, row_normalization, pilot_reuse, column_sampling):
    """The CPU path and the GPU path (forced on CPU: static slots, fused attention for eq. 6) given a sample."""
    q, k, v = qkv(2, 3, n, 8)
    mask = scattered_mask(2, n)
    mask[1, 9:] = False  # the two sequences get different m and d (on the GPU path: unused slots past d_b)
    with force_path(path):
        sample = skein_sample(q, k, v, mask, samples=12, column_sampling=column_sampling,
                              generator=torch.Generator().manual_seed(3))
    assert sample.sample_counts[0] != sample.sample_counts[1]
    # a pilot row drawn twice must not have its gradient counted twice
    sample.pilot_indices[0, 0, 1] = sample.pilot_indices[0, 0, 0]
    kwargs = dict(sample=sample, row_normalization=row_normalization, pilot_reuse=pilot_reuse)
    with force_path(path):
        out = skein_attention_from_sample(q, k, v, mask, **kwargs)
    ref = skein_attention_reference(q, k, v, mask, **kwargs)
    rows = real_rows(mask, out)
    torch.testing.assert_close(out[rows], ref[rows])
    for a, r in zip(grads_on_real_rows(out, mask, (q, k, v)), grads_on_real_rows(ref, mask, (q, k, v))):
        torch.testing.assert_close(a, r)


@pytest.mark.parametrize("row_normalization, pilot_reuse, column_sampling", OPTIONS)
def test_skein_attention_draws_what_skein_sample_draws(row_normalization, pilot_reuse, column_sampling):
    q, k, v = qkv(2, 2, 45, 4)
    mask = scattered_mask(2, 45)
    opts = dict(samples=9, column_sampling=column_sampling)
    sample = skein_sample(q, k, v, mask, generator=torch.Generator().manual_seed(7), **opts)
    out = skein_attention(q, k, v, mask, generator=torch.Generator().manual_seed(7),
                          row_normalization=row_normalization, pilot_reuse=pilot_reuse, **opts)
    expected = skein_attention_from_sample(q, k, v, mask, sample=sample,
                                           row_normalization=row_normalization, pilot_reuse=pilot_reuse)
    torch.testing.assert_close(out, expected, rtol=0, atol=0)


@pytest.mark.parametrize("row_normalization", ["adaptive", "simple"])
@pytest.mark.parametrize("pilot_reuse", [True, False])
def test_every_column_sampled_equals_exact_softmax(row_normalization, pilot_reuse):
    # With d = m there is no un-selected column: eq. (6) is the exact softmax normaliser.
    b, h, n = 2, 2, 53
    q, k, v = qkv(b, h, n, 8, seed=4)
    mask = scattered_mask(b, n, seed=5)
    mask[1, :20] = False
    m = mask.sum(-1)
    slots = int(m.max())
    g = torch.Generator().manual_seed(6)
    columns = torch.zeros(b, h, slots, dtype=torch.long)
    pilot = torch.zeros(b, h, slots, dtype=torch.long)
    for i in range(b):
        positions = mask[i].nonzero().flatten()
        for j in range(h):
            columns[i, j, : m[i]] = positions[torch.randperm(m[i], generator=g)]
            pilot[i, j, : m[i]] = positions[torch.randint(m[i], (int(m[i]),), generator=g)]
    sample = SkeinSample(pilot, columns, m.clone())
    out = skein_attention_from_sample(q, k, v, mask, sample=sample,
                                      row_normalization=row_normalization, pilot_reuse=pilot_reuse)
    exact = softmax_attention(q, k, v, mask)
    rows = real_rows(mask, out)
    torch.testing.assert_close(out[rows], exact[rows])
    for a, r in zip(grads_on_real_rows(out, mask, (q, k, v)), grads_on_real_rows(exact, mask, (q, k, v))):
        torch.testing.assert_close(a, r)


def test_pilot_rows_get_their_exact_output():
    q, k, v = qkv(1, 2, 64, 8, seed=8)
    sample = skein_sample(q, k, v, samples=10, generator=torch.Generator().manual_seed(0))
    out = skein_attention_from_sample(q, k, v, sample=sample)
    exact = softmax_attention(q, k, v)
    for h in range(2):
        rows = sample.pilot_indices[0, h]
        torch.testing.assert_close(out[0, h, rows], exact[0, h, rows])
    without = skein_attention_from_sample(q, k, v, sample=sample, pilot_reuse=False)
    assert not torch.allclose(without[0, 0, sample.pilot_indices[0, 0]], exact[0, 0, sample.pilot_indices[0, 0]])


def test_sample_size_is_min_samples_m_minus_one_per_sequence():
    mask = torch.zeros(4, 600, dtype=torch.bool)
    mask[0, :] = True  # m = 600 -> 256
    mask[1, ::3] = True  # m = 200 -> 199
    mask[2, 5] = True  # m = 1 -> 1 (the only column)
    # m = 0 -> 0
    assert sample_counts_for(mask, 256).tolist() == [256, 199, 1, 0]
    q, k, v = qkv(4, 2, 600, 4)
    sample = skein_sample(q, k, v, mask)
    assert sample.column_indices.shape == (4, 2, 256)
    out = skein_attention(q, k, v, mask)
    assert torch.isfinite(out).all()
    assert torch.all(out[3] == 0), "a sequence without real tokens gives zeros"
    torch.testing.assert_close(out[2, :, 5], v[2, :, 5].detach())  # one real token: its value


def test_padded_tokens_are_never_drawn_and_padded_content_never_matters():
    b, h, n = 3, 4, 211
    q, k, v = qkv(b, h, n, 8, seed=9)
    mask = scattered_mask(b, n, keep=0.4, seed=10)  # scattered, mostly padding
    real_heads = mask[:, None, :].expand(b, h, n)
    for seed, column_sampling in itertools.product(range(10), ["importance", "uniform"]):
        sample = skein_sample(q, k, v, mask, samples=64, column_sampling=column_sampling,
                              generator=torch.Generator().manual_seed(seed))
        used = sample.slot_mask().expand_as(sample.column_indices)
        assert real_heads.gather(2, sample.pilot_indices)[used].all()
        assert real_heads.gather(2, sample.column_indices)[used].all()
        for i, j in itertools.product(range(b), range(h)):
            cols = sample.column_indices[i, j, : sample.sample_counts[i]]
            assert cols.unique().numel() == cols.numel(), "columns are drawn without replacement"

    # padded content (even nan/inf) changes neither the draws nor the real outputs
    poison = torch.full_like(q, float("nan"))
    poison[..., 0] = float("inf")
    q2, k2, v2 = (torch.where(real_rows(mask, t), t, poison) for t in (q, k, v))
    s1 = skein_sample(q, k, v, mask, generator=torch.Generator().manual_seed(1))
    s2 = skein_sample(q2, k2, v2, mask, generator=torch.Generator().manual_seed(1))
    assert torch.equal(s1.pilot_indices, s2.pilot_indices)
    assert torch.equal(s1.column_indices, s2.column_indices)
    out1 = skein_attention(q, k, v, mask, generator=torch.Generator().manual_seed(1))
    out2 = skein_attention(q2, k2, v2, mask, generator=torch.Generator().manual_seed(1))
    rows = real_rows(mask, out1)
    torch.testing.assert_close(out2[rows], out1[rows])
    assert torch.isfinite(out2).all()


def test_column_probabilities_follow_eq5():
    b, h, n, d = 1, 2, 40, 7
    q, k, v = qkv(b, h, n, 8, seed=11)
    mask = scattered_mask(b, n, seed=12)
    sample = skein_sample(q, k, v, mask, samples=d, generator=torch.Generator().manual_seed(0))
    scale = 1 / math.sqrt(8)
    for j in range(h):
        scores = (q[0, j] @ k[0, j].T * scale).masked_fill(~mask[0], float("-inf"))
        pilot_rows = torch.softmax(scores, -1)[sample.pilot_indices[0, j]]  # B_J with repeats
        weight = pilot_rows.square().sum(0).sqrt() * v[0, j].norm(dim=-1)  # eq. (5)
        p_hat = weight / weight.sum()
        torch.testing.assert_close(sample.column_probabilities[0, j], p_hat[sample.column_indices[0, j]].detach())
        assert torch.all(p_hat[~mask[0]] == 0)


def test_column_draws_have_the_requested_first_draw_frequencies():
    probs = torch.tensor([0.5, 0.25, 0.15, 0.1, 0.0])
    draws = 40000
    real = torch.tensor([[True, True, True, True, True]])
    columns = _draw_columns(probs.expand(1, draws, 5), real, 3, torch.Generator().manual_seed(0))
    freq = torch.bincount(columns[0, :, 0], minlength=5).double() / draws
    torch.testing.assert_close(freq, probs.double(), atol=0.01, rtol=0)
    # the zero-probability column is drawn only once the positive ones are exhausted
    assert (columns[0, :, :3] != 4).all()
    for row in columns[0, :100]:
        assert row.unique().numel() == 3


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("row_normalization", ["adaptive", "simple"])
def test_stable_with_large_scores_in_low_precision(dtype, row_normalization):
    b, h, n, p = 2, 2, 129, 16
    q, k, v = (t.detach() for t in qkv(b, h, n, p, seed=13))
    q = q * 12.0
    k = k * 12.0  # |scores| reach several hundred
    mask = scattered_mask(b, n, seed=14)
    scores = (q.float() @ k.float().transpose(-1, -2)) / math.sqrt(p)
    assert torch.isinf(torch.exp(scores)).any(), "the naive exp(QK^T) must overflow for this test to mean anything"
    sample = skein_sample(q, k, v, mask, samples=32, generator=torch.Generator().manual_seed(0))
    expected = skein_attention_from_sample(q, k, v, mask, sample=sample, row_normalization=row_normalization)
    ql, kl, vl = (t.to(dtype).requires_grad_() for t in (q, k, v))
    out = skein_attention_from_sample(ql, kl, vl, mask, sample=sample, row_normalization=row_normalization)
    assert out.dtype == dtype
    assert torch.isfinite(out).all()
    rows = real_rows(mask, out)
    tol = dict(rtol=1e-3, atol=1e-3) if dtype == torch.float32 else dict(rtol=0.1, atol=0.1)
    if dtype == torch.float32:
        torch.testing.assert_close(out[rows].double(), expected[rows], **tol)
    else:
        # bf16 rounding of q and k moves scores of size ~300 by ~1: compare with the same rounded inputs
        rounded = [t.to(dtype).double() for t in (q, k, v)]
        expected = skein_attention_from_sample(*rounded, mask, sample=sample, row_normalization=row_normalization)
        torch.testing.assert_close(out[rows].double(), expected[rows], **tol)
    out.float().square().sum().backward()
    assert all(torch.isfinite(t.grad).all() for t in (ql, kl, vl))
    # the full stochastic path is finite as well
    full = skein_attention(ql, kl, vl, mask, row_normalization=row_normalization)
    assert torch.isfinite(full).all()


def test_exact_row_sums_ablation_has_no_quadratic_intermediate():
    n = 2048
    q, k, v = qkv(1, 1, n, 16)
    with LargestTensorRecorder() as rec:
        skein_attention(q, k, v, row_normalization="none").sum().backward()
    assert rec.max_numel <= n * 256, (rec.max_shape, rec.max_op)


def test_module_redraws_in_eval_and_accepts_ablation_options():
    torch.manual_seed(0)
    x = torch.randn(2, 300, 16)
    layer = attention.build("skein", dim=16, heads=2, samples=32).eval()
    assert not torch.allclose(layer(x), layer(x)), "samples are redrawn at every forward, also in eval"
    for row_normalization, pilot_reuse, column_sampling in OPTIONS:
        layer = attention.build("skein", dim=16, heads=2, samples=16, row_normalization=row_normalization,
                                pilot_reuse=pilot_reuse, column_sampling=column_sampling)
        out = layer(x, torch.rand(2, 300) > 0.5)
        assert torch.isfinite(out).all()


@pytest.mark.parametrize("options, message", [
    (dict(samples=0), "samples"),
    (dict(samples=2.5), "samples"),
    (dict(column_sampling="topk"), "column_sampling"),
    (dict(row_normalization="exact"), "row_normalization"),
    (dict(pilot_reuse="yes"), "pilot_reuse"),
])
def test_bad_options_raise(options, message):
    with pytest.raises(AttentionError, match=message):
        attention.build("skein", dim=16, heads=2, **options)
    q, k, v = qkv(1, 2, 10, 8)
    with pytest.raises(AttentionError, match=message):
        skein_attention(q, k, v, **options)


def test_bad_samples_raise():
    q, k, v = qkv(1, 1, 12, 4)
    mask = torch.ones(1, 12, dtype=torch.bool)
    mask[0, 3] = False
    good = skein_sample(q, k, v, mask, samples=4, generator=torch.Generator().manual_seed(0))

    def variant(**changes):
        fields = dict(pilot_indices=good.pilot_indices.clone(), column_indices=good.column_indices.clone(),
                      sample_counts=good.sample_counts.clone(), column_probabilities=good.column_probabilities)
        fields.update(changes)
        return SkeinSample(**fields)

    padded = good.column_indices.clone()
    padded[0, 0, 0] = 3
    duplicate = good.column_indices.clone()
    duplicate[0, 0, 1] = duplicate[0, 0, 0]
    cases = [
        (variant(column_indices=padded), "padded"),
        (variant(column_indices=duplicate), "distinct"),
        (variant(sample_counts=torch.tensor([5])), "sample_counts"),
        (variant(pilot_indices=good.pilot_indices + 100), r"\[0, 12\)"),
    ]
    for sample, message in cases:
        with pytest.raises(AttentionError, match=message):
            skein_attention_from_sample(q, k, v, mask, sample=sample)
    with pytest.raises(AttentionError, match="column_probabilities"):
        skein_attention_from_sample(q, k, v, mask, sample=variant(column_probabilities=None), row_normalization="none")


def test_importance_sampling_finds_the_heavy_columns():
    # A few "hub" keys take most of the attention mass: eq. (5) should sample them, uniform
    # column sampling mostly misses them (Sec. 4.1), and V-Mean ignores them.
    from longattn.attention.vmean import vmean_attention

    g = torch.Generator().manual_seed(0)
    n, p = 1023, 16
    q, k, v = (torch.randn(1, 2, n, p, generator=g, dtype=torch.float64) for _ in range(3))
    hubs = torch.randperm(n, generator=g)[:8]
    k[:, :, hubs] += 3.0 * torch.randn(1, 2, 8, p, generator=g, dtype=torch.float64)
    exact = softmax_attention(q, k, v)

    def error(approx):
        return (torch.linalg.matrix_norm(exact - approx, ord=2) / torch.linalg.matrix_norm(exact, ord=2)).mean()

    def mean_error(**options):
        return sum(error(skein_attention(q, k, v, samples=64, generator=torch.Generator().manual_seed(s), **options))
                   for s in range(4)) / 4

    importance, uniform = mean_error(), mean_error(column_sampling="uniform")
    assert importance < 0.7 * uniform
    assert importance < 0.7 * error(vmean_attention(q, k, v))


# ----------------------------------------------------------------------------- GPU path (forced on CPU)


def gpu_sample(q, k, v, mask, seed=3, **options):
    with force_path("gpu"):
        return skein_sample(q, k, v, mask, generator=torch.Generator().manual_seed(seed), **options)


@pytest.mark.parametrize("row_normalization", ["adaptive", "simple", "none"])
def test_gpu_path_draws_what_its_sample_draws_and_what_the_cpu_path_draws(row_normalization):
    q, k, v = qkv(2, 2, 45, 4)
    mask = scattered_mask(2, 45)
    with force_path("gpu"):
        out = skein_attention(q, k, v, mask, samples=9, row_normalization=row_normalization,
                              generator=torch.Generator().manual_seed(7))
        expected = skein_attention_from_sample(q, k, v, mask, sample=gpu_sample(q, k, v, mask, seed=7, samples=9),
                                               row_normalization=row_normalization)
    torch.testing.assert_close(out, expected, rtol=0, atol=0)
    # without padding the fused attention runs without masks (every slot is used): the same output
    with force_path("gpu"):
        unmasked = skein_attention(q, k, v, samples=9, row_normalization=row_normalization,
                                   generator=torch.Generator().manual_seed(7))
        masked = skein_attention_from_sample(q, k, v, sample=gpu_sample(q, k, v, None, seed=7, samples=9),
                                             row_normalization=row_normalization)
    torch.testing.assert_close(unmasked, masked)
    # both paths draw the same indices from one generator state (the CPU path keeps the slots it uses)
    mask[:, 6:] = False  # the CPU path's slots (the largest d, 5) fewer than the GPU path's D = 9
    cpu_sample = skein_sample(q, k, v, mask, samples=9, generator=torch.Generator().manual_seed(7))
    gpu_draws = gpu_sample(q, k, v, mask, seed=7, samples=9)
    slots = cpu_sample.column_indices.shape[-1]
    assert slots < gpu_draws.column_indices.shape[-1]
    used = cpu_sample.slot_mask().expand_as(cpu_sample.column_indices)  # unused slots hold arbitrary indices
    for name in ("pilot_indices", "column_indices"):
        assert torch.equal(getattr(gpu_draws, name)[..., :slots][used], getattr(cpu_sample, name)[used])
    cpu = skein_attention(q, k, v, mask, samples=9, row_normalization=row_normalization,
                          generator=torch.Generator().manual_seed(7))
    with force_path("gpu"):
        gpu = skein_attention(q, k, v, mask, samples=9, row_normalization=row_normalization,
                              generator=torch.Generator().manual_seed(7))
    torch.testing.assert_close(gpu, cpu)


def test_gpu_path_on_short_empty_and_poisoned_sequences():
    q, k, v = qkv(4, 2, 30, 4)
    mask = torch.zeros(4, 30, dtype=torch.bool)
    mask[0] = True
    mask[1, ::3] = True
    mask[2, 5] = True  # one real token: its own value
    # sequence 3 has no real token: zeros
    poison = torch.full_like(q, float("nan"))
    q2, k2, v2 = (torch.where(real_rows(mask, t), t, poison) for t in (q, k, v))
    for row_normalization, pilot_reuse, column_sampling in OPTIONS:
        opts = dict(samples=8, row_normalization=row_normalization, pilot_reuse=pilot_reuse,
                    column_sampling=column_sampling)
        with force_path("gpu"):
            out = skein_attention(q, k, v, mask, generator=torch.Generator().manual_seed(0), **opts)
            poisoned = skein_attention(q2, k2, v2, mask, generator=torch.Generator().manual_seed(0), **opts)
        assert torch.isfinite(out).all() and torch.all(out[3] == 0)
        torch.testing.assert_close(out[2, :, 5], v[2, :, 5].detach())
        torch.testing.assert_close(poisoned, out)
        out.square().sum().backward()
        assert all(torch.isfinite(t.grad).all() for t in (q, k, v))


def test_gpu_sample_draws_real_distinct_columns_into_static_slots():
    q, k, v = qkv(3, 4, 211, 8, seed=9)
    mask = scattered_mask(3, 211, keep=0.4, seed=10)
    mask[2, 20:] = False
    sample = gpu_sample(q, k, v, mask, samples=64)
    assert sample.column_indices.shape == (3, 4, gpu_slots(211, 64)) == (3, 4, 64)
    assert sample.sample_counts.tolist() == sample_counts_for(mask, 64).tolist()
    used = sample.slot_mask().expand_as(sample.column_indices)
    real_heads = mask[:, None, :].expand(3, 4, 211)
    assert real_heads.gather(2, sample.pilot_indices)[used].all()
    assert real_heads.gather(2, sample.column_indices)[used].all()
    for i, j in itertools.product(range(3), range(4)):
        cols = sample.column_indices[i, j, : sample.sample_counts[i]]
        assert cols.unique().numel() == cols.numel()


def test_gpu_path_stable_with_large_scores_in_bfloat16():
    q, k, v = (t.detach() * s for t, s in zip(qkv(2, 2, 129, 16, seed=13), (12.0, 12.0, 1.0)))
    mask = scattered_mask(2, 129, seed=14)
    sample = gpu_sample(q, k, v, mask, samples=32)
    rounded = [t.to(torch.bfloat16).double() for t in (q, k, v)]
    for row_normalization in ("adaptive", "simple"):
        expected = skein_attention_from_sample(*rounded, mask, sample=sample, row_normalization=row_normalization)
        with force_path("gpu"):
            out = skein_attention_from_sample(*(t.to(torch.bfloat16) for t in (q, k, v)), mask, sample=sample,
                                              row_normalization=row_normalization)
        assert out.dtype == torch.bfloat16 and torch.isfinite(out).all()
        rows = real_rows(mask, out)
        torch.testing.assert_close(out[rows].double(), expected[rows], rtol=0.1, atol=0.1)


def test_gpu_kernels_draw_and_compute_what_the_pytorch_gpu_path_does():
    """The pilot statistics of eq. (5) by the Triton kernels (compiled on CUDA, else interpreted): the same
    draws and output as the PyTorch GPU path (float32: the kernels' dtype on CUDA)."""
    q, k, v = (t.float() for t in qkv(1, 2, 40, 8, seed=3))
    mask = scattered_mask(1, 40, seed=4)
    with running_kernels() as device:
        inputs = [t.to(device) for t in (q, k, v, mask)]
        with force_path("gpu"):
            fused = skein_attention(*inputs, samples=8, generator=torch.Generator(device).manual_seed(1))
            with use_triton(False):
                plain = skein_attention(*inputs, samples=8, generator=torch.Generator(device).manual_seed(1))
    torch.testing.assert_close(fused, plain, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("row_normalization", ["adaptive", "simple"])
def test_gpu_path_has_no_quadratic_intermediate(row_normalization):
    """The largest tensors are the [d, N] pilot statistics without triton and, on CPU, the [N, d + 1] scores of
    scaled-dot-product attention's math path (fused kernels on CUDA). ("none" attends over all N keys: O(N^2)
    time by design, O(N) memory only in a fused kernel.)"""
    n = 1024
    q, k, v = qkv(1, 1, n, 16)
    with force_path("gpu"), LargestTensorRecorder() as rec:
        skein_attention(q, k, v, samples=64, row_normalization=row_normalization).sum().backward()
    assert rec.max_numel <= n * (64 + 1), (rec.max_shape, rec.max_op)
