"""FEDformer (Zhou et al., "FEDformer: Frequency Enhanced Decomposed Transformer for Long-term Series
Forecasting", ICML 2022).

The Autoformer-style decomposition Transformer (:class:`~longattn.models.forecast_blocks.DecompEncoderDecoder`,
FEDformer Section 3.1, Figure 2) with a Mixture-Of-Experts decomposition (MOEDecomp) and the attention blocks
replaced by frequency-enhanced blocks:

* **Fourier version** (Section 3.2): Frequency Enhanced Block FEB-f (eq. 3-4: Q~ = Select(F(q)), Y~ = Q~ (.) R,
  output F^{-1}(Padding(Y~))) for the self-attention of encoder and decoder, Frequency Enhanced Attention
  FEA-f (eq. 5-6: sigma(Q~ K~^T) V~ in the frequency domain, tanh activation, keys used as values) for the
  cross-attention. M modes (64) selected at random once at construction (Section 3.4, "random selection").
* **Wavelet version** (Section 3.3): FEB-w (Legendre multiwavelet decomposition, Fourier kernels A, B, C on
  the detail/smooth coefficients of each level, a linear map T0 on the coarsest, reconstruction) and FEA-w
  (the same decomposition of q, k, v with FEA-f-style cross attention on each level).

Where the paper and the authors' code leave details open, the code's choices are the defaults and each is an
option (see docs/forecasting_models.md): FEB-f writes the selected modes' products into the first M frequency
bins and FEA-f at the selected frequencies themselves (``output_modes`` / ``cross_output_modes``), the mode pool
is [0, L/2), FEA-f's output is divided by d_model^2, FEB-w ignores its queries and keys. Two code behaviours
that contradict or go beyond the paper are options, off by default: ``output_layout="code"``, ``shared_blocks``.
"""

from __future__ import annotations

import math
from typing import Callable

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from longattn.models.forecast_blocks import (
    DecompEncoderDecoder,
    MixtureDecomposition,
    resolve_label_len,
    truncate_or_pad_keys,
)
from longattn.models.registry import register_model

MODE_SELECTIONS = ("random", "lowest")
OUTPUT_MODES = ("first", "selected")
OUTPUT_LAYOUTS = ("paper", "code")


def frequency_modes(length: int, modes: int, method: str = "random") -> Tensor:
    """Sorted indices of the M = min(modes, length // 2) frequency bins a frequency block keeps (Section 3.4):
    ``random`` draws them once from [0, length // 2) with the global torch RNG, ``lowest`` keeps 0 .. M - 1."""
    if method not in MODE_SELECTIONS:
        raise ValueError(f"mode selection must be one of {MODE_SELECTIONS}, got {method!r}")
    if modes < 1:
        raise ValueError(f"modes must be >= 1, got {modes}")
    pool = max(1, length // 2)
    count = min(modes, pool)
    if method == "lowest":
        return torch.arange(count)
    return torch.randperm(pool)[:count].sort().values


def _complex_uniform(scale: float, *shape: int) -> nn.Parameter:
    # The authors' initialisation: scale * U[0, 1) for the real and the imaginary part.
    return nn.Parameter(scale * torch.rand(*shape, dtype=torch.cfloat))


def _as_complex(weights: Tensor, dtype: torch.dtype) -> Tensor:
    return weights.to(torch.complex128 if dtype == torch.float64 else torch.complex64)


def _check_choice(name: str, value: str, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise ValueError(f"{name} must be one of {choices}, got {value!r}")


def _to_heads(out: Tensor, layout: str) -> Tensor:
    """A frequency block's time-domain result [B, H, E, L] as heads [B, L, H, E]. ``paper``: transposed, so that
    step l holds the inverse transform at time l (eq. 4 and 6 give a length-L sequence). ``code``: the authors'
    AutoCorrelationLayer reads the [B, H, E, L] tensor as [B, L, H*E] with ``view``, which scrambles time and
    channels; kept as an option because the published numbers were produced that way."""
    b, h, e, n = out.shape
    return out.permute(0, 3, 1, 2) if layout == "paper" else out.contiguous().reshape(b, n, h, e)


class FourierBlock(nn.Module):
    """FEB-f on heads [B, L, H, E] (uses only the queries, eq. 3-4): per head, the kept modes of the rFFT over time
    are mixed across the E channels by a learned complex [E, E] matrix per mode (R in eq. 4), then inverted."""

    uses = "q"

    def __init__(self, heads: int, head_dim: int, length: int, modes: int = 64, mode_selection: str = "random",
                 output_modes: str = "first", output_layout: str = "paper") -> None:
        super().__init__()
        _check_choice("output_modes", output_modes, OUTPUT_MODES)
        _check_choice("output_layout", output_layout, OUTPUT_LAYOUTS)
        self.length, self.output_modes, self.output_layout = length, output_modes, output_layout
        self.register_buffer("index", frequency_modes(length, modes, mode_selection))
        d_model = heads * head_dim
        self.weights = _complex_uniform(1.0 / (d_model * d_model), heads, head_dim, head_dim, len(self.index))

    def forward(self, queries: Tensor, keys: Tensor, values: Tensor) -> Tensor:
        b, n, h, e = queries.shape
        if n != self.length:
            raise ValueError(f"this Fourier block was built for length {self.length}, got {n}")
        spectrum = torch.fft.rfft(queries.permute(0, 2, 3, 1), dim=-1)  # [B, H, E, L//2+1]
        mixed = torch.einsum("bhim,hiom->bhom", spectrum[..., self.index], _as_complex(self.weights, queries.dtype))
        out = torch.zeros(b, h, e, n // 2 + 1, dtype=mixed.dtype, device=queries.device)
        target = torch.arange(len(self.index), device=queries.device) if self.output_modes == "first" else self.index
        out[..., target] = mixed
        return _to_heads(torch.fft.irfft(out, n=n, dim=-1), self.output_layout)


class FourierCrossAttention(nn.Module):
    """FEA-f (eq. 5-6): Q~ = Select(F(q)), K~ = Select(F(k)); Y~ = sigma(Q~ K~^T) K~ (the keys double as values,
    as in the authors' code) mixed by a learned complex [E, E] matrix per query mode; inverted and divided by
    d_model^2 (the code's scaling). sigma = tanh (default) or softmax of the magnitudes. Unlike FEB-f, the
    authors' code writes FEA-f's products back at the selected queries' own frequencies (``output_modes=
    "selected"``, the default here)."""

    uses = "qk"

    def __init__(self, heads: int, head_dim: int, length_q: int, length_kv: int, modes: int = 64,
                 mode_selection: str = "random", activation: str = "tanh", output_modes: str = "selected",
                 output_layout: str = "paper") -> None:
        super().__init__()
        if activation not in ("tanh", "softmax"):
            raise ValueError(f"activation must be 'tanh' or 'softmax', got {activation!r}")
        _check_choice("output_modes", output_modes, OUTPUT_MODES)
        _check_choice("output_layout", output_layout, OUTPUT_LAYOUTS)
        self.length_q, self.length_kv, self.activation = length_q, length_kv, activation
        self.output_modes, self.output_layout = output_modes, output_layout
        self.register_buffer("index_q", frequency_modes(length_q, modes, mode_selection))
        self.register_buffer("index_kv", frequency_modes(length_kv, modes, mode_selection))
        self.d_model = heads * head_dim
        self.weights = _complex_uniform(1.0 / (self.d_model * self.d_model), heads, head_dim, head_dim,
                                        len(self.index_q))

    def forward(self, queries: Tensor, keys: Tensor, values: Tensor) -> Tensor:
        b, n, h, e = queries.shape
        if n != self.length_q or keys.shape[1] != self.length_kv:
            raise ValueError(f"built for lengths ({self.length_q}, {self.length_kv}), got ({n}, {keys.shape[1]})")
        q = torch.fft.rfft(queries.permute(0, 2, 3, 1), dim=-1)[..., self.index_q]  # [B, H, E, Mq]
        k = torch.fft.rfft(keys.permute(0, 2, 3, 1), dim=-1)[..., self.index_kv]  # [B, H, E, Mkv]
        scores = torch.einsum("bhex,bhey->bhxy", q, k)
        if self.activation == "tanh":
            scores = scores.tanh()
        else:
            scores = torch.complex(torch.softmax(scores.abs(), dim=-1), torch.zeros_like(scores.real))
        attended = torch.einsum("bhxy,bhey->bhex", scores, k)
        mixed = torch.einsum("bhex,heox->bhox", attended, _as_complex(self.weights, queries.dtype))
        out = torch.zeros(b, h, e, n // 2 + 1, dtype=mixed.dtype, device=queries.device)
        target = torch.arange(len(self.index_q), device=queries.device) if self.output_modes == "first" else self.index_q
        out[..., target] = mixed
        return _to_heads(torch.fft.irfft(out / (self.d_model * self.d_model), n=n, dim=-1), self.output_layout)


# ----------------------------------------------------------------------------- Legendre multiwavelets


def legendre_scaling(k: int, points: np.ndarray) -> np.ndarray:
    """phi_i(x) = sqrt(2i + 1) P_i(2x - 1) on [0, 1], i < k: the orthonormal Legendre scaling functions. [k, P]."""
    return np.stack([math.sqrt(2 * i + 1) * np.polynomial.legendre.legval(2 * points - 1, [0] * i + [1])
                     for i in range(k)])


def legendre_filters(k: int) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Two-scale filters (H0, H1, G0, G1), each [k, k], of the Legendre multiwavelets (Alpert 1993; Gupta et al.
    2021, used by FEDformer Section 3.3): phi_i(x) = sqrt(2) sum_j (H0_ij phi_j(2x) + H1_ij phi_j(2x - 1)), the
    wavelets psi likewise with G0, G1; [[H0, H1], [G0, G1]] is orthogonal. H is computed by Gauss-Legendre
    quadrature (exact for these polynomials); the wavelets by Gram-Schmidt of the half-interval functions
    sqrt(2) phi_i(2x) on [0, 1/2) against the phi and the earlier wavelets (any orthonormal completion spans the
    same space; the learned kernels that follow absorb the choice)."""
    nodes, weights = np.polynomial.legendre.leggauss(2 * k)
    left = (nodes + 1) / 4  # quadrature on [0, 1/2]
    right = left + 0.5
    half_weights = weights / 4
    phi_left, phi_right = legendre_scaling(k, left), legendre_scaling(k, right)
    h0 = math.sqrt(2) * (phi_left * half_weights) @ legendre_scaling(k, 2 * left).T
    h1 = math.sqrt(2) * (phi_right * half_weights) @ legendre_scaling(k, 2 * right - 1).T
    basis = [np.concatenate([h0[i], h1[i]]) for i in range(k)]
    wavelets = []
    for i in range(k):
        candidate = np.zeros(2 * k)
        candidate[i] = 1.0  # sqrt(2) phi_i(2x) on [0, 1/2) in the (left, right) half-interval basis
        for row in basis + wavelets:
            candidate = candidate - (candidate @ row) * row
        wavelets.append(candidate / np.linalg.norm(candidate))
    g = np.stack(wavelets)
    return tuple(torch.tensor(np.where(np.abs(a) < 1e-12, 0.0, a)) for a in (h0, h1, g[:, :k], g[:, k:]))


class MultiwaveletFilters(nn.Module):
    """One level of the multiwavelet transform and its inverse on [B, N, c, k] (N even)."""

    def __init__(self, k: int) -> None:
        super().__init__()
        h0, h1, g0, g1 = legendre_filters(k)
        self.register_buffer("smooth", torch.cat([h0.T, h1.T]))  # [2k, k]: s = x_even H0^T + x_odd H1^T
        self.register_buffer("detail", torch.cat([g0.T, g1.T]))
        self.register_buffer("even", torch.cat([h0, g0]))  # x_even = s H0 + d G0
        self.register_buffer("odd", torch.cat([h1, g1]))

    def decompose(self, x: Tensor) -> tuple[Tensor, Tensor]:
        """x [B, N, c, k] -> (detail d, smooth s), each [B, N/2, c, k]."""
        pairs = torch.cat([x[:, ::2], x[:, 1::2]], dim=-1)
        return pairs @ self.detail.to(x.dtype), pairs @ self.smooth.to(x.dtype)

    def reconstruct(self, smooth: Tensor, detail: Tensor) -> Tensor:
        """Inverse of :meth:`decompose`: [B, N/2, c, k] twice -> [B, N, c, k]."""
        both = torch.cat([smooth, detail], dim=-1)
        even, odd = both @ self.even.to(both.dtype), both @ self.odd.to(both.dtype)
        return torch.stack([even, odd], dim=2).reshape(even.shape[0], -1, *even.shape[2:])


def pad_to_power_of_two(x: Tensor) -> Tensor:
    """Append the first steps again until the length is a power of two (the authors' padding)."""
    n = x.shape[1]
    target = 1 << max(0, math.ceil(math.log2(n)))
    return torch.cat([x, x[:, : target - n]], dim=1)


def decomposition_levels(length: int, coarsest: int) -> int:
    """floor(log2 N) - L: the number of decomposition levels when the ``coarsest`` levels are skipped."""
    levels = int(math.floor(math.log2(length))) - coarsest
    if levels < 0:
        raise ValueError(f"length {length} is too short for {coarsest} skipped wavelet levels")
    return levels


class SparseKernelFT(nn.Module):
    """A Fourier kernel on [B, N, c, k]: the lowest ``modes`` rFFT bins of the c*k channels mixed by a learned
    complex [c*k, c*k] matrix per mode (the A, B, C operators of FEB-w)."""

    def __init__(self, k: int, c: int, modes: int) -> None:
        super().__init__()
        self.modes = modes
        self.weights = _complex_uniform(1.0 / (c * k * c * k), c * k, c * k, modes)

    def forward(self, x: Tensor) -> Tensor:
        b, n, c, k = x.shape
        spectrum = torch.fft.rfft(x.reshape(b, n, c * k).transpose(1, 2), dim=-1)  # [B, ck, N//2+1]
        used = min(self.modes, n // 2 + 1)
        out = torch.zeros_like(spectrum)
        out[..., :used] = torch.einsum("bix,iox->box", spectrum[..., :used],
                                       _as_complex(self.weights[..., :used], x.dtype))
        return torch.fft.irfft(out, n=n, dim=-1).transpose(1, 2).reshape(b, n, c, k)


class MultiwaveletBlock(nn.Module):
    """FEB-w (Section 3.3, Figure 5): values [B, L, H, E] -> Linear(d_model -> c*k) -> multiwavelet decomposition
    over ``levels = floor(log2 L') - skipped_levels`` levels (L' = L padded to a power of two), per level
    Ud = A(d) + B(s), Us = C(d); T0 on the coarsest s; reconstruction adding Us and Ud level by level;
    Linear(c*k -> d_model). Queries and keys are not used (as in the authors' code)."""

    uses = "v"

    def __init__(self, d_model: int, k: int = 8, c: int = 128, modes: int = 16, skipped_levels: int = 3) -> None:
        super().__init__()
        self.c, self.k, self.skipped_levels = c, k, skipped_levels
        self.filters = MultiwaveletFilters(k)
        self.to_wavelet = nn.Linear(d_model, c * k)
        self.from_wavelet = nn.Linear(c * k, d_model)
        self.a, self.b, self.c_kernel = (SparseKernelFT(k, c, modes) for _ in range(3))
        self.coarsest = nn.Linear(k, k)  # T0

    def transform(self, x: Tensor) -> Tensor:
        """The decomposition / reconstruction of [B, N, c, k] (the authors' MWT_CZ1d)."""
        n = x.shape[1]
        x = pad_to_power_of_two(x)
        details, smooths = [], []
        for _ in range(decomposition_levels(n, self.skipped_levels)):
            d, x = self.filters.decompose(x)
            details.append(self.a(d) + self.b(x))
            smooths.append(self.c_kernel(d))
        x = self.coarsest(x)
        for detail, smooth in zip(reversed(details), reversed(smooths)):
            x = self.filters.reconstruct(x + smooth, detail)
        return x[:, :n]

    def forward(self, queries: Tensor | None, keys: Tensor | None, values: Tensor) -> Tensor:
        b, n, h, e = values.shape
        v = self.to_wavelet(values.reshape(b, n, h * e)).reshape(b, n, self.c, self.k)
        return self.from_wavelet(self.transform(v).reshape(b, n, -1)).reshape(b, n, h, e)


class WaveletLevelCrossAttention(nn.Module):
    """FEA-f without learned weights on wavelet coefficients [B, N, c, k] (k plays the heads, c the channels):
    the lowest ``modes`` bins of q and k, sigma(Q~ K~^T) K~, inverted and divided by (c k)^2."""

    def __init__(self, modes: int, activation: str) -> None:
        super().__init__()
        if activation not in ("tanh", "softmax"):
            raise ValueError(f"activation must be 'tanh' or 'softmax', got {activation!r}")
        self.modes, self.activation = modes, activation

    def forward(self, q: Tensor, k: Tensor) -> Tensor:
        n, width = q.shape[1], q.shape[2] * q.shape[3]
        q_ft = torch.fft.rfft(q.permute(0, 3, 2, 1), dim=-1)[..., : min(self.modes, q.shape[1] // 2 + 1)]
        k_ft = torch.fft.rfft(k.permute(0, 3, 2, 1), dim=-1)[..., : min(self.modes, k.shape[1] // 2 + 1)]
        scores = torch.einsum("bhex,bhey->bhxy", q_ft, k_ft)
        if self.activation == "tanh":
            scores = scores.tanh()
        else:
            scores = torch.complex(torch.softmax(scores.abs(), dim=-1), torch.zeros_like(scores.real))
        attended = torch.einsum("bhxy,bhey->bhex", scores, k_ft)
        out = torch.zeros(*attended.shape[:3], n // 2 + 1, dtype=attended.dtype, device=q.device)
        out[..., : attended.shape[-1]] = attended
        return torch.fft.irfft(out / (width * width), n=n, dim=-1).permute(0, 3, 2, 1)


class MultiwaveletCrossAttention(nn.Module):
    """FEA-w (Section 3.3): q, k, v [B, L, H, E] -> Linear(d_model -> c*k) each -> keys/values aligned to L ->
    multiwavelet decomposition of all three; per level Ud = FEA(d_q, d_k) + FEA(s_q, s_k), Us = FEA(d_q, d_k);
    FEA on the coarsest level; reconstruction as in FEB-w; Linear(c*k -> d_model). As in FEA-f the keys double as
    values (the authors' code projects and decomposes v but its level attention never reads it)."""

    uses = "qk"

    def __init__(self, d_model: int, k: int = 8, c: int = 64, modes: int = 64, skipped_levels: int = 0,
                 activation: str = "tanh") -> None:
        super().__init__()
        self.c, self.k, self.skipped_levels = c, k, skipped_levels
        self.filters = MultiwaveletFilters(k)
        self.to_q, self.to_k = nn.Linear(d_model, c * k), nn.Linear(d_model, c * k)
        self.out = nn.Linear(c * k, d_model)
        self.detail_attention, self.smooth_attention, self.cross_smooth, self.coarsest = (
            WaveletLevelCrossAttention(modes, activation) for _ in range(4)
        )

    def forward(self, queries: Tensor, keys: Tensor, values: Tensor) -> Tensor:
        b, n, h, e = queries.shape
        q = self.to_q(queries.reshape(b, n, -1)).reshape(b, n, self.c, self.k)
        k = self.to_k(keys.reshape(b, keys.shape[1], -1)).reshape(b, keys.shape[1], self.c, self.k)
        k, _ = truncate_or_pad_keys(k, k, n)
        q, k = pad_to_power_of_two(q), pad_to_power_of_two(k)
        details, smooths = [], []
        for _ in range(decomposition_levels(n, self.skipped_levels)):
            dq, q = self.filters.decompose(q)
            dk, k = self.filters.decompose(k)
            details.append(self.detail_attention(dq, dk) + self.smooth_attention(q, k))
            smooths.append(self.cross_smooth(dq, dk))
        x = self.coarsest(q, k)
        for detail, smooth in zip(reversed(details), reversed(smooths)):
            x = self.filters.reconstruct(x + smooth, detail)
        return self.out(x[:, :n].reshape(b, n, -1)).reshape(b, n, h, e)


def _built_once(factory: Callable[[], nn.Module]) -> Callable[[], nn.Module]:
    """A factory that returns one and the same module on every call (the code's sharing across layers)."""
    module = factory()
    return lambda: module


@register_model("fedformer", family="forecaster")
class FEDformer(DecompEncoderDecoder):
    """FEDformer: ``version="fourier"`` (FEDformer-f, default) or ``"wavelet"`` (FEDformer-w). Defaults are the
    paper's: 2 encoder / 1 decoder layers, d_model 512, 8 heads, d_ff 2048, dropout 0.05, GELU, 64 random modes,
    MOE decomposition with the code's kernel list [24], tanh cross activation, label_len = seq_len // 2;
    wavelet: Legendre k = 8, 16 modes in the A/B/C kernels, c = 128 (FEB-w) / 64 (FEA-w), 3 skipped levels in
    FEB-w, none in FEA-w.

    Two behaviours of the authors' code that the paper does not describe are options, off by default:
    ``output_layout="code"`` (the Fourier blocks' [B, H, E, L] output read as [B, L, H*E], see :func:`_to_heads`)
    and ``shared_blocks=True`` (the code builds the encoder's frequency block, the decoder's and the cross block
    once and passes the same module to every layer, so all encoder layers share one FEB's weights and modes).
    With both, the model computes what the authors' FEDformer-f computes (checked numerically in float64, see
    docs/forecasting_models.md)."""

    def __init__(self, channels: int, seq_len: int, pred_len: int, label_len: int | None = None,
                 version: str = "fourier", d_model: int = 512, heads: int = 8, encoder_layers: int = 2,
                 decoder_layers: int = 1, d_ff: int = 2048, dropout: float = 0.05, activation: str = "gelu",
                 moving_avg: tuple[int, ...] | list[int] = (24,), modes: int = 64, mode_selection: str = "random",
                 output_modes: str = "first", cross_output_modes: str = "selected", output_layout: str = "paper",
                 shared_blocks: bool = False, cross_activation: str = "tanh", wavelet_k: int = 8,
                 wavelet_modes: int = 16, wavelet_c: int = 128, wavelet_cross_c: int = 64,
                 wavelet_skipped_levels: int = 3, calendar_dim: int = 0) -> None:
        if version not in ("fourier", "wavelet"):
            raise ValueError(f"version must be 'fourier' or 'wavelet', got {version!r}")
        if version == "wavelet" and output_layout != "paper":
            raise ValueError("output_layout applies to the Fourier version only")
        if d_model % heads:
            raise ValueError(f"d_model ({d_model}) must be divisible by heads ({heads})")
        head_dim = d_model // heads
        decoder_len = resolve_label_len(label_len, seq_len) + pred_len
        if version == "fourier":
            inners = (
                lambda: FourierBlock(heads, head_dim, seq_len, modes, mode_selection, output_modes, output_layout),
                lambda: FourierBlock(heads, head_dim, decoder_len, modes, mode_selection, output_modes, output_layout),
                lambda: FourierCrossAttention(heads, head_dim, decoder_len, seq_len, modes, mode_selection,
                                              cross_activation, cross_output_modes, output_layout),
            )
        else:
            block = lambda: MultiwaveletBlock(d_model, wavelet_k, wavelet_c, wavelet_modes,  # noqa: E731
                                              wavelet_skipped_levels)
            inners = (block, block, lambda: MultiwaveletCrossAttention(d_model, wavelet_k, wavelet_cross_c, modes, 0,
                                                                       cross_activation))
        if shared_blocks:
            inners = tuple(_built_once(factory) for factory in inners)
        super().__init__(
            channels, seq_len, pred_len, label_len=label_len, d_model=d_model, heads=heads,
            encoder_layers=encoder_layers, decoder_layers=decoder_layers, d_ff=d_ff, dropout=dropout,
            activation=activation, calendar_dim=calendar_dim,
            decomposition=lambda: MixtureDecomposition(tuple(moving_avg)),
            encoder_inner=inners[0], decoder_inner=inners[1], cross_inner=inners[2],
        )
        self.version = version
