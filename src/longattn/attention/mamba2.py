"""Mamba-2's SSD layer (Dao and Gu, ICML 2024, "Transformers are SSMs: Generalized Models and Efficient Algorithms
Through Structured State Space Duality").

The selective state space model with a scalar decay per head (the SSD form, eq. 2 with A_t = a_t I, Section 3)::

    h_t = exp(dt_t A) h_{t-1} + dt_t B_t x_t^T,   y_t = h_t^T C_t + D x_t

its state-space duality (Section 4): C, B, x play queries, keys and values of a masked linear attention whose mask
is the product of the decays between two tokens (eq. 16). The block around it (Section 7.1, Figure 6): C, B and x
come from the input projection, through a short depthwise causal convolution and SiLU; dt = softplus(x W_dt +
dt_bias) per head and A = -exp(A_log) < 0; the skip D x; the output gate y * SiLU(z) with z = x W_z, then an RMS
norm (mamba_ssm's ``RMSNormGated``, the gate before the norm), then the output projection. The chunked algorithm
(Section 6) and the decoding step are those of :mod:`longattn.attention.ops.gated_scan`, the layer around them
GLA's too (:class:`~longattn.attention.ops.gated_layer.GatedScanLayer`); on CUDA with
``fla-core`` installed, fla's ``chunk_simple_gla`` kernel. Cost per token: O(C N_state + N_state P) per head
(chunks of C tokens, state N_state x P = head size x head size); decoding state: the [Dh, Dh] matrix per head and
the last ``conv_size - 1`` inputs of the convolution, O(1) in N.

Every component is an option, on by default as in the paper: ``conv_size`` (None: no convolution), the dt/A
initialisation ranges, ``d_skip``, ``output_gate``, ``norm``. B and C are per head (the paper's multi-head SSM
with as many B/C groups as heads); the norm is per head. SSD is causal; with ``causal=False`` it runs the
bidirectional form (the forward scan plus the backward one, as Hydra, Hwang et al. 2024), the convolution staying
causal.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from longattn.attention.base import (
    AttentionError,
    Capabilities,
    contiguous_gradient,
    merge_heads,
    padding_safe,
    register_attention,
    split_heads,
)
from longattn.attention.ops.gated_layer import GatedScanLayer, ScanInputs
from longattn.attention.ops.gated_scan import SCAN_CHUNK, gated_parallel_reference, masked_gated_scan, without_padding

CONV_SIZE = 4  # mamba_ssm's d_conv
DT_RANGE = (1e-3, 1e-1)  # dt_min, dt_max: dt is initialised log-uniformly in it
A_RANGE = (1.0, 16.0)  # A_init_range: -A uniformly in it
NORM_EPS = 1e-5  # mamba_ssm's RMSNormGated eps: fixed, so that float32 and float64 normalise alike


@padding_safe
def ssd_attention(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    log_decay: Tensor,
    attention_mask: Tensor | None = None,
    *,
    is_causal: bool = True,
    chunk_size: int = SCAN_CHUNK,
) -> Tensor:
    """The SSD scan (eq. 2 in attention form, eq. 16) on [B, H, N, Dh]: C as ``query``, B as ``key``, dt x as
    ``value`` and dt A as ``log_decay`` [B, H, N, 1] (<= 0); unscaled. ``is_causal=False``: the bidirectional form.
    ``attention_mask`` bool [B, N], True = real token."""
    out, _ = masked_gated_scan(query, key, value, log_decay, attention_mask, is_causal=is_causal, scale=1.0,
                               chunk=chunk_size)
    return out


@padding_safe
def ssd_attention_reference(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    log_decay: Tensor,
    attention_mask: Tensor | None = None,
    *,
    is_causal: bool = True,
    chunk_size: int = SCAN_CHUNK,
) -> Tensor:
    """SSD's quadratic (attention) form, eq. 16, with the [N, N] decay mask; for tests only."""
    key, value, log_decay = without_padding(attention_mask, key, value, log_decay)
    return gated_parallel_reference(query, key, value, log_decay, is_causal=is_causal)


def _inverse_softplus(x: Tensor) -> Tensor:
    return x + torch.log(-torch.expm1(-x))


@register_attention(
    "mamba2",
    capabilities=Capabilities(causal=True),
    functional=ssd_attention,
    reference=ssd_attention_reference,
    paper="Transformers are SSMs: Generalized Models and Efficient Algorithms Through Structured State Space "
          "Duality (Dao and Gu, ICML 2024)",
)
class Mamba2(GatedScanLayer):
    """Mamba-2's SSD layer: a scalar data-dependent decay per head, short convolution, gate and norm; causal,
    bidirectional as an encoder."""

    def __init__(
        self,
        dim: int,
        heads: int,
        max_len: int | None = None,
        causal: bool = False,
        conv_size: int | None = CONV_SIZE,
        dt_range: tuple[float, float] = DT_RANGE,
        a_range: tuple[float, float] = A_RANGE,
        d_skip: bool = True,
        output_gate: bool = True,
        norm: bool = True,
        chunk_size: int = SCAN_CHUNK,
        bias: bool = True,
    ) -> None:
        # the projections of C, B and x of Figure 6 (as queries, keys and values) are GatedScanLayer's
        super().__init__(dim, heads, max_len, causal, chunk_size=chunk_size, bias=bias)
        if conv_size is not None and (not isinstance(conv_size, int) or conv_size <= 0):
            raise AttentionError(f"conv_size must be a positive int or None (no convolution), got {conv_size!r}")
        for label, (low, high) in (("dt_range", dt_range), ("a_range", a_range)):
            if not 0 < low <= high:
                raise AttentionError(f"{label} must be (low, high) with 0 < low <= high, got {(low, high)!r}")
        # depthwise causal convolution over the channels of C, B and x, with bias (mamba_ssm's conv1d)
        self.conv = nn.Conv1d(3 * dim, 3 * dim, conv_size, groups=3 * dim) if conv_size is not None else None
        self.to_dt = nn.Linear(dim, heads)  # its bias is dt_bias
        with torch.no_grad():  # dt = softplus(dt_bias) log-uniform in dt_range at initialisation (mamba_ssm)
            low, high = dt_range
            dt = torch.exp(torch.rand(heads) * (math.log(high) - math.log(low)) + math.log(low))
            self.to_dt.bias.copy_(_inverse_softplus(dt))
        self.a_log = nn.Parameter(torch.empty(heads).uniform_(*a_range).log())  # A = -exp(A_log)
        self.d_skip = nn.Parameter(torch.ones(heads)) if d_skip else None
        self.to_output_gate = nn.Linear(dim, dim) if output_gate else None  # z
        self.head_norm = nn.RMSNorm(self.head_dim, eps=NORM_EPS) if norm else None
        self.conv_size = conv_size

    # -- the parts of the block -------------------------------------------------------------------------
    def convolve(self, channels: Tensor, past: Tensor | None = None) -> Tensor:
        """SiLU(causal depthwise convolution) of ``channels`` [B, N, 3 dim] (C, B, x side by side), continuing the
        ``conv_size - 1`` inputs ``past`` [B, conv_size - 1, 3 dim] (None: zeros before the sequence)."""
        if self.conv is None:
            return channels
        history = channels.new_zeros(channels.shape[0], self.conv_size - 1, channels.shape[2]) if past is None else past
        padded = torch.cat([history.to(channels.dtype), channels], dim=1)
        # the taps as shifted products, summed in order: exact float32 on CUDA (cuDNN's default would be TF32) and
        # the same arithmetic in the forward and in a decoding step
        n = channels.shape[1]
        weight = self.conv.weight[:, 0].to(channels.dtype)  # [3 dim, conv_size]
        mixed = self.conv.bias.to(channels.dtype) + sum(padded[:, tap:tap + n] * weight[:, tap]
                                                        for tap in range(self.conv_size))
        return F.silu(mixed)

    def scan_inputs(self, x: Tensor, attention_mask: Tensor | None, extra: dict[str, Tensor]) -> ScanInputs:
        """C, B, dt x and dt A per head [B, H, N, *] as the scan's queries, keys, values and log decays, x for the
        skip and the convolution's inputs [B, N, 3 dim] (for the decoding state), the convolution continuing
        ``extra["conv"]``. Padded tokens enter the convolution as zeros, as before the sequence."""
        q, k, v = self.proj.qkv(x)
        channels = torch.cat([merge_heads(q), merge_heads(k), merge_heads(v)], dim=-1)
        if attention_mask is not None:
            channels = channels.masked_fill(~attention_mask[..., None], 0.0)
        convolved = self.convolve(channels, extra.get("conv"))
        c, b, values = (split_heads(t, self.heads) for t in convolved.chunk(3, dim=-1))
        # softplus' gradient comes back transposed, in a layout its CPU kernel and torch.compile's trace differ on
        dt = F.softplus(contiguous_gradient(self.to_dt(x))).transpose(1, 2)[..., None]  # [B, H, N, 1]
        log_decay = -self.a_log.exp()[:, None, None] * dt  # dt A <= 0
        return ScanInputs(c, b, values * dt.to(values.dtype), log_decay, skip=values, carry=channels)

    def finish(self, x: Tensor, heads_out: Tensor, inputs: ScanInputs) -> Tensor:
        """y + D x, then RMSNorm(y * SiLU(z)), then the output projection (Figure 6), each as configured."""
        if self.d_skip is not None:
            heads_out = heads_out + self.d_skip[:, None, None] * inputs.skip
        heads_out = self.output_gated(x, heads_out)
        if self.head_norm is not None:
            heads_out = self.head_norm(heads_out)
        return self.proj.out(heads_out)

    # -- decoding: the [Dh, Dh] state per head (GatedScanLayer) and the convolution's last inputs -------------
    def continued_extra(self, inputs: ScanInputs, extra: dict[str, Tensor]) -> dict[str, Tensor]:
        """The convolution's last ``conv_size - 1`` inputs after ``inputs.carry`` [B, n, 3 dim], continuing
        ``extra["conv"]`` (zeros before the sequence)."""
        if self.conv is None:
            return {}
        width = self.conv_size - 1
        channels, past = inputs.carry, extra.get("conv")
        if past is None:
            past = channels.new_zeros(channels.shape[0], width, channels.shape[2])
        joined = torch.cat([past.to(channels.dtype), channels], dim=1)
        return {"conv": joined[:, joined.shape[1] - width:]}
