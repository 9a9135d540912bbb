"""Linear transformer (Katharopoulos et al., 2020, "Transformers are RNNs").

Attention with a kernel feature map instead of softmax (eq. 4-6)::

    V'_i = phi(Q_i)^T sum_j phi(K_j) V_j^T / (phi(Q_i)^T sum_j phi(K_j)),   phi(x) = elu(x) + 1  (eq. 7)

so the cost is linear in N. The causal form (eq. 8-9) uses prefix sums, computed chunk by chunk with a
running state across chunks. The sums themselves (shared with Performer, cosFormer and others) live in
:mod:`longattn.attention.ops.linear_scan`, CPU and GPU path alike.
"""

from __future__ import annotations

from torch import Tensor

from longattn.attention.base import (
    AttentionBase,
    AttentionError,
    Capabilities,
    QKVProjection,
    check_qkv,
    output_dtype,
    padding_safe,
    register_attention,
    uses_gpu_path,
)
from longattn.attention.decoding import RecurrentState, kernel_state_sums, kernel_step_output
from longattn.attention.ops.linear_scan import (
    causal_kernel_attention,
    elu_feature_map,
    kernel_attention,
    kernel_sums_gpu,
    mask_keys,
    normalised,
)


def _linear_attention_gpu(query: Tensor, key: Tensor, value: Tensor, attention_mask: Tensor | None,
                          is_causal: bool, eps: float) -> Tensor:
    dtype = output_dtype(query)
    phi_q = elu_feature_map(query.to(dtype))
    phi_k, value = mask_keys(elu_feature_map(key.to(dtype)), value.to(dtype), attention_mask)
    numerator, normaliser = kernel_sums_gpu(phi_q, phi_k, value, is_causal)
    return normalised(numerator, normaliser + eps, dtype)


@padding_safe
def linear_attention(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attention_mask: Tensor | None = None,
    *,
    is_causal: bool = False,
    eps: float = 1e-6,
) -> Tensor:
    """Linear attention with phi = elu + 1 on [B, H, N, Dh]; ``attention_mask`` bool [B, N], True = real."""
    check_qkv(query, key, value, attention_mask)
    if is_causal and query.shape[-2] != key.shape[-2]:
        raise AttentionError("causal linear attention needs as many queries as keys")
    if uses_gpu_path(query):
        return _linear_attention_gpu(query, key, value, attention_mask, is_causal, eps)
    phi_q = elu_feature_map(query)
    phi_k, value = mask_keys(elu_feature_map(key), value, attention_mask)
    if is_causal:
        return causal_kernel_attention(phi_q, phi_k, value, eps)
    return kernel_attention(phi_q, phi_k, value, eps)


@padding_safe
def linear_attention_reference(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attention_mask: Tensor | None = None,
    *,
    is_causal: bool = False,
    eps: float = 1e-6,
) -> Tensor:
    """Plain eq. 4 with the full N x N similarity matrix; for tests only."""
    sim = elu_feature_map(query) @ elu_feature_map(key).transpose(-1, -2)
    if attention_mask is not None:
        sim = sim * attention_mask[:, None, None, :].to(sim.dtype)
    if is_causal:
        sim = sim.tril()
    return (sim @ value) / (sim.sum(dim=-1, keepdim=True) + eps)


@register_attention(
    "linear",
    capabilities=Capabilities(causal=True, sequence_parallel=True),
    functional=linear_attention,
    reference=linear_attention_reference,
    paper="Transformers are RNNs: Fast Autoregressive Transformers with Linear Attention (Katharopoulos et al., 2020)",
)
class LinearAttention(AttentionBase):
    """Linear transformer attention with the elu(x) + 1 feature map; supports causal masking."""

    def __init__(
        self,
        dim: int,
        heads: int,
        max_len: int | None = None,
        causal: bool = False,
        eps: float = 1e-6,
        bias: bool = True,
    ) -> None:
        super().__init__(dim, heads, max_len, causal)
        if eps < 0:
            raise AttentionError(f"eps must be >= 0, got {eps}")
        self.proj = QKVProjection(dim, heads, bias=bias)
        self.eps = eps

    def attend(self, x: Tensor, attention_mask: Tensor | None, layer_state: dict | None) -> Tensor:
        q, k, v = self.proj.qkv(x)
        return self.proj.out(linear_attention(q, k, v, attention_mask, is_causal=self.causal, eps=self.eps))

    # -- decoding: the running sums of eq. 8-9 ---------------------------------------------------
    decode_state = "recurrent"

    def prefill_heads(self, query: Tensor, key: Tensor, value: Tensor, attention_mask: Tensor | None,
                      layer_state: dict | None) -> tuple[Tensor, RecurrentState]:
        out = linear_attention(query, key, value, attention_mask, is_causal=True, eps=self.eps)
        phi_k, value = mask_keys(elu_feature_map(key), value, attention_mask)
        return out, RecurrentState(length=key.shape[2], sums=kernel_state_sums(phi_k, value))

    def step_heads(self, query: Tensor, key: Tensor, value: Tensor, state: RecurrentState, real: Tensor | None,
                   layer_state: dict | None) -> tuple[Tensor, RecurrentState]:
        """S_i = S_{i-1} + phi(K_i) [V_i, 1]^T, then phi(Q_i) S_i normalised (eq. 8-9 as a recurrence)."""
        phi_k, value = mask_keys(elu_feature_map(key), value, None if real is None else real[:, None])
        state.sums = state.sums + kernel_state_sums(phi_k, value)
        return kernel_step_output(elu_feature_map(query), state.sums, eps=self.eps), state
