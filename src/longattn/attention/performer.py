"""Performer's FAVOR+ (Choromanski et al., 2021, "Rethinking Attention with Performers").

softmax attention is approximated with positive random features (Lemma 1)::

    SM(x, y) = E_w[ exp(w^T x - |x|^2/2) exp(w^T y - |y|^2/2) ],   w ~ N(0, I_d)
    phi(x)   = exp(-|x|^2 / 2) / sqrt(m) * [exp(w_1^T x), ..., exp(w_m^T x)]

applied to x = q / d^(1/4), y = k / d^(1/4) (so that x.y = q.k / sqrt(d)), with the m rows w_i drawn
as orthogonal random features (Section 2.4: blocks of d orthogonal directions, each row rescaled to
the norm of a Gaussian vector). Attention is then linear: D^-1 (phi(Q) (phi(K)^T V)) (eq. 4-5),
causal via prefix sums. The features are redrawn every ``redraw_interval`` training calls
(Section 4.2 "feature redrawing").

Numerics: exp(w^T x - |x|^2/2) is computed after subtracting a constant that cancels in the
normalised output (the per-query max for queries, the max over real keys of one head for keys);
the constant carries no gradient because it cancels exactly.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor
from torch.utils.checkpoint import checkpoint

from longattn.attention.base import (
    AttentionBase,
    AttentionError,
    Capabilities,
    QKVProjection,
    check_qkv,
    padding_safe,
    register_attention,
)
from longattn.attention.linear import causal_kernel_attention


def orthogonal_random_features(
    num_features: int,
    head_dim: int,
    *,
    orthogonal: bool = True,
    generator: torch.Generator | None = None,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str | None = None,
) -> Tensor:
    """The [m, d] projection of FAVOR+: rows w_i with E[w w^T] = I.

    ``orthogonal=True`` (the paper's ORF): stack blocks of d exactly orthogonal unit directions (QR
    of a Gaussian matrix), the last block truncated, then give each row the length of an
    independent d-dimensional Gaussian vector so every row is marginally N(0, I_d).
    ``orthogonal=False``: i.i.d. Gaussian rows (the ablation in the paper).
    """
    if num_features <= 0:
        raise AttentionError(f"nb_features must be a positive int, got {num_features}")
    if not orthogonal:
        return torch.randn(num_features, head_dim, generator=generator, dtype=dtype, device=device)
    blocks = []
    for _ in range(math.ceil(num_features / head_dim)):
        gaussian = torch.randn(head_dim, head_dim, generator=generator, dtype=torch.float64)
        q, _ = torch.linalg.qr(gaussian)
        blocks.append(q.T)  # rows are orthonormal directions
    directions = torch.cat(blocks)[:num_features]
    lengths = torch.randn(num_features, head_dim, generator=generator, dtype=torch.float64).norm(dim=1)
    return (directions * lengths[:, None]).to(dtype=dtype, device=device)


def _feature_shift(x: Tensor, projection: Tensor, stabiliser_dims: tuple[int, ...], real: Tensor | None) -> Tensor:
    """The stabiliser of phi(x): the largest exponent over ``stabiliser_dims`` (padded rows
    excluded; 0 where nothing is real). It cancels exactly, so it carries no gradient."""
    with torch.no_grad():
        exponent = x @ projection.T.to(x.dtype) - x.square().sum(dim=-1, keepdim=True) / 2
        if real is not None:
            exponent = exponent.masked_fill(~real, float("-inf"))
        shift = exponent.amax(dim=stabiliser_dims, keepdim=True)
        return shift.masked_fill(~torch.isfinite(shift), 0.0)  # a fully padded row / head


def _positive_features(
    x: Tensor, projection: Tensor, stabiliser_dims: tuple[int, ...], real: Tensor | None, shift: Tensor | None = None
) -> Tensor:
    """phi(x) of Lemma 1 up to a constant that cancels (see module doc). x: [B, H, N, d] already
    scaled; ``shift`` the stabiliser when it was taken over more rows than x holds."""
    projected = x @ projection.T.to(x.dtype)  # [B, H, N, m]
    half_sq_norm = x.square().sum(dim=-1, keepdim=True) / 2
    if shift is None:
        shift = _feature_shift(x, projection, stabiliser_dims, real)
    # exp(w.x - |x|^2/2 - shift) / sqrt(m), with every per-row term folded into one [.., N, 1] offset
    offset = half_sq_norm + (shift + 0.5 * math.log(projection.shape[0]))
    features = torch.exp(projected - offset)
    return features if real is None else features * real.to(features.dtype)


def favor_features(
    query: Tensor, key: Tensor, projection: Tensor, attention_mask: Tensor | None
) -> tuple[Tensor, Tensor]:
    """phi(Q), phi(K) for FAVOR+ with padded keys' features set to zero."""
    data_scale = query.shape[-1] ** -0.25  # x.y = q.k / sqrt(d)
    real_keys = None if attention_mask is None else attention_mask[:, None, :, None]
    phi_q = _positive_features(query * data_scale, projection, (-1,), None)
    phi_k = _positive_features(key * data_scale, projection, (-1, -2), real_keys)
    return phi_q, phi_k


@padding_safe
def performer_attention(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attention_mask: Tensor | None = None,
    *,
    projection: Tensor,
    is_causal: bool = False,
) -> Tensor:
    """FAVOR+ on [B, H, N, Dh] with random-feature matrix ``projection`` [m, Dh]."""
    check_qkv(query, key, value, attention_mask)
    if projection.dim() != 2 or projection.shape[1] != query.shape[-1]:
        raise AttentionError(
            f"projection must be [m, Dh={query.shape[-1]}], got {list(projection.shape)}"
        )
    if is_causal and query.shape[-2] != key.shape[-2]:
        raise AttentionError("causal Performer attention needs as many queries as keys")
    if attention_mask is not None:
        value = value * attention_mask[:, None, :, None].to(value.dtype)
    # All-positive features: the normaliser is > 0 unless every key is padded; the tiny eps only
    # turns that 0/0 into 0.
    eps = torch.finfo(query.dtype).tiny
    if is_causal:
        phi_q, phi_k = favor_features(query, key, projection, attention_mask)
        return causal_kernel_attention(phi_q, phi_k, value, eps)
    return _chunked_favor(query, key, value, projection, attention_mask, eps)


# Tokens per chunk of the non-causal path: the [chunk, m] features of one chunk are the only
# feature tensors alive at a time, forward or backward (recomputed there: checkpoint).
FAVOR_CHUNK = 2048


def _chunked_favor(query: Tensor, key: Tensor, value: Tensor, projection: Tensor, attention_mask: Tensor | None,
                   eps: float) -> Tensor:
    """Non-causal FAVOR+ (eq. 5-6 with Lemma 1's features) chunk by chunk along N: the key
    sums phi(K)^T [V, 1] accumulated over key chunks, then each query chunk's output; the same
    numbers as kernel_attention on favor_features, without any [N, m] feature tensor."""
    data_scale = query.shape[-1] ** -0.25  # x.y = q.k / sqrt(d)
    n = key.shape[2]
    real = None if attention_mask is None else attention_mask[:, None, :, None]
    spans = [(start, min(start + FAVOR_CHUNK, n)) for start in range(0, n, FAVOR_CHUNK)]

    def real_of(start: int, stop: int) -> Tensor | None:
        return None if real is None else real[:, :, start:stop]

    # the keys' stabiliser is one maximum over every key and feature (see favor_features)
    shifts = [_feature_shift(key[:, :, a:b] * data_scale, projection, (-1, -2), real_of(a, b)) for a, b in spans]
    shift = torch.stack(shifts).amax(0)
    context = normaliser = None
    for a, b in spans:
        part_context, part_normaliser = checkpoint(_favor_key_sums, key[:, :, a:b] * data_scale, value[:, :, a:b],
                                                   projection, real_of(a, b), shift, use_reentrant=False)
        context = part_context if context is None else context + part_context
        normaliser = part_normaliser if normaliser is None else normaliser + part_normaliser
    outputs = [checkpoint(_favor_query_output, query[:, :, a:b] * data_scale, projection, context, normaliser, eps,
                          use_reentrant=False) for a, b in spans]
    return torch.cat(outputs, dim=2)


def _favor_key_sums(key: Tensor, value: Tensor, projection: Tensor, real: Tensor | None,
                    shift: Tensor) -> tuple[Tensor, Tensor]:
    """One key chunk's phi(K)^T V [B, H, m, Dv] and sum_j phi(K_j) [B, H, 1, m]."""
    phi_k = _positive_features(key, projection, (-1, -2), real, shift)
    return phi_k.transpose(-1, -2) @ value, phi_k.sum(dim=-2, keepdim=True)


def _favor_query_output(query: Tensor, projection: Tensor, context: Tensor, normaliser: Tensor, eps: float) -> Tensor:
    """One query chunk's phi(Q) (phi(K)^T V) / (phi(Q) sum_j phi(K_j) + eps)."""
    phi_q = _positive_features(query, projection, (-1,), None)
    return (phi_q @ context) / (phi_q @ normaliser.transpose(-1, -2) + eps)


@padding_safe
def performer_attention_reference(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attention_mask: Tensor | None = None,
    *,
    projection: Tensor,
    is_causal: bool = False,
) -> Tensor:
    """Plain Lemma 1 without stabilisers: A_hat = phi(Q) phi(K)^T materialised; for tests only."""
    d = query.shape[-1]
    m = projection.shape[0]
    w = projection.to(query.dtype)

    def phi(x: Tensor) -> Tensor:
        x = x / d**0.25
        return torch.exp(x @ w.T - (x * x).sum(-1, keepdim=True) / 2) / math.sqrt(m)

    a_hat = phi(query) @ phi(key).transpose(-1, -2)
    if attention_mask is not None:
        a_hat = a_hat * attention_mask[:, None, None, :].to(a_hat.dtype)
    if is_causal:
        a_hat = a_hat.tril()
    row_sums = a_hat.sum(-1, keepdim=True)
    return torch.where(row_sums > 0, a_hat @ value / row_sums, torch.zeros_like(row_sums))


@register_attention(
    "performer",
    capabilities=Capabilities(causal=True),
    functional=performer_attention,
    reference=performer_attention_reference,
    paper="Rethinking Attention with Performers (Choromanski et al., ICLR 2021)",
)
class PerformerAttention(AttentionBase):
    """FAVOR+ attention: positive orthogonal random features, redrawn during training."""

    def __init__(
        self,
        dim: int,
        heads: int,
        max_len: int | None = None,
        causal: bool = False,
        nb_features: int = 256,
        orthogonal: bool = True,
        redraw_interval: int | None = 1000,
        bias: bool = True,
    ) -> None:
        super().__init__(dim, heads, max_len, causal)
        if not isinstance(nb_features, int) or nb_features <= 0:
            raise AttentionError(f"nb_features must be a positive int, got {nb_features!r}")
        if redraw_interval is not None and (not isinstance(redraw_interval, int) or redraw_interval <= 0):
            raise AttentionError(f"redraw_interval must be a positive int or None, got {redraw_interval!r}")
        self.proj = QKVProjection(dim, heads, bias=bias)
        self.nb_features = nb_features
        self.orthogonal = orthogonal
        self.redraw_interval = redraw_interval
        # One feature matrix shared by all heads (as in the paper's implementation); a buffer so
        # it is saved with the model and follows .to(device).
        self.register_buffer(
            "projection", orthogonal_random_features(nb_features, self.head_dim, orthogonal=orthogonal)
        )
        self.register_buffer("calls_since_redraw", torch.zeros((), dtype=torch.long))

    @torch.no_grad()
    def redraw_features(self) -> None:
        """Draw a fresh random-feature matrix (uses the global torch RNG)."""
        fresh = orthogonal_random_features(
            self.nb_features, self.head_dim, orthogonal=self.orthogonal,
            dtype=self.projection.dtype, device=self.projection.device,
        )
        self.projection.copy_(fresh)
        self.calls_since_redraw.zero_()

    def attend(self, x: Tensor, attention_mask: Tensor | None, layer_state: dict | None) -> Tensor:
        if self.training and self.redraw_interval is not None:
            if int(self.calls_since_redraw) >= self.redraw_interval:
                self.redraw_features()
            self.calls_since_redraw += 1
        q, k, v = self.proj.qkv(x)
        out = performer_attention(q, k, v, attention_mask, projection=self.projection, is_causal=self.causal)
        return self.proj.out(out)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, nb_features={self.nb_features}, redraw_interval={self.redraw_interval}"
