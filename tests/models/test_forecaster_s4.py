"""S4 (S4D kernel): the FFT convolution against the recurrent scan, the kernel against its closed form,
causality, shapes, gradients, overfit."""

from __future__ import annotations

import math

import pytest
import torch

from forecaster_checks import check_forward_and_gradients, check_rejects_bad_input, overfit_ratio, tiny
from longattn.models.s4 import S4DKernel, S4DLayer, causal_fft_conv, s4d_recurrence


@pytest.mark.parametrize("length", [1, 17, 32])
def test_fft_convolution_matches_the_recurrent_scan(length):
    kernel = S4DKernel(3, state_size=8).double()
    u = torch.randn(2, 3, length, dtype=torch.float64)
    d = torch.randn(3, dtype=torch.float64)
    fast = causal_fft_conv(u, kernel(length)) + u * d[:, None]
    torch.testing.assert_close(fast, s4d_recurrence(kernel, u, d))


def test_kernel_closed_form_and_initialisation():
    kernel = S4DKernel(2, state_size=6).double()
    a = -0.5 + 1j * math.pi * torch.arange(3)  # S4D-Lin
    torch.testing.assert_close(torch.complex(-kernel.log_A_real.exp(), kernel.A_imag),
                               a.to(torch.complex128).expand(2, 3))
    assert (kernel.log_dt.exp() >= 0.001).all() and (kernel.log_dt.exp() <= 0.1).all()
    dt = kernel.log_dt.exp()
    c = torch.view_as_complex(kernel.C.contiguous())
    expected = torch.stack([torch.stack([2 * sum(c[h, n] * (torch.exp(dt[h] * a[n]) - 1) / a[n]
                                                 * torch.exp(dt[h] * a[n]) ** l for n in range(3)).real
                                         for l in range(5)]) for h in range(2)])
    torch.testing.assert_close(kernel(5), expected)


@pytest.mark.parametrize("bidirectional", [False, True])
def test_layer_causality(bidirectional):
    layer = S4DLayer(4, state_size=4, bidirectional=bidirectional).double().eval()
    u = torch.randn(2, 4, 15, dtype=torch.float64)
    changed = u.clone()
    changed[..., 10:] += 1.0
    same = torch.allclose(layer(u)[..., :10], layer(changed)[..., :10])
    assert same != bidirectional  # causal kernels never look ahead; the bidirectional layer does


SMALL = dict(d_model=16, layers=2, state_size=8)


@pytest.mark.parametrize("seq_len, pred_len, options", [(23, 5, {}), (24, 7, {"bidirectional": True})])
def test_shapes_and_gradients(seq_len, pred_len, options):
    model = tiny("s4", 3, seq_len, pred_len, **SMALL, **options)
    check_forward_and_gradients(model, seq_len, pred_len, 3)
    check_rejects_bad_input(model, seq_len, 3)


def test_calendar_marks():
    check_forward_and_gradients(tiny("s4", 3, 24, 7, calendar_dim=4, **SMALL), 24, 7, 3, calendar_dim=4)


def test_overfits_a_synthetic_series():
    assert overfit_ratio(tiny("s4", 2, 24, 6, **SMALL), 24, 6, 2) < 0.5
