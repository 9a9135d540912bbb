"""Gated linear attention (Yang, Wang, Shen, Panda and Kim, ICML 2024, "Gated Linear Attention Transformers with
Hardware-Efficient Training").

Linear attention whose [K, V] state forgets at a data-dependent rate per key channel (eq. 3)::

    S_t = Diag(alpha_t) S_{t-1} + k_t v_t^T,   o_t = S_t^T q_t / sqrt(d_k)

with the gate of Section 4.4, a low-rank projection (rank 16) through a sigmoid, sharpened by a temperature
tau = 16: alpha_t = sigmoid(x_t W_a1 W_a2 + b_a)^(1 / tau), computed as log alpha_t = logsigmoid(.) / tau. The
layer's output (Section 4.4) is y_t = (LN(o_t) * Swish(x_t W_r + b_r)) W_O: a LayerNorm per head, then the
output gate. The chunkwise form (Section 4.2-4.3), the decoding step and fla's kernels on CUDA are those of
:mod:`longattn.attention.ops.gated_scan`; the layer around them (scan, decoding state) is Mamba-2's too,
:class:`~longattn.attention.ops.gated_layer.GatedScanLayer`. Cost per token: O(C K + K V) per head for chunks of C tokens; decoding
state: the [K, V] matrix per head, O(1) in N.

Every component is an option, on by default as in the paper: ``gate_rank`` (None: a full-rank gate projection),
``gate_temperature``, ``output_gate``, ``norm``. The queries and keys have the head size (the paper halves the key
dimension; here it is the head dimension shared by every mechanism). GLA is causal; with ``causal=False`` it runs
the bidirectional form (the forward scan plus the backward one, :func:`~longattn.attention.ops.gated_scan.
bidirectional_gated_scan`) for encoders.
"""

from __future__ import annotations

import torch.nn.functional as F
from torch import Tensor, nn

from longattn.attention.base import AttentionError, Capabilities, padding_safe, register_attention, split_heads
from longattn.attention.ops.gated_layer import GatedScanLayer, ScanInputs
from longattn.attention.ops.gated_scan import SCAN_CHUNK, gated_parallel_reference, masked_gated_scan, without_padding

GATE_RANK = 16  # Section 4.4: W_a1 W_a2 of rank 16
GATE_TEMPERATURE = 16.0  # Section 4.4: tau


def _scale_of(scale: float | None, head_dim: int) -> float:
    return head_dim**-0.5 if scale is None else scale


@padding_safe
def gated_linear_attention(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    log_decay: Tensor,
    attention_mask: Tensor | None = None,
    *,
    is_causal: bool = True,
    scale: float | None = None,
    chunk_size: int = SCAN_CHUNK,
) -> Tensor:
    """GLA's recurrence (eq. 3) on [B, H, N, Dh], ``log_decay`` [B, H, N, Dh] (log alpha <= 0, per key channel) or
    [B, H, N, 1] (per head); queries scaled by ``scale`` (default 1 / sqrt(Dh)). ``is_causal=False``: the
    bidirectional form. ``attention_mask`` bool [B, N], True = real token."""
    out, _ = masked_gated_scan(query, key, value, log_decay, attention_mask, is_causal=is_causal,
                               scale=_scale_of(scale, key.shape[-1]), chunk=chunk_size)
    return out


@padding_safe
def gated_linear_attention_reference(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    log_decay: Tensor,
    attention_mask: Tensor | None = None,
    *,
    is_causal: bool = True,
    scale: float | None = None,
    chunk_size: int = SCAN_CHUNK,
) -> Tensor:
    """The parallel form of eq. 4 with the [N, N, Dh] decay weights; for tests only (``chunk_size`` is ignored)."""
    key, value, log_decay = without_padding(attention_mask, key, value, log_decay)
    return gated_parallel_reference(query * _scale_of(scale, key.shape[-1]), key, value, log_decay,
                                    is_causal=is_causal)


@register_attention(
    "gla",
    capabilities=Capabilities(causal=True),
    functional=gated_linear_attention,
    reference=gated_linear_attention_reference,
    paper="Gated Linear Attention Transformers with Hardware-Efficient Training (Yang et al., ICML 2024)",
)
class GatedLinearAttention(GatedScanLayer):
    """Gated linear attention: a data-dependent decay per key channel; causal, bidirectional as an encoder."""

    def __init__(
        self,
        dim: int,
        heads: int,
        max_len: int | None = None,
        causal: bool = False,
        gate_rank: int | None = GATE_RANK,
        gate_temperature: float = GATE_TEMPERATURE,
        output_gate: bool = True,
        norm: bool = True,
        scale: float | None = None,
        chunk_size: int = SCAN_CHUNK,
        bias: bool = True,
    ) -> None:
        super().__init__(dim, heads, max_len, causal, chunk_size=chunk_size, bias=bias)
        if gate_rank is not None and (not isinstance(gate_rank, int) or gate_rank <= 0):
            raise AttentionError(f"gate_rank must be a positive int or None (full rank), got {gate_rank!r}")
        if not gate_temperature > 0:
            raise AttentionError(f"gate_temperature must be > 0, got {gate_temperature!r}")
        if scale is not None and not scale > 0:
            raise AttentionError(f"scale must be > 0 or None, got {scale!r}")
        # x W_a1 W_a2 + b_a (Section 4.4): the low-rank factor has no bias of its own
        self.to_gate = (nn.Linear(dim, dim) if gate_rank is None
                        else nn.Sequential(nn.Linear(dim, gate_rank, bias=False), nn.Linear(gate_rank, dim)))
        self.to_output_gate = nn.Linear(dim, dim) if output_gate else None
        self.head_norm = nn.LayerNorm(self.head_dim) if norm else None
        self.gate_temperature = gate_temperature
        self.scale = scale

    @property
    def scan_scale(self) -> float:
        return _scale_of(self.scale, self.head_dim)

    def log_decay(self, x: Tensor) -> Tensor:
        """log alpha_t = logsigmoid(x_t W_a1 W_a2 + b_a) / tau per key channel: [B, H, N, Dh], <= 0."""
        return split_heads(F.logsigmoid(self.to_gate(x)) / self.gate_temperature, self.heads)

    def scan_inputs(self, x: Tensor, attention_mask: Tensor | None, extra: dict[str, Tensor]) -> ScanInputs:
        """q, k, v of the projections and the gate's log alpha (eq. 3): GLA keeps nothing besides its state."""
        return ScanInputs(*self.proj.qkv(x), self.log_decay(x))

    def finish(self, x: Tensor, heads_out: Tensor, inputs: ScanInputs) -> Tensor:
        """(LN(o) * Swish(x W_r + b_r)) W_O, each part as configured (Section 4.4)."""
        if self.head_norm is not None:
            heads_out = self.head_norm(heads_out)
        return self.proj.out(self.output_gated(x, heads_out))
