"""FSAT: Fourier Sparse Attention for Transformer (Zhuang et al., ACL 2022).

Two parts, both O(L log L) or better in the sequence length L:

1. Pooled hidden-state cross (section 3.2): non-linear feature maps f1, f2 of the hidden states are
   crossed pairwise and sum-pooled along antidiagonals (eq. 2) by an FFT linear convolution (eq. 3);
   consecutive antidiagonals are merged around their central token and layer-normalised (eq. 4).
   Keys and values are projected from that cross C, queries from X (eq. 6).
2. Predictable sparse attention (section 4): every key j predicts M dominant query positions
   I_bar = sigmoid(C W_I + b) * Lmax (eq. 9). Query i attends only to the keys that chose it
   (the union with random choices while training, the predicted ones only in eval); the softmax
   over those keys is multiplied by a Gaussian confidence rho(i | I_bar, sigma^2) (eqs. 7, 8, 10),
   whose gradient is truncated to (-inf, 0] (section 4.2.4). Everything is gathered and scattered
   per edge (L * (M + R) of them), so no L x L tensor exists, forward or backward.

The dense ablation FAT (softmax attention with K, V from C) lives in ``fat.py``.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.autograd.function import once_differentiable
from torch.utils.checkpoint import checkpoint

from longattn.attention.base import (
    AttentionBase,
    AttentionError,
    Capabilities,
    check_qkv,
    merge_heads,
    padding_safe,
    register_attention,
    split_heads,
)

__all__ = [
    "FSATAttention",
    "PooledHiddenStateCross",
    "central_token_symmetry_merge",
    "central_token_symmetry_merge_reference",
    "fsat_sparse_attention",
    "fsat_sparse_attention_reference",
    "pooled_hidden_state_cross",
    "pooled_hidden_state_cross_reference",
]

FEATURE_MAPS = ("dense", "conv")
ACTIVATIONS = {"gelu": F.gelu, "relu": F.relu, "elu": F.elu, "tanh": torch.tanh, "silu": F.silu}
TRAIN_INDICES = ("union", "predicted", "random")
# Elements of one [B, H, keys, E, Dh] per-edge block (2 MB in float32) and of one block of
# the pooled cross's spectra (complex: 8 MB in complex64).
_EDGE_BLOCK_ELEMENTS = 1 << 19
_FFT_BLOCK_ELEMENTS = 1 << 20


# ----------------------------------------------------------------------------- pooled cross (eqs. 2-4)


def pooled_hidden_state_cross(f1x: Tensor, f2x: Tensor) -> Tensor:
    """Antidiagonal sum-pooled crosses c_k = sum_{i+j=k} f1(x_i) * f2(x_j), k = 0..2L-2 (eqs. 2-3).

    ``f1x``, ``f2x``: [B, L, D] feature-mapped hidden states (zero them at padded tokens to leave
    padding out). Returns [B, 2L-1, D]. The FFT is zero-padded to >= 2L-1 points so the product in
    frequency space is the *linear* convolution of eq. 2, not a circular one.
    """
    if f1x.shape != f2x.shape or f1x.dim() != 3:
        raise AttentionError(f"f1x and f2x must both be [B, L, D], got {list(f1x.shape)}, {list(f2x.shape)}")
    return _in_feature_blocks(_cross_block, f1x, f2x)


def _in_feature_blocks(block_fn, f1x: Tensor, f2x: Tensor) -> Tensor:
    """``block_fn(part1, part2, n_fft)`` over blocks of features (they are independent), so that no
    spectrum above ~8 MB exists (cache friendly, and below the allocator's mmap threshold: linear
    growth in L); under autograd each block is recomputed in its own backward, so no block's
    spectra are kept either."""
    length = f1x.shape[1]
    n_fft = 1 << (2 * length - 2).bit_length()  # smallest power of two >= 2L-1
    # torch.fft has no bf16 kernels and half needs care: cross in float32, return in the input dtype.
    work = torch.promote_types(f1x.dtype, torch.float32)
    features = max(1, _FFT_BLOCK_ELEMENTS // (f1x.shape[0] * n_fft))
    recompute = torch.is_grad_enabled() and (f1x.requires_grad or f2x.requires_grad)
    blocks = [checkpoint(block_fn, part1, part2, n_fft, use_reentrant=False) if recompute else block_fn(part1, part2, n_fft)
              for part1, part2 in zip(f1x.to(work).split(features, dim=2), f2x.to(work).split(features, dim=2))]
    return torch.cat(blocks, dim=2).to(f1x.dtype)


def _cross_block(part1: Tensor, part2: Tensor, n_fft: int) -> Tensor:
    """Eq. 3 for a block of features: [B, L, d] x 2 -> [B, 2L-1, d]."""
    spec = torch.fft.rfft(part1, n=n_fft, dim=1) * torch.fft.rfft(part2, n=n_fft, dim=1)
    # irfft returns the real part (eq. 3's Re): the spectrum of a real convolution is Hermitian.
    return torch.fft.irfft(spec, n=n_fft, dim=1)[:, : 2 * part1.shape[1] - 1]


def _paired_cross_block(part1: Tensor, part2: Tensor, n_fft: int) -> Tensor:
    """c_{2t} + c_{2t+1} of eq. 4 for a block of features: [B, L, d] x 2 -> [B, L, d]."""
    return _pairs(_cross_block(part1, part2, n_fft))


def _pairs(pooled: Tensor) -> Tensor:
    """[B, 2L-1, D] -> [B, L, D]: rows 2t and 2t+1 summed (one zero row appended for the odd rows)."""
    b, rows, d = pooled.shape
    return F.pad(pooled, (0, 0, 0, 1)).view(b, (rows + 1) // 2, 2, d).sum(2)


def pooled_hidden_state_cross_reference(f1x: Tensor, f2x: Tensor) -> Tensor:
    """Eq. 2 literally: all L^2 crosses c_ij = f1(x_i) * f2(x_j), summed over i + j = k. Tests only."""
    b, length, d = f1x.shape
    crosses = f1x[:, :, None, :] * f2x[:, None, :, :]  # [B, L(i), L(j), D]
    pos = torch.arange(length, device=f1x.device)
    antidiagonal = (pos[:, None] + pos[None, :]).flatten()
    pooled = f1x.new_zeros(b, 2 * length - 1, d)
    return pooled.index_add(1, antidiagonal, crosses.flatten(1, 2))


def central_token_symmetry_merge(pooled: Tensor, f1x: Tensor, f2x: Tensor) -> Tensor:
    """C1 + C2 - f1(X) * f2(X) of eq. 4 (before the LayerNorm): row t = c_{2t} + c_{2t+1} - f1(x_t) f2(x_t).

    Antidiagonal 2t is centred on token t and 2t+1 between t and t+1; the odd rows get one zero
    row appended to reach L rows. The self-cross t-t is subtracted.
    """
    b, length, d = f1x.shape
    if pooled.shape != (b, 2 * length - 1, d):
        raise AttentionError(
            f"pooled cross must be [B, 2L-1, D] = {[b, 2 * length - 1, d]}, got {list(pooled.shape)}"
        )
    return _pairs(pooled) - f1x * f2x


def central_token_symmetry_merge_reference(f1x: Tensor, f2x: Tensor) -> Tensor:
    """Eqs. 2 + 4 from their meaning: token t collects every cross (i, j), i != j, with (i+j) // 2 == t."""
    b, length, d = f1x.shape
    pos = torch.arange(length, device=f1x.device)
    centre = (pos[:, None] + pos[None, :]) // 2
    off_diagonal = pos[:, None] != pos[None, :]
    assign = F.one_hot(centre, length).to(f1x.dtype) * off_diagonal[..., None].to(f1x.dtype)  # [L(i), L(j), L(t)]
    return torch.einsum("bid,bjd,ijt->btd", f1x, f2x, assign)


class FeatureMap(nn.Module):
    """A parameterised non-linear feature map f (eq. 1): dense ``act(x W + b)`` or the depth-wise
    separable convolution variant ``act(pointwise(depthwise_k(x)))`` (paper: kernel 5, the Text task)."""

    def __init__(self, dim: int, kind: str, kernel_size: int, activation: str) -> None:
        super().__init__()
        self.kind = kind
        self.activation = ACTIVATIONS[activation]
        if kind == "conv":
            self.depthwise = nn.Conv1d(dim, dim, kernel_size, padding=kernel_size // 2, groups=dim)
        self.linear = nn.Linear(dim, dim)  # the dense layer, or the point-wise conv of the conv variant

    def forward(self, x: Tensor) -> Tensor:
        if self.kind == "conv":
            x = self.depthwise(x.transpose(1, 2)).transpose(1, 2)
        return self.activation(self.linear(x))


class PooledHiddenStateCross(nn.Module):
    """X [B, L, D] -> C = LN(C1 + C2 - f1(X) * f2(X)) [B, L, D] (eqs. 1-4), padding left out."""

    def __init__(
        self, dim: int, feature_map: str = "dense", conv_kernel_size: int = 5, feature_activation: str = "gelu"
    ) -> None:
        super().__init__()
        if feature_map not in FEATURE_MAPS:
            raise AttentionError(f"feature_map must be one of {FEATURE_MAPS}, got {feature_map!r}")
        if feature_activation not in ACTIVATIONS:
            raise AttentionError(
                f"feature_activation must be one of {sorted(ACTIVATIONS)}, got {feature_activation!r}"
            )
        if not isinstance(conv_kernel_size, int) or conv_kernel_size < 1 or conv_kernel_size % 2 == 0:
            raise AttentionError(f"conv_kernel_size must be a positive odd int, got {conv_kernel_size!r}")
        self.f1 = FeatureMap(dim, feature_map, conv_kernel_size, feature_activation)
        self.f2 = FeatureMap(dim, feature_map, conv_kernel_size, feature_activation)
        self.norm = nn.LayerNorm(dim)

    def forward(self, x: Tensor, attention_mask: Tensor | None, input_masked: bool = False) -> Tensor:
        """``input_masked``: ``x`` is already zero at padded tokens (an attention layer's input is)."""
        keep = None if attention_mask is None else attention_mask[..., None].to(x.dtype)
        if keep is not None and not input_masked:
            x = x * keep  # the conv variant must not see padded tokens' values
        # each feature map is recomputed in backward: its pre-activation is not kept
        recompute = torch.is_grad_enabled()
        f1x, f2x = (checkpoint(_masked_feature, f, x, keep, use_reentrant=False) if recompute else _masked_feature(f, x, keep)
                    for f in (self.f1, self.f2))
        # central_token_symmetry_merge(pooled_hidden_state_cross(f1x, f2x), f1x, f2x), with the pairs of
        # eq. 4 summed inside each feature block: no [B, 2L-1, D] cross is kept
        return self.norm(_in_feature_blocks(_paired_cross_block, f1x, f2x) - f1x * f2x)


def _masked_feature(feature_map: FeatureMap, x: Tensor, keep: Tensor | None) -> Tensor:
    """f(x), zero at padded tokens: they take part in no cross (eq. 2)."""
    fx = feature_map(x)
    return fx if keep is None else fx * keep


# ----------------------------------------------------------------------------- sparse attention (eqs. 7-10)


class _TruncateGradient(torch.autograd.Function):
    """Identity forward; backward keeps only the non-positive part of the gradient (section 4.2.4)."""

    @staticmethod
    def forward(ctx, x: Tensor) -> Tensor:  # type: ignore[override]
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: Tensor) -> Tensor:  # type: ignore[override]
        return grad.clamp(max=0.0)


def _gaussian_confidence(index: Tensor, centre: Tensor, sigma2: float, normalize: bool) -> Tensor:
    # eqs. 8 / 10: the Gaussian density rho(I | I_bar, sigma^2); ``normalize=False`` drops 1/sqrt(2 pi sigma^2).
    conf = torch.exp(-(index.to(centre.dtype) - centre).square() / (2.0 * sigma2))
    return conf / math.sqrt(2.0 * math.pi * sigma2) if normalize else conf


def _edges(
    dominant_index: Tensor,
    random_index: Tensor | None,
    use_predicted: bool,
    lmax: int,
) -> tuple[Tensor, Tensor]:
    """Integer query index of every edge [B, H, L, E] and the predicted centre I_bar it is scored against.

    Predicted edges are I_p = floor(I_bar) (eq. 9, section 4.2.3); random column r is paired with
    predicted column r mod M for its confidence (the paper draws I_r with I's shape L x M).
    floor(I_bar) is clamped to [0, Lmax - 1]: sigmoid saturates to exactly 1 in low precision.
    """
    m = dominant_index.shape[-1]
    indices, centres = [], []
    if use_predicted:
        indices.append(dominant_index.detach().floor().long().clamp(0, lmax - 1))
        centres.append(dominant_index)
    if random_index is not None:
        r = random_index.shape[-1]
        columns = torch.arange(r, device=dominant_index.device) % m
        indices.append(random_index)
        centres.append(dominant_index.index_select(-1, columns))
    if not indices:
        raise AttentionError("fsat: no edges: use_predicted=False needs a random_index")
    return torch.cat(indices, -1), torch.cat(centres, -1)


def _check_sparse_inputs(query: Tensor, key: Tensor, dominant_index: Tensor, random_index: Tensor | None) -> None:
    b, h, n = key.shape[:3]
    if query.shape[2] != n:
        raise AttentionError(f"fsat is self-attention: query and key lengths differ ({query.shape[2]} vs {n})")
    if not isinstance(dominant_index, Tensor) or dominant_index.dim() != 4 or dominant_index.shape[:3] != (b, h, n):
        raise AttentionError(
            f"dominant_index must be a float tensor [B, H, N, M] = [{b}, {h}, {n}, M], "
            f"got {getattr(dominant_index, 'shape', type(dominant_index).__name__)}"
        )
    if not dominant_index.is_floating_point():
        raise AttentionError(f"dominant_index must be floating point (eq. 9), got {dominant_index.dtype}")
    if random_index is not None:
        if random_index.dim() != 4 or random_index.shape[:3] != (b, h, n) or random_index.dtype != torch.long:
            raise AttentionError(
                f"random_index must be a long tensor [B, H, N, R], got {random_index.dtype} {list(random_index.shape)}"
            )


def _edge_blocks(target: Tensor, dh: int) -> int:
    """Keys per block of per-edge work: no [B, H, N, E, Dh] tensor exists at once (small blocks
    stay cache-resident and below the allocator's mmap threshold, so the cost grows linearly)."""
    b, h, _, e = target.shape
    return max(1, _EDGE_BLOCK_ELEMENTS // (b * h * e * dh))


class _EdgeScores(torch.autograd.Function):
    """scores[b, h, j, e] = query[target[b, h, j, e]] . key[b, h, j] (``query`` flattened to rows),
    key block by key block, forward and backward; keeps only its inputs for backward (autograd
    through the blocks kept every block's gathered queries, and its backward made a full-size
    query gradient per block)."""

    @staticmethod
    def forward(ctx, flat_query: Tensor, key: Tensor, target: Tensor) -> Tensor:  # type: ignore[override]
        ctx.save_for_backward(flat_query, key, target)
        rows, dh = _edge_blocks(target, key.shape[-1]), key.shape[-1]
        return torch.cat([torch.einsum("bhjed,bhjd->bhje", flat_query.index_select(0, t.flatten()).view(*t.shape, dh), k)
                          for t, k in zip(target.split(rows, dim=2), key.split(rows, dim=2))], dim=2)

    @staticmethod
    @once_differentiable
    def backward(ctx, grad: Tensor) -> tuple[Tensor | None, Tensor | None, None]:  # type: ignore[override]
        flat_query, key, target = ctx.saved_tensors
        rows, dh = _edge_blocks(target, key.shape[-1]), key.shape[-1]
        grad_query = torch.zeros_like(flat_query) if ctx.needs_input_grad[0] else None
        grad_key = torch.empty_like(key) if ctx.needs_input_grad[1] else None
        start = 0
        for t, k, g in zip(target.split(rows, dim=2), key.split(rows, dim=2), grad.split(rows, dim=2)):
            if grad_key is not None:
                gathered = flat_query.index_select(0, t.flatten()).view(*t.shape, dh)
                grad_key[:, :, start:start + t.shape[2]] = torch.einsum("bhje,bhjed->bhjd", g, gathered)
            if grad_query is not None:
                grad_query.index_add_(0, t.flatten(), (g.unsqueeze(-1) * k.unsqueeze(3)).reshape(-1, dh))
            start += t.shape[2]
        return grad_query, grad_key, None


class _EdgeSums(torch.autograd.Function):
    """out[target[b, h, j, e]] += weight[b, h, j, e] * value[b, h, j] over all edges ([B*H*N, Dh]
    rows), key block by key block, forward and backward; keeps only its inputs for backward."""

    @staticmethod
    def forward(ctx, weight: Tensor, value: Tensor, target: Tensor) -> Tensor:  # type: ignore[override]
        ctx.save_for_backward(weight, value, target)
        b, h, n, dh = value.shape
        rows = _edge_blocks(target, dh)
        out = value.new_zeros(b * h * n, dh)
        for t, w, v in zip(target.split(rows, dim=2), weight.split(rows, dim=2), value.split(rows, dim=2)):
            out.index_add_(0, t.flatten(), (w.unsqueeze(-1) * v.unsqueeze(3)).reshape(-1, dh))
        return out

    @staticmethod
    @once_differentiable
    def backward(ctx, grad: Tensor) -> tuple[Tensor | None, Tensor | None, None]:  # type: ignore[override]
        weight, value, target = ctx.saved_tensors
        dh = value.shape[-1]
        rows = _edge_blocks(target, dh)
        grad_weight = torch.empty_like(weight) if ctx.needs_input_grad[0] else None
        grad_value = torch.empty_like(value) if ctx.needs_input_grad[1] else None
        start = 0
        for t, w, v in zip(target.split(rows, dim=2), weight.split(rows, dim=2), value.split(rows, dim=2)):
            received = grad.index_select(0, t.flatten()).view(*t.shape, dh)  # the gradient at each edge's query
            stop = start + t.shape[2]
            if grad_weight is not None:
                grad_weight[:, :, start:stop] = torch.einsum("bhjed,bhjd->bhje", received, v)
            if grad_value is not None:
                grad_value[:, :, start:stop] = torch.einsum("bhje,bhjed->bhjd", w, received)
            start = stop
        return grad_weight, grad_value, None


def _repeated_edges(index: Tensor, valid: Tensor, n: int) -> Tensor:
    """Union as a set: sort each key's edges and mark repeats of a query (the stable sort keeps the
    first column). Its sort buffers die with this call."""
    e = index.shape[-1]
    sort_key = torch.where(valid, index, n + torch.arange(e, device=index.device))
    sorted_key, order = torch.sort(sort_key, dim=-1, stable=True)
    repeat_sorted = F.pad(sorted_key[..., 1:] == sorted_key[..., :-1], (1, 0), value=False)
    return torch.zeros_like(repeat_sorted).scatter(-1, order, repeat_sorted)


@padding_safe
def fsat_sparse_attention(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attention_mask: Tensor | None = None,
    *,
    dominant_index: Tensor,
    random_index: Tensor | None = None,
    use_predicted: bool = True,
    lmax: int | None = None,
    sigma2: float | None = None,
    normalize_confidence: bool = True,
    truncate_gradient: bool = True,
    scale: float | None = None,
) -> Tensor:
    """Predictable sparse attention (eq. 7) by gather/scatter over edges; no N x N tensor.

    Args:
        query, key, value: [B, H, N, Dh].
        attention_mask: bool [B, N], True = real token. Edges from padded keys or to padded queries
            are dropped.
        dominant_index: I_bar [B, H, N, M], float in [0, Lmax): key j's predicted dominant query
            positions (eq. 9). Edges go from query floor(I_bar[j, m]) to key j; positions >= N drop.
        random_index: optional long [B, H, N, R] of extra (exploration) query positions per key.
        use_predicted: include the predicted edges (False: random edges only, the "Only I_r" ablation).
        lmax: Lmax, the range of I_bar (eq. 9); None means N.
        sigma2: variance of the confidence (paper: Lmax); None means Lmax.
        normalize_confidence: use the Gaussian density (with 1/sqrt(2 pi sigma^2)) as in eq. 8.
        truncate_gradient: clamp the confidence's gradient to (-inf, 0] (section 4.2.4).
        scale: score scale, default 1/sqrt(Dh).

    Duplicate edges (the same query chosen twice by one key) count once, keeping the first in
    column order (predicted before random). A query no key points to gets a zero output.
    """
    check_qkv(query, key, value, attention_mask)
    _check_sparse_inputs(query, key, dominant_index, random_index)
    b, h, n, dh = key.shape
    scale = 1.0 / math.sqrt(query.shape[-1]) if scale is None else scale
    lmax = n if lmax is None else lmax
    sigma2 = float(lmax) if sigma2 is None else float(sigma2)
    if lmax < 1 or not sigma2 > 0:
        raise AttentionError(f"fsat needs lmax >= 1 and sigma2 > 0, got lmax={lmax}, sigma2={sigma2}")

    index, centre = _edges(dominant_index, random_index, use_predicted, lmax)  # [B, H, N(key), E]
    e = index.shape[-1]
    valid = (index >= 0) & (index < n)
    index = index.clamp(0, n - 1)
    if attention_mask is not None:
        real = attention_mask[:, None, :].expand(b, h, n)  # [B, H, N]
        valid = valid & real.gather(2, index.flatten(2)).view_as(index) & attention_mask[:, None, :, None]
    keep = valid & ~_repeated_edges(index, valid, n)

    confidence = _gaussian_confidence(index, centre, sigma2, normalize_confidence)
    if truncate_gradient:
        confidence = _TruncateGradient.apply(confidence)

    # Flatten (batch, query, head) so one index_add / scatter covers every head's graph at once; the
    # token-major order is the projections' own layout, so queries and output need no copy.
    offsets = (torch.arange(b, device=index.device).view(b, 1, 1, 1) * n * h
               + torch.arange(h, device=index.device).view(1, h, 1, 1))
    target = index * h + offsets  # query row of each edge, [B, H, N(key), E]
    flat_query = query.transpose(1, 2).reshape(b * n * h, dh)
    scores = _EdgeScores.apply(flat_query, key, target) * scale  # q_{I_je} . k_j
    target = target.flatten()

    # Softmax over each query's in-edges (its out-neighbour keys N_i of eq. 7).
    # softmax is shift invariant: the per-query max needs no gradient
    masked = scores.detach().masked_fill(~keep, float("-inf")).flatten()
    row_max = scores.new_full((b * h * n,), float("-inf")).scatter_reduce(0, target, masked, "amax")
    row_max = row_max.nan_to_num(0.0, neginf=0.0)  # queries without edges
    # mask before exp: a dropped edge may out-score its query's kept ones (inf * 0 = NaN in backward)
    weight = torch.exp((scores.flatten() - row_max[target]).masked_fill(~keep.flatten(), float("-inf")))
    denom = scores.new_zeros(b * h * n).index_add(0, target, weight)
    prob = weight / denom[target].clamp_min(torch.finfo(scores.dtype).tiny)

    edge_weight = prob.view(b, h, n, e) * confidence  # Psi(.) * s of eq. 7
    return _EdgeSums.apply(edge_weight, value, target.view(b, h, n, e)).view(b, n, h, dh).transpose(1, 2)


@padding_safe
def fsat_sparse_attention_reference(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attention_mask: Tensor | None = None,
    *,
    dominant_index: Tensor,
    random_index: Tensor | None = None,
    use_predicted: bool = True,
    lmax: int | None = None,
    sigma2: float | None = None,
    normalize_confidence: bool = True,
    truncate_gradient: bool = True,
    scale: float | None = None,
) -> Tensor:
    """Same math with the sparse pattern built as explicit N x N adjacency and confidence matrices.

    Plain and quadratic: for tests at small N only. The gradient truncation is a tensor hook here.
    """
    b, h, n, dh = key.shape
    scale = 1.0 / math.sqrt(dh) if scale is None else scale
    lmax = n if lmax is None else lmax
    sigma2 = float(lmax) if sigma2 is None else float(sigma2)
    index, centre = _edges(dominant_index, random_index, use_predicted, lmax)
    valid = (index >= 0) & (index < n)
    index = index.clamp(0, n - 1)
    if attention_mask is not None:
        query_real = attention_mask[:, None, None, :].expand(b, h, n, n).gather(3, index)
        valid = valid & query_real & attention_mask[:, None, :, None]
    # edge e of key j repeats an earlier valid edge e' < e of the same key to the same query
    same = (index[..., :, None] == index[..., None, :]) & valid[..., None, :]
    earlier = torch.ones(index.shape[-1], index.shape[-1], dtype=torch.bool, device=index.device).tril(-1)
    keep = valid & ~(same & earlier).any(-1)

    confidence = (
        torch.exp(-(index.to(centre.dtype) - centre) ** 2 / (2 * sigma2))
        * (1 / math.sqrt(2 * math.pi * sigma2) if normalize_confidence else 1.0)
    )
    if truncate_gradient and confidence.requires_grad:
        confidence.register_hook(lambda g: torch.minimum(g, torch.zeros_like(g)))

    one_hot = F.one_hot(index, n).to(query.dtype) * keep[..., None].to(query.dtype)  # [B, H, key, E, query]
    adjacency = one_hot.sum(3).transpose(-1, -2) > 0  # [B, H, query, key]
    conf_matrix = (one_hot * confidence[..., None]).sum(3).transpose(-1, -2)
    scores = (query @ key.transpose(-1, -2) * scale).masked_fill(~adjacency, float("-inf"))
    probs = torch.softmax(scores, dim=-1).nan_to_num(0.0)  # a query without keys: all zeros
    return (probs * conf_matrix) @ value


# ----------------------------------------------------------------------------- module


@register_attention(
    "fsat",
    capabilities=Capabilities(causal=False, subquadratic=True, stochastic_eval=False),
    functional=fsat_sparse_attention,
    reference=fsat_sparse_attention_reference,
    paper="Long-range Sequence Modeling with Predictable Sparse Attention / FSAT (Zhuang et al., ACL 2022)",
)
class FSATAttention(AttentionBase):
    """FSAT: pooled hidden-state cross by FFT + predictable sparse attention (O(L log L)).

    Options (paper defaults):
        num_dominant: M, predicted dominant queries per key (4).
        num_random: random (exploration) queries per key while training; None = M.
        train_indices: training graph: "union" of predicted and random (paper), or the ablations
            "predicted" (only I_p) and "random" (only I_r). Eval always uses the predicted ones only.
        feature_map: f1, f2 as "dense" (fully connected, paper default) or "conv" (depth-wise
            separable convolution, the paper's Text-task variant) with ``conv_kernel_size`` (5).
        feature_activation: non-linearity of f1, f2 (paper: unspecified; "gelu").
        lmax: Lmax of eq. 9; None = the current (padded) sequence length N, so any N works.
            With a fixed lmax, predicted positions >= N are dropped.
        sigma2: confidence variance; None = Lmax (paper).
        normalize_confidence: Gaussian density with its 1/sqrt(2 pi sigma^2) factor (paper) or
            without it (peak 1).
        truncate_gradient: truncate the confidence gradient to (-inf, 0] (section 4.2.4).
        scale: score scale (1/sqrt(Dh)); bias: biases of the Q, K, V, output projections.
    """

    def __init__(
        self,
        dim: int,
        heads: int,
        max_len: int | None = None,
        causal: bool = False,
        num_dominant: int = 4,
        num_random: int | None = None,
        train_indices: str = "union",
        feature_map: str = "dense",
        conv_kernel_size: int = 5,
        feature_activation: str = "gelu",
        lmax: int | None = None,
        sigma2: float | None = None,
        normalize_confidence: bool = True,
        truncate_gradient: bool = True,
        scale: float | None = None,
        bias: bool = True,
    ) -> None:
        super().__init__(dim, heads, max_len, causal)
        if not isinstance(num_dominant, int) or num_dominant < 1:
            raise AttentionError(f"num_dominant (M) must be a positive int, got {num_dominant!r}")
        num_random = num_dominant if num_random is None else num_random
        if not isinstance(num_random, int) or num_random < 0:
            raise AttentionError(f"num_random must be a non-negative int or None, got {num_random!r}")
        if train_indices not in TRAIN_INDICES:
            raise AttentionError(f"train_indices must be one of {TRAIN_INDICES}, got {train_indices!r}")
        if train_indices != "predicted" and num_random == 0:
            raise AttentionError(f"train_indices={train_indices!r} needs num_random > 0")
        if lmax is not None and (not isinstance(lmax, int) or lmax < 1):
            raise AttentionError(f"lmax must be a positive int or None, got {lmax!r}")
        if sigma2 is not None and not sigma2 > 0:
            raise AttentionError(f"sigma2 must be positive or None, got {sigma2!r}")
        self.num_dominant = num_dominant
        self.num_random = num_random
        self.train_indices = train_indices
        self.lmax = lmax
        self.sigma2 = sigma2
        self.normalize_confidence = normalize_confidence
        self.truncate_gradient = truncate_gradient
        self.scale = scale
        self.cross = PooledHiddenStateCross(dim, feature_map, conv_kernel_size, feature_activation)
        self.to_q = nn.Linear(dim, dim, bias=bias)  # eq. 6: Q from X
        self.to_k = nn.Linear(dim, dim, bias=bias)  # K, V from C
        self.to_v = nn.Linear(dim, dim, bias=bias)
        self.to_index = nn.Linear(dim, heads * num_dominant)  # W_I, b_I of eq. 9, one graph per head
        self.to_out = nn.Linear(dim, dim, bias=bias)

    def attend(self, x: Tensor, attention_mask: Tensor | None, layer_state: dict | None) -> Tensor:
        b, n, _ = x.shape
        c = self.cross(x, attention_mask, input_masked=True)  # eqs. 1-4
        q = split_heads(self.to_q(x), self.heads)
        k = split_heads(self.to_k(c), self.heads)
        v = split_heads(self.to_v(c), self.heads)
        lmax = n if self.lmax is None else self.lmax
        logits = self.to_index(c).view(b, n, self.heads, self.num_dominant).transpose(1, 2)
        dominant_index = torch.sigmoid(logits) * lmax  # eq. 9
        explore = self.training and self.train_indices != "predicted"
        random_index = (
            torch.randint(0, n, (b, self.heads, n, self.num_random), device=x.device) if explore else None
        )  # I_r ~ U[0, N-1], training only (section 4.2.3)
        out = fsat_sparse_attention(
            q, k, v, attention_mask,
            dominant_index=dominant_index,
            random_index=random_index,
            use_predicted=not (self.training and self.train_indices == "random"),
            lmax=lmax,
            sigma2=self.sigma2,
            normalize_confidence=self.normalize_confidence,
            truncate_gradient=self.truncate_gradient,
            scale=self.scale,
        )
        return self.to_out(merge_heads(out))
