"""cosFormer (Qin et al., ICLR 2022): ReLU linear attention with cos-based re-weighting.

The softmax is replaced by a non-negative similarity with a locality bias (Sec. 3.2-3.3):

    s(Q_i, K_j) = ReLU(Q_i) ReLU(K_j)^T cos(pi/2 * (i - j) / M)                        (eq. 9)

and ``O_i = sum_j s(Q_i, K_j) V_j / sum_j s(Q_i, K_j)``. Ptolemy's identity
``cos(a - b) = cos a cos b + sin a sin b`` splits the re-weighting into per-token factors
(eq. 10), so each token gets the feature ``[ReLU(x) cos(pi i / 2M), ReLU(x) sin(pi i / 2M)]`` and
the attention is linear: ``O = phi(Q) (phi(K)^T V) / (phi(Q) sum_j phi(K_j))`` (eq. 11).
Causal attention uses prefix sums, computed chunk by chunk (intra-chunk block + carried state),
so memory stays O(N C + (N / C) d^2).

GPU path (:func:`~longattn.attention.base.uses_gpu_path`): the same features (angles and cos / sin
in float32, the products in the autocast dtype) through
:func:`~longattn.attention.ops.linear_scan.kernel_sums_gpu`: batched GEMMs, causal by the chunked scan
(Triton kernels where they run) with its running state in float32.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from longattn.attention.base import (
    AttentionBase,
    AttentionError,
    Capabilities,
    QKVProjection,
    check_qkv,
    compute_dtype,
    output_dtype,
    padding_safe,
    register_attention,
    uses_gpu_path,
)
from longattn.attention.decoding import RecurrentState, kernel_state_sums, kernel_step_output
from longattn.attention.ops.linear_scan import causal_kernel_sums, elu_feature_map, kernel_sums, kernel_sums_gpu, normalised

__all__ = [
    "CosformerAttention",
    "cosformer_attention",
    "cosformer_attention_reference",
    "cosformer_features",
]


def _reweight_angles(length: int, max_positions: int | None, like: Tensor, offset: int = 0) -> Tensor:
    """pi/2 * i / M for positions i = offset+1..offset+N (only differences i - j matter); M = N by
    default. ``offset``: a shard's start in a sequence split across processes (longattn.parallel)."""
    m = length if max_positions is None else max_positions
    if not isinstance(m, int) or isinstance(m, bool) or m < offset + length:
        raise AttentionError(
            f"max_positions (M of eq. 9) must be an int >= the sequence length {offset + length}, "
            f"got {max_positions!r}"
        )
    return (math.pi / 2) * torch.arange(offset + 1, offset + length + 1, dtype=like.dtype, device=like.device) / m


FEATURE_MAPS = ("relu", "elu")


def _positive_map(x: Tensor, feature_map: str) -> Tensor:
    """The non-negative feature map: ReLU (the paper) or elu(x) + 1 (the authors' code's alternative)."""
    if feature_map == "relu":
        return torch.relu(x)
    if feature_map == "elu":
        return elu_feature_map(x)
    raise AttentionError(f"feature_map must be one of {FEATURE_MAPS}, got {feature_map!r}")


def cosformer_features(
    x: Tensor, max_positions: int | None = None, reweight: bool = True, feature_map: str = "relu", offset: int = 0
) -> Tensor:
    """phi(x) of eq. 10 on [B, H, N, d]: [ReLU(x) cos(theta_i), ReLU(x) sin(theta_i)] -> [B, H, N, 2d].

    With ``reweight=False`` (the ablation without re-weighting) it is just ReLU(x) -> [B, H, N, d].
    """
    positive = _positive_map(x, feature_map)
    if not reweight:
        return positive
    theta = _reweight_angles(x.shape[2], max_positions, x, offset)[:, None]
    return torch.cat([positive * torch.cos(theta), positive * torch.sin(theta)], dim=-1)


@padding_safe
def cosformer_attention(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attention_mask: Tensor | None = None,
    *,
    is_causal: bool = False,
    max_positions: int | None = None,
    reweight: bool = True,
    feature_map: str = "relu",
    eps: float = 1e-6,
    chunk_size: int = 64,
) -> Tensor:
    """cosFormer attention on [B, H, N, d] in O(N d^2) (eq. 11); causal via chunked prefix sums.

    ``max_positions``: M of eq. 9 (None = the sequence length N). ``eps`` floors the denominator.
    """
    check_qkv(query, key, value, attention_mask)
    n = query.shape[2]
    if key.shape[2] != n:
        raise AttentionError("cosFormer here is self-attention: query and key lengths must match")
    if not isinstance(chunk_size, int) or isinstance(chunk_size, bool) or chunk_size <= 0:
        raise AttentionError(f"chunk_size must be a positive int, got {chunk_size!r}")
    if uses_gpu_path(query):
        return _cosformer_gpu(query, key, value, attention_mask, is_causal, max_positions, reweight, feature_map,
                              eps, chunk_size)
    phi_q = cosformer_features(query, max_positions, reweight, feature_map)
    phi_k = cosformer_features(key, max_positions, reweight, feature_map)
    if attention_mask is not None:
        phi_k = phi_k * attention_mask[:, None, :, None].to(phi_k.dtype)  # padded keys contribute 0
    if is_causal:
        numerator, denominator = causal_kernel_sums(phi_q, phi_k, value, chunk_size)
    else:
        numerator, denominator = kernel_sums(phi_q, phi_k, value)
    return numerator / denominator.clamp_min(eps)


def _gpu_features(x: Tensor, max_positions: int | None, reweight: bool, feature_map: str) -> Tensor:
    """:func:`cosformer_features` with the angles and their cos / sin in float32 (half precision does not
    hold pi i / 2M for long sequences), the products in x's dtype (the GEMM dtype)."""
    positive = _positive_map(x, feature_map)
    if not reweight:
        return positive
    angles = _reweight_angles(x.shape[2], max_positions, x.new_empty(0, dtype=compute_dtype(x.dtype)))[:, None]
    return torch.cat([positive * torch.cos(angles).to(x.dtype), positive * torch.sin(angles).to(x.dtype)], dim=-1)


def _cosformer_gpu(query: Tensor, key: Tensor, value: Tensor, attention_mask: Tensor | None, is_causal: bool,
                   max_positions: int | None, reweight: bool, feature_map: str, eps: float, chunk_size: int) -> Tensor:
    dtype = output_dtype(query)
    phi_q = _gpu_features(query.to(dtype), max_positions, reweight, feature_map)
    phi_k = _gpu_features(key.to(dtype), max_positions, reweight, feature_map)
    if attention_mask is not None:
        phi_k = phi_k.masked_fill(~attention_mask[:, None, :, None], 0.0)  # padded keys contribute 0
    numerator, denominator = kernel_sums_gpu(phi_q, phi_k, value.to(dtype), is_causal, chunk_size)
    return normalised(numerator, denominator.clamp_min(eps), dtype)


@padding_safe
def cosformer_attention_reference(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attention_mask: Tensor | None = None,
    *,
    is_causal: bool = False,
    max_positions: int | None = None,
    reweight: bool = True,
    feature_map: str = "relu",
    eps: float = 1e-6,
) -> Tensor:
    """Plain eq. 9 with the full N x N similarity matrix; for tests only."""
    n = query.shape[2]
    m = n if max_positions is None else max_positions
    positive = torch.relu if feature_map == "relu" else (lambda t: torch.where(t > 0, t + 1, torch.exp(t)))
    sim = positive(query) @ positive(key).transpose(-1, -2)
    if reweight:
        i = torch.arange(n, dtype=query.dtype)
        sim = sim * torch.cos(math.pi / 2 * (i[:, None] - i[None, :]) / m)
    if attention_mask is not None:
        sim = sim * attention_mask[:, None, None, :]
    if is_causal:
        sim = sim * torch.ones(n, n, dtype=torch.bool).tril()
    return sim @ value / sim.sum(-1, keepdim=True).clamp_min(eps)


@register_attention(
    "cosformer",
    capabilities=Capabilities(causal=True, subquadratic=True, sequence_parallel=True),
    functional=cosformer_attention,
    reference=cosformer_attention_reference,
    paper="cosFormer: Rethinking Softmax in Attention (Qin et al., ICLR 2022)",
)
class CosformerAttention(AttentionBase):
    """cosFormer: ReLU feature map with cos-based re-weighting, linear in N, causal or not.

    Options (paper defaults):
        max_positions: M of eq. 9; None = the current sequence length (as the authors' code).
        reweight: the cos-based re-weighting (True); False = the ReLU-only ablation.
        feature_map: "relu" (the paper) or "elu" (elu(x) + 1, the alternative in the authors' code).
        eps: floor of the normaliser (1e-6).
        chunk_size: chunk length of the causal prefix sums (64; speed/memory only, same result).
        bias: biases of the projections.
    """

    def __init__(
        self,
        dim: int,
        heads: int,
        max_len: int | None = None,
        causal: bool = False,
        max_positions: int | None = None,
        reweight: bool = True,
        feature_map: str = "relu",
        eps: float = 1e-6,
        chunk_size: int = 64,
        bias: bool = True,
    ) -> None:
        super().__init__(dim, heads, max_len, causal)
        if max_positions is not None and (
            not isinstance(max_positions, int) or isinstance(max_positions, bool) or max_positions <= 0
        ):
            raise AttentionError(f"max_positions must be a positive int or None, got {max_positions!r}")
        if not eps > 0:
            raise AttentionError(f"eps must be positive, got {eps!r}")
        if not isinstance(chunk_size, int) or isinstance(chunk_size, bool) or chunk_size <= 0:
            raise AttentionError(f"chunk_size must be a positive int, got {chunk_size!r}")
        self.max_positions = max_positions
        self.reweight = reweight
        if feature_map not in FEATURE_MAPS:
            raise AttentionError(f"feature_map must be one of {FEATURE_MAPS}, got {feature_map!r}")
        self.feature_map = feature_map
        self.eps = eps
        self.chunk_size = chunk_size
        self.proj = QKVProjection(dim, heads, bias=bias)

    def attend(self, x: Tensor, attention_mask: Tensor | None, layer_state: dict | None) -> Tensor:
        q, k, v = self.proj.qkv(x)
        out = cosformer_attention(
            q, k, v, attention_mask,
            is_causal=self.causal,
            max_positions=self.max_positions,
            reweight=self.reweight,
            feature_map=self.feature_map,
            eps=self.eps,
            chunk_size=self.chunk_size,
        )
        return self.proj.out(out)

    def extra_repr(self) -> str:
        return (
            f"{super().extra_repr()}, max_positions={self.max_positions}, reweight={self.reweight}, "
            f"causal={self.causal}"
        )

    # -- decoding: running sums of the position-weighted features (eq. 10) -----------------------
    decode_state = "recurrent"

    def _decoding_positions(self) -> int | None:
        if self.reweight and self.max_positions is None:
            raise AttentionError(
                "cosFormer decodes one token at a time only with a fixed M (max_positions, M of eq. 9): with M = the "
                "sequence length every new token changes the re-weighting of the whole prefix; build it with "
                "max_positions = the longest sequence it will see (and train it so)"
            )
        return self.max_positions

    def _features(self, x: Tensor, offset: int = 0) -> Tensor:
        return cosformer_features(x, self._decoding_positions(), self.reweight, self.feature_map, offset)

    def prefill_heads(self, query: Tensor, key: Tensor, value: Tensor, attention_mask: Tensor | None,
                      layer_state: dict | None) -> tuple[Tensor, RecurrentState]:
        out = cosformer_attention(query, key, value, attention_mask, is_causal=True,
                                  max_positions=self._decoding_positions(), reweight=self.reweight,
                                  feature_map=self.feature_map, eps=self.eps, chunk_size=self.chunk_size)
        phi_k = self._features(key)
        if attention_mask is not None:
            phi_k = phi_k * attention_mask[:, None, :, None].to(phi_k.dtype)
        return out, RecurrentState(length=key.shape[2], sums=kernel_state_sums(phi_k, value))

    def step_heads(self, query: Tensor, key: Tensor, value: Tensor, state: RecurrentState, real: Tensor | None,
                   layer_state: dict | None) -> tuple[Tensor, RecurrentState]:
        """The features of position ``state.length`` added to the sums, then eq. 11 for the new query."""
        phi_k = self._features(key, state.length)
        if real is not None:
            phi_k = phi_k * real[:, None, None, None].to(phi_k.dtype)
        state.sums = state.sums + kernel_state_sums(phi_k, value)
        return kernel_step_output(self._features(query, state.length), state.sums, floor=self.eps), state
