"""The GPU paths of the sampled mechanisms (skein, informer, reformer) and of the kernel family's causal scans
(linear, performer, cosformer), forced on CPU: launch overhead (aten ops per forward+backward, independent of the
length and the batch), autocast (output dtype, RMS ratio against float64), padding, no N x N intermediate.
Each mechanism's test file compares its GPU path with its reference; the Triton kernels have their own files."""

import pytest
import torch
from gpu_path_checks import OP_COUNT_SHAPES, assert_close_rms, module_op_counts, rms_ratio

from longattn import attention
from longattn.attention import force_path
from longattn.attention.informer import probsparse_attention
from longattn.attention.reformer import lsh_attention
from longattn.attention.skein import skein_attention_from_sample, skein_sample
from longattn.testing import LargestTensorRecorder, random_qkv, scattered_mask

MECHANISMS = [
    ("skein", {}),
    ("skein", {"row_normalization": "none"}),
    ("informer", {}),
    ("reformer", {}),
    ("reformer", {"causal": True}),
    ("linear", {}),
    ("linear", {"causal": True}),
    ("performer", {}),
    ("performer", {"causal": True}),
    ("cosformer", {}),
    ("cosformer", {"causal": True}),
]
IDS = [name + "-" + "-".join(f"{k}={v}" for k, v in options.items()) for name, options in MECHANISMS]

# RMS(error) / RMS(float64) under CPU autocast with the GPU path forced (flash-linear-attention's measure):
# bfloat16 keeps 8 significant bits, float16 11
RMS_RATIO = {torch.bfloat16: 1.5e-2, torch.float16: 2e-3}


@pytest.mark.parametrize("name, options", MECHANISMS, ids=IDS)
def test_op_count_does_not_grow_with_length_or_batch(name, options):
    """One forward+backward of the module on meta tensors: the same aten ops at N = 1k and 64k, batch 2 and 64
    (a Python loop over tokens, blocks, chunks, buckets, samples, rows or heads would change the count)."""
    counts = module_op_counts(name, **options)
    assert len(set(counts)) == 1, dict(zip(OP_COUNT_SHAPES, counts))
    assert counts[0] < 500


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("name, causal", [("linear", False), ("linear", True), ("cosformer", False),
                                          ("cosformer", True), ("performer", False), ("performer", True)])
def test_autocast_module_output_dtype_and_rms_ratio(name, causal, dtype):
    torch.manual_seed(0)
    layer = attention.build(name, dim=64, heads=4, causal=causal)
    x = torch.randn(2, 300, 64)
    mask = scattered_mask(2, 300)
    reference = layer.double()(x.double(), mask)
    layer.float()
    with force_path("gpu"), torch.autocast("cpu", dtype=dtype):
        out = layer(x, mask)
    assert out.dtype == dtype
    assert_close_rms(out, reference, RMS_RATIO[dtype])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("row_normalization", ["adaptive", "simple", "none"])
def test_autocast_skein_given_its_sample(row_normalization, dtype):
    """Skeinformer's deterministic core given one float64 draw (a half-precision draw may pick other columns)."""
    q, k, v = (t.detach() for t in random_qkv(2, 4, 300, 16, dtype=torch.float32))
    mask = scattered_mask(2, 300)
    with force_path("gpu"):
        sample = skein_sample(q.double(), k.double(), v.double(), mask, samples=64,
                              generator=torch.Generator().manual_seed(0))
        reference = skein_attention_from_sample(q.double(), k.double(), v.double(), mask, sample=sample,
                                                row_normalization=row_normalization)
        with torch.autocast("cpu", dtype=dtype):
            out = skein_attention_from_sample(q, k, v, mask, sample=sample, row_normalization=row_normalization)
    assert out.dtype == dtype
    rows = mask[:, None, :, None].expand_as(out)
    assert_close_rms(out[rows], reference[rows], RMS_RATIO[dtype])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_autocast_informer_with_every_query_active(dtype):
    """u = m (factor 20 at 60 tokens): half precision cannot reorder the top-u queries, so the output is the
    float32-softmax attention of the autocast path against float64."""
    q, k, v = (t.detach() for t in random_qkv(2, 4, 60, 16, dtype=torch.float32))
    mask = scattered_mask(2, 60)
    with force_path("gpu"):
        reference = probsparse_attention(q.double(), k.double(), v.double(), mask, factor=20.0)
        with torch.autocast("cpu", dtype=dtype):
            out = probsparse_attention(q, k, v, mask, factor=20.0)
    assert out.dtype == dtype
    rows = mask[:, None, :, None].expand_as(out)
    assert_close_rms(out[rows], reference[rows], RMS_RATIO[dtype])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("causal", [False, True])
def test_autocast_reformer_with_well_separated_buckets(causal, dtype):
    """Vectors near one rotation column each, so that half precision hashes them as float64 does."""
    g = torch.Generator().manual_seed(0)
    d, half, rounds, n = 16, 8, 2, 301
    columns = torch.linalg.qr(torch.randn(d, d, generator=g, dtype=torch.float64))[0][:, :half]
    rotations = columns[:, None, :].expand(d, rounds, half).contiguous()
    which = torch.randint(half, (2, 4, n), generator=g)
    sign = torch.randint(2, (2, 4, n), generator=g) * 2 - 1
    qk = 4 * columns.T[which] * sign[..., None] + 0.3 * torch.randn(2, 4, n, d, generator=g, dtype=torch.float64)
    v = torch.randn(2, 4, n, d, generator=g, dtype=torch.float64)
    mask = scattered_mask(2, n)
    kw = dict(bucket_size=32, is_causal=causal)
    with force_path("gpu"):
        reference = lsh_attention(qk, v, mask, rotations=rotations, **kw)
        with torch.autocast("cpu", dtype=dtype):
            out = lsh_attention(qk.float(), v.float(), mask, rotations=rotations.float(), **kw)
    assert out.dtype == dtype
    rows = mask[:, None, :, None].expand_as(out)
    assert_close_rms(out[rows], reference[rows], RMS_RATIO[dtype])


@pytest.mark.parametrize("name, options", MECHANISMS, ids=IDS)
def test_padded_content_never_matters_and_padded_rows_are_zero(name, options):
    torch.manual_seed(0)
    layer = attention.build(name, dim=32, heads=2, **options).double().eval()
    x = torch.randn(2, 101, 32, dtype=torch.float64)
    mask = scattered_mask(2, 101)
    poisoned = torch.where(mask[..., None], x, torch.full_like(x, float("nan")))
    with force_path("gpu"):
        torch.manual_seed(1)
        out = layer(x, mask)
        torch.manual_seed(1)
        again = layer(poisoned, mask)
    torch.testing.assert_close(again, out)
    assert torch.all(out[~mask] == 0) and torch.isfinite(out).all()


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("name", ["linear", "performer", "cosformer"])
def test_kernel_family_has_no_quadratic_intermediate(name, causal):
    """Not causal: [N, F] features and [F, Dv + 1] contexts; causal, the chunked scan without triton:
    [N / 64, F, Dv + 1] states and [N / 64, 64, 64] intra-chunk products."""
    def largest(n):
        torch.manual_seed(0)
        layer = attention.build(name, dim=32, heads=1, causal=causal)
        x = torch.randn(1, n, 32, requires_grad=True)
        with force_path("gpu"), LargestTensorRecorder() as rec:
            layer(x).sum().backward()
        return rec

    big, small = largest(2048), largest(1024)
    assert big.max_numel <= 2048 * 256, (big.max_shape, big.max_op)
    assert big.max_numel <= 2.5 * small.max_numel


def test_rms_ratio_measures_relative_error():
    ref = torch.ones(4, dtype=torch.float64)
    assert rms_ratio(ref * 1.01, ref) == pytest.approx(0.01)
