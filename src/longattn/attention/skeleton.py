"""Skeleton attention of SKTformer / S^3 Attention, with its Smoother in front (the full sublayer).

Paper: SKTformer (ICLR 2023 submission) Section 3, Algorithms 1-2; S^3 Attention (journal version).

Per head, with Q, K, V of shape [N, Dh]:

* row attention (the paper's eq. for V_1 "column self-attention" of Section 3.1; Algorithm 1 and
  Appendix E call it Row Attention): s1 token positions i_1 < ... < i_s1 are sampled,
  ``V_1 = softmax(Q (P1 K)^T / sqrt(Dh)) P1 V`` (softmax over the s1 samples);
* column attention (V_2 of Section 3.1): s2 feature coordinates are sampled,
  ``V_2 = V P2 softmax(P2^T K^T Q / sqrt(n))`` (softmax over the s2 samples, i.e. per column of
  the s2 x Dh score matrix);
* output (eq. 2 as coded in Algorithm 1): ``LN_1(V_1) / 2 + LN_2(V_2) / 2``, each LayerNorm over
  all heads' features together.

The sampled indices are drawn once per layer at construction (shared by the batch and the heads)
and stored as buffers, so they are saved with the model. The cost is O(N (s1 + s2) Dh) per head:
no N x N tensor exists at any step.

Two paths compute the same layer: on a CPU, tiles sized for the caches (``_SkeletonCore``, the Smoother's
fused stem); on a GPU (``uses_gpu_path``), one batched program with no host synchronisation, autocast-native,
with the Triton kernels of ``_skeleton_triton`` and ``_smoother_triton`` where they run (``_gpu_attend``).
"""

from __future__ import annotations

import contextlib
import math
from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from longattn.attention._triton import float32_takes_pytorch_path, pytorch_path_where_kernels_do_not_fit, triton_runs_on
from longattn.attention.base import (
    AttentionBase,
    AttentionError,
    Capabilities,
    QKVProjection,
    check_qkv,
    compute_dtype,
    merge_heads,
    output_dtype,
    padding_safe,
    register_attention,
    split_heads,
    uses_gpu_path,
)
from longattn.attention.smoother import KERNEL_DTYPES, PRECISIONS, Smoother, draw_keep, mask_factor, no_autocast

__all__ = ["SkeletonAttention", "skeleton_attention", "skeleton_attention_reference", "draw_skeleton_indices"]

_COLUMN_SCALES = ("max_len", "valid")


def draw_skeleton_indices(length: int, head_dim: int, s1: int, s2: int, device=None) -> tuple[Tensor, Tensor]:
    """Uniform draws without replacement: min(s1, length) token positions and min(s2, head_dim)
    feature coordinates, each sorted (the paper's i_1 < i_2 < ...). Uses the global RNG."""
    rows = torch.randperm(length, device=device)[: min(s1, length)].sort().values
    columns = torch.randperm(head_dim, device=device)[: min(s2, head_dim)].sort().values
    return rows, columns


def _check_indices(row_indices: Tensor, column_indices: Tensor, head_dim: int) -> None:
    for label, idx in (("row_indices", row_indices), ("column_indices", column_indices)):
        if not isinstance(idx, Tensor) or idx.dim() != 1 or idx.dtype != torch.long or idx.numel() == 0:
            raise AttentionError(f"{label} must be a non-empty 1-D torch.long tensor, got {idx!r}")
    if int(row_indices.min()) < 0:
        raise AttentionError("row_indices must be non-negative token positions")
    if int(column_indices.min()) < 0 or int(column_indices.max()) >= head_dim:
        raise AttentionError(f"column_indices must lie in [0, head_dim={head_dim})")


def _row_sample_validity(row_indices: Tensor, attention_mask: Tensor | None, batch: int, length: int) -> Tensor:
    """bool [B, s1]: the sampled position exists (< N) and is a real token.

    A position at or beyond N is treated as padding: the layer sees a sequence shorter than
    max_len exactly like the same sequence padded to max_len.
    """
    in_range = row_indices < length
    valid = in_range.expand(batch, -1)
    if attention_mask is not None:
        valid = valid & attention_mask[:, row_indices.clamp(max=length - 1)]
    return valid


def _column_scale_tensor(column_scale: float | Tensor | None, length: int, like: Tensor) -> Tensor | float:
    if column_scale is None:
        return 1.0 / math.sqrt(length)
    if isinstance(column_scale, Tensor):  # one scale per batch element, e.g. 1/sqrt(#real tokens)
        return column_scale.to(like.dtype).view(-1, 1, 1, 1)
    return float(column_scale)


def _half_layer_norm(x: Tensor, norm: tuple[Tensor | None, Tensor | None] | None, eps: float) -> Tensor:
    """LN(x) / 2 over all heads' features of a token ([B, N, H*Dh]), as Algorithm 1 does on the
    merged heads. The 1/2 of eq. (2) is folded into the affine weights (scaling by 2 is exact)."""
    weight, bias = norm if norm is not None else (None, None)
    half_weight = x.new_full(x.shape[-1:], 0.5) if weight is None else weight * 0.5
    half_bias = None if bias is None else bias * 0.5
    return F.layer_norm(x, x.shape[-1:], half_weight, half_bias, eps)


def _block_diagonal(blocks: Tensor) -> Tensor:
    """[B, H, P, Q] -> [B, H*P, H*Q] with head h's block at (h, h) and zeros elsewhere.

    Lets one matmul on the token-major [B, N, H*Dh] layout do every head's small product, so
    no [B, H, N, Dh] copy of the queries or of the outputs is made (forward or backward).
    """
    batch, heads, p, q = blocks.shape
    eye = torch.eye(heads, dtype=blocks.dtype, device=blocks.device)
    return (blocks[:, :, :, None, :] * eye[None, :, None, :, None]).reshape(batch, heads * p, heads * q)


@padding_safe
def skeleton_attention(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attention_mask: Tensor | None = None,
    *,
    row_indices: Tensor,
    column_indices: Tensor,
    row_scale: float | None = None,
    column_scale: float | Tensor | None = None,
    dropout_p: float = 0.0,
    mask_padded_samples: bool = True,
    row_attention: bool = True,
    column_attention: bool = True,
    row_norm: tuple[Tensor | None, Tensor | None] | None = None,
    column_norm: tuple[Tensor | None, Tensor | None] | None = None,
    norm_eps: float = 1e-5,
    validate_indices: bool = True,
) -> Tensor:
    """Skeleton attention on [B, H, N, Dh] with given sample indices (shared by batch and heads).

    Args:
        row_indices: long [s1] sampled token positions; positions >= N count as padding.
        column_indices: long [s2] sampled feature coordinates in [0, Dh).
        row_scale: row-branch temperature, default 1/sqrt(Dh).
        column_scale: column-branch temperature: a float, a [B] tensor (one per sequence), or
            None for 1/sqrt(N).
        dropout_p: dropout on both branches' attention weights (pass 0 in eval).
        mask_padded_samples: True drops sampled padded tokens from the row softmax; False only
            zeroes their key and value (the authors' code: they still take weight exp(0)).
        row_attention, column_attention: Table 6 ablation switches (a disabled branch adds 0).
        row_norm, column_norm: (weight, bias) of the two LayerNorms over H*Dh, or None.
        validate_indices: check the index ranges (a host sync on GPU); the module passes False
            because its buffers are valid by construction.

    Padded keys and values are zeroed, so padded tokens never influence a real token.
    Returns [B, H, N, Dh].
    """
    check_qkv(query, key, value, attention_mask)
    if query.shape[2] != key.shape[2] or value.shape[-1] != query.shape[-1]:
        raise AttentionError("skeleton attention is self-attention: query, key, value must share N and Dh")
    if not (row_attention or column_attention):
        raise AttentionError("skeleton attention needs row_attention or column_attention")
    batch, heads, length, head_dim = query.shape
    if validate_indices:
        _check_indices(row_indices, column_indices, head_dim)
    safe_rows = row_indices.clamp(max=length - 1)
    out = _skeleton_from_samples(
        merge_heads(query),  # token-major [B, N, H*Dh]: a free view of split_heads outputs
        heads,
        row_keys=key[:, :, safe_rows] if row_attention else None,  # P1 K: [B, H, s1, Dh]
        row_values=value[:, :, safe_rows] if row_attention else None,  # P1 V
        column_keys=_column_samples(key, column_indices) if column_attention else None,  # K P2
        column_values=_column_samples(value, column_indices) if column_attention else None,  # V P2
        attention_mask=attention_mask,
        row_indices=row_indices,
        row_scale=row_scale,
        column_scale=column_scale,
        dropout_p=dropout_p,
        mask_padded_samples=mask_padded_samples,
        row_norm=row_norm,
        column_norm=column_norm,
        norm_eps=norm_eps,
    )
    return split_heads(out, heads)


def _column_samples(x: Tensor, column_indices: Tensor) -> Tensor:
    """[B, H, N, Dh] -> the sampled feature columns of every head, token-major [B, N, H*s2]."""
    batch, heads, length, _ = x.shape
    return x.transpose(1, 2)[..., column_indices].reshape(batch, length, heads * column_indices.numel())


class _SampledProjections(torch.autograd.Function):
    """Q = x W_q^T + b_q, the sampled feature columns of K and V (x W_k[P2]^T + b_k[P2], the
    same for V) and the sampled token rows x[P1], with one hand-written backward: the three
    input-gradient GEMMs accumulate in place into one buffer and the rows' gradient is added
    there by index (autograd would allocate a full-size gradient per use of x and sum them).
    Outputs for a disabled branch are None. With ``gemm_dtype`` the GEMMs take factors of that
    dtype (float32 accumulation), biases and outputs stay in x's dtype."""

    @staticmethod
    def forward(ctx, x, weight_q, bias_q, weight_k, bias_k, weight_v, bias_v, features, rows, gemm_dtype):  # type: ignore[override]
        gemm_dtype = gemm_dtype or x.dtype
        gemm_x = x.to(gemm_dtype)
        weights = [weight_q] + ([weight_k[features], weight_v[features]] if features is not None else [])
        biases = [bias_q] + ([None if b is None else b[features] for b in (bias_k, bias_v)] if features is not None else [])
        outputs = []
        for weight, bias in zip(weights, biases):
            out = F.linear(gemm_x, weight.to(gemm_dtype)).to(x.dtype)
            outputs.append(out if bias is None else out.add_(bias))
        ctx.save_for_backward(x, *weights, *(() if features is None else (features,)), *(() if rows is None else (rows,)))
        ctx.config = (features is not None, rows is not None, bias_q is not None, gemm_dtype)
        query, column_keys, column_values = outputs + [None] * (3 - len(outputs))
        sampled = None if rows is None else x[:, rows]
        return query, column_keys, column_values, sampled

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_q, grad_k, grad_v, grad_sampled):  # type: ignore[override]
        has_columns, has_rows, has_bias, gemm_dtype = ctx.config
        x, weight_q, *rest = ctx.saved_tensors
        weight_k, weight_v, features = rest[:3] if has_columns else (None, None, None)
        rows = rest[-1] if has_rows else None
        dim = x.shape[-1]
        pairs = [(grad_q, weight_q)] + ([(grad_k, weight_k), (grad_v, weight_v)] if has_columns else [])
        gemm_x = x.to(gemm_dtype).reshape(-1, dim)
        grad_x = torch.zeros_like(x) if grad_q is None else None
        weight_grads, bias_grads = [], []
        for grad, weight in pairs:
            if grad is None:
                weight_grads.append(torch.zeros_like(weight))
                bias_grads.append(weight.new_zeros(weight.shape[0]))
                continue
            gemm_grad = grad.to(gemm_dtype)
            part = (gemm_grad @ weight.to(gemm_dtype)).to(x.dtype)
            grad_x = part if grad_x is None else grad_x.add_(part)
            weight_grads.append((gemm_grad.reshape(-1, grad.shape[-1]).t() @ gemm_x).to(x.dtype))
            bias_grads.append(grad.sum((0, 1)))
        if grad_sampled is not None:
            grad_x.index_add_(1, rows, grad_sampled)

        def full(rows_grad: Tensor | None) -> Tensor | None:  # gradient of W_k / b_k from that of their rows
            if rows_grad is None:
                return None
            return rows_grad.new_zeros((dim,) + rows_grad.shape[1:]).index_add_(0, features, rows_grad)

        grad_k_weight = grad_k_bias = grad_v_weight = grad_v_bias = None
        if has_columns:
            grad_k_weight, grad_v_weight = full(weight_grads[1]), full(weight_grads[2])
            if has_bias:
                grad_k_bias, grad_v_bias = full(bias_grads[1]), full(bias_grads[2])
        grad_q_bias = bias_grads[0] if has_bias else None
        return (grad_x, weight_grads[0], grad_q_bias, grad_k_weight, grad_k_bias, grad_v_weight, grad_v_bias,
                None, None, None)


# Rows (batch x tokens) per tile of the fused core (_SkeletonCore): its temporaries are [B, tile, dim]
# and a few [B, H*s, tile] blocks, small enough to stay near the cache, and a whole sequence never has
# more than its input, output and gradient at full length.
CORE_TILE = 4096


def _core_tile(batch: int) -> int:
    """Tokens per tile of the fused core for ``batch`` sequences."""
    return max(1, CORE_TILE // batch)


def _head_blocks(full: Tensor, heads: int) -> Tensor:
    """The diagonal blocks of [B, H*P, H*Q] (the per-head products of a _block_diagonal product) as [B, H, P, Q]."""
    batch, rows, cols = full.shape
    return full.view(batch, heads, rows // heads, heads, cols // heads).diagonal(dim1=1, dim2=3).permute(0, 3, 1, 2)


class _InputGradient:
    """The gradient of the core's input s, shared by _SkeletonCore and _GramAndRows: the core's
    backward leaves its whole-sequence gradient here instead of returning it, and _GramAndRows'
    backward (which autograd runs after it, since its outputs feed the core's inputs) adds its
    part in place and returns the sum: one [B, N, dim] buffer, and no autograd sum of two."""

    def __init__(self) -> None:
        self.tensor: Tensor | None = None
        self.gram_done = False


def _summed_products(a: Tensor, b: Tensor) -> Tensor:
    """sum over the batch of a[i]^T @ b[i] for [B, T, p] and [B, T, q] tiles (no reshape copy of a
    tile that is not contiguous across the batch)."""
    out = torch.mm(a[0].t(), b[0])
    for i in range(1, a.shape[0]):
        out.addmm_(a[i].t(), b[i])
    return out


class _GramAndRows(torch.autograd.Function):
    """What the column branch needs from the whole sequence, and the sampled token rows.

    The column scores Q^T (K P2) over the real tokens (Section 3.1) are a linear image of the Gram
    matrix of the layer input s: with Q = s W_q^T + b_q, K P2 = s W_k[P2]^T + b_k[P2] and m = 1 at
    real tokens, sum_n m_n Q_n^T (K P2)_n = W_q G W_k[P2]^T + W_q sigma b_k[P2]^T + b_q sigma^T
    W_k[P2]^T + c b_q b_k[P2]^T with G = s^T diag(m) s, sigma = s^T m, c = sum m. This function
    returns G [B, dim, dim] and sigma [B, dim] (tile by tile: neither Q nor K P2 exists at full
    length), plus s[:, rows]; its backward adds ds = m (s (dG + dG^T) + dsigma) and the rows'
    gradient into the core's gradient buffer (see _InputGradient).
    """

    @staticmethod
    def forward(ctx, s, mask, rows, shared):  # type: ignore[override]
        batch, length, dim = s.shape
        gram, total = s.new_zeros(batch, dim, dim), s.new_zeros(batch, dim)
        step = _core_tile(batch)
        for start in range(0, length, step):
            tile = s[:, start:start + step]
            real = tile if mask is None else tile * mask_factor(mask[:, start:start + step, None], s.dtype)
            for b in range(batch):  # per batch element: a tile is not contiguous across the batch
                gram[b].addmm_(tile[b].t(), real[b])
            total += real.sum(1)
        ctx.save_for_backward(s, *(() if mask is None else (mask,)), *(() if rows is None else (rows,)))
        ctx.flags = (mask is not None, rows is not None)
        ctx.shared = shared
        return gram, total, None if rows is None else s[:, rows]

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_gram, grad_total, grad_rows):  # type: ignore[override]
        masked, has_rows = ctx.flags
        s, *rest = ctx.saved_tensors
        mask = rest[0] if masked else None
        rows = rest[-1] if has_rows else None
        batch, _, dim = s.shape
        symmetric = s.new_zeros(batch, dim, dim) if grad_gram is None else grad_gram + grad_gram.transpose(1, 2)
        shift = s.new_zeros(batch, 1, dim) if grad_total is None else grad_total[:, None, :]
        shared = ctx.shared
        grad_s, shared.tensor, shared.gram_done = shared.tensor, None, True
        fresh = grad_s is None  # the core left no gradient of s: this part is all of it
        if fresh:
            grad_s = torch.empty_like(s)
        step = _core_tile(batch)
        for start in range(0, s.shape[1], step):
            tile, out = s[:, start:start + step], grad_s[:, start:start + step]
            factor = None if mask is None else mask_factor(mask[:, start:start + step, None], s.dtype)
            if fresh:
                torch.baddbmm(shift, tile, symmetric, out=out)
                if factor is not None:
                    out *= factor
            elif factor is None:
                for b in range(batch):
                    out[b].addmm_(tile[b], symmetric[b]).add_(shift[b])
            else:
                out.addcmul_(torch.baddbmm(shift, tile, symmetric), factor)
        if grad_rows is not None:
            grad_s.index_add_(1, rows, grad_rows)
        return grad_s, None, None, None


class _SkeletonCore(torch.autograd.Function):
    """Both branches, their LayerNorms and the output projection, tile by tile along the sequence,
    given what they need from the whole sequence: the column weights softmax(P2^T K^T Q / sqrt(n))
    (after dropout) [B, H, Dh, s2] and the sampled rows' keys (temperature folded in) and values
    [B, H, s1, Dh]. Per tile of the input s: the row scores (from s and the sampled keys with the
    query projection folded in: Q itself is never formed), their softmax over the s1 samples and
    dropout, V P2, and the output projection of LN_1(V_1)/2 + LN_2(V_2)/2 with the LayerNorms folded
    into it (see _CoreTiles: V_1, V_2 and their normalised sum are never formed); the same numbers as
    ``_SampledProjections`` -> ``_skeleton_from_samples`` -> ``to_out`` (tested in float64).
    Saved for backward: s, the parameters, the small sampled blocks and the row dropout as one bool
    [B, N, H, s1]; backward recomputes each tile (a few GEMMs of [tile, dim]) instead of keeping a
    dozen [B, N, dim] activations, and writes the gradient of s tile by tile into one buffer.
    """

    @staticmethod
    def forward(ctx, s, weight_q, bias_q, weight_v, bias_v, column_weights, row_keys, row_values, row_norm_weight,
                row_norm_bias, column_norm_weight, column_norm_bias, weight_out, bias_out, mask, row_valid, row_keep,
                config, shared):  # type: ignore[override]
        out = torch.empty_like(s)
        # its products are skinny ([T, dim] by at most [dim, dim]) and stay in s's dtype: not autocast's
        with torch.autocast(s.device.type, enabled=False):
            tiles = _CoreTiles(s, weight_q, bias_q, weight_v, bias_v, column_weights, row_keys, row_values,
                               (row_norm_weight, row_norm_bias), (column_norm_weight, column_norm_bias), weight_out,
                               bias_out, mask, row_valid, row_keep, config)
            for start in range(0, s.shape[1], tiles.step):
                tiles.forward(start, out=out[:, start:start + tiles.step])
        ctx.save_for_backward(s, weight_q, bias_q, weight_v, bias_v, column_weights, row_keys, row_values,
                              row_norm_weight, row_norm_bias, column_norm_weight, column_norm_bias, weight_out,
                              bias_out, mask, row_valid, row_keep)
        ctx.config, ctx.shared = config, shared
        return out

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_out):  # type: ignore[override]
        (s, weight_q, bias_q, weight_v, bias_v, column_weights, row_keys, row_values, row_norm_weight, row_norm_bias,
         column_norm_weight, column_norm_bias, weight_out, bias_out, mask, row_valid, row_keep) = ctx.saved_tensors
        grad_s = torch.empty_like(s)
        with torch.autocast(s.device.type, enabled=False):
            tiles = _CoreTiles(s, weight_q, bias_q, weight_v, bias_v, column_weights, row_keys, row_values,
                               (row_norm_weight, row_norm_bias), (column_norm_weight, column_norm_bias), weight_out,
                               bias_out, mask, row_valid, row_keep, ctx.config)
            for start in range(0, s.shape[1], tiles.step):
                tiles.backward(start, grad_out[:, start:start + tiles.step], grad_s[:, start:start + tiles.step])
            parameter_grads = tiles.parameter_grads()
        shared = ctx.shared
        if shared is not None and not shared.gram_done:  # _GramAndRows' backward completes and returns it
            shared.tensor, grad_s = grad_s, None
        return (grad_s, *parameter_grads, None, None, None, None, None)


class _CoreTiles:
    """One tile of _SkeletonCore forward (keeping what its backward needs) and its backward, which
    accumulates the gradients of the parameters and of the sampled blocks across tiles.

    The LayerNorms are folded into the output projection. A branch's output is V = P M with P the
    tile's [T, K] mixing weights (row branch: the softmax weights over the H*s1 sampled rows;
    column branch: the sampled columns V P2) and M [K, D] (block-diagonal sampled values; column
    softmax weights). Its mean over the D features is P (M 1/D), so V - mean = P Mc with
    Mc = M (I - 1 1^T / D), and its variance (1/D) p_t^T (Mc Mc^T) p_t. Hence
    LN(V) W^T = (r o P) (Mc diag(gamma) W^T) + beta W^T with r = (var + eps)^-1/2 per token:
    one GEMM [T, K] x [K, D] per branch gives the projected output, and no [T, D] activation of
    either branch (nor their LayerNorms' outputs or gradients) exists, forward or backward."""

    def __init__(self, s, weight_q, bias_q, weight_v, bias_v, column_weights, row_keys, row_values, row_norm,
                 column_norm, weight_out, bias_out, mask, row_valid, row_keep, config) -> None:
        self.heads, self.fill_invalid, self.keep_scale, self.eps = config
        self.s, self.mask, self.row_valid, self.row_keep = s, mask, row_valid, row_keep
        self.step = _core_tile(s.shape[0])
        if row_valid is not None:
            self.row_valid_factor = row_valid[:, None, :, None].to(s.dtype)  # [B, 1, s1, 1]
        self.weight_q, self.weight_v, self.weight_out = weight_q, weight_v, weight_out
        self.bias_q, self.bias_v, self.bias_out = bias_q, bias_v, bias_out
        self.rows = row_keys is not None
        self.columns = column_weights is not None
        self.branches: dict[str, dict[str, Tensor]] = {}
        const = torch.zeros_like(weight_out[:, 0]) if bias_out is None else bias_out.clone()
        if self.rows:
            self.row_keys = _block_diagonal(row_keys)  # [B, H*s1, H*Dh]
            # the queries folded into the sampled keys: (P1 K) Q^T = (P1 K) W_q s^T + (P1 K) b_q, so the
            # scores of a tile are one [H*s1, dim] x [dim, T] product and Q never exists
            self.score_weight = self.row_keys @ weight_q  # [B, H*s1, dim]
            self.score_bias = None if bias_q is None else self.row_keys @ bias_q  # [B, H*s1]
            self.branches["row"] = self._fold(_block_diagonal(row_values), *row_norm)
            const += weight_out @ row_norm[1]
        if self.columns:
            self.branches["column"] = self._fold(_block_diagonal(column_weights.transpose(-1, -2)), *column_norm)
            const += weight_out @ column_norm[1]
        self.const = const  # (beta_1 + beta_2) W^T + b
        self.grads: dict[str, Tensor] = {}

    def _fold(self, mix: Tensor, gamma: Tensor, beta: Tensor) -> dict[str, Tensor]:
        """What a branch's LayerNorm folded into the output projection needs of its mixing matrix M."""
        centred = mix - mix.mean(-1, keepdim=True)  # Mc [B, K, D]
        return {"mix": mix, "centred": centred, "gamma": gamma, "beta": beta,
                "gram": centred @ centred.transpose(1, 2),  # Mc Mc^T [B, K, K]
                "projected": (centred * gamma) @ self.weight_out.t()}  # Mc diag(gamma) W^T [B, K, D_out]

    @staticmethod
    def _linear(x: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
        """x W^T + b for a [B, T, p] tile: one GEMM per batch element (a tile is not contiguous
        across the batch)."""
        out = x.new_empty(x.shape[:-1] + weight.shape[:1])
        for b in range(x.shape[0]):
            if bias is None:
                torch.mm(x[b], weight.t(), out=out[b])
            else:
                torch.addmm(bias, x[b], weight.t(), out=out[b])
        return out

    @staticmethod
    def _product_into(out: Tensor, grad: Tensor, weight: Tensor, accumulate: bool) -> None:
        """out (+)= grad @ W for [B, T, p] tiles, the GEMM writing in place; W [p, q] or one per
        batch element [B, p, q]."""
        for b in range(out.shape[0]):
            factor = weight[b] if weight.dim() == 3 else weight
            if accumulate:
                out[b].addmm_(grad[b], factor)
            else:
                torch.mm(grad[b], factor, out=out[b])

    def _accumulate(self, name: str, value: Tensor) -> None:
        self.grads[name] = value if name not in self.grads else self.grads[name].add_(value)

    def _normalise(self, name: str, weights: Tensor) -> Tensor:
        """r o P for the branch's [B, T, K] weights P (a view is fine): the per-token 1/std of P M."""
        branch = self.branches[name]
        spread = weights @ branch["gram"]  # P Mc Mc^T [B, T, K]
        var = (spread * weights).sum(-1) / branch["mix"].shape[-1]
        rstd = torch.rsqrt(var + self.eps)
        branch.update(weights=weights, spread=spread, rstd=rstd)
        return weights * rstd[..., None]

    def forward(self, start: int, out: Tensor | None = None) -> "_CoreTiles":
        """Compute the tile at ``start``, with the output written into ``out`` when given; what the
        backward needs stays on self."""
        s = self.s[:, start:start + self.step]
        batch, length, dim = s.shape
        self.tile_s, self.start = s, start
        if self.rows:
            heads = self.heads
            # sample-major scores [B, H, s1, T]: the softmax over the samples runs along a contiguous axis
            scores = self.score_weight @ s.transpose(1, 2)
            if self.score_bias is not None:
                scores += self.score_bias[..., None]
            scores = scores.view(batch, heads, -1, length)
            if self.fill_invalid:
                valid = self.row_valid[:, None, :, None]
                scores.masked_fill_(~valid, torch.finfo(scores.dtype).min)
                self.soft = torch.softmax(scores, dim=2)
                weights = self.soft * self.row_valid_factor
            else:
                self.soft = weights = torch.softmax(scores, dim=2)
            if self.row_keep is not None:
                keep = self.row_keep[:, start:start + self.step].permute(0, 2, 3, 1)  # [B, H, s1, T]
                weights = weights * mask_factor(keep, weights.dtype) * self.keep_scale
            # P of the row branch token-major [B, T, H*s1] (a transposed view)
            self.row_scaled = self._normalise("row", weights.reshape(batch, -1, length).transpose(1, 2))
        if self.columns:
            sampled = self._linear(s, self.weight_v, self.bias_v)  # V P2: [B, T, H*s2]
            if self.mask is not None:
                sampled *= mask_factor(self.mask[:, start:start + self.step, None], s.dtype)
            self.column_scaled = self._normalise("column", sampled)
        if out is not None:  # sum over the branches of (r o P) Mc diag(gamma) W^T, plus the constant
            scaled = [getattr(self, f"{name}_scaled") for name in self.branches]
            for b in range(batch):
                first, *rest = [(part[b], self.branches[name]["projected"][b])
                                for part, name in zip(scaled, self.branches)]
                torch.addmm(self.const, *first, out=out[b])
                for factors in rest:
                    out[b].addmm_(*factors)
        return self

    def _branch_backward(self, name: str, grad_out: Tensor) -> Tensor:
        """The gradient of the branch's weights P from that of the output; accumulates that of
        its folded projection (Mc diag(gamma) W^T) and of Mc Mc^T."""
        branch = self.branches[name]
        weights, spread, rstd = branch["weights"], branch["spread"], branch["rstd"]
        scaled = getattr(self, f"{name}_scaled")
        self._accumulate(f"{name}_projected", scaled.transpose(1, 2) @ grad_out)  # [B, K, D_out]
        grad_scaled = grad_out @ branch["projected"].transpose(1, 2)  # [B, T, K]
        grad_rstd = (grad_scaled * weights).sum(-1)
        grad_var = -0.5 * rstd.pow(3) * grad_rstd  # [B, T]
        # var = p^T (Mc Mc^T) p / D: its gradient is 2 (Mc Mc^T) p / D; that of the Gram matrix p p^T / D
        scale = grad_var[..., None] * (1.0 / branch["mix"].shape[-1])
        self._accumulate(f"{name}_gram", (weights * scale).transpose(1, 2) @ weights)
        return torch.addcmul(grad_scaled * rstd[..., None], spread, scale, value=2.0)

    def backward(self, start: int, grad_out: Tensor, grad_s: Tensor) -> None:
        """Write the gradient of the tile's input s into ``grad_s``; parameter gradients accumulate on self."""
        self.forward(start)
        s = self.tile_s
        batch, length, dim = s.shape
        self._accumulate("grad_out_sum", grad_out.sum((0, 1)))
        if self.rows:
            grad_weights = self._branch_backward("row", grad_out).transpose(1, 2)  # [B, H*s1, T]
            grad_weights = grad_weights.reshape(batch, self.heads, -1, length)
            if self.row_keep is not None:
                keep = self.row_keep[:, start:start + self.step].permute(0, 2, 3, 1)
                grad_weights = grad_weights * mask_factor(keep, grad_weights.dtype) * self.keep_scale
            if self.fill_invalid:
                grad_weights = grad_weights * self.row_valid_factor
            soft = self.soft
            grad_scores = soft * (grad_weights - (soft * grad_weights).sum(2, keepdim=True))
            if self.fill_invalid:  # masked_fill passes no gradient to the filled scores
                grad_scores = grad_scores * self.row_valid_factor
            grad_scores = grad_scores.view(batch, -1, length)  # [B, H*s1, T]
            self._accumulate("score_weight", grad_scores @ s)
            if self.score_bias is not None:
                self._accumulate("score_bias", grad_scores.sum(-1))
            self._product_into(grad_s, grad_scores.transpose(1, 2), self.score_weight, accumulate=False)
        if self.columns:
            grad_sampled = self._branch_backward("column", grad_out)  # [B, T, H*s2]
            if self.mask is not None:
                grad_sampled *= mask_factor(self.mask[:, start:start + self.step, None], s.dtype)
            self._accumulate("weight_v", _summed_products(grad_sampled, s))
            if self.bias_v is not None:
                self._accumulate("bias_v", grad_sampled.sum((0, 1)))
            self._product_into(grad_s, grad_sampled, self.weight_v, accumulate=self.rows)

    def _branch_parameter_grads(self, name: str, grad_weight_out: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """(dM, dgamma, dbeta) of a branch from its accumulated gradients; adds its part of dW_out."""
        branch, g = self.branches[name], self.grads
        centred, gamma = branch["centred"], branch["gamma"]
        grad_projected = g[f"{name}_projected"]  # of Mc diag(gamma) W^T, [B, K, D_out]
        weighted = centred * gamma
        grad_weight_out += (grad_projected.transpose(1, 2) @ weighted).sum(0)
        grad_weighted = grad_projected @ self.weight_out  # [B, K, D]
        grad_gamma = (grad_weighted * centred).sum((0, 1))
        gram_grad = g[f"{name}_gram"]
        grad_centred = grad_weighted * gamma + (gram_grad + gram_grad.transpose(1, 2)) @ centred
        grad_mix = grad_centred - grad_centred.mean(-1, keepdim=True)  # through Mc = M (I - 1 1^T / D)
        grad_beta = g["grad_out_sum"] @ self.weight_out
        return grad_mix, grad_gamma, grad_beta

    def parameter_grads(self) -> tuple[Tensor | None, ...]:
        """Gradients in the order of _SkeletonCore's inputs after s (None for what is absent)."""
        g = self.grads.get
        grad_out_sum = self.grads["grad_out_sum"]
        grad_weight_out = torch.zeros_like(self.weight_out)
        row = column = (None, None, None)
        if self.rows:
            row = self._branch_parameter_grads("row", grad_weight_out)
            grad_weight_out += torch.outer(grad_out_sum, self.branches["row"]["beta"])
        if self.columns:
            column = self._branch_parameter_grads("column", grad_weight_out)
            grad_weight_out += torch.outer(grad_out_sum, self.branches["column"]["beta"])
        column_weights = None if column[0] is None else _head_blocks(column[0], self.heads).transpose(-1, -2)
        row_keys = row_values = grad_weight_q = grad_bias_q = None
        if self.rows:
            # back through score_weight = (P1 K) W_q and score_bias = (P1 K) b_q
            grad_score_weight, grad_score_bias = g("score_weight"), g("score_bias")
            grad_keys = grad_score_weight @ self.weight_q.t()  # [B, H*s1, H*Dh]
            grad_weight_q = _summed_products(self.row_keys, grad_score_weight)
            if grad_score_bias is not None:
                grad_keys += grad_score_bias[..., None] * self.bias_q
                grad_bias_q = torch.einsum("bkd,bk->d", self.row_keys, grad_score_bias)
            row_keys, row_values = _head_blocks(grad_keys, self.heads), _head_blocks(row[0], self.heads)
        grad_bias_out = None if self.bias_out is None else grad_out_sum
        return (grad_weight_q, grad_bias_q, g("weight_v"), g("bias_v"), column_weights, row_keys, row_values,
                row[1], row[2], column[1], column[2], grad_weight_out, grad_bias_out)


class _ProjectAndSample(torch.autograd.Function):
    """s W^T + b in ``dtype`` (one GEMM for the stacked [Q | K P2 | V P2] weights) and the sampled token rows
    s[:, rows] (None without rows), with one backward: the rows' gradient is added in place into the GEMM's
    input gradient (autograd would make a zero tensor of the whole sequence for it, then add the two)."""

    @staticmethod
    def forward(ctx, s, weight, bias, rows, dtype):  # type: ignore[override]
        with no_autocast(s):
            gemm_input = s.to(dtype)
            projected = F.linear(gemm_input, weight.to(dtype), None if bias is None else bias.to(dtype))
        ctx.save_for_backward(gemm_input, weight, rows)
        ctx.has_bias = bias is not None
        return projected, None if rows is None else s[:, rows]

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad, grad_sampled):  # type: ignore[override]
        gemm_input, weight, rows = ctx.saved_tensors
        with no_autocast(grad):
            grad = grad.to(gemm_input.dtype)
            flat = grad.reshape(-1, grad.shape[-1])
            grad_s = (flat @ weight.to(grad.dtype)).view(gemm_input.shape)
            if grad_sampled is not None:
                grad_s.index_add_(1, rows, grad_sampled.to(grad_s.dtype))
            grad_weight = flat.t() @ gemm_input.reshape(-1, gemm_input.shape[-1])
        return grad_s, grad_weight, flat.sum(0) if ctx.has_bias else None, None, None


def _stacked_linear(parts: list[tuple[nn.Module, Tensor | None]]) -> tuple[Tensor, Tensor | None]:
    """(weight, bias) of one linear map producing the outputs of several linear layers side by side, each
    restricted to the given output rows (None = all of them); a missing bias counts as zeros."""
    weights = [linear.weight if rows is None else linear.weight[rows] for linear, rows in parts]
    if all(linear.bias is None for linear, _ in parts):
        return torch.cat(weights), None
    biases = [w.new_zeros(w.shape[0]) if linear.bias is None else (linear.bias if rows is None else linear.bias[rows])
              for (linear, rows), w in zip(parts, weights)]
    return torch.cat(weights), torch.cat(biases)


def _linear(linear: nn.Linear, x: Tensor, gemm_dtype: torch.dtype | None) -> Tensor:
    """``linear(x)``; with ``gemm_dtype`` the product takes factors of that dtype (the GEMM
    accumulates in float32) and the bias is added in x's dtype."""
    if gemm_dtype is None or gemm_dtype == x.dtype:
        return linear(x)
    out = F.linear(x.to(gemm_dtype), linear.weight.to(gemm_dtype)).to(x.dtype)
    return out if linear.bias is None else out + linear.bias


def _skeleton_from_samples(
    merged_query: Tensor,
    heads: int,
    *,
    row_keys: Tensor | None,
    row_values: Tensor | None,
    column_keys: Tensor | None,
    column_values: Tensor | None,
    attention_mask: Tensor | None,
    row_indices: Tensor,
    row_scale: float | None,
    column_scale: float | Tensor | None,
    dropout_p: float,
    mask_padded_samples: bool,
    row_norm: tuple[Tensor | None, Tensor | None] | None,
    column_norm: tuple[Tensor | None, Tensor | None] | None,
    norm_eps: float = 1e-5,
    row_valid: Tensor | None = None,
    sum_over_tokens: Callable[[Tensor], Tensor] | None = None,
) -> Tensor:
    """Both branches from the queries [B, N, H*Dh] and only the K, V entries they read: the
    sampled rows [B, H, s1, Dh] and the sampled columns [B, N, H*s2] (None = branch off).
    Returns LN_1(V_1)/2 + LN_2(V_2)/2 as [B, N, H*Dh].

    For a sequence split across processes (longattn.parallel) the caller passes ``row_valid``
    (bool [B, s1]: the sample is a real token; the samples live on other processes) and
    ``sum_over_tokens``, an all-reduce completing the column branch's sums over the tokens.

    On the GPU path (``uses_gpu_path``) the same numbers come from ``_skeleton_from_samples_gpu``."""
    if uses_gpu_path(merged_query):
        return _skeleton_from_samples_gpu(
            merged_query, heads, row_keys=row_keys, row_values=row_values, column_keys=column_keys,
            column_values=column_values, attention_mask=attention_mask, row_indices=row_indices, row_scale=row_scale,
            column_scale=column_scale, dropout_p=dropout_p, mask_padded_samples=mask_padded_samples,
            row_norm=row_norm, column_norm=column_norm, norm_eps=norm_eps, row_valid=row_valid,
            sum_over_tokens=sum_over_tokens)
    batch, length, _ = merged_query.shape
    out = None

    if row_keys is not None:
        s1, head_dim = row_keys.shape[2:]
        valid = _row_sample_validity(row_indices, attention_mask, batch, length) if row_valid is None else row_valid
        # padded (or beyond-N) samples: zero keys and values (then score 0, weight exp(0) when
        # mask_padded_samples is False; left out of the softmax below otherwise)
        sample_valid = valid[:, None, :, None].to(row_keys.dtype)
        row_keys, row_values = row_keys * sample_valid, row_values * sample_valid
        scale = 1.0 / math.sqrt(head_dim) if row_scale is None else row_scale
        # (Q (P1 K)^T / sqrt(Dh))^T for every head at once, sample-major [B, H*s1, N] -> [B, H, s1, N]:
        # the softmax over the s1 samples then runs along a long contiguous axis (over a
        # last axis of length s1 it is an order of magnitude slower on CPU)
        scores = (_block_diagonal(row_keys * scale) @ merged_query.transpose(1, 2)).view(batch, heads, s1, length)
        if mask_padded_samples and not bool(valid.all()):
            # a finite fill keeps all-padded rows NaN-free (uniform, then zeroed below)
            scores = scores.masked_fill(~valid[:, None, :, None], torch.finfo(scores.dtype).min)
            weights = torch.softmax(scores, dim=2) * valid[:, None, :, None].to(scores.dtype)
        else:
            weights = torch.softmax(scores, dim=2)
        if dropout_p > 0:
            # dropout drawn on the token-major [B, N, H, s1] layout (as _SkeletonCore draws it), applied here
            keep = draw_keep((batch, length, heads, s1), dropout_p, weights.device)
            weights = weights * keep.permute(0, 2, 3, 1) * (1.0 / (1.0 - dropout_p))
        # V_1 = weights P1 V: [B, N, H*s1] (a transposed view) @ [B, H*s1, H*Dh] -> [B, N, H*Dh]
        row_out = weights.view(batch, heads * s1, length).transpose(1, 2) @ _block_diagonal(row_values)
        out = _half_layer_norm(row_out, row_norm, norm_eps)

    if column_keys is not None:
        if attention_mask is not None:  # padded K and V are zeroed
            keep = attention_mask[..., None].to(column_keys.dtype)
            column_keys, column_values = column_keys * keep, column_values * keep
        head_dim = merged_query.shape[-1] // heads
        s2 = column_keys.shape[-1] // heads
        scale = _column_scale_tensor(column_scale, length, merged_query)
        # Q^T K P2 of every head pair in one product; the diagonal blocks are the per-head ones
        all_pairs = (merged_query.transpose(1, 2) @ column_keys).view(batch, heads, head_dim, heads, s2)
        scores = all_pairs.diagonal(dim1=1, dim2=3).permute(0, 3, 1, 2)  # [B, H, Dh, s2]
        if sum_over_tokens is not None:
            scores = sum_over_tokens(scores)
        scores = scores * scale
        weights = torch.softmax(scores, dim=-1)  # softmax over the s2 samples
        weights = F.dropout(weights, dropout_p) if dropout_p > 0 else weights
        column_out = column_values @ _block_diagonal(weights.transpose(-1, -2))  # V P2 softmax(...): [B, N, H*Dh]
        column_half = _half_layer_norm(column_out, column_norm, norm_eps)
        out = column_half if out is None else out + column_half
    return out


# ----------------------------------------------------------------------------- GPU path


def _half_norm(norm: tuple[Tensor | None, Tensor | None] | None, dim: int, like: Tensor) -> tuple[Tensor, Tensor]:
    """(weight / 2, bias / 2) of a branch's LayerNorm (the 1/2 of eq. 2), ones / 2 and zeros where absent."""
    weight, bias = norm if norm is not None else (None, None)
    half_weight = like.new_full((dim,), 0.5) if weight is None else weight * 0.5
    return half_weight, like.new_zeros(dim) if bias is None else bias * 0.5


def _skeleton_from_samples_gpu(
    merged_query: Tensor,
    heads: int,
    *,
    row_keys: Tensor | None,
    row_values: Tensor | None,
    column_keys: Tensor | None,
    column_values: Tensor | None,
    attention_mask: Tensor | None,
    row_indices: Tensor,
    row_scale: float | None,
    column_scale: float | Tensor | None,
    dropout_p: float,
    mask_padded_samples: bool,
    row_norm: tuple[Tensor | None, Tensor | None] | None,
    column_norm: tuple[Tensor | None, Tensor | None] | None,
    norm_eps: float = 1e-5,
    row_valid: Tensor | None = None,
    sum_over_tokens: Callable[[Tensor], Tensor] | None = None,
) -> Tensor:
    """``_skeleton_from_samples`` on the GPU path: the whole-sequence reduction of the column branch (its
    scores Q^T K P2 over the real tokens, softmax and dropout, all heads in one product), then both
    branches and their LayerNorms token by token in ``skeleton_core``. No host synchronisation: padded
    samples are always masked (a mask that excludes nothing changes nothing). GEMMs in the queries'
    dtype (the autocast dtype under autocast), softmaxes and LayerNorm statistics in float32, output in
    the queries' dtype."""
    batch, length, dim = merged_query.shape
    stats_dtype = compute_dtype(merged_query.dtype)
    valid = keep = column_weights = None
    if row_keys is not None:
        s1, head_dim = row_keys.shape[2:]
        valid = _row_sample_validity(row_indices, attention_mask, batch, length) if row_valid is None else row_valid
        factor = valid[:, None, :, None].to(row_keys.dtype)
        scale = 1.0 / math.sqrt(head_dim) if row_scale is None else row_scale
        # the temperature folded into P1 K; padded (or beyond-N) samples get zero keys and values
        row_keys, row_values = row_keys * (factor * scale), row_values * factor
        if dropout_p > 0:  # token-major [B, N, H, s1], drawn before the column dropout (as the CPU paths)
            keep = torch.rand((batch, length, heads, s1), device=merged_query.device) >= dropout_p
    if column_keys is not None:
        if attention_mask is not None:  # padded K and V are zeroed
            real = attention_mask[..., None].to(column_keys.dtype)
            column_keys, column_values = column_keys * real, column_values * real
        # Q^T K P2 of every head pair in one product over the tokens; the diagonal blocks are the per-head ones
        scores = _head_blocks(merged_query.transpose(1, 2) @ column_keys, heads).to(stats_dtype)  # [B, H, Dh, s2]
        if sum_over_tokens is not None:
            scores = sum_over_tokens(scores)
        scores = scores * _column_scale_tensor(column_scale, length, scores)
        column_weights = torch.softmax(scores, dim=-1)  # over the s2 samples
        column_weights = F.dropout(column_weights, dropout_p) if dropout_p > 0 else column_weights
    norms = tuple(_half_norm(norm, dim, merged_query.new_empty((), dtype=stats_dtype))
                  for norm in (row_norm, column_norm))
    return skeleton_core(merged_query, column_values, row_keys, row_values, column_weights, norms, valid, keep,
                         1.0 / (1.0 - dropout_p) if dropout_p > 0 else 1.0, norm_eps, mask_padded_samples)


@pytorch_path_where_kernels_do_not_fit
def skeleton_core(query: Tensor, column_values: Tensor | None, row_keys: Tensor | None, row_values: Tensor | None,
                  column_weights: Tensor | None, norms: tuple[tuple[Tensor, Tensor], tuple[Tensor, Tensor]],
                  row_valid: Tensor | None, row_keep: Tensor | None, keep_scale: float, eps: float,
                  mask_padded_samples: bool) -> Tensor:
    """LN_1(V_1) / 2 + LN_2(V_2) / 2 of eq. (2), token by token, on the GPU path: the Triton kernel of
    ``_skeleton_triton`` where it runs (CUDA with triton installed, or the interpreter in the tests; float32 on a
    GPU excepted: :func:`~longattn.attention._triton.float32_takes_pytorch_path`), else ``gpu_core_torch``.

    Args:
        query: [B, N, H*Dh] queries (a view with unit feature stride is fine).
        column_values: [B, N, H*s2] the sampled feature columns V P2, zero at padded tokens; None: no column branch.
        row_keys, row_values: [B, H, s1, Dh] P1 K (temperature folded in) and P1 V, zero for padded samples;
            None: no row branch.
        column_weights: [B, H, Dh, s2] softmax(P2^T K^T Q / sqrt(n)) transposed, after dropout.
        norms: (weight / 2, bias / 2) of the two LayerNorms over H*Dh.
        row_valid: bool [B, s1], the sample is a real token; row_keep: bool [B, N, H, s1] row dropout or None,
            kept weights scaled by ``keep_scale``.
        mask_padded_samples: leave invalid samples out of the row softmax (else they keep weight exp(0)).
    Returns [B, N, H*Dh] in the queries' dtype.
    """
    if query.dtype in KERNEL_DTYPES and triton_runs_on(query) and not float32_takes_pytorch_path(query):
        from longattn.attention import _skeleton_triton

        return _skeleton_triton.skeleton_core(query, column_values, row_keys, row_values, column_weights, norms,
                                              row_valid, row_keep, keep_scale, eps, mask_padded_samples)
    return gpu_core_torch(query, column_values, row_keys, row_values, column_weights, norms, row_valid, row_keep,
                          keep_scale, eps, mask_padded_samples)


def gpu_core_torch(query: Tensor, column_values: Tensor | None, row_keys: Tensor | None, row_values: Tensor | None,
                   column_weights: Tensor | None, norms: tuple[tuple[Tensor, Tensor], tuple[Tensor, Tensor]],
                   row_valid: Tensor | None, row_keep: Tensor | None, keep_scale: float, eps: float,
                   mask_padded_samples: bool) -> Tensor:
    """``skeleton_core`` in batched PyTorch (autograd differentiates it): every head's small product at once
    as one batched GEMM with block-diagonal sampled blocks (see _block_diagonal)."""
    batch, length, dim = query.shape
    dtype, stats_dtype = query.dtype, compute_dtype(query.dtype)
    out = None
    if row_keys is not None:
        heads, s1 = row_keys.shape[1:3]
        scores = (query @ _block_diagonal(row_keys).transpose(1, 2)).to(stats_dtype).view(batch, length, heads, s1)
        valid = row_valid[:, None, None, :]
        if mask_padded_samples:  # a finite fill keeps all-padded rows NaN-free (uniform, then zeroed)
            scores = scores.masked_fill(~valid, torch.finfo(stats_dtype).min)
        weights = torch.softmax(scores, dim=-1)
        if mask_padded_samples:
            weights = weights * valid.to(stats_dtype)
        if row_keep is not None:
            weights = weights * (row_keep.to(stats_dtype) * keep_scale)
        mixed = weights.view(batch, length, heads * s1).to(dtype) @ _block_diagonal(row_values)  # V_1: [B, N, H*Dh]
        out = F.layer_norm(mixed.to(stats_dtype), (dim,), *(t.to(stats_dtype) for t in norms[0]), eps)
    if column_weights is not None:
        mixed = column_values @ _block_diagonal(column_weights.transpose(-1, -2).to(dtype))  # V_2: [B, N, H*Dh]
        column_half = F.layer_norm(mixed.to(stats_dtype), (dim,), *(t.to(stats_dtype) for t in norms[1]), eps)
        out = column_half if out is None else out + column_half
    return out.to(dtype)


@padding_safe
def skeleton_attention_reference(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attention_mask: Tensor | None = None,
    *,
    row_indices: Tensor,
    column_indices: Tensor,
    row_scale: float | None = None,
    column_scale: float | Tensor | None = None,
    mask_padded_samples: bool = True,
    row_attention: bool = True,
    column_attention: bool = True,
    row_norm: tuple[Tensor | None, Tensor | None] | None = None,
    column_norm: tuple[Tensor | None, Tensor | None] | None = None,
    norm_eps: float = 1e-5,
) -> Tensor:
    """The paper's formulas with explicit sampling matrices P1 [s1, N] and P2 [Dh, s2]. Tests only."""
    batch, heads, length, head_dim = query.shape
    dtype = query.dtype
    mask = torch.ones(batch, length, dtype=torch.bool, device=query.device) if attention_mask is None else attention_mask
    key = key * mask[:, None, :, None].to(dtype)
    value = value * mask[:, None, :, None].to(dtype)

    def layer_norm(x: Tensor, norm) -> Tensor:
        merged = x.transpose(1, 2).reshape(batch, length, heads * head_dim)
        mean = merged.mean(-1, keepdim=True)
        var = merged.var(-1, unbiased=False, keepdim=True)
        normed = (merged - mean) / torch.sqrt(var + norm_eps)
        if norm is not None:
            normed = normed * norm[0] + norm[1]
        return normed.reshape(batch, length, heads, head_dim).transpose(1, 2)

    out = torch.zeros_like(query)
    if row_attention:
        p1 = torch.zeros(len(row_indices), length, dtype=dtype, device=query.device)
        for a, i in enumerate(row_indices.tolist()):
            if i < length:
                p1[a, i] = 1.0
        sampled_real = (p1 @ mask.to(dtype).T).T > 0  # [B, s1]: sample exists and is a real token
        k1, v1 = p1 @ key, p1 @ value  # zero rows for padded or beyond-N samples
        scale = 1.0 / math.sqrt(head_dim) if row_scale is None else row_scale
        scores = query @ k1.transpose(-1, -2) * scale
        if mask_padded_samples:
            counted = sampled_real[:, None, None, :].to(dtype)
        else:
            counted = torch.ones_like(scores)  # padded samples stay in: score 0, value 0
        exp_scores = torch.exp(scores - scores.amax(-1, keepdim=True)) * counted
        weights = exp_scores / exp_scores.sum(-1, keepdim=True).clamp_min(torch.finfo(dtype).tiny)
        out = out + layer_norm(weights @ v1, row_norm) / 2
    if column_attention:
        p2 = torch.zeros(head_dim, len(column_indices), dtype=dtype, device=query.device)
        p2[column_indices, torch.arange(len(column_indices), device=query.device)] = 1.0
        if column_scale is None:
            scale = 1.0 / math.sqrt(length)
        elif isinstance(column_scale, Tensor):
            scale = column_scale.to(dtype).view(-1, 1, 1, 1)
        else:
            scale = column_scale
        scores = p2.T @ key.transpose(-1, -2) @ query * scale  # P2^T K^T Q: [B, H, s2, Dh]
        weights = torch.softmax(scores, dim=-2)  # normalise each column over the s2 samples
        out = out + layer_norm(value @ p2 @ weights, column_norm) / 2
    return out


@register_attention(
    "skeleton",
    capabilities=Capabilities(needs_max_len=True, sequence_parallel=True),
    functional=skeleton_attention,
    reference=skeleton_attention_reference,
    paper="SKTformer: A Skeleton Transformer for Long Sequence Data (ICLR 2023 submission); "
    "S^3 Attention: Improving Long Sequence Attention with Smoothed Skeleton Sketching",
)
class SkeletonAttention(AttentionBase):
    """SKTformer sublayer: Smoother, then skeleton (row + column) attention with sampled indices.

    Options (paper defaults; docs/skeleton.md has the full table):
        s1: sampled token positions for row attention (8; clipped to max_len).
        s2: sampled feature coordinates per head for column attention (8; clipped to head dim).
        row_scale: row temperature, default 1/sqrt(head_dim).
        column_scale: "max_len" (1/sqrt(max_len), authors), "valid" (1/sqrt(#real tokens)
            per sequence) or a positive float.
        dropout: on both branches' attention weights (Algorithm 1 default 0.1).
        resample_each_step: redraw (and store) the indices at every training forward pass.
        mask_padded_samples: exclude sampled padded tokens from the row softmax (default) or,
            as in the authors' code, only zero their keys and values.
        row_attention, column_attention, fourier_conv, conv_stem: Table 6 ablation switches.
        smoother: put the Smoother in front (default); ``smoother_*`` are its options.
        bias: bias of the Q/K/V/output projections.
        precision: "full" (default) or "bf16": opt-in reduced precision for float32 inputs, the
            Smoother's stem GEMMs with bfloat16 factors and float32 accumulation (the stem keeps
            X^smooth, its conv output and the gradient of X^smooth in bfloat16), and in the module
            path the Q/K/V projections too; FFT, normalisations, softmaxes, the tiled core (its
            products are skinny: the query projection folded into the sampled keys, the
            LayerNorms into the output projection) and outputs stay float32 (error against
            float32 in docs/performance.md).
    """

    def __init__(
        self,
        dim: int,
        heads: int,
        max_len: int | None = None,
        causal: bool = False,
        s1: int = 8,
        s2: int = 8,
        row_scale: float | None = None,
        column_scale: float | str = "max_len",
        dropout: float = 0.1,
        resample_each_step: bool = False,
        mask_padded_samples: bool = True,
        row_attention: bool = True,
        column_attention: bool = True,
        smoother: bool = True,
        fourier_conv: bool = True,
        conv_stem: bool = True,
        smoother_segments: int = 8,
        smoother_kernel_size: int = 3,
        smoother_activation: str = "relu",
        smoother_segment_average: bool = True,
        smoother_dropout: float = 0.5,
        smoother_fft_norm: str = "backward",
        smoother_batchnorm_over: str = "positions",
        bias: bool = True,
        precision: str = "full",
    ) -> None:
        super().__init__(dim, heads, max_len, causal)
        if max_len is None:
            raise AttentionError("skeleton attention needs a fixed max_len (indices and Smoother size)")
        for label, value in (("s1", s1), ("s2", s2)):
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise AttentionError(f"{label} must be a positive int, got {value!r}")
        if not (row_attention or column_attention):
            raise AttentionError("skeleton attention needs row_attention or column_attention")
        if isinstance(column_scale, str):
            if column_scale not in _COLUMN_SCALES:
                raise AttentionError(f"column_scale must be one of {_COLUMN_SCALES} or a positive float, got {column_scale!r}")
        elif not isinstance(column_scale, (int, float)) or column_scale <= 0:
            raise AttentionError(f"column_scale must be one of {_COLUMN_SCALES} or a positive float, got {column_scale!r}")
        if row_scale is not None and (not isinstance(row_scale, (int, float)) or row_scale <= 0):
            raise AttentionError(f"row_scale must be a positive float or None, got {row_scale!r}")
        if not 0.0 <= dropout < 1.0:
            raise AttentionError(f"dropout must be in [0, 1), got {dropout!r}")
        self.s1 = s1
        self.s2 = s2
        self.row_scale = row_scale
        self.column_scale = column_scale
        self.dropout = dropout
        self.resample_each_step = resample_each_step
        self.mask_padded_samples = mask_padded_samples
        self.row_attention = row_attention
        self.column_attention = column_attention
        if precision not in PRECISIONS:
            raise AttentionError(f"precision must be one of {PRECISIONS}, got {precision!r}")
        self.precision = precision
        # the tiled core (_fused_core) for float32/float64; tests switch it off to compare
        self.fused = True
        # with both smoother parts ablated the Smoother is the identity: leave it out
        self.smoother = (
            Smoother(
                dim,
                max_len,
                segments=smoother_segments,
                kernel_size=smoother_kernel_size,
                activation=smoother_activation,
                segment_average=smoother_segment_average,
                fourier=fourier_conv,
                conv_stem=conv_stem,
                dropout=smoother_dropout,
                fft_norm=smoother_fft_norm,
                batchnorm_over=smoother_batchnorm_over,
                precision=precision,
            )
            if smoother and (fourier_conv or conv_stem)
            else None
        )
        self.proj = QKVProjection(dim, heads, bias=bias)
        self.row_norm = nn.LayerNorm(dim) if row_attention else None
        self.column_norm = nn.LayerNorm(dim) if column_attention else None
        rows, columns = draw_skeleton_indices(max_len, self.head_dim, s1, s2)
        self.register_buffer("row_indices", rows)
        self.register_buffer("column_indices", columns)

    def forward(self, x: Tensor, attention_mask: Tensor | None = None, layer_state: dict | None = None) -> Tensor:
        if (isinstance(x, Tensor) and isinstance(attention_mask, Tensor) and attention_mask.dtype == torch.bool
                and attention_mask.shape == x.shape[:2] and attention_mask.device == x.device
                and not uses_gpu_path(x) and bool(attention_mask.all())):
            # every token real: the same numbers without the two whole-sequence masking copies
            attention_mask = None
        return super().forward(x, attention_mask, layer_state)

    def _uses_fused_core(self, x: Tensor) -> bool:
        """The tiled core runs for float32/float64 with the layer's own projections (a transformers
        model lends its own, see longattn.hf)."""
        return self.fused and x.dtype in (torch.float32, torch.float64) and isinstance(self.proj, QKVProjection)

    def _smoother_observed(self) -> bool:
        """Whether a module hook (the Smoother's own or a global one) could see or replace the Smoother's
        output or its gradient. Without one, that output feeds only this layer's fused core, so the
        gradient autograd passes back for it is private to the layer (see Smoother.forward)."""
        smoother = self.smoother
        own = (smoother._forward_hooks, smoother._forward_pre_hooks, smoother._backward_hooks,
               smoother._backward_pre_hooks)
        # torch's own test for global module hooks; if a torch version lacks it, assume there are some
        any_global = getattr(torch.nn.modules.module, "_has_any_global_hook", lambda: True)
        return any(map(bool, own)) or bool(any_global())

    def resample(self) -> None:
        """Redraw the stored sample indices (global RNG)."""
        rows, columns = draw_skeleton_indices(self.max_len, self.head_dim, self.s1, self.s2, self.row_indices.device)
        self.row_indices.copy_(rows)
        self.column_indices.copy_(columns)

    def attend(self, x: Tensor, attention_mask: Tensor | None, layer_state: dict | None) -> Tensor:
        if self.training and self.resample_each_step:
            self.resample()
        if uses_gpu_path(x):
            return self._gpu_attend(x, attention_mask)
        if attention_mask is not None and bool(attention_mask.all()):
            attention_mask = None  # every token real: the same numbers without any mask pass
        fused_core = self._uses_fused_core(x)
        if self.smoother is not None:
            x = self.smoother(x, attention_mask, output_grad_private=fused_core and not self._smoother_observed())
        if fused_core:
            return self._fused_core(x, attention_mask)
        proj, length = self.proj, x.shape[1]
        gemm_dtype = torch.bfloat16 if self.precision == "bf16" and x.dtype == torch.float32 else None
        # The branches read K and V only at the s1 sampled tokens and at the s2 sampled feature
        # columns of each head, so only those entries are projected (the same numbers as
        # projecting everything and then sampling, at a fraction of the cost).
        rows = self.row_indices.clamp(max=length - 1) if self.row_attention else None
        features = None
        if self.column_attention:
            head_offsets = torch.arange(self.heads, device=x.device)[:, None] * self.head_dim
            features = (head_offsets + self.column_indices).flatten()  # h*Dh + the P2 columns
        query, column_keys, column_values, sampled_tokens = _SampledProjections.apply(
            x, proj.to_q.weight, proj.to_q.bias, proj.to_k.weight, proj.to_k.bias, proj.to_v.weight,
            proj.to_v.bias, features, rows, gemm_dtype,
        )  # [B, N, H*Dh], [B, N, H*s2] twice, [B, s1, dim]
        row_keys = row_values = None
        if self.row_attention:
            row_keys = split_heads(proj.to_k(sampled_tokens), self.heads)  # [B, H, s1, Dh]
            row_values = split_heads(proj.to_v(sampled_tokens), self.heads)
        out = self.combine_samples(x, query, row_keys, row_values, column_keys, column_values, attention_mask)
        return _linear(proj.to_out, out, gemm_dtype)

    def combine_samples(self, x: Tensor, query: Tensor, row_keys: Tensor | None, row_values: Tensor | None,
                        column_keys: Tensor, column_values: Tensor, attention_mask: Tensor | None,
                        sum_over_tokens: Callable[[Tensor], Tensor] | None = None, **extra: Any) -> Tensor:
        """The two branches on the sampled keys/values with this layer's settings. ``sum_over_tokens``
        completes sums over the sequence (identity here; an all-reduce over the shards of a
        sequence-parallel layer, which also passes its ``extra`` arguments)."""
        column_scale = self._column_temperature(x, attention_mask, sum_over_tokens)
        if sum_over_tokens is not None:
            extra["sum_over_tokens"] = sum_over_tokens
        return _skeleton_from_samples(
            query, self.heads,
            row_keys=row_keys,
            row_values=row_values,
            column_keys=column_keys,
            column_values=column_values,
            attention_mask=attention_mask,
            row_indices=self.row_indices,
            row_scale=self.row_scale,
            column_scale=column_scale,
            dropout_p=self.dropout if self.training else 0.0,
            mask_padded_samples=self.mask_padded_samples,
            row_norm=None if self.row_norm is None else (self.row_norm.weight, self.row_norm.bias),
            column_norm=None if self.column_norm is None else (self.column_norm.weight, self.column_norm.bias),
            **extra,
        )

    def _column_temperature(self, x: Tensor, attention_mask: Tensor | None,
                            sum_over_tokens: Callable[[Tensor], Tensor] | None = None) -> float | Tensor:
        if self.column_scale == "max_len":
            return 1.0 / math.sqrt(self.max_len)
        if self.column_scale == "valid":
            real = x.new_full((x.shape[0],), x.shape[1]) if attention_mask is None else attention_mask.sum(-1)
            real = real.to(x.dtype)
            return (real if sum_over_tokens is None else sum_over_tokens(real)).clamp_min(1).rsqrt()
        return float(self.column_scale)

    def _fused_core(self, x: Tensor, attention_mask: Tensor | None) -> Tensor:
        """Projections, both branches and the output projection with only x, the output and their
        gradients at full length: the whole-sequence parts (the column scores, from the Gram matrix
        of x, and the sampled rows) in _GramAndRows, everything else tile by tile in _SkeletonCore.
        The same numbers, and the same dropout draws, as the module path below it in ``attend``."""
        proj, heads, (batch, length, _) = self.proj, self.heads, x.shape
        dropout = self.dropout if self.training else 0.0
        rows = self.row_indices.clamp(max=length - 1) if self.row_attention else None
        shared = _InputGradient()
        gram, total, sampled = _GramAndRows.apply(x, attention_mask, rows, shared)
        row_keys = row_values = row_valid = row_keep = None
        fill_invalid = False
        if self.row_attention:
            row_valid = _row_sample_validity(self.row_indices, attention_mask, batch, length)
            fill_invalid = self.mask_padded_samples and not bool(row_valid.all())
            sample_valid = row_valid[:, None, :, None].to(x.dtype)
            scale = 1.0 / math.sqrt(self.head_dim) if self.row_scale is None else self.row_scale
            row_keys = split_heads(proj.to_k(sampled), heads) * sample_valid * scale  # P1 K / sqrt(Dh): [B, H, s1, Dh]
            row_values = split_heads(proj.to_v(sampled), heads) * sample_valid
            if dropout > 0:  # drawn before the column dropout, as in _skeleton_from_samples
                row_keep = draw_keep((batch, length, heads, row_keys.shape[2]), dropout, x.device)
        column_weights = weight_v = bias_v = None
        if self.column_attention:
            head_offsets = torch.arange(heads, device=x.device)[:, None] * self.head_dim
            features = (head_offsets + self.column_indices).flatten()  # h*Dh + the P2 columns
            weight_q, bias_q = proj.to_q.weight, proj.to_q.bias
            weight_k, bias_k = proj.to_k.weight[features], None if proj.to_k.bias is None else proj.to_k.bias[features]
            weight_v, bias_v = proj.to_v.weight[features], None if proj.to_v.bias is None else proj.to_v.bias[features]
            # sum over real tokens of Q^T K P2 (see _GramAndRows), [B, H*Dh, H*s2]
            pairs = weight_q @ gram @ weight_k.t()
            if bias_q is not None:
                count = x.new_full((batch,), length) if attention_mask is None else attention_mask.sum(-1).to(x.dtype)
                pairs = (pairs + (total @ weight_q.t())[:, :, None] * bias_k + bias_q[:, None] * (total @ weight_k.t())[:, None, :]
                         + count[:, None, None] * torch.outer(bias_q, bias_k))
            scores = _head_blocks(pairs, heads) * _column_scale_tensor(
                self._column_temperature(x, attention_mask), length, x)  # [B, H, Dh, s2]
            column_weights = torch.softmax(scores, dim=-1)  # over the s2 samples
            column_weights = F.dropout(column_weights, dropout) if dropout > 0 else column_weights
        norms = [(None, None) if n is None else (n.weight * 0.5, n.bias * 0.5)  # the 1/2 of eq. (2)
                 for n in (self.row_norm, self.column_norm)]
        config = (heads, fill_invalid, 1.0 / (1.0 - dropout) if dropout > 0 else 1.0, 1e-5)
        return _SkeletonCore.apply(
            x, proj.to_q.weight if self.row_attention else None, proj.to_q.bias if self.row_attention else None,
            weight_v, bias_v, column_weights, row_keys, row_values, *norms[0], *norms[1], proj.to_out.weight,
            proj.to_out.bias, attention_mask, row_valid, row_keep, config, shared,
        )

    def _gpu_attend(self, x: Tensor, attention_mask: Tensor | None) -> Tensor:
        """The GPU path: Smoother, the projections the branches read, both branches and the output projection
        as a fixed sequence of batched operations (none of them repeated per batch element, head, tile or
        block) with no host synchronisation; GEMMs in the autocast dtype (bfloat16 with ``precision="bf16"``
        for float32 inputs), FFT, statistics, softmaxes and LayerNorms in float32; output in output_dtype(x)."""
        out_dtype = output_dtype(x)
        reduced = self.precision == "bf16" and out_dtype == torch.float32 and x.device.type in ("cpu", "cuda")
        with torch.autocast(x.device.type, dtype=torch.bfloat16) if reduced else contextlib.nullcontext():
            smoothed = x if self.smoother is None else self.smoother(x, attention_mask)
            out = self._gpu_core(smoothed, attention_mask)
        return out.to(out_dtype)

    def _gpu_core(self, s: Tensor, attention_mask: Tensor | None) -> Tensor:
        """Q, the sampled K/V feature columns (one GEMM over the tokens) and the sampled rows' K/V (one small
        GEMM), the two branches, the output projection."""
        proj, heads, (batch, length, dim) = self.proj, self.heads, s.shape
        parts = [(proj.to_q, None)]
        if self.column_attention:
            head_offsets = torch.arange(heads, device=s.device)[:, None] * self.head_dim
            features = (head_offsets + self.column_indices).flatten()  # h*Dh + the P2 columns
            parts += [(proj.to_k, features), (proj.to_v, features)]
        rows = self.row_indices.clamp(max=length - 1) if self.row_attention else None
        projected, sampled = _ProjectAndSample.apply(s, *_stacked_linear(parts), rows, output_dtype(s))
        width = (projected.shape[-1] - dim) // 2
        query, column_keys, column_values = (projected.split([dim, width, width], -1) if width
                                             else (projected, None, None))
        row_keys = row_values = None
        if self.row_attention:
            sampled_keys_values = F.linear(sampled, *_stacked_linear([(proj.to_k, None), (proj.to_v, None)]))
            row_keys, row_values = (split_heads(t, heads) for t in sampled_keys_values.split(dim, -1))
        out = self.combine_samples(s, query, row_keys, row_values, column_keys, column_values, attention_mask)
        return proj.to_out(out)

    def extra_repr(self) -> str:
        return (
            f"{super().extra_repr()}, s1={self.row_indices.numel()}, s2={self.column_indices.numel()}, "
            f"column_scale={self.column_scale!r}, resample_each_step={self.resample_each_step}"
        )
