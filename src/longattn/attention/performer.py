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

GPU path (:func:`~longattn.attention.base.uses_gpu_path`): the same features and sums as batched
tensor programs in the autocast dtype (no loop over batch rows, heads, groups or chunks); not
causal, :class:`_FavorGPU` keeps only the [F, Dv + 1] context and recomputes the features in the
backward pass; causal, the chunked scan of :func:`~longattn.attention.ops.linear_scan.causal_scan` (Triton
kernels where they run) on the features, its running state in float32.
"""

from __future__ import annotations

import math
from typing import Callable

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.utils.checkpoint import checkpoint

from longattn.attention.base import (
    AttentionBase,
    AttentionError,
    Capabilities,
    QKVProjection,
    budget_slices,
    check_qkv,
    compute_dtype,
    output_dtype,
    padding_safe,
    register_attention,
    uses_gpu_path,
)
from longattn.attention.decoding import RecurrentState, kernel_state_sums, kernel_step_output
from longattn.attention.ops.linear_scan import causal_chunks, causal_kernel_attention, kernel_sums_gpu, normalised


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


def _project(x: Tensor, projection: Tensor) -> Tensor:
    """w_i^T x for every row of x [..., d] -> [..., m], as one matrix product over all rows."""
    w = projection.to(x.dtype)
    return (x.reshape(-1, x.shape[-1]) @ w.T).view(*x.shape[:-1], w.shape[0])


def _half_square_norm(x: Tensor) -> Tensor:
    return x.square().sum(dim=-1, keepdim=True) / 2


def _stabiliser(projected: Tensor, half_sq_norm: Tensor, stabiliser_dims: tuple[int, ...],
                real: Tensor | None) -> Tensor:
    """The largest exponent w.x - |x|^2/2 over ``stabiliser_dims`` (padded rows excluded; 0 where nothing
    is real), read off the projections: rounding is monotone, so max_i(a_i) - h is exactly max_i(a_i - h)
    and no [.., N, m] difference is formed. It cancels exactly, so it carries no gradient."""
    with torch.no_grad():
        shift = projected.amax(dim=-1, keepdim=True) - half_sq_norm
        if real is not None:
            shift = shift.masked_fill(~real, float("-inf"))
        rows = tuple(dim for dim in stabiliser_dims if dim != -1)
        if rows:
            shift = shift.amax(dim=rows, keepdim=True)
        return shift.masked_fill(~torch.isfinite(shift), 0.0)  # a fully padded row / head


def _feature_shift(x: Tensor, projection: Tensor, stabiliser_dims: tuple[int, ...], real: Tensor | None) -> Tensor:
    """The stabiliser of phi(x) (see :func:`_stabiliser`) on its own, for a shift over more rows than one
    call of :func:`_positive_features` sees."""
    with torch.no_grad():
        return _stabiliser(_project(x, projection), _half_square_norm(x), stabiliser_dims, real)


def _features_and_shift(x: Tensor, projection: Tensor, stabiliser_dims: tuple[int, ...], real: Tensor | None,
                        shift: Tensor | None,
                        max_over_shards: Callable[[Tensor], Tensor] | None = None) -> tuple[Tensor, Tensor]:
    """phi(x) = exp(w.x - |x|^2/2 - shift) / sqrt(m) (zero on padded rows) and its shift (the stabiliser over
    ``stabiliser_dims`` unless given), without autograd."""
    projected = _project(x, projection)
    half_sq_norm = _half_square_norm(x)
    if shift is None:
        shift = _stabiliser(projected, half_sq_norm, stabiliser_dims, real)
        if max_over_shards is not None:  # keys split across processes: one shift for all of them
            shift = max_over_shards(shift)
    # every per-row term folded into one [.., N, 1] offset
    offset = half_sq_norm + (shift + 0.5 * math.log(projection.shape[0]))
    features = projected.sub_(offset).exp_()
    if real is not None:
        features.mul_(real.to(features.dtype))
    return features, shift


def _feature_grads(weighted: Tensor, x: Tensor, projection: Tensor, needs_x: bool,
                   needs_projection: bool) -> tuple[Tensor | None, Tensor | None]:
    """The gradients of phi(x) for x and W from G = grad * phi ([.., N, m], laid out as phi):
    d/dx = G W - x sum_i G_i and d/dW = G^T x."""
    weighted = weighted.reshape(-1, weighted.shape[-1])
    rows = x.reshape(-1, x.shape[-1])
    grad_x = grad_projection = None
    if needs_x:
        grad_x = (weighted @ projection.to(x.dtype) - rows * weighted.sum(dim=-1, keepdim=True)).view_as(x)
    if needs_projection:
        grad_projection = (weighted.T @ rows).to(projection.dtype)
    return grad_x, grad_projection


class _PositiveFeatures(torch.autograd.Function):
    """phi(x) = exp(w.x - |x|^2/2 - shift) / sqrt(m) with its gradient written out: with G = grad * phi,
    d/dx = G W - x sum_i G_i and d/dW = G^T x. Autograd of the same expression would also keep the
    [.., N, m] projections and form a negated copy of G for the |x|^2 term; here phi is the only
    [.., N, m] tensor saved and G the only one formed in the backward pass."""

    @staticmethod
    def forward(ctx, x: Tensor, projection: Tensor, stabiliser_dims: tuple[int, ...], real: Tensor | None,
                shift: Tensor | None, max_over_shards: Callable[[Tensor], Tensor] | None) -> Tensor:
        features, _ = _features_and_shift(x, projection, stabiliser_dims, real, shift, max_over_shards)
        ctx.save_for_backward(x, projection, features)
        return features

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad: Tensor):
        x, projection, features = ctx.saved_tensors
        # G, laid out as phi whatever the layout of grad (so that the reshape is a view); zero on padded rows
        weighted = torch.mul(grad, features, out=torch.empty_like(features))
        grad_x, grad_projection = _feature_grads(weighted, x, projection, *ctx.needs_input_grad[:2])
        return grad_x, grad_projection, None, None, None, None


def _positive_features(
    x: Tensor, projection: Tensor, stabiliser_dims: tuple[int, ...], real: Tensor | None, shift: Tensor | None = None,
    max_over_shards: Callable[[Tensor], Tensor] | None = None,
) -> Tensor:
    """phi(x) of Lemma 1 up to a constant that cancels (see module doc). x: [B, H, N, d] already
    scaled; ``shift`` the stabiliser when it was taken over more rows than x holds, ``max_over_shards``
    the reduction that makes the local one the shift of the whole sequence."""
    return _PositiveFeatures.apply(x, projection, stabiliser_dims, real, shift, max_over_shards)


def favor_features(
    query: Tensor,
    key: Tensor,
    projection: Tensor,
    attention_mask: Tensor | None,
    max_over_shards: Callable[[Tensor], Tensor] | None = None,
) -> tuple[Tensor, Tensor]:
    """phi(Q), phi(K) for FAVOR+ with padded keys' features set to zero.

    ``max_over_shards`` (longattn.parallel: an all-reduce max) makes the keys' stabilising shift
    the one of the whole sequence when each process holds part of the keys."""
    data_scale = query.shape[-1] ** -0.25  # x.y = q.k / sqrt(d)
    real_keys = None if attention_mask is None else attention_mask[:, None, :, None]
    phi_q = _positive_features(query * data_scale, projection, (-1,), None)
    phi_k = _positive_features(key * data_scale, projection, (-1, -2), real_keys, max_over_shards=max_over_shards)
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
    if uses_gpu_path(query):
        return _favor_gpu(query, key, value, attention_mask, projection, is_causal)
    if torch.is_grad_enabled() and any(t.requires_grad for t in (query, key, value, projection)):
        # training: the features and the sums in cache, a group of (batch, head) pairs at a time (causal, or a
        # sequence whose features are kept for the backward pass anyway)
        if is_causal or _keeps_features(*query.shape[:3], key.shape[2], projection.shape[0]):
            return _grouped_favor(query, key, value, attention_mask, projection, is_causal)
        return _favor(query, key, value, attention_mask, projection, is_causal)
    # Forward only (evaluation): a few batch rows at a time, so that one slice's features stay in cache instead of
    # [B, H, N, m] tensors (800 MB each for the Performer forecaster's decoder at batch 256, N = 384). Every
    # stabiliser is a maximum within one query row or one (batch, head) pair, so slices give the same numbers.
    slices = budget_slices(query.shape[0], query.shape[1] * max(query.shape[2], key.shape[2]) * projection.shape[0],
                           FAVOR_SLICE_ELEMENTS)
    if len(slices) == 1:
        return _favor(query, key, value, attention_mask, projection, is_causal)
    return torch.cat([
        _favor(query[rows], key[rows], value[rows], None if attention_mask is None else attention_mask[rows],
               projection, is_causal)
        for rows in slices])


def _favor(query: Tensor, key: Tensor, value: Tensor, attention_mask: Tensor | None, projection: Tensor,
           is_causal: bool) -> Tensor:
    """FAVOR+ (eq. 4-5, causal: prefix sums) on checked inputs."""
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
# ... unless the features of the whole sequence (one chunk) hold at most this many elements: then they are
# kept for the backward pass instead of computed again (at forecasting sizes, B*H = 256, N = 96, m = 256,
# the recomputation was a third of the mechanism's time).
FAVOR_KEEP_ELEMENTS = 1 << 23
# Without gradients, batch rows per slice such that a slice's [rows, H, N, m] features hold at most this many
# elements (at least one row): 4 MiB in float32, a few times the L2 cache (performer_attention).
FAVOR_SLICE_ELEMENTS = 1 << 20


def _keeps_features(batch: int, heads: int, n_query: int, n_key: int, features: int) -> bool:
    """Whether the non-causal path takes the whole sequence as one chunk and keeps its features (see FAVOR_CHUNK)."""
    n = max(n_query, n_key)
    return n <= FAVOR_CHUNK and batch * heads * n * features <= FAVOR_KEEP_ELEMENTS


def _grouped_favor(query: Tensor, key: Tensor, value: Tensor, attention_mask: Tensor | None, projection: Tensor,
                   is_causal: bool) -> Tensor:
    """FAVOR+ as :func:`_favor` computes it (the same features, stabilisers and sums), through :class:`_GroupedFavor`:
    [B, H, N, d] flattened to B * H (batch, head) pairs."""
    b, h, n_query, _ = query.shape
    n = key.shape[2]
    if attention_mask is not None:
        value = value * attention_mask[:, None, :, None].to(value.dtype)
    data_scale = query.shape[-1] ** -0.25  # x.y = q.k / sqrt(d)
    real = None if attention_mask is None else attention_mask[:, None, :, None].expand(b, h, n, 1).reshape(b * h, n, 1)
    pairs = (t.reshape(b * h, t.shape[2], t.shape[3]) for t in (query * data_scale, key * data_scale, value))
    out = _GroupedFavor.apply(*pairs, projection, real, torch.finfo(query.dtype).tiny, is_causal)
    return out.view(b, h, n_query, value.shape[-1])


class _GroupedFavor(torch.autograd.Function):
    """FAVOR+ (eq. 4-5, Lemma 1's features; causal: with the prefix sums of eq. 8-9 of the linear transformer) on
    [P, N, d] (batch, head) pairs with its backward written out, a group of pairs at a time: a group's
    [pairs, N, m] features hold at most FAVOR_SLICE_ELEMENTS elements, so that the chunk products, the prefix
    sums and their gradients run on features in cache instead of on [B, H, N, m] tensors in memory (200 MB each
    at the Performer forecaster's decoder at horizon 720), and no gradient of a sum or product is formed by
    itself and added to another (autograd of the chunked sums adds two [B, H, N, m] gradients per feature map).
    Saved per group: the features (causal: chunked, with the within-chunk products and the prefix states).

    The numbers are those of :func:`_favor`: phi(Q) with a per-row stabiliser, phi(K) with one per (batch, head)
    over its real keys (both within one pair, so a group computes what the whole batch would); not causal, the
    context phi(K)^T [V, 1] and S = phi(Q) phi(K)^T [V, 1] (:class:`_FavorGroup`); causal, the chunks of
    :func:`~longattn.attention.ops.linear_scan.causal_chunks`, within a chunk the masked product, across chunks the
    exclusive prefix sum of the states phi(K_c)^T [V_c, 1] (the normaliser is the numerator of a value column of
    ones). With S = [num, den] per query: S_c = phi(Q_c) P_c + tril(phi(Q_c) phi(K_c)^T) V1_c, P_c = sum_{c' < c}
    phi(K_c')^T V1_c', out = num / (den + eps); the backward pass is the chain rule of these products."""

    @staticmethod
    def forward(ctx, query: Tensor, key: Tensor, value: Tensor, projection: Tensor, real: Tensor | None,
                eps: float, is_causal: bool) -> Tensor:
        pairs, n_query, _ = query.shape
        dv = value.shape[-1]
        out, denominator = value.new_empty(pairs, n_query, dv), value.new_empty(pairs, n_query, 1)
        ctx.groups = []
        for group in budget_slices(pairs, max(n_query, key.shape[1]) * projection.shape[0], FAVOR_SLICE_ELEMENTS):
            sums = (_CausalFavorGroup if is_causal else _FavorGroup)(
                query[group], key[group], value[group], projection, None if real is None else real[group])
            both = sums.sums()
            torch.add(both[..., dv:], eps, out=denominator[group])
            torch.div(both[..., :dv], denominator[group], out=out[group])
            ctx.groups.append((group, sums))
        ctx.save_for_backward(query, key, projection, out, denominator)
        return out

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad: Tensor):
        query, key, projection, out, denominator = ctx.saved_tensors
        needs_q, needs_k, needs_v, needs_w = ctx.needs_input_grad[:4]
        grad_q = torch.empty_like(query) if needs_q else None
        grad_k = torch.empty_like(key) if needs_k else None
        grad_v = key.new_empty(*key.shape[:2], out.shape[-1]) if needs_v else None
        grad_w = torch.zeros_like(projection) if needs_w else None
        for group, sums in ctx.groups:
            # out = num / (den + eps): d/dnum = g / (den + eps), d/dden = -sum_j g_j out_j / (den + eps)
            g, group_denominator = grad[group], denominator[group]
            grad_sums = torch.cat([g / group_denominator,
                                   -(g * out[group]).sum(-1, keepdim=True) / group_denominator], dim=-1)
            grad_phi_q, grad_phi_k, grad_v1 = sums.backward(grad_sums)
            if needs_v:
                grad_v[group] = grad_v1[..., :-1]
            for x, phi, grad_phi, grad_x in ((query[group], sums.phi_q, grad_phi_q, grad_q),
                                            (key[group], sums.phi_k, grad_phi_k, grad_k)):
                if grad_x is None and not needs_w:
                    continue
                group_grad_x, grad_projection = _feature_grads(grad_phi.mul_(phi), x, projection, grad_x is not None,
                                                               needs_w)
                if grad_x is not None:
                    grad_x[group] = group_grad_x
                if needs_w:
                    grad_w += grad_projection
        return grad_q, grad_k, grad_v, grad_w, None, None, None


class _FavorGroup:
    """One group's non-causal FAVOR+: the features and the context that the sums S = [num, den] and their backward
    pass are made of (see :class:`_GroupedFavor`)."""

    def __init__(self, query: Tensor, key: Tensor, value: Tensor, projection: Tensor, real: Tensor | None) -> None:
        self.phi_q, _ = _features_and_shift(query, projection, (-1,), None, None)
        self.phi_k, _ = _features_and_shift(key, projection, (-1, -2), real, None)
        self.value = torch.cat([value, value.new_ones(*value.shape[:-1], 1)], dim=-1)  # [V, 1]
        self.context = torch.bmm(self.phi_k.transpose(1, 2), self.value)  # phi(K)^T [V, 1]

    def sums(self) -> Tensor:
        """S = [num, den]: [P, N_q, Dv + 1]."""
        return torch.bmm(self.phi_q, self.context)

    def backward(self, grad_sums: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """The gradients of phi(Q), phi(K) and [V, 1] (fresh tensors) from that of S."""
        grad_context = torch.bmm(self.phi_q.transpose(1, 2), grad_sums)
        return (torch.bmm(grad_sums, self.context.transpose(1, 2)), torch.bmm(self.value, grad_context.transpose(1, 2)),
                torch.bmm(self.phi_k, grad_context))


class _CausalFavorGroup:
    """One group's causal FAVOR+: the features and the chunked products that the sums S = [num, den] and their
    backward pass are made of (see :class:`_GroupedFavor`)."""

    def __init__(self, query: Tensor, key: Tensor, value: Tensor, projection: Tensor, real: Tensor | None) -> None:
        pairs, n, _ = query.shape
        count, length = causal_chunks(n)
        self.n, self.shape = n, (pairs, count, length)
        phi_q, _ = _features_and_shift(query, projection, (-1,), None, None)
        phi_k, _ = _features_and_shift(key, projection, (-1, -2), real, None)
        # [P * chunks, chunk, .], zero features (and values) on a padded tail: they add nothing to any sum
        self.q_c, self.k_c = self._chunked(phi_q), self._chunked(phi_k)
        self.value = value
        v_c = self._values()
        states = torch.bmm(self.k_c.transpose(1, 2), v_c).view(pairs, count, -1, v_c.shape[-1])
        self.past = (states.cumsum(dim=1) - states).view(pairs * count, -1, v_c.shape[-1])  # chunks strictly before
        self.within = torch.bmm(self.q_c, self.k_c.transpose(1, 2)).tril_()  # j <= i inside a chunk

    @property
    def phi_q(self) -> Tensor:
        return self._unchunked(self.q_c)

    @property
    def phi_k(self) -> Tensor:
        return self._unchunked(self.k_c)

    def _values(self) -> Tensor:
        """[V, 1] chunked."""
        return self._chunked(torch.cat([self.value, self.value.new_ones(*self.value.shape[:-1], 1)], dim=-1))

    def _chunked(self, x: Tensor) -> Tensor:
        """[P, N, k] -> [P * chunks, chunk, k], zero-padded at the end."""
        pairs, count, length = self.shape
        if count * length > self.n:
            x = F.pad(x, (0, 0, 0, count * length - self.n))
        return x.reshape(pairs * count, length, x.shape[-1])

    def _unchunked(self, x: Tensor) -> Tensor:
        """[P * chunks, chunk, k] -> [P, N, k] (a view)."""
        pairs, count, length = self.shape
        return x.view(pairs, count * length, -1)[:, :self.n]

    def sums(self) -> Tensor:
        """S = [num, den]: [P, N, Dv + 1]."""
        return self._unchunked(torch.bmm(self.within, self._values()).baddbmm_(self.q_c, self.past))

    def backward(self, grad_sums: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """The gradients of phi(Q), phi(K) ([P, N, m], fresh tensors) and of [V, 1] ([P, N, Dv + 1]) from that of S."""
        pairs, count, length = self.shape
        grad_c, v_c = self._chunked(grad_sums), self._values()
        grad_within = torch.bmm(grad_c, v_c.transpose(1, 2)).tril_()
        grad_q = torch.bmm(grad_within, self.k_c).baddbmm_(grad_c, self.past.transpose(1, 2))
        grad_past = torch.bmm(self.q_c.transpose(1, 2), grad_c).view(pairs, count, *self.past.shape[1:])
        # each chunk's state reaches the sums of every later chunk: the reverse exclusive prefix sum
        grad_states = (grad_past.flip(1).cumsum(dim=1).flip(1) - grad_past).view(self.past.shape)
        grad_k = torch.bmm(grad_within.transpose(1, 2), self.q_c).baddbmm_(v_c, grad_states.transpose(1, 2))
        grad_v = torch.bmm(self.within.transpose(1, 2), grad_c).baddbmm_(self.k_c, grad_states)
        return self._unchunked(grad_q), self._unchunked(grad_k), self._unchunked(grad_v)


def _chunked_favor(query: Tensor, key: Tensor, value: Tensor, projection: Tensor, attention_mask: Tensor | None,
                   eps: float) -> Tensor:
    """Non-causal FAVOR+ (eq. 5-6 with Lemma 1's features) chunk by chunk along N: the key
    sums phi(K)^T [V, 1] accumulated over key chunks, then each query chunk's output; the same
    numbers as kernel_attention on favor_features, without any [N, m] feature tensor beyond
    FAVOR_CHUNK tokens (or FAVOR_KEEP_ELEMENTS elements)."""
    data_scale = query.shape[-1] ** -0.25  # x.y = q.k / sqrt(d)
    b, h, n_query, _ = query.shape
    n = key.shape[2]
    real = None if attention_mask is None else attention_mask[:, None, :, None]
    # the normaliser sum_j phi(K_j) is the context of a value column of ones: one product gives both
    value = torch.cat([value, value.new_ones(*value.shape[:-1], 1)], dim=-1)
    if _keeps_features(b, h, n_query, n, projection.shape[0]):
        sums = _favor_key_sums(key * data_scale, value, projection, real, None)
        return _favor_query_output(query * data_scale, projection, sums, eps)

    def spans(length: int) -> list[tuple[int, int]]:
        return [(start, min(start + FAVOR_CHUNK, length)) for start in range(0, length, FAVOR_CHUNK)]

    def real_of(start: int, stop: int) -> Tensor | None:
        return None if real is None else real[:, :, start:stop]

    # the keys' stabiliser is one maximum over every key and feature (see favor_features)
    shifts = [_feature_shift(key[:, :, start:stop] * data_scale, projection, (-1, -2), real_of(start, stop))
              for start, stop in spans(n)]
    shift = torch.stack(shifts).amax(0)
    sums = None
    for start, stop in spans(n):
        part = checkpoint(_favor_key_sums, key[:, :, start:stop] * data_scale, value[:, :, start:stop], projection,
                          real_of(start, stop), shift, use_reentrant=False)
        sums = part if sums is None else sums + part
    outputs = [checkpoint(_favor_query_output, query[:, :, start:stop] * data_scale, projection, sums, eps,
                          use_reentrant=False) for start, stop in spans(n_query)]
    return torch.cat(outputs, dim=2)


def _favor_key_sums(key: Tensor, value: Tensor, projection: Tensor, real: Tensor | None,
                    shift: Tensor | None) -> Tensor:
    """One key chunk's phi(K)^T [V, 1]: [B, H, m, Dv + 1] (the context, then sum_j phi(K_j))."""
    return _positive_features(key, projection, (-1, -2), real, shift).transpose(-1, -2) @ value


def _favor_query_output(query: Tensor, projection: Tensor, sums: Tensor, eps: float) -> Tensor:
    """One query chunk's phi(Q) (phi(K)^T V) / (phi(Q) sum_j phi(K_j) + eps), both from one product."""
    both = _positive_features(query, projection, (-1,), None) @ sums
    return both[..., :-1] / (both[..., -1:] + eps)


# ----------------------------------------------------------------------------- GPU path


def _favor_gpu(query: Tensor, key: Tensor, value: Tensor, attention_mask: Tensor | None, projection: Tensor,
               is_causal: bool) -> Tensor:
    """FAVOR+ (eq. 4-5, causal: prefix sums) on the GPU path: features and GEMMs in the autocast dtype, the
    normalisation (and the causal running state) in float32, output in the autocast dtype."""
    dtype = output_dtype(query)
    data_scale = query.shape[-1] ** -0.25  # x.y = q.k / sqrt(d)
    x_q, x_k, value = query.to(dtype) * data_scale, key.to(dtype) * data_scale, value.to(dtype)
    real = None
    if attention_mask is not None:
        real = attention_mask[:, None, :, None]
        value = value.masked_fill(~real, 0.0)
    eps = torch.finfo(compute_dtype(dtype)).tiny  # turns a fully padded 0 / 0 into 0
    if not is_causal:
        return _FavorGPU.apply(x_q, x_k, value, projection, real, eps).to(dtype)
    phi_q = _positive_features(x_q, projection, (-1,), None)
    phi_k = _positive_features(x_k, projection, (-1, -2), real)
    numerator, normaliser = kernel_sums_gpu(phi_q, phi_k, value, is_causal=True)
    return normalised(numerator, normaliser + eps, dtype)


class _FavorGPU(torch.autograd.Function):
    """Non-causal FAVOR+ as one batched program that keeps neither feature map for the backward pass:
    phi(K) gives the context C = phi(K)^T [V, 1] ([F, Dv + 1] per head) and is freed, then
    S = phi(Q) C = [num, den] and out = num / (den + eps). The backward pass recomputes phi(K) and phi(Q)
    (one GEMM and an exp each, with the same stabilisers) instead of holding two [B, H, N, F] tensors from
    the forward pass to the backward pass; with G = grad_phi * phi the feature gradients are those of
    :func:`_feature_grads`."""

    @staticmethod
    def forward(ctx, x_q: Tensor, x_k: Tensor, value: Tensor, projection: Tensor, real: Tensor | None,
                eps: float) -> Tensor:
        value1 = torch.cat([value, value.new_ones(*value.shape[:-1], 1)], dim=-1)  # [V, 1]
        phi_k, key_shift = _features_and_shift(x_k, projection, (-1, -2), real, None)
        context = phi_k.transpose(-1, -2) @ value1
        del phi_k
        phi_q, _ = _features_and_shift(x_q, projection, (-1,), None, None)
        sums = (phi_q @ context).to(compute_dtype(x_q.dtype))
        denominator = sums[..., -1:] + eps
        out = sums[..., :-1] / denominator
        ctx.save_for_backward(x_q, x_k, value1, projection, real, key_shift, context, out, denominator)
        return out

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad: Tensor):
        x_q, x_k, value1, projection, real, key_shift, context, out, denominator = ctx.saved_tensors
        needs_q, needs_k, needs_v, needs_w = ctx.needs_input_grad[:4]
        dtype = x_q.dtype
        # out = num / den: d/dnum = g / den, d/dden = -(g . out) / den
        grad_sums = torch.cat([grad / denominator, -(grad * out).sum(-1, keepdim=True) / denominator], dim=-1)
        grad_sums = grad_sums.to(dtype)
        grad_q = grad_k = grad_v = grad_w = None
        phi_q, _ = _features_and_shift(x_q, projection, (-1,), None, None)
        grad_context = phi_q.transpose(-1, -2) @ grad_sums  # [F, Dv + 1]
        if needs_q or needs_w:
            weighted = (grad_sums @ context.transpose(-1, -2)).mul_(phi_q)  # G = grad_phi(Q) * phi(Q)
            grad_q, grad_w = _feature_grads(weighted, x_q, projection, needs_q, needs_w)
            del weighted
        del phi_q
        phi_k, _ = _features_and_shift(x_k, projection, (-1, -2), real, key_shift)
        if needs_v:
            grad_v = (phi_k @ grad_context[..., :-1])
        if needs_k or needs_w:
            weighted = (value1 @ grad_context.transpose(-1, -2)).mul_(phi_k)
            grad_k, grad_w_k = _feature_grads(weighted, x_k, projection, needs_k, needs_w)
            grad_w = grad_w_k if grad_w is None else grad_w + grad_w_k
        return grad_q, grad_k, grad_v, grad_w, None, None


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
    capabilities=Capabilities(causal=True, sequence_parallel=True),
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
        # a host copy of calls_since_redraw, so that a training call does not read the buffer back from the GPU
        # (a device sync per call); None: read it at the next call (after loading a state dict)
        self._calls_on_host: int | None = 0
        self._register_load_state_dict_pre_hook(self._forget_host_calls)

    def _forget_host_calls(self, *args: object) -> None:
        self._calls_on_host = None

    @torch.no_grad()
    def redraw_features(self) -> None:
        """Draw a fresh random-feature matrix (uses the global torch RNG)."""
        fresh = orthogonal_random_features(
            self.nb_features, self.head_dim, orthogonal=self.orthogonal,
            dtype=self.projection.dtype, device=self.projection.device,
        )
        self.projection.copy_(fresh)
        self.calls_since_redraw.zero_()
        self._calls_on_host = 0

    def attend(self, x: Tensor, attention_mask: Tensor | None, layer_state: dict | None) -> Tensor:
        if self.training and self.redraw_interval is not None:
            if self._calls_on_host is None:
                self._calls_on_host = int(self.calls_since_redraw)
            if self._calls_on_host >= self.redraw_interval:
                self.redraw_features()
            self.calls_since_redraw += 1
            self._calls_on_host += 1
        q, k, v = self.proj.qkv(x)
        out = performer_attention(q, k, v, attention_mask, projection=self.projection, is_causal=self.causal)
        return self.proj.out(out)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, nb_features={self.nb_features}, redraw_interval={self.redraw_interval}"

    # -- decoding: running sums of the FAVOR+ features with a running stabiliser ------------------
    decode_state = "recurrent"

    def prefill_heads(self, query: Tensor, key: Tensor, value: Tensor, attention_mask: Tensor | None,
                      layer_state: dict | None) -> tuple[Tensor, RecurrentState]:
        out = performer_attention(query, key, value, attention_mask, projection=self.projection, is_causal=True)
        with torch.no_grad():  # the state is for decoding: no gradient flows into later tokens through it
            real = None if attention_mask is None else attention_mask[:, None, :, None]
            phi_k, shift = _features_and_shift(key * query.shape[-1] ** -0.25, self.projection, (-1, -2), real, None)
            if real is not None:
                value = value * real.to(value.dtype)
                # no real key yet: no stabiliser (the first real key sets it)
                shift = shift.masked_fill(~real.any(2, keepdim=True), float("-inf"))
            state = RecurrentState(length=key.shape[2], sums=kernel_state_sums(phi_k, value), extra={"shift": shift})
        return out, state

    def step_heads(self, query: Tensor, key: Tensor, value: Tensor, state: RecurrentState, real: Tensor | None,
                   layer_state: dict | None) -> tuple[Tensor, RecurrentState]:
        """phi(k) joins the sums under the keys' stabiliser, the running maximum of their exponents w.x - |x|^2/2:
        when the new key raises it the sums are rescaled by exp(old - new), so every term carries the one shift
        that the full forward's maximum over all keys gives (it cancels in the normalised output)."""
        data_scale = query.shape[-1] ** -0.25
        x = key * data_scale
        exponents = _project(x, self.projection) - _half_square_norm(x)  # [B, H, 1, m]
        old = state.extra["shift"]
        new = exponents.amax(-1, keepdim=True)
        if real is not None:
            new = new.masked_fill(~real[:, None, None, None], float("-inf"))
        shift = torch.maximum(old, new)
        growth = torch.exp(old - shift).nan_to_num(0.0)  # -inf - -inf: nothing real so far, nothing to rescale
        phi_k = torch.exp(exponents - shift - 0.5 * math.log(self.projection.shape[0]))
        if real is not None:
            phi_k = torch.where(real[:, None, None, None], phi_k, 0.0)
        state.sums = state.sums * growth + kernel_state_sums(phi_k, value)
        state.extra["shift"] = shift
        phi_q, _ = _features_and_shift(query * data_scale, self.projection, (-1,), None, None)
        return kernel_step_output(phi_q, state.sums, eps=torch.finfo(query.dtype).tiny), state
