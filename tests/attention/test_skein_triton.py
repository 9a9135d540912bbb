"""Skeinformer's pilot statistics kernels (compiled on CUDA, else interpreted) against their plain PyTorch
reference: padding anywhere, unused slots, a sequence without real tokens, pilot and key blocks with partial
tails."""

import pytest
import torch
from gpu_path_checks import running_kernels, skip_float64_kernels_on_cuda

from longattn.attention.skein import _draw_pilot, _slot_mask, sample_counts_for
from longattn.testing import scattered_mask


@pytest.mark.parametrize("dtype, rtol", [(torch.float64, 1e-12), (torch.float32, 1e-5), (torch.float16, 2e-2)])
def test_pilot_square_sums_match_the_reference(dtype, rtol):
    skip_float64_kernels_on_cuda(dtype)
    g = torch.Generator().manual_seed(0)
    q, k = (torch.randn(3, 2, 70, 12, generator=g, dtype=torch.float64) for _ in range(2))
    real = scattered_mask(3, 70)
    real[1, 9:] = False  # d < D: unused slots
    real[2] = False  # no real token: zeros
    slots = 40  # two pilot blocks of 32, the second partial; N = 70: two key blocks of 64
    pilot = _draw_pilot(real, 2, slots, torch.Generator().manual_seed(1))
    used = _slot_mask(sample_counts_for(real, slots), slots)
    with running_kernels() as device:
        from longattn.attention._skein_triton import pilot_square_sums, pilot_square_sums_reference

        got = pilot_square_sums(*(t.to(device) for t in (q.to(dtype), k.to(dtype), real, pilot, used)), 0.4).cpu()
    want = pilot_square_sums_reference(q, k, real, pilot, used, 0.4)
    assert got.dtype == (torch.float64 if dtype == torch.float64 else torch.float32)
    torch.testing.assert_close(got.double(), want, rtol=rtol, atol=rtol * want.abs().max().item())
    assert torch.all(got[2] == 0) and torch.all(got[0][:, ~real[0]] == 0)
