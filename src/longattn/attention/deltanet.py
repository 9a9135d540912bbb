"""DeltaNet (Schlag et al., 2021; Yang et al., NeurIPS 2024, "Parallelizing Linear Transformers with the Delta
Rule over Sequence Length").

Linear attention whose state is corrected, not only added to: each token writes its value under its key after
removing what the state already held there (eq. 2),

    S_t = S_{t-1} (I - beta_t k_t k_t^T) + beta_t v_t k_t^T,      o_t = S_t q_t,

computed in the chunkwise WY / UT form of Yang et al. (eq. 8-9 there; :mod:`longattn.attention.ops.delta_rule`):
cost O(N L D + N D^2) for chunks of L tokens, a [Dk, Dv] state per head, O(D^2) per decoded token. The layer's
components (Sec. 3.4: short convolutions with SiLU, L2-normalised queries and keys, sigmoid beta, the output
norm) are options, on by default as in the paper; the output gate is off, as in the paper's DeltaNet.
"""

from __future__ import annotations

from longattn.attention.base import Capabilities, register_attention
from longattn.attention.ops.delta_layer import DeltaRuleLayer
from longattn.attention.ops.delta_rule import DELTA_CHUNK, delta_rule_attention, delta_rule_attention_reference

__all__ = ["DeltaNet"]


@register_attention(
    "deltanet",
    capabilities=Capabilities(causal=True),
    functional=delta_rule_attention,
    reference=delta_rule_attention_reference,
    paper="Parallelizing Linear Transformers with the Delta Rule over Sequence Length (Yang et al., NeurIPS 2024)",
)
class DeltaNet(DeltaRuleLayer):
    """DeltaNet: linear attention with the delta-rule state update, chunkwise parallel.

    Options (paper defaults): short_conv / conv_size (causal depthwise convolutions of q, k, v, 4 taps, SiLU),
    l2_norm (queries and keys), sigmoid_beta (beta = sigmoid(W x); off: beta = 1), output_norm (RMSNorm per
    head), output_gate (o * SiLU(W x), off in DeltaNet), chunk_size (L, speed and memory only), bias (of the
    projections). Not causal: the bidirectional form (forward + backward scans).
    """

    def __init__(self, dim: int, heads: int, max_len: int | None = None, causal: bool = False,
                 short_conv: bool = True, conv_size: int = 4, l2_norm: bool = True, sigmoid_beta: bool = True,
                 output_norm: bool = True, output_gate: bool = False, chunk_size: int = DELTA_CHUNK,
                 bias: bool = False) -> None:
        super().__init__(dim, heads, max_len, causal, short_conv=short_conv, conv_size=conv_size, l2_norm=l2_norm,
                         sigmoid_beta=sigmoid_beta, output_norm=output_norm, output_gate=output_gate,
                         chunk_size=chunk_size, bias=bias)
