"""The layer around the delta rule that DeltaNet and Gated DeltaNet share (their module forms subclass it).

Per token x (Yang et al., NeurIPS 2024, Sec. 3.4 and Fig. 1 of Yang, Kautz, Hatamizadeh, ICLR 2025):

* q, k, v = the projections of x, each through a short causal depthwise convolution (4 taps) and SiLU
  (``short_conv``); keys, and queries, L2-normalised per head (``l2_norm``);
* beta_t = sigmoid(W_beta x_t) per head (``sigmoid_beta``; off: beta = 1, the plain delta rule);
* Gated DeltaNet's decay g_t = -exp(A) softplus(W_alpha x_t + dt_bias) per head (alpha_t = exp(g_t), the
  Mamba-2 parametrisation of its decay, eq. 10 of Yang et al. 2025);
* o_t from the (gated) delta rule (:mod:`longattn.attention.ops.delta_rule`), then per head RMSNorm
  (``output_norm``) and the output gate o * SiLU(W_g x) (``output_gate``), then the output projection.

Causal by nature; built with ``causal=False`` the layer is bidirectional (the encoder tasks): the rule over the
sequence plus the rule over the reversed sequence, the convolutions anti-causal in the second. Padded tokens
enter nothing: their projections are zero before the convolutions and their beta and g are zero, so a padded
token leaves the state as it is (left padding gives what the unpadded sequence gives).

Decoding (``recurrent``): the state S [B, H, Dk, Dv] and the last three inputs of each convolution.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from longattn.attention.base import (
    AttentionBase,
    AttentionError,
    QKVProjection,
    autocast_disabled,
    compute_dtype,
    merge_heads,
    output_dtype,
    split_heads,
    uses_gpu_path,
)
from longattn.attention.decoding import DecodingState, ones_or
from longattn.attention.ops.delta_rule import (
    L2_EPS,
    delta_rule,
    delta_rule_attention,
    delta_rule_step,
    l2_normalised,
    rule_inputs,
)

__all__ = ["CONV_TILE", "DeltaRuleLayer", "DeltaRuleState", "causal_short_conv", "conv_features"]

# Tokens per tile of the CPU path's convolution features: a tile's channels stay in the cache between its passes.
CONV_TILE = 512


def causal_short_conv(x: Tensor, weight: Tensor) -> Tensor:
    """Depthwise causal convolution of [B, H, N, Dh] along N with ``weight`` [H, Dh, K] (tap K - 1 the current
    token), as K shifted products: a few taps need no cuDNN (whose float32 is TF32 by default), and the
    decoding step applies the same weights to its window."""
    taps = weight.shape[-1]
    n = x.shape[2]
    padded = F.pad(x, (0, 0, taps - 1, 0))
    w = weight[:, None]  # [H, 1, Dh, K]
    return sum(w[..., i] * padded[:, :, i:i + n] for i in range(taps))


class _ConvFeatures(torch.autograd.Function):
    """SiLU(causal depthwise convolution) of token-major channels [B, N, C] with ``taps`` [K, C] (tap K - 1 the
    current token), then its first ``normalised`` channels L2-normalised in groups of ``group`` (the query and
    key heads), ``tile`` tokens at a time: each tile's shifted products, activation and norm run while it is in
    the cache, and the backward recomputes them tile by tile from the padded input (the only tensor kept)."""

    @staticmethod
    def forward(ctx, x: Tensor, taps: Tensor, normalised: int, group: int, tile: int) -> Tensor:
        padded = F.pad(x, (0, 0, taps.shape[0] - 1, 0))
        out = torch.empty_like(x)
        for lo in range(0, x.shape[1], tile):
            hi = min(lo + tile, x.shape[1])
            F.silu(_convolve(padded, taps, lo, hi, out=out[:, lo:hi]), inplace=True)
            _l2_normalise_(out[:, lo:hi, :normalised], group)
        ctx.save_for_backward(padded, taps)
        ctx.normalised, ctx.group, ctx.tile = normalised, group, tile
        return out

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, d_out: Tensor) -> tuple[Tensor | None, ...]:
        padded, taps = ctx.saved_tensors
        normalised, group, tile = ctx.normalised, ctx.group, ctx.tile
        n = d_out.shape[1]
        d_padded = torch.zeros_like(padded)
        d_taps = torch.zeros_like(taps)
        for lo in range(0, n, tile):
            hi = min(lo + tile, n)
            convolved = _convolve(padded, taps, lo, hi)
            d_act = d_out[:, lo:hi].clone()
            if normalised:  # y = a / ||a||: dL/da = (dL/dy - y (y . dL/dy)) / ||a||
                act = F.silu(convolved[..., :normalised]).unflatten(-1, (-1, group))
                inverse_norm = torch.rsqrt(act.square().sum(-1, keepdim=True) + L2_EPS)
                unit = act.mul_(inverse_norm)
                d_unit = d_act[..., :normalised].unflatten(-1, (-1, group))
                d_unit.sub_(unit * (unit * d_unit).sum(-1, keepdim=True)).mul_(inverse_norm)
            d_conv = torch.ops.aten.silu_backward(d_act, convolved)
            for j in range(taps.shape[0]):
                d_padded[:, lo + j:hi + j].addcmul_(d_conv, taps[j])
                d_taps[j] += (d_conv * padded[:, lo + j:hi + j]).sum((0, 1))
        return d_padded[:, taps.shape[0] - 1:], d_taps, None, None, None


def _convolve(padded: Tensor, taps: Tensor, lo: int, hi: int, out: Tensor | None = None) -> Tensor:
    """sum_j taps_j x_{t - K + 1 + j} for tokens t = lo .. hi - 1 of the left-padded input (into ``out``)."""
    convolved = torch.mul(padded[:, lo:hi], taps[0], out=out)
    for j in range(1, taps.shape[0]):
        convolved.addcmul_(padded[:, lo + j:hi + j], taps[j])
    return convolved


def _l2_normalise_(channels: Tensor, group: int) -> None:
    """Each group of ``group`` channels of ``channels`` [..., C] divided by its L2 norm, in place."""
    if channels.shape[-1]:
        heads = channels.unflatten(-1, (-1, group))
        heads.mul_(torch.rsqrt(heads.square().sum(-1, keepdim=True) + L2_EPS))


def conv_features(x: Tensor, taps: Tensor, normalised: int, group: int) -> Tensor:
    """SiLU(causal depthwise convolution) of ``x`` [B, N, C] with ``taps`` [K, C], its first ``normalised``
    channels then L2-normalised in groups of ``group`` (as :func:`l2_normalised`). The CPU path works ``CONV_TILE`` tokens
    at a time, the GPU path in one tile (its op count does not depend on N)."""
    tile = x.shape[1] if uses_gpu_path(x) else CONV_TILE
    return _ConvFeatures.apply(x, taps, normalised, group, max(1, tile))


def _linear(layer: nn.Linear, x: Tensor) -> Tensor:
    """``layer(x)`` in x's dtype."""
    bias = None if layer.bias is None else layer.bias.to(x.dtype)
    return F.linear(x, layer.weight.to(x.dtype), bias)


def _window_conv(window: Tensor, weight: Tensor) -> Tensor:
    """The causal convolution's output at the last of ``window``'s K tokens ([B, H, K, Dh] -> [B, H, 1, Dh])."""
    return (window * weight.transpose(-1, -2)).sum(2, keepdim=True)


@dataclass
class DeltaRuleState(DecodingState):
    """The delta rule's state ``rule`` [B, H, Dk, Dv] and, with the short convolutions, ``windows``: the last
    K - 1 inputs of the q, k and v convolutions, each [B, H, K - 1, Dh] (zeros before the sequence start)."""

    rule: Tensor | None = None
    windows: list[Tensor] = field(default_factory=list)


class DeltaRuleLayer(AttentionBase):
    """Module form shared by ``deltanet`` and ``gated_deltanet`` (``gated``: the data-dependent decay)."""

    gated: bool = False

    def __init__(self, dim: int, heads: int, max_len: int | None, causal: bool, *, short_conv: bool,
                 conv_size: int, l2_norm: bool, sigmoid_beta: bool, output_norm: bool, output_gate: bool,
                 chunk_size: int, bias: bool) -> None:
        super().__init__(dim, heads, max_len, causal)
        for label, value in (("conv_size", conv_size), ("chunk_size", chunk_size)):
            if not isinstance(value, int) or value < 1:
                raise AttentionError(f"{label} must be a positive int, got {value!r}")
        self.l2_norm, self.chunk_size = l2_norm, chunk_size
        self.proj = QKVProjection(dim, heads, bias=bias)
        # q, k, v convolutions; initialised as PyTorch's Conv1d (uniform in +-1/sqrt(fan_in), fan_in = K)
        bound = 1.0 / math.sqrt(conv_size)
        self.conv_weight = (nn.Parameter(torch.empty(3, heads, self.head_dim, conv_size).uniform_(-bound, bound))
                            if short_conv else None)
        self.to_beta = nn.Linear(dim, heads, bias=bias) if sigmoid_beta else None
        if self.gated:
            self.to_decay = nn.Linear(dim, heads, bias=False)
            # A ~ U(1, 16) and dt ~ logU(1e-3, 1e-1) (dt_bias = softplus^-1(dt)), the Mamba-2 initialisation
            self.decay_log_scale = nn.Parameter(torch.empty(heads).uniform_(1, 16).log())
            dt = torch.empty(heads).uniform_(math.log(1e-3), math.log(1e-1)).exp()
            self.decay_bias = nn.Parameter(dt + torch.log(-torch.expm1(-dt)))
        self.norm_weight = nn.Parameter(torch.ones(self.head_dim)) if output_norm else None
        self.to_gate = nn.Linear(dim, dim, bias=bias) if output_gate else None

    # -- per-token pieces ---------------------------------------------------------------------------------
    def _split(self, t: Tensor) -> Tensor:
        """[B, N, H] -> [B, H, N]."""
        return t.transpose(1, 2)

    def _gates(self, x: Tensor) -> tuple[Tensor | None, Tensor | None]:
        """(beta, g) [B, H, N] of tokens x [B, N, dim]; None where the option is off. Their projections (dim ->
        heads, cheap) run in the accumulation dtype outside autocast: g enters the state through its cumulative
        sums, where a bfloat16 pre-activation's rounding would compound."""
        work = compute_dtype(x.dtype)
        with autocast_disabled(x.device):
            xw = x.to(work)
            beta = None if self.to_beta is None else self._split(torch.sigmoid(_linear(self.to_beta, xw)))
            if not self.gated:
                return beta, None
            rate = F.softplus(_linear(self.to_decay, xw) + self.decay_bias.to(work))
            return beta, self._split(-self.decay_log_scale.to(work).exp() * rate)

    def _features(self, q: Tensor, k: Tensor, v: Tensor, convolve: Callable[[Tensor, Tensor], Tensor]
                  ) -> tuple[Tensor, Tensor, Tensor]:
        """The short convolutions (``convolve(input, weight [H, Dh, K])``) and SiLU, then L2-normalised queries
        and keys; in the accumulation dtype, which the rule works in: no rounding before. The decoding step's
        form of :meth:`_sequence_features`."""
        q, k, v = (t.to(compute_dtype(t.dtype)) for t in (q, k, v))
        if self.conv_weight is not None:
            weights = self.conv_weight.to(q.dtype)
            q, k, v = (F.silu(convolve(t, w)) for t, w in zip((q, k, v), weights))
        return (l2_normalised(q), l2_normalised(k), v) if self.l2_norm else (q, k, v)

    def _sequence_features(self, qkv: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """:meth:`_features` of a whole sequence's projections [B, N, 3 dim] (q, k, v side by side): with the
        convolutions, one pass of :func:`conv_features` over all their channels."""
        qkv = qkv.to(compute_dtype(qkv.dtype))
        if self.conv_weight is None:
            return self._features(*self._heads(qkv), causal_short_conv)
        taps = self.conv_weight.to(qkv.dtype).flatten(0, 2).t()  # [K, 3 dim], the channels of qkv
        return self._heads(conv_features(qkv, taps, 2 * self.dim if self.l2_norm else 0, self.head_dim))

    def _heads(self, qkv: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """[B, N, 3 dim] -> q, k, v [B, H, N, Dh] (views)."""
        return tuple(split_heads(t, self.heads) for t in qkv.chunk(3, dim=-1))

    def _output(self, o: Tensor, x: Tensor) -> Tensor:
        """Per-head RMSNorm, the output gate, the output projection: [B, H, N, Dv] -> [B, N, dim]. The norm and
        the gate in the accumulation dtype, rounded once before the projection (each rounding in between
        would add its own relative error, 2^-8 in bfloat16); token-major ([B, N, H, Dv], one copy), where the
        gate's projection and the output projection's input are contiguous."""
        o = o.to(compute_dtype(o.dtype)).transpose(1, 2).contiguous()
        if self.norm_weight is not None:
            o = F.rms_norm(o, (o.shape[-1],), self.norm_weight.to(o.dtype), eps=1e-6)
        if self.to_gate is not None:
            o = o * F.silu(self.to_gate(x).to(o.dtype).unflatten(-1, (self.heads, -1)))
        return self.proj.out(o.to(output_dtype(x)).transpose(1, 2))

    def _projections(self, x: Tensor, attention_mask: Tensor | None) -> Tensor:
        """q, k, v of tokens x [B, N, dim] side by side, [B, N, 3 dim]: one product with the three projections'
        weights stacked, or the q, k, v of a model that lends its projections (:mod:`longattn.hf`)."""
        if isinstance(self.proj, QKVProjection):
            linears = (self.proj.to_q, self.proj.to_k, self.proj.to_v)
            bias = None if linears[0].bias is None else torch.cat([layer.bias for layer in linears])
            qkv = F.linear(x, torch.cat([layer.weight for layer in linears]), bias)
            # the convolutions must read zeros at padded tokens, where the input is zero: only a bias moves them
            if bias is None:
                return qkv
        else:
            qkv = torch.cat([merge_heads(t) for t in self.proj.qkv(x)], dim=-1)
        return qkv if attention_mask is None else qkv.masked_fill(~attention_mask[..., None], 0.0)

    def _mix(self, qkv: Tensor, beta: Tensor | None, g: Tensor | None, attention_mask: Tensor | None) -> Tensor:
        q, k, v = self._sequence_features(qkv)
        return delta_rule_attention(q, k, v, attention_mask, beta=beta, log_decay=g, is_causal=True,
                                    l2_norm=False, chunk_size=self.chunk_size)

    def attend(self, x: Tensor, attention_mask: Tensor | None, layer_state: dict | None) -> Tensor:
        qkv = self._projections(x, attention_mask)
        beta, g = self._gates(x)
        o = self._mix(qkv, beta, g, attention_mask)
        if not self.causal:  # the backward scan: the same layer over the reversed sequence, reversed back
            flip = [None if t is None else t.flip(2) for t in (beta, g)]
            mask = None if attention_mask is None else attention_mask.flip(1)
            o = o + self._mix(qkv.flip(1), *flip, mask).flip(2)
        return self._output(o, x)

    def extra_repr(self) -> str:
        return (f"{super().extra_repr()}, causal={self.causal}, short_conv={self.conv_weight is not None}, "
                f"l2_norm={self.l2_norm}, sigmoid_beta={self.to_beta is not None}, "
                f"output_norm={self.norm_weight is not None}, output_gate={self.to_gate is not None}, "
                f"chunk_size={self.chunk_size}")

    # -- decoding: the rule's state and the convolutions' windows -------------------------------------------
    decode_state = "recurrent"

    def prefill_attend(self, x: Tensor, attention_mask: Tensor | None,
                       layer_state: dict | None) -> tuple[Tensor, DeltaRuleState]:
        qkv = self._projections(x, attention_mask)
        beta, g = self._gates(x)
        windows = []
        if self.conv_weight is not None:
            taps = self.conv_weight.shape[-1]
            windows = [F.pad(t, (0, 0, taps - 1, 0))[:, :, t.shape[2]:] for t in self._heads(qkv)]
        q, k, v = self._sequence_features(qkv)
        k, beta, g = rule_inputs(k, beta, g, attention_mask, l2_norm=False)
        o, rule = delta_rule(q, k, v, beta, g, scale=k.shape[-1] ** -0.5, chunk=self.chunk_size)
        return self._output(o, x), DeltaRuleState(length=x.shape[1], rule=rule, windows=windows)

    def step_attend(self, x: Tensor, state: DeltaRuleState, real: Tensor | None,
                    layer_state: dict | None) -> tuple[Tensor, DeltaRuleState]:
        """One token of the recurrence (:func:`delta_rule_step`) after its convolutions over the window."""
        real = ones_or(real, x.shape[0], x.device)
        q, k, v = self._heads(self._projections(x, real[:, None]))
        beta, g = self._gates(x)
        if self.conv_weight is not None:  # the window and the new token: [B, H, K, Dh]
            q, k, v = (torch.cat([w, t], dim=2) for w, t in zip(state.windows, (q, k, v)))
            state.windows = [t[:, :, 1:] for t in (q, k, v)]
        q, k, v = self._features(q, k, v, _window_conv)
        k, beta, g = rule_inputs(k, beta, g, real[:, None], l2_norm=False)
        o, state.rule = delta_rule_step(q[:, :, 0], k[:, :, 0], v[:, :, 0], beta[:, :, 0],
                                        None if g is None else g[:, :, 0], state.rule, k.shape[-1] ** -0.5)
        return self._output(o[:, :, None], x), state
