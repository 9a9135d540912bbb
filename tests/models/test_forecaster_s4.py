"""S4 (S4D kernel): the FFT convolution against the recurrent scan and (forward and gradients) a plain sum, the
kernel against its closed form (forward and gradients), causality, shapes, gradients, overfit."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from forecaster_checks import (SMALL_OPTIONS, check_forward_and_gradients, check_matches_reference_with_dropout,
                               check_rejects_bad_input, overfit_ratio, tiny)
from longattn.models.s4 import S4DKernel, S4DLayer, causal_fft_conv, s4d_recurrence


@pytest.mark.parametrize("length", [1, 17, 32])
def test_fft_convolution_matches_the_recurrent_scan(length):
    kernel = S4DKernel(3, state_size=8).double()
    u = torch.randn(2, 3, length, dtype=torch.float64)
    d = torch.randn(3, dtype=torch.float64)
    fast = causal_fft_conv(u, kernel(length)) + u * d[:, None]
    torch.testing.assert_close(fast, s4d_recurrence(kernel, u, d))


def plain_causal_conv(u, kernel):
    """y_t = sum_(s <= t) K_(t-s) u_s written out."""
    n = u.shape[-1]
    return torch.stack([sum(kernel[..., t - s] * u[..., s] for s in range(t + 1)) for t in range(n)], dim=-1)


@pytest.mark.parametrize("length", [1, 2, 17, 32])
@pytest.mark.parametrize("u_needs_grad", [True, False])
def test_fft_convolution_gradients_match_a_plain_sum(length, u_needs_grad):
    """The written-out backward (correlations by FFT) against autograd through the plain sum, float64."""
    torch.manual_seed(length)
    u = torch.randn(3, 4, length, dtype=torch.float64, requires_grad=u_needs_grad)
    kernel = torch.randn(4, length, dtype=torch.float64, requires_grad=True)
    out, ref = causal_fft_conv(u, kernel), plain_causal_conv(u, kernel)
    torch.testing.assert_close(out, ref)
    g = torch.randn_like(out)
    inputs = [u, kernel] if u_needs_grad else [kernel]
    for a, r in zip(torch.autograd.grad(out, inputs, g), torch.autograd.grad(ref, inputs, g)):
        torch.testing.assert_close(a, r)
    with pytest.raises(ValueError, match="kernel length"):
        causal_fft_conv(u, kernel[..., 1:])


def complex_vandermonde_kernel(kernel, length):
    """The pre-change computation (S4D eq. 5 in complex arithmetic): 2 Re(sum_n (C B_bar)_n exp(l dt A_n))."""
    dt_a, b_bar, c = kernel.discretised()
    powers = torch.exp(dt_a[..., None] * torch.arange(length))
    return 2 * torch.einsum("hn,hnl->hl", c * b_bar, powers).real


@pytest.mark.parametrize("length", [1, 19, 64])
def test_real_arithmetic_kernel_matches_the_complex_form_with_gradients(length):
    torch.manual_seed(length)
    kernel = S4DKernel(3, state_size=10).double()
    out, ref = kernel(length), complex_vandermonde_kernel(kernel, length)
    torch.testing.assert_close(out, ref)
    g = torch.randn_like(out)
    params = list(kernel.parameters())
    for a, r in zip(torch.autograd.grad(out, params, g), torch.autograd.grad(ref, params, g)):
        torch.testing.assert_close(a, r)


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


@pytest.mark.parametrize("length", [1, 23])
def test_layer_output_product_matches_the_convolution_with_the_same_dropout(length):
    """The output Conv1d(H, 2H, 1) as a batched product: forward and gradients against the nn.Conv1d module
    itself (float64, training mode, the same dropout mask for the same seed)."""
    torch.manual_seed(length)
    layer = S4DLayer(6, state_size=4, dropout=0.3).double().train()
    u = torch.randn(3, 6, length, dtype=torch.float64, requires_grad=True)

    def plain(u):
        y = causal_fft_conv(u, layer.kernel(length)) + u * layer.D[:, None]
        return layer.output(layer.dropout(F.gelu(y)))

    check_matches_reference_with_dropout(layer, plain, u, list(layer.parameters()))


@pytest.mark.parametrize("bidirectional", [False, True])
def test_layer_causality(bidirectional):
    layer = S4DLayer(4, state_size=4, bidirectional=bidirectional).double().eval()
    u = torch.randn(2, 4, 15, dtype=torch.float64)
    changed = u.clone()
    changed[..., 10:] += 1.0
    same = torch.allclose(layer(u)[..., :10], layer(changed)[..., :10])
    assert same != bidirectional  # causal kernels never look ahead; the bidirectional layer does


SMALL = SMALL_OPTIONS["s4"]


@pytest.mark.parametrize("seq_len, pred_len, options", [(23, 5, {}), (24, 7, {"bidirectional": True})])
def test_shapes_and_gradients(seq_len, pred_len, options):
    model = tiny("s4", 3, seq_len, pred_len, **SMALL, **options)
    check_forward_and_gradients(model, seq_len, pred_len, 3)
    check_rejects_bad_input(model, seq_len, 3)


def test_calendar_marks():
    check_forward_and_gradients(tiny("s4", 3, 24, 7, calendar_dim=4, **SMALL), 24, 7, 3, calendar_dim=4)


def test_overfits_a_synthetic_series():
    assert overfit_ratio(tiny("s4", 2, 24, 6, **SMALL), 24, 6, 2) < 0.5
