import torch

from longattn.attention import build
from longattn.attention.fnet import fourier_mix, fourier_mix_reference


def test_fft_matches_dft_matrices_forward_and_backward(path):
    x = torch.randn(2, 37, 11, dtype=torch.float64, requires_grad=True)
    mask = torch.rand(2, 37) > 0.3
    out, ref = fourier_mix(x, mask), fourier_mix_reference(x, mask)
    torch.testing.assert_close(out, ref)
    g = torch.randn_like(out)
    torch.testing.assert_close(torch.autograd.grad(out, x, g)[0], torch.autograd.grad(ref, x, g)[0])


def test_constant_input_concentrates_in_the_zero_frequency():
    x = torch.ones(1, 8, 4)
    out = fourier_mix(x)
    assert out[0, 0, 0] == 32 and torch.count_nonzero(out) == 1


def test_module_has_no_parameters_and_ortho_norm_preserves_energy():
    layer = build("fnet", dim=16, heads=2, fft_norm="ortho")
    assert sum(p.numel() for p in layer.parameters()) == 0
    x = torch.randn(1, 64, 16, dtype=torch.float64)
    # Re(.) keeps at most all the energy of the unitary transform
    assert layer(x).norm() <= x.norm() + 1e-9
