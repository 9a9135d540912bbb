"""S4 as the forecasting papers' state-space baseline, with the diagonal S4D kernel (Gu, Gupta, Goel, Re, "On the
Parameterization and Initialization of Diagonal State Space Models", NeurIPS 2022; the model of Gu, Goel, Re,
"Efficiently Modeling Long Sequences with Structured State Spaces", ICLR 2022).

Per channel h, the continuous SSM x' = A x + B u, y = C x + D u (S4 eq. 1) with diagonal complex A (N/2 modes,
each with its conjugate, hence the factor 2 Re below), B = 1, discretised by zero-order hold with a learned step
dt (S4D eq. 4 / Section 3): A_bar = exp(dt A), B_bar = (exp(dt A) - 1) / A. Its output is the convolution of u
with the kernel (S4 eq. 5, S4D eq. 5, a Vandermonde product)

    K_l = 2 Re( sum_n C_n B_bar_n A_bar_n^l ),  l = 0 .. L - 1,

computed here by FFT (:meth:`S4DKernel.forward` + :func:`causal_fft_conv`); :func:`s4d_recurrence` is the plain
recurrent scan x_k = A_bar x_{k-1} + B_bar u_k, y_k = 2 Re(C x_k) + D u_k that the tests compare with.
Initialisation S4D-Lin: A_n = -1/2 + i pi n; dt log-uniform in [0.001, 0.1]; C complex normal; D normal.

Forecaster (the S4 paper's masked set-up for the Informer benchmarks, Section 4.3 / Appendix): the window followed
by ``pred_len`` zeros is embedded by a Linear, passed through ``layers`` residual S4D blocks (S4D -> GELU ->
dropout -> Conv1d(H, 2H, 1) + GLU, then residual and post-LayerNorm, as the authors' example model) and a Linear
to the channels; the outputs at the placeholder positions are the forecast.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.autograd.function import once_differentiable

from longattn.models.forecast_blocks import check_window, pointwise_conv
from longattn.models.registry import register_model


class S4DKernel(nn.Module):
    """The S4D convolution kernel [channels, L] of ``channels`` independent diagonal SSMs of state size N."""

    def __init__(self, channels: int, state_size: int = 64, dt_min: float = 0.001, dt_max: float = 0.1) -> None:
        super().__init__()
        if state_size < 2 or state_size % 2:
            raise ValueError(f"state_size must be an even number >= 2, got {state_size}")
        modes = state_size // 2
        self.log_dt = nn.Parameter(torch.rand(channels) * (math.log(dt_max) - math.log(dt_min)) + math.log(dt_min))
        self.C = nn.Parameter(torch.view_as_real(torch.randn(channels, modes, dtype=torch.cfloat)))
        self.log_A_real = nn.Parameter(torch.log(0.5 * torch.ones(channels, modes)))  # S4D-Lin: Re A = -1/2
        self.A_imag = nn.Parameter(math.pi * torch.arange(modes, dtype=torch.float32).expand(channels, -1).clone())

    def discretised(self) -> tuple[Tensor, Tensor, Tensor]:
        """(dt A, B_bar, C) as complex [channels, N/2] tensors (zero-order hold: A_bar = exp(dt A))."""
        complex_dtype = torch.complex128 if self.log_dt.dtype == torch.float64 else torch.complex64
        a = torch.complex(-torch.exp(self.log_A_real), self.A_imag).to(complex_dtype)
        dt_a = a * torch.exp(self.log_dt)[:, None]
        return dt_a, (torch.exp(dt_a) - 1.0) / a, torch.view_as_complex(self.C.contiguous()).to(complex_dtype)

    def forward(self, length: int) -> Tensor:
        dt_a, b_bar, c = self.discretised()
        # K_l = 2 Re(sum_n (C B_bar)_n A_bar_n^l) with A_bar^l = exp(l dt A) (S4D eq. 5), in real arithmetic: for
        # dt A = x + iy and C B_bar = p + iq, Re((p + iq) e^(lx) (cos ly + i sin ly)) = e^(lx) (p cos ly - q sin ly)
        # (the same numbers up to rounding; real exp, cos and sin are vectorised on CPU, the complex exp is not)
        steps = torch.arange(length, dtype=dt_a.real.dtype, device=dt_a.device)
        decay, angle = torch.exp(dt_a.real[..., None] * steps), dt_a.imag[..., None] * steps  # [H, N/2, L]
        cb = c * b_bar
        return 2 * (torch.einsum("hn,hnl->hl", cb.real, decay * torch.cos(angle))
                    - torch.einsum("hn,hnl->hl", cb.imag, decay * torch.sin(angle)))


class _CausalFFTConv(torch.autograd.Function):
    """Causal convolution by FFT of length 2L with its gradients written out as the correlations they are,
    again by FFTs of length 2L: dL/du_s = sum_(t >= s) g_t K_(t-s), dL/dK_j = sum_(batch, t) g_t u_(t-j) (the
    zero half of the padded spectra keeps them from wrapping around). Autograd's own backward of the forward
    ran a full complex FFT for the rfft's gradient and zero-filled full-length copies for the slices."""

    @staticmethod
    def forward(ctx, u: Tensor, kernel: Tensor) -> Tensor:  # type: ignore[override]
        n = u.shape[-1]
        u_spectrum, kernel_spectrum = torch.fft.rfft(u, n=2 * n), torch.fft.rfft(kernel, n=2 * n)
        ctx.save_for_backward(u_spectrum, kernel_spectrum)
        return torch.fft.irfft(u_spectrum * kernel_spectrum, n=2 * n)[..., :n]

    @staticmethod
    @once_differentiable
    def backward(ctx, grad: Tensor) -> tuple[Tensor | None, Tensor | None]:  # type: ignore[override]
        u_spectrum, kernel_spectrum = ctx.saved_tensors
        n = grad.shape[-1]
        grad_spectrum = torch.fft.rfft(grad, n=2 * n)
        grad_u = grad_kernel = None
        if ctx.needs_input_grad[0]:
            grad_u = torch.fft.irfft(grad_spectrum * kernel_spectrum.conj(), n=2 * n)[..., :n]
        if ctx.needs_input_grad[1]:
            cross = (grad_spectrum * u_spectrum.conj()).sum_to_size(kernel_spectrum.shape)  # sum over the batch
            grad_kernel = torch.fft.irfft(cross, n=2 * n)[..., :n]
        return grad_u, grad_kernel


def causal_fft_conv(u: Tensor, kernel: Tensor) -> Tensor:
    """y_t = sum_{s <= t} K_{t-s} u_s for u [B, H, L], K [H, L], by FFT of length 2L (no wrap-around)."""
    if u.shape[-1] != kernel.shape[-1]:
        raise ValueError(f"kernel length {kernel.shape[-1]} differs from the sequence length {u.shape[-1]}")
    return _CausalFFTConv.apply(u, kernel)


def s4d_recurrence(kernel: S4DKernel, u: Tensor, d: Tensor) -> Tensor:
    """The plain recurrent scan of the discretised SSM (for tests): u [B, H, L] -> y [B, H, L]."""
    dt_a, b_bar, c = kernel.discretised()
    a_bar = torch.exp(dt_a)
    state = torch.zeros(u.shape[0], *a_bar.shape, dtype=a_bar.dtype)
    outputs = []
    for t in range(u.shape[-1]):
        state = a_bar * state + b_bar * u[..., t, None]
        outputs.append(2 * (c * state).sum(-1).real + d * u[..., t])
    return torch.stack(outputs, dim=-1)


class S4DLayer(nn.Module):
    """S4D on [B, H, L]: y = K * u + D u (causal; ``bidirectional`` adds a second kernel run backwards), GELU,
    dropout, Conv1d(H, 2H, 1) + GLU."""

    def __init__(self, d_model: int, state_size: int = 64, dropout: float = 0.0, bidirectional: bool = False) -> None:
        super().__init__()
        self.bidirectional = bidirectional
        self.kernel = S4DKernel(2 * d_model if bidirectional else d_model, state_size)
        self.D = nn.Parameter(torch.randn(d_model))
        self.dropout = nn.Dropout(dropout)
        self.output = nn.Sequential(nn.Conv1d(d_model, 2 * d_model, kernel_size=1), nn.GLU(dim=-2))

    def forward(self, u: Tensor) -> Tensor:
        kernel = self.kernel(u.shape[-1]).to(u.dtype)
        if self.bidirectional:
            forward_kernel, backward_kernel = kernel.chunk(2, dim=0)
            y = causal_fft_conv(u, forward_kernel) + causal_fft_conv(u.flip(-1), backward_kernel).flip(-1)
        else:
            y = causal_fft_conv(u, kernel)
        y = y + u * self.D[:, None]
        # Conv1d(H, 2H, 1) as one batched product (the convolution's numbers up to rounding), then the GLU
        return self.output[1](pointwise_conv(self.output[0], self.dropout(F.gelu(y))))


@register_model("s4", family="forecaster")
class S4Forecaster(nn.Module):
    """S4 (S4D kernel) over [window; pred_len zeros]. Defaults (not given by the forecasting papers, see
    docs/forecasting_models.md): d_model 128, 4 layers, state size 64, dropout 0.1, causal kernels."""

    def __init__(self, channels: int, seq_len: int, pred_len: int, d_model: int = 128, layers: int = 4,
                 state_size: int = 64, dropout: float = 0.1, bidirectional: bool = False,
                 calendar_dim: int = 0) -> None:
        super().__init__()
        if layers < 1:
            raise ValueError(f"layers must be >= 1, got {layers}")
        self.channels, self.seq_len, self.pred_len = channels, seq_len, pred_len
        self.embedding = nn.Linear(channels, d_model)
        self.calendar = nn.Linear(calendar_dim, d_model, bias=False) if calendar_dim > 0 else None
        self.layers = nn.ModuleList(S4DLayer(d_model, state_size, dropout, bidirectional) for _ in range(layers))
        self.norms = nn.ModuleList(nn.LayerNorm(d_model) for _ in range(layers))
        self.dropout = nn.Dropout(dropout)
        self.projection = nn.Linear(d_model, channels)

    def forward(self, x: Tensor, marks: Tensor | None = None) -> Tensor:
        check_window(x, self.seq_len, self.channels)
        h = self.embedding(F.pad(x, (0, 0, 0, self.pred_len)))
        if self.calendar is not None:
            if marks is None or marks.shape[-1] != self.calendar.in_features:
                raise ValueError(f"this model was built with {self.calendar.in_features} calendar features; pass them")
            h = h + self.calendar(F.pad(marks, (0, 0, 0, self.pred_len)))
        for layer, norm in zip(self.layers, self.norms):
            h = norm(h + self.dropout(layer(h.transpose(1, 2)).transpose(1, 2)))
        return self.projection(h)[:, -self.pred_len :]
