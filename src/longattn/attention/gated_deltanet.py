"""Gated DeltaNet (Yang, Kautz, Hatamizadeh, ICLR 2025, "Gated Delta Networks: Improving Mamba2 with Delta Rule").

The delta rule with Mamba-2's data-dependent decay alpha_t = exp(g_t) in (0, 1] (eq. 10):

    S_t = S_{t-1} alpha_t (I - beta_t k_t k_t^T) + beta_t v_t k_t^T,      o_t = S_t q_t,

g_t = -exp(A) softplus(W_alpha x_t + dt_bias) per head. The decay forgets quickly, the delta rule overwrites
precisely; the chunkwise form carries the decay's cumulative products inside a chunk (Sec. 3.3;
:mod:`longattn.attention.ops.delta_rule`): cost O(N L D + N D^2), a [Dk, Dv] state per head, O(D^2) per
decoded token. The block's components (Fig. 1: short convolutions with SiLU, L2-normalised queries and keys,
sigmoid beta, RMSNorm and the SiLU output gate) are options, all on by default as in the paper.
"""

from __future__ import annotations

from longattn.attention.base import Capabilities, register_attention
from longattn.attention.ops.delta_layer import DeltaRuleLayer
from longattn.attention.ops.delta_rule import DELTA_CHUNK, delta_rule_attention, delta_rule_attention_reference

__all__ = ["GatedDeltaNet"]


@register_attention(
    "gated_deltanet",
    capabilities=Capabilities(causal=True),
    functional=delta_rule_attention,
    reference=delta_rule_attention_reference,
    paper="Gated Delta Networks: Improving Mamba2 with Delta Rule (Yang, Kautz, Hatamizadeh, ICLR 2025)",
)
class GatedDeltaNet(DeltaRuleLayer):
    """Gated DeltaNet: the delta rule with a data-dependent decay, chunkwise parallel.

    Options (paper defaults): short_conv / conv_size (causal depthwise convolutions of q, k, v, 4 taps, SiLU),
    l2_norm (queries and keys), sigmoid_beta (beta = sigmoid(W x); off: beta = 1), output_norm (RMSNorm per
    head), output_gate (o * SiLU(W x)), chunk_size (L, speed and memory only), bias (of the projections).
    Not causal: the bidirectional form (forward + backward scans).
    """

    gated = True

    def __init__(self, dim: int, heads: int, max_len: int | None = None, causal: bool = False,
                 short_conv: bool = True, conv_size: int = 4, l2_norm: bool = True, sigmoid_beta: bool = True,
                 output_norm: bool = True, output_gate: bool = True, chunk_size: int = DELTA_CHUNK,
                 bias: bool = False) -> None:
        super().__init__(dim, heads, max_len, causal, short_conv=short_conv, conv_size=conv_size, l2_norm=l2_norm,
                         sigmoid_beta=sigmoid_beta, output_norm=output_norm, output_gate=output_gate,
                         chunk_size=chunk_size, bias=bias)
