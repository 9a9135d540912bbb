"""FNet token mixing (Lee-Thorp et al., 2021): the attention sublayer replaced by a 2-D DFT.

y = Re(FFT_seq(FFT_hidden(x))) (FNet eq. 3): a discrete Fourier transform along the hidden
dimension, then along the sequence, keeping the real part. No parameters, no attention weights,
O(N log N). Padded tokens are zeroed before the transform so their content never leaks; as in
FNet itself the sequence transform still spans the padded length (there is no per-sequence
length in a 2-D FFT of a padded batch), so outputs depend on how much padding a batch has.
"""

from __future__ import annotations

import torch
from torch import Tensor

from longattn.attention.base import AttentionBase, Capabilities, output_dtype, register_attention


def fourier_mix(x: Tensor, attention_mask: Tensor | None = None, fft_norm: str = "backward") -> Tensor:
    """Re(FFT_seq(FFT_hidden(x))) on [B, N, D] (FNet eq. 3), padding zeroed first."""
    if attention_mask is not None:
        x = x.masked_fill(~attention_mask.unsqueeze(-1), 0.0)  # replaced, not multiplied: NaN * 0 is NaN
    return torch.fft.fft2(x.to(torch.promote_types(x.dtype, torch.float32)), dim=(-2, -1), norm=fft_norm).real.to(x.dtype)


def fourier_mix_reference(x: Tensor, attention_mask: Tensor | None = None) -> Tensor:
    """The same transform with explicit DFT matrices (O(N^2)); tests only."""
    if attention_mask is not None:
        x = x.masked_fill(~attention_mask.unsqueeze(-1), 0.0)  # replaced, not multiplied: NaN * 0 is NaN
    n, d = x.shape[-2:]
    dft = lambda m: torch.exp(-2j * torch.pi * torch.outer(torch.arange(m), torch.arange(m)).double() / m)  # noqa: E731
    return (dft(n).to(torch.complex128) @ x.to(torch.complex128) @ dft(d).T).real.to(x.dtype)


@register_attention(
    "fnet",
    capabilities=Capabilities(),
    paper="FNet: Mixing Tokens with Fourier Transforms (Lee-Thorp et al., 2021)",
)
class FNetMixing(AttentionBase):
    """FNet's parameter-free Fourier token mixing in place of attention (`heads` is ignored)."""

    def __init__(self, dim: int, heads: int, max_len: int | None = None, causal: bool = False,
                 fft_norm: str = "backward") -> None:
        super().__init__(dim, heads, max_len, causal)
        if fft_norm not in ("backward", "ortho", "forward"):
            raise ValueError(f"fft_norm must be 'backward', 'ortho' or 'forward', got {fft_norm!r}")
        self.fft_norm = fft_norm

    def attend(self, x: Tensor, attention_mask: Tensor | None, layer_state: dict | None) -> Tensor:
        # the FFTs in float32 (cuFFT has no bfloat16), the output in the autocast dtype like any layer's
        return fourier_mix(x, attention_mask, self.fft_norm).to(output_dtype(x))
