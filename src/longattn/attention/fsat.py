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
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.autograd.function import once_differentiable

from longattn.attention.base import (
    AttentionBase,
    AttentionError,
    Capabilities,
    autocast_state,
    check_qkv,
    compute_dtype,
    exact_float32,
    merge_heads,
    padding_safe,
    register_attention,
    restored_autocast,
    split_heads,
    uses_gpu_path,
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
# Elements of one [B, H, keys, E, Dh] per-edge block (2 MB in float32) and FFT points of one
# block of features of the pooled cross (B * n_fft * features: a 2 MB complex64 half-spectrum).
_EDGE_BLOCK_ELEMENTS = 1 << 19
_FFT_BLOCK_ELEMENTS = 1 << 19


# ----------------------------------------------------------------------------- pooled cross (eqs. 2-4)


def pooled_hidden_state_cross(f1x: Tensor, f2x: Tensor) -> Tensor:
    """Antidiagonal sum-pooled crosses c_k = sum_{i+j=k} f1(x_i) * f2(x_j), k = 0..2L-2 (eqs. 2-3).

    ``f1x``, ``f2x``: [B, L, D] feature-mapped hidden states (zero them at padded tokens to leave
    padding out). Returns [B, 2L-1, D]. The FFT is zero-padded to >= 2L-1 points so the product in
    frequency space is the *linear* convolution of eq. 2, not a circular one.
    """
    if f1x.shape != f2x.shape or f1x.dim() != 3:
        raise AttentionError(f"f1x and f2x must both be [B, L, D], got {list(f1x.shape)}, {list(f2x.shape)}")
    n_fft, work, features = _fft_plan(f1x)
    # feature blocks are independent: no spectrum above ~2 MB exists
    blocks = [_cross_block(part1, part2, n_fft)
              for part1, part2 in zip(f1x.to(work).split(features, dim=2), f2x.to(work).split(features, dim=2))]
    return torch.cat(blocks, dim=2).to(f1x.dtype)


def _fft_plan(f1x: Tensor) -> tuple[int, torch.dtype, int]:
    """(n_fft, the dtype the FFT runs in, features per block) for feature maps [B, L, D]. The CPU path
    works in blocks of features whose spectrum fits a cache (~2 MB); the GPU path in one block of all
    of them (one batched FFT, no loop: its [B, n_fft / 2 + 1, D] spectrum is the size of a few X)."""
    batch, length, dim = f1x.shape
    n_fft = 1 << (2 * length - 2).bit_length()  # smallest power of two >= 2L-1
    # torch.fft has no bf16 kernels and half needs care: cross in float32, return in the input dtype.
    work = torch.promote_types(f1x.dtype, torch.float32)
    features = dim if uses_gpu_path(f1x) else max(1, _FFT_BLOCK_ELEMENTS // (batch * n_fft))
    return n_fft, work, features


def _cross_block(part1: Tensor, part2: Tensor, n_fft: int) -> Tensor:
    """Eq. 3 for a block of features: [B, L, d] x 2 -> [B, 2L-1, d]."""
    spec = torch.fft.rfft(part1, n=n_fft, dim=1).mul_(torch.fft.rfft(part2, n=n_fft, dim=1))  # two spectra, not three
    # irfft returns the real part (eq. 3's Re): the spectrum of a real convolution is Hermitian.
    return torch.fft.irfft(spec, n=n_fft, dim=1)[:, : 2 * part1.shape[1] - 1]


def _pairs(pooled: Tensor) -> Tensor:
    """[B, 2L-1, D] -> [B, L, D]: rows 2t and 2t+1 summed (one zero row appended for the odd rows)."""
    b, rows, d = pooled.shape
    return F.pad(pooled, (0, 0, 0, 1)).view(b, (rows + 1) // 2, 2, d).sum(2)


class _PooledCross(torch.autograd.Function):
    """X -> C = LN(C1 + C2 - f1(X) * f2(X)) of eqs. 1-4, one block of features at a time, forward and
    backward; kept for backward: X, C and the LayerNorm's per-token mean and 1/std.

    Why a function: through autograd, f1(X), f2(X), their merged cross and its LayerNorm input
    ([B, L, D] each) stayed alive until backward. The last layer of each feature map is dense (eq. 1),
    so a block of its output features needs only the matching rows of W: every [B, L, D] tensor but
    C (and the conv variant's depth-wise output) exists one block of features at a time. Backward
    recomputes each block and differentiates by hand: the LayerNorm (its per-token sums come from C,
    since gamma * x_hat = C - beta), then eqs. 2-4: d c_k / d f1(x_i) = f2(x_{k-i}), so the gradient
    of f1(x_i) is the cross-correlation sum_j g_{i+j} f2(x_j) of the pooled gradient with f2(X) (and
    the same with f1(X) for f2(X)), an FFT product with the conjugate spectrum, exact because
    i + j <= 2L-2 < n_fft never wraps; pooled row k gets the gradient of token k // 2 (the pairs of
    eq. 4), and the self-cross gives -g f2. The activations' backward runs on each block through
    autograd, the dense layers' by hand.
    """

    @staticmethod
    def forward(ctx, cross: PooledHiddenStateCross, keep: Tensor | None, x: Tensor,  # type: ignore[override]
                *params: Tensor) -> Tensor:
        maps, norm = (cross.f1, cross.f2), cross.norm
        n_fft, work, features = _fft_plan(x)
        with exact_float32(x):  # the conv variant's depth-wise convolution
            mixed = [f.mix(x) for f in maps]
        merged = torch.empty(x.shape, dtype=work, device=x.device)
        for cols in _feature_blocks(x.shape[2], features):
            part1, part2 = (_masked(f.activation(_dense_rows(f, m, cols)), keep).to(work) for f, m in zip(maps, mixed))
            merged[..., cols] = _pairs(_cross_block(part1, part2, n_fft)) - part1 * part2
        c, mean, rstd = torch.native_layer_norm(merged, norm.normalized_shape, norm.weight.to(work),
                                                norm.bias.to(work), norm.eps)
        c = c.to(norm.weight.dtype)
        ctx.cross, ctx.keep, ctx.autocast = cross, keep, autocast_state(x.device)
        ctx.save_for_backward(x, c, mean, rstd)
        return c

    @staticmethod
    @once_differentiable
    def backward(ctx, grad: Tensor) -> tuple[Tensor | None, ...]:  # type: ignore[override]
        x, c, mean, rstd = ctx.saved_tensors
        cross: PooledHiddenStateCross = ctx.cross
        maps, norm, keep = (cross.f1, cross.f2), cross.norm, ctx.keep
        length, dim = x.shape[1:]
        n_fft, work, features = _fft_plan(x)
        grads = {name: torch.zeros_like(p) for name, p in cross.named_parameters()}
        leaf = x.detach().requires_grad_(ctx.needs_input_grad[2])
        with restored_autocast(ctx.autocast), exact_float32(x):
            with torch.enable_grad():
                mixed = [f.mix(leaf) for f in maps]  # the conv variant's depth-wise part; X itself otherwise
            # the gradients of the dense layers' inputs: one buffer in the dense variant, where X feeds both
            if mixed[1] is mixed[0]:
                grad_mixed = [torch.zeros(x.shape, dtype=x.dtype, device=x.device)] * 2
            else:
                grad_mixed = [torch.zeros(m.shape, dtype=m.dtype, device=m.device) for m in mixed]
            g = grad.to(work)
            gamma, beta = norm.weight.to(work), norm.bias.to(work)
            # the LayerNorm's per-token means of g * gamma and of g * gamma * x_hat = g * (C - beta)
            mean_grad = (g @ gamma / dim).unsqueeze(-1)
            mean_grad_xhat = sum(torch.einsum("bld,bld->bl", g[..., cols], c[..., cols].to(work) - beta[cols])
                                 for cols in _feature_blocks(dim, features)).unsqueeze(-1) / dim
            norm_terms = (g, gamma, mean, rstd, mean_grad, mean_grad_xhat)
            for cols in _feature_blocks(dim, features):
                _pooled_cross_block_backward(cross, keep, mixed, grad_mixed, grads, norm_terms, cols, n_fft)
            # the depth-wise part (conv variant) and X
            grad_x = None
            for name, f, m, grad_m in zip(("f1", "f2"), maps, mixed, grad_mixed):
                if m is not leaf:
                    depthwise = [(f"{name}.depthwise.{n}", p) for n, p in f.depthwise.named_parameters() if p.requires_grad]
                    wanted = [leaf] * leaf.requires_grad + [p for _, p in depthwise]
                    got = torch.autograd.grad(m, wanted, grad_m) if wanted else ()
                    for (key, _), grad_p in zip(depthwise, got[leaf.requires_grad:]):
                        grads[key] = grad_p
                    grad_m = got[0] if leaf.requires_grad else None
                if leaf.requires_grad and grad_m is not grad_x:
                    grad_x = grad_m if grad_x is None else grad_x + grad_m
        return (None, None, grad_x, *(grads[name] for name, _ in cross.named_parameters()))


def _pooled_cross_block_backward(cross: PooledHiddenStateCross, keep: Tensor | None, mixed: list[Tensor],
                                 grad_mixed: list[Tensor], grads: dict[str, Tensor], norm_terms: tuple[Tensor, ...],
                                 cols: slice, n_fft: int) -> None:
    """:class:`_PooledCross`'s backward for the output features ``cols``: the block is recomputed,
    then differentiated through the LayerNorm, eqs. 4, 3 and 1 in turn; adds into ``grad_mixed``
    (the dense layers' inputs) and ``grads`` (the parameters')."""
    g, gamma, mean, rstd, mean_grad, mean_grad_xhat = norm_terms
    length = mixed[0].shape[1]
    maps = (cross.f1, cross.f2)
    pre = [_dense_rows(f, m.detach(), cols) for f, m in zip(maps, mixed)]
    part1, part2 = (_masked(f.activation(p), keep).to(g.dtype) for f, p in zip(maps, pre))
    spec1, spec2 = torch.fft.rfft(part1, n=n_fft, dim=1), torch.fft.rfft(part2, n=n_fft, dim=1)
    merged = _pairs(torch.fft.irfft(spec1 * spec2, n=n_fft, dim=1)[:, : 2 * length - 1]) - part1 * part2
    x_hat = merged.sub_(mean).mul_(rstd)
    grads["norm.weight"][cols] = torch.einsum("bld,bld->d", g[..., cols], x_hat)
    grads["norm.bias"][cols] = g[..., cols].sum((0, 1))
    grad_merged = x_hat.mul_(-mean_grad_xhat).add_(g[..., cols] * gamma[cols]).sub_(mean_grad).mul_(rstd)
    pooled_grad = torch.fft.rfft(grad_merged.repeat_interleave(2, dim=1)[:, : 2 * length - 1], n=n_fft, dim=1)
    for name, f, m, p, other, other_spec, grad_m in (("f1", maps[0], mixed[0], pre[0], part2, spec2, grad_mixed[0]),
                                                     ("f2", maps[1], mixed[1], pre[1], part1, spec1, grad_mixed[1])):
        correlation = torch.fft.irfft(other_spec.conj_physical_().mul_(pooled_grad), n=n_fft, dim=1)[:, :length]
        grad_part = correlation - grad_merged * other
        del correlation
        with torch.enable_grad():
            p = p.detach().requires_grad_()
            (grad_pre,) = torch.autograd.grad(_masked(f.activation(p), keep), p, grad_part.to(p.dtype))
        # in place, no [B, L, D] temporary per block (in-place ops are outside autocast: one dtype)
        grad_m.view(-1, grad_m.shape[-1]).addmm_(grad_pre.flatten(0, 1).to(grad_m.dtype), f.linear.weight[cols].to(grad_m.dtype))
        grads[f"{name}.linear.weight"][cols] = grad_pre.flatten(0, 1).T @ m.detach().flatten(0, 1)
        grads[f"{name}.linear.bias"][cols] = grad_pre.sum((0, 1))


def _feature_blocks(dim: int, features: int) -> list[slice]:
    return [slice(start, min(start + features, dim)) for start in range(0, dim, features)]


def _dense_rows(feature_map: FeatureMap, mixed: Tensor, cols: slice) -> Tensor:
    """The output features ``cols`` of a feature map's dense layer (eq. 1), before its activation."""
    return F.linear(mixed, feature_map.linear.weight[cols], feature_map.linear.bias[cols])


def _masked(features: Tensor, keep: Tensor | None) -> Tensor:
    """Feature-mapped tokens, zero at padded tokens: they take part in no cross (eq. 2)."""
    return features if keep is None else features * keep


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

    def mix(self, x: Tensor) -> Tensor:
        """What comes before the dense layer: the depth-wise convolution (conv variant), else x itself."""
        return self.depthwise(x.transpose(1, 2)).transpose(1, 2) if self.kind == "conv" else x

    def forward(self, x: Tensor) -> Tensor:
        return self.activation(self.linear(self.mix(x)))


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
        return _PooledCross.apply(self, keep, x, *self.parameters())


# ----------------------------------------------------------------------------- sparse attention (eqs. 7-10)


class _TruncateGradient(torch.autograd.Function):
    """Identity forward; backward keeps only the non-positive part of the gradient (section 4.2.4)."""

    @staticmethod
    def forward(ctx, x: Tensor) -> Tensor:  # type: ignore[override]
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: Tensor) -> Tensor:  # type: ignore[override]
        return grad.clamp(max=0.0)


class _GaussianConfidence(torch.autograd.Function):
    """s = rho(I | I_bar, sigma^2) of eqs. 8 / 10 for every edge: the Gaussian density at the edge's
    query position I around the predicted centre I_bar (``normalize=False`` drops 1/sqrt(2 pi sigma^2));
    differentiable in the centre only (I is an integer position).

    Why a function: autograd kept two [B, H, N, E] tensors for it (I - I_bar and the exponential);
    here only the derivative ds / dI_bar = s (I - I_bar) / sigma^2 is kept. Computed and returned in
    float32 for half centres (positions up to N and a density are not for 8 bits of mantissa)."""

    @staticmethod
    def forward(ctx, index: Tensor, centre: Tensor, sigma2: float, normalize: bool) -> Tensor:  # type: ignore[override]
        work = compute_dtype(centre.dtype)
        offset = index.to(work) - centre.to(work)
        conf = torch.exp(-offset.square() / (2.0 * sigma2))
        if normalize:
            conf = conf / math.sqrt(2.0 * math.pi * sigma2)
        if ctx.needs_input_grad[1]:
            ctx.save_for_backward(offset.mul_(conf).div_(sigma2))
        ctx.centre_dtype = centre.dtype
        return conf

    @staticmethod
    @once_differentiable
    def backward(ctx, grad: Tensor) -> tuple[None, Tensor, None, None]:  # type: ignore[override]
        (slope,) = ctx.saved_tensors
        return None, (grad * slope).to(ctx.centre_dtype), None, None


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


# A piece of the per-edge work: (keys, edge columns) of the [B, H, N(key), E] edges.
EdgeUnit = tuple[slice, slice]


def _edge_units(target: Tensor, dh: int, gpu: bool) -> list[EdgeUnit]:
    """The pieces the per-edge work is done in; no [B, H, N, E, Dh] tensor exists at once.

    CPU path: blocks of keys with all their edges (small blocks stay cache-resident and below the
    allocator's mmap threshold, so the cost grows linearly). GPU path: all keys, one edge column at a
    time: M + R batched steps (a constant of the layer, not of N or the batch), each holding tensors the
    size of the queries, where all edges at once would hold M + R times that."""
    b, h, n, e = target.shape
    if gpu:
        return [(slice(None), slice(column, column + 1)) for column in range(e)]
    keys = max(1, _EDGE_BLOCK_ELEMENTS // (b * h * e * dh))
    return [(slice(start, min(start + keys, n)), slice(None)) for start in range(0, n, keys)]


def _gather(rows: Tensor, target: Tensor) -> Tensor:
    """The rows ([R, Dh]) at every edge's ``target`` row: [*target.shape, Dh]."""
    return rows.index_select(0, target.flatten()).view(*target.shape, rows.shape[-1])


@dataclass(frozen=True)
class _KeyValues:
    """Where a key block's K and V [B, H, keys, Dh] come from: the functional form's K and V
    (``inputs`` = (K, V), ``heads`` None), or in the module form the block's rows of the cross C
    [B, N, D] projected inside the block (eq. 6; ``inputs`` = (C, W_K, b_K, W_V, b_V)), so that
    full-length K and V and their gradients never exist."""

    heads: int | None = None

    def block(self, inputs: tuple[Tensor | None, ...], which: int, rows: slice) -> Tensor:
        """The keys (``which`` = 0) or values (1) of the key block ``rows``."""
        if self.heads is None:
            return inputs[which][:, :, rows]
        return split_heads(F.linear(inputs[0][:, rows], inputs[1 + 2 * which], inputs[2 + 2 * which]), self.heads)

    def needs_grad(self, needs: tuple[bool, ...], which: int) -> bool:
        """Whether the keys' (``which`` = 0) or values' (1) inputs need a gradient (``needs``: one per input)."""
        return needs[which] if self.heads is None else needs[0] or needs[1 + 2 * which] or needs[2 + 2 * which]

    def add_grad(self, grads: list[Tensor | None], inputs: tuple[Tensor | None, ...], which: int, rows: slice,
                 grad_block: Tensor) -> None:
        """Add the gradient of a block's keys or values into ``grads`` (one per input, None if not needed)."""
        if self.heads is None:
            if grads[which] is not None:
                grads[which][:, :, rows] += grad_block
            return
        grad_rows = merge_heads(grad_block)  # [B, keys, D]
        weight, bias = 1 + 2 * which, 2 + 2 * which
        if grads[0] is not None:
            grads[0][:, rows] += grad_rows @ inputs[weight]
        if grads[weight] is not None:
            grads[weight] += grad_rows.flatten(0, 1).T @ inputs[0][:, rows].flatten(0, 1)
        if grads[bias] is not None:
            grads[bias] += grad_rows.sum((0, 1))


def _edge_softmax(scores: Tensor, target: Tensor, keep: Tensor) -> Tensor:
    """Softmax of the edge scores [B, H, N, E] over each query's kept in-edges (its out-neighbour keys
    N_i of eq. 7), in place; dropped edges get probability 0."""
    flat, rows = scores.view(-1), target.view(-1)
    # mask before exp: a dropped edge may out-score its query's kept ones; exp(-inf) = 0 drops it
    flat.masked_fill_(~keep.view(-1), float("-inf"))
    # softmax is shift invariant: subtract each query's max (0 for a query without edges)
    row_max = flat.new_full((target.shape[0] * target.shape[1] * target.shape[2],), float("-inf"))
    row_max = row_max.scatter_reduce_(0, rows, flat, "amax").nan_to_num_(0.0, neginf=0.0)
    flat.sub_(row_max[rows]).exp_()
    denom = torch.zeros_like(row_max).index_add_(0, rows, flat)
    return scores.div_(denom[rows].clamp_min_(torch.finfo(scores.dtype).tiny).view_as(scores))


class _SparseAttention(torch.autograd.Function):
    """Eq. 7 over every edge: out_i = sum_{j in N_i} softmax_{N_i}(q_i . k_j * scale) s_{i->j} v_j,
    one :data:`EdgeUnit` at a time (no [B, H, N, E, Dh] tensor at once), forward and backward.

    Why one function: through autograd, the softmax over each query's in-edges kept a dozen
    [B, H, N, E] tensors (scores, masks, exponentials, the per-edge gathers of maxima and sums), and
    in the module form K and V [B, H, N, Dh] stayed alive with full-size gradients. Here only the
    inputs and the edges' probabilities are kept; keys and values come block by block from
    :class:`_KeyValues`, again in backward, and the softmax's backward is written out:
    dL/dscore = p (dL/dp - sum over the query's edges of p dL/dp).

    ``flat_query`` [B*N*H, Dh]: token-major query rows; ``confidence`` s [B, H, N, E]; ``target``
    [B, H, N, E]: the row of each edge's query; ``keep``: its bool mask (False: invalid, padded or a
    repeat). Returns the [B*N*H, Dh] output rows. The products of queries, keys and values run in their
    dtype (the autocast dtype under autocast); scores, the softmax and every sum over edges in float32
    for half inputs (:func:`compute_dtype`).
    """

    @staticmethod
    def forward(ctx, layout: _KeyValues, units: list[EdgeUnit], scale: float, flat_query: Tensor,  # type: ignore[override]
                confidence: Tensor, target: Tensor, keep: Tensor, *inputs: Tensor | None) -> Tensor:
        work = compute_dtype(flat_query.dtype)
        scores = torch.empty(target.shape, dtype=work, device=target.device)
        for rows, cols in units:
            scores[:, :, rows, cols] = torch.einsum(
                "bhjed,bhjd->bhje", _gather(flat_query, target[:, :, rows, cols]), layout.block(inputs, 0, rows))
        prob = _edge_softmax(scores.mul_(scale), target, keep)
        out = torch.zeros(flat_query.shape, dtype=work, device=flat_query.device)
        for rows, cols in units:
            value = layout.block(inputs, 1, rows)
            weight = prob[:, :, rows, cols] * confidence[:, :, rows, cols]  # Psi(.) * s of eq. 7
            out.index_add_(0, target[:, :, rows, cols].flatten(),
                           (weight.unsqueeze(-1) * value.unsqueeze(3)).flatten(0, 3).to(work))
        ctx.layout, ctx.units, ctx.scale, ctx.autocast = layout, units, scale, autocast_state(flat_query.device)
        ctx.save_for_backward(flat_query, confidence, target, prob, *inputs)
        return out.to(flat_query.dtype)

    @staticmethod
    @once_differentiable
    def backward(ctx, grad: Tensor) -> tuple[Tensor | None, ...]:  # type: ignore[override]
        flat_query, confidence, target, prob, *inputs = ctx.saved_tensors
        layout: _KeyValues = ctx.layout
        needs = ctx.needs_input_grad[7:]
        data, work = flat_query.dtype, prob.dtype
        grads = [torch.zeros_like(t, dtype=compute_dtype(t.dtype)) if need else None for t, need in zip(inputs, needs)]
        grad = grad.to(data)
        grad_weight = torch.empty_like(prob)  # of the edge weights p * s
        with restored_autocast(ctx.autocast):
            for rows, cols in ctx.units:
                received = _gather(grad, target[:, :, rows, cols])  # the gradient at each edge's query
                value = layout.block(inputs, 1, rows)
                grad_weight[:, :, rows, cols] = torch.einsum("bhjed,bhjd->bhje", received, value)
                if layout.needs_grad(needs, 1):
                    weight = (prob[:, :, rows, cols] * confidence[:, :, rows, cols]).to(data)
                    layout.add_grad(grads, inputs, 1, rows, torch.einsum("bhje,bhjed->bhjd", weight, received))
                del received  # before the next unit's: one unit's edges at a time
            grad_confidence = grad_weight * prob if ctx.needs_input_grad[4] else None
            grad_score = grad_weight.mul_(confidence)  # dL/dp for now, dL/dscore after the next two lines
            rows_of_edges = target.view(-1)
            total = torch.zeros(flat_query.shape[0], dtype=work, device=prob.device)
            total.index_add_(0, rows_of_edges, (prob * grad_score).view(-1))
            grad_score.sub_(total[rows_of_edges].view_as(prob)).mul_(prob).mul_(ctx.scale)
            grad_query = torch.zeros(flat_query.shape, dtype=work, device=flat_query.device) \
                if ctx.needs_input_grad[3] else None
            for rows, cols in ctx.units:
                key, g, edges = layout.block(inputs, 0, rows), grad_score[:, :, rows, cols], target[:, :, rows, cols]
                if layout.needs_grad(needs, 0):
                    layout.add_grad(grads, inputs, 0, rows,
                                    torch.einsum("bhje,bhjed->bhjd", g.to(data), _gather(flat_query, edges)))
                if grad_query is not None:
                    grad_query.index_add_(0, edges.flatten(), (g.unsqueeze(-1) * key.unsqueeze(3)).flatten(0, 3).to(work))
        grads = [None if g is None else g.to(t.dtype) for g, t in zip(grads, inputs)]
        return (None, None, None, None if grad_query is None else grad_query.to(data), grad_confidence, None, None,
                *grads)


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
    return _predictable_sparse_attention(
        query, _KeyValues(), (key, value), attention_mask, dominant_index, random_index, use_predicted=use_predicted,
        lmax=lmax, sigma2=sigma2, normalize_confidence=normalize_confidence, truncate_gradient=truncate_gradient,
        scale=scale,
    )


def _predictable_sparse_attention(
    query: Tensor,
    layout: _KeyValues,
    key_values: tuple[Tensor | None, ...],
    attention_mask: Tensor | None,
    dominant_index: Tensor,
    random_index: Tensor | None,
    *,
    use_predicted: bool,
    lmax: int | None,
    sigma2: float | None,
    normalize_confidence: bool,
    truncate_gradient: bool,
    scale: float | None,
) -> Tensor:
    """:func:`fsat_sparse_attention` with its keys and values from ``layout`` and ``key_values``
    (see :class:`_KeyValues`): the edges, their confidence and eq. 7. Returns [B, H, N, Dh]."""
    b, h, n, dh = query.shape
    scale = 1.0 / math.sqrt(dh) if scale is None else scale
    lmax = n if lmax is None else lmax
    sigma2 = float(lmax) if sigma2 is None else float(sigma2)
    if lmax < 1 or not sigma2 > 0:
        raise AttentionError(f"fsat needs lmax >= 1 and sigma2 > 0, got lmax={lmax}, sigma2={sigma2}")

    index, centre = _edges(dominant_index, random_index, use_predicted, lmax)  # [B, H, N(key), E]
    valid = (index >= 0) & (index < n)
    index = index.clamp(0, n - 1)
    if attention_mask is not None:
        real = attention_mask[:, None, :].expand(b, h, n)  # [B, H, N]
        valid = valid & real.gather(2, index.flatten(2)).view_as(index) & attention_mask[:, None, :, None]
    keep = valid & ~_repeated_edges(index, valid, n)

    confidence = _GaussianConfidence.apply(index, centre, sigma2, normalize_confidence)
    if truncate_gradient:
        confidence = _TruncateGradient.apply(confidence)

    # Flatten (batch, query, head) so one index_add / scatter covers every head's graph at once; the
    # token-major order is the projections' own layout, so queries and output need no copy.
    offsets = (torch.arange(b, device=index.device).view(b, 1, 1, 1) * n * h
               + torch.arange(h, device=index.device).view(1, h, 1, 1))
    target = index * h + offsets  # query row of each edge, [B, H, N(key), E]
    flat_query = query.transpose(1, 2).reshape(b * n * h, dh)
    gpu = uses_gpu_path(query)
    if gpu and layout.heads is not None:
        # GPU path: K and V of every key at once (eq. 6), so that no edge column projects them again
        c, weight_k, bias_k, weight_v, bias_v = key_values
        key_values = (split_heads(F.linear(c, weight_k, bias_k), layout.heads),
                      split_heads(F.linear(c, weight_v, bias_v), layout.heads))
        layout = _KeyValues()
    units = _edge_units(target, dh, gpu)
    out = _SparseAttention.apply(layout, units, scale, flat_query, confidence, target, keep, *key_values)
    return out.view(b, n, h, dh).transpose(1, 2)


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
        lmax = n if self.lmax is None else self.lmax
        logits = self.to_index(c).view(b, n, self.heads, self.num_dominant).transpose(1, 2)
        # eq. 9, in float32 for half logits: positions up to N need more than 8 bits of mantissa
        dominant_index = torch.sigmoid(logits.to(compute_dtype(logits.dtype))) * lmax
        explore = self.training and self.train_indices != "predicted"
        random_index = (
            torch.randint(0, n, (b, self.heads, n, self.num_random), device=x.device) if explore else None
        )  # I_r ~ U[0, N-1], training only (section 4.2.3)
        # K and V (eq. 6) are projected from C inside the key blocks of the sparse attention
        key_values = (c, self.to_k.weight, self.to_k.bias, self.to_v.weight, self.to_v.bias)
        out = _predictable_sparse_attention(
            q, _KeyValues(self.heads), key_values, attention_mask, dominant_index, random_index,
            use_predicted=not (self.training and self.train_indices == "random"),
            lmax=lmax,
            sigma2=self.sigma2,
            normalize_confidence=self.normalize_confidence,
            truncate_gradient=self.truncate_gradient,
            scale=self.scale,
        )
        return self.to_out(merge_heads(out))
