"""Skeinformer (Chen et al., NAACL 2022): sketching-based self-attention, Algorithm 1.

The computation is split so that the random part and the deterministic part can be used apart:

* :func:`skein_sample` draws the indices (pilot rows with replacement, Alg. 1 line 1; columns
  without replacement with the probabilities of eq. 5, lines 3-5). No gradient flows through it.
* :func:`skein_attention_from_sample` is the deterministic attention given those indices
  (column sampling, adaptive row normalisation of eq. 6 and pilot sampling reutilisation,
  lines 6-12).
* :func:`skein_attention` does both (it computes the pilot attention once and uses it for the
  probabilities and for the reused rows).

On the GPU path (:func:`~longattn.attention.base.uses_gpu_path`) the same algorithm runs as a few
batched programs (:func:`_draw_sample_gpu`, :func:`_skein_core_gpu`): no loop over blocks of rows,
no read-back of ``d`` (the index tensors have D = min(samples, N - 1) slots, the slots >= d of a
sequence unused), GEMMs in the autocast dtype, softmax statistics in float32, the pilot output
B_J V and eq. (6) by fused scaled-dot-product attention, and the pilot column statistics of eq. (5)
by the Triton kernels of ``_skein_triton`` where they run.

Shapes: ``query``/``key``/``value`` are [B, H, N, Dh]; ``attention_mask`` is bool [B, N] with
True = real token, padding anywhere. ``m`` is the number of real tokens of a sequence and the
sample size of that sequence is ``d = min(samples, m - 1)`` (authors' code; ``d = m`` when
``m <= 1``). Sequences of one batch may have different ``d``: every index tensor has
``D = max d`` slots and the slots ``>= d`` of a sequence are unused.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.utils.checkpoint import checkpoint

from longattn.attention._triton import float32_takes_pytorch_path, kernels_run_on, pytorch_path_where_kernels_do_not_fit
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
from longattn.attention.ops.linear_scan import normalised

ColumnSampling = Literal["importance", "uniform"]
RowNormalization = Literal["adaptive", "simple", "none"]
COLUMN_SAMPLINGS = ("importance", "uniform")
ROW_NORMALIZATIONS = ("adaptive", "simple", "none")

# Keys per chunk when the exact row sums are needed (row_normalization="none"): bounds the
# largest intermediate to N x chunk.
_EXACT_ROW_SUM_CHUNK = 256


@dataclass
class SkeinSample:
    """The random draws of one Skeinformer forward pass.

    Attributes:
        pilot_indices: long [B, H, D], the pilot rows J (uniform over real tokens, with replacement).
        column_indices: long [B, H, D], the sampled columns J' (distinct real tokens).
        sample_counts: long [B], d of each sequence; slots ``>= sample_counts[b]`` are unused.
        column_probabilities: [B, H, D], the probability p_hat (eq. 5, or uniform) of each sampled
            column; only needed by ``row_normalization="none"`` (sketch weights 1/(d p_hat)).
    """

    pilot_indices: Tensor
    column_indices: Tensor
    sample_counts: Tensor
    column_probabilities: Tensor | None = None

    def slot_mask(self) -> Tensor:
        """bool [B, 1, D]: which slots hold a draw (broadcasts over heads)."""
        return _slot_mask(self.sample_counts, self.column_indices.shape[-1])


def _slot_mask(counts: Tensor, slots: int) -> Tensor:
    """bool [B, 1, D]: slot k of sequence b is used iff k < d_b."""
    return (torch.arange(slots, device=counts.device) < counts[:, None])[:, None, :]


# ----------------------------------------------------------------------------- helpers


def _real_token_mask(attention_mask: Tensor | None, batch: int, length: int, device: torch.device) -> Tensor:
    if attention_mask is None:
        return torch.ones(batch, length, dtype=torch.bool, device=device)
    return attention_mask


def sample_counts_for(real_tokens: Tensor, samples: int) -> Tensor:
    """d = min(samples, m - 1) per sequence (authors' code); d = m when m <= 1 (nothing else to draw)."""
    m = real_tokens.sum(-1)
    return torch.where(m >= 2, (m - 1).clamp(max=samples), m)


def _check_sampling_options(samples: int, column_sampling: str) -> None:
    if isinstance(samples, bool) or not isinstance(samples, int) or samples < 1:
        raise AttentionError(f"samples must be a positive int, got {samples!r}")
    if column_sampling not in COLUMN_SAMPLINGS:
        raise AttentionError(f"column_sampling must be one of {COLUMN_SAMPLINGS}, got {column_sampling!r}")


def _check_output_options(row_normalization: str, pilot_reuse: bool) -> None:
    if row_normalization not in ROW_NORMALIZATIONS:
        raise AttentionError(
            f"row_normalization must be one of {ROW_NORMALIZATIONS}, got {row_normalization!r}"
        )
    if not isinstance(pilot_reuse, bool):
        raise AttentionError(f"pilot_reuse must be a bool, got {pilot_reuse!r}")


def _gather_rows(x: Tensor, indices: Tensor) -> Tensor:
    """x [B, H, N, P], indices [B, H, D] -> [B, H, D, P]."""
    return x.gather(2, indices[..., None].expand(-1, -1, -1, x.shape[-1]))


def _pilot_attention(query: Tensor, key: Tensor, real: Tensor, pilot_indices: Tensor, scale: float) -> Tensor:
    """B_J = softmax(Q_J K^T * scale) over real keys, [B, H, D, N] (Alg. 1 line 3)."""
    scores = (_gather_rows(query, pilot_indices) * scale) @ key.transpose(-1, -2)
    return (scores + _padding_bias(real, scores.dtype)[:, None, None, :]).softmax(dim=-1)


def _padding_bias(real: Tensor, dtype: torch.dtype) -> Tensor:
    """0 at real tokens, the most negative finite number at padding, [B, N].

    Finite rather than -inf so that a sequence without real tokens stays free of NaN (also in
    its gradients); exp of it is exactly 0 next to any real score.
    """
    return torch.zeros(real.shape, dtype=dtype, device=real.device).masked_fill(~real, torch.finfo(dtype).min)


def _pilot_pass(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    real: Tensor,
    pilot_indices: Tensor,
    slot_mask: Tensor,
    scale: float,
    square_sums: bool,
    output: bool,
) -> tuple[Tensor | None, Tensor | None]:
    """What Alg. 1 needs from B_J, computed in blocks of pilot slots so that no [B, H, D, N]
    tensor exists at once (small blocks stay cache-resident and below the allocator's mmap
    threshold, so the cost grows linearly in N):

    * ``square_sums``: sum_k b_{j_k i}^2 over the used slots, [B, H, N] (eq. 5), no gradient;
    * ``output``: B_J V, [B, H, D, P] (pilot reutilisation, line 12), with gradient.
    """
    if not (square_sums or output):
        return None, None
    rows = _query_block_rows(query.shape[0] * query.shape[1] * key.shape[2])
    squares, outputs = None, []
    for indices, used in zip(pilot_indices.split(rows, dim=2), slot_mask.split(rows, dim=2)):
        if output:
            weights = _pilot_attention(query, key, real, indices, scale)  # [B, H, rows, N]
            outputs.append(weights @ value)
            weights = weights.detach()
        else:
            with torch.no_grad():
                weights = _pilot_attention(query, key, real, indices, scale)
        if square_sums:
            with torch.no_grad():
                block = (weights.square() * used[..., None].to(weights.dtype)).sum(2)
                squares = block if squares is None else squares + block
    return squares, torch.cat(outputs, dim=2) if output else None


def _column_probabilities(
    pilot_square_sums: Tensor | None, value_norms: Tensor, real: Tensor, column_sampling: str
) -> Tensor:
    """p_hat over the N columns, [B, H, N], zero at padding, summing to one over real tokens;
    ``value_norms`` [B, H, N] = ||V_(i)||."""
    real_heads = real[:, None, :].expand(-1, value_norms.shape[1], -1)
    if column_sampling == "uniform":
        weights = real_heads.to(value_norms.dtype)
    else:
        # eq. (5): p_hat_i ∝ (sum_k b_{j_k i}^2)^(1/2) ||V_(i)||, summed over the used pilot slots.
        weights = pilot_square_sums.sqrt() * value_norms
        weights = weights.masked_fill(~real_heads, 0.0)
        # All-zero weights (e.g. V = 0 on every real token) carry no information: fall back to uniform.
        weights = torch.where(weights.sum(-1, keepdim=True) > 0, weights, real_heads.to(weights.dtype))
    total = weights.sum(-1, keepdim=True)
    return weights / torch.where(total > 0, total, torch.ones_like(total))


def _draw_pilot(real: Tensor, heads: int, slots: int, generator: torch.Generator | None) -> Tensor:
    """Uniform draws with replacement among each sequence's real tokens, [B, H, D] (Alg. 1 line 1)."""
    batch, length = real.shape
    m = real.sum(-1)
    # Positions of the real tokens first, in order: works for padding anywhere.
    real_positions = torch.argsort((~real).to(torch.int8), dim=-1, stable=True)
    uniform = torch.rand(batch, heads, slots, generator=generator, device=real.device, dtype=torch.float64)
    # min(): u * m can round up to m; a sequence without real tokens has only unused slots.
    rank = torch.minimum((uniform * m[:, None, None]).long(), (m - 1).clamp(min=0)[:, None, None])
    return real_positions.gather(1, rank.reshape(batch, heads * slots)).reshape(batch, heads, slots)


def _draw_columns(
    probabilities: Tensor, real: Tensor, slots: int, generator: torch.Generator | None
) -> Tensor:
    """Columns without replacement with the given probabilities, [B, H, D] (Alg. 1 line 5).

    Gumbel-top-k: the order of log p + Gumbel noise is distributed exactly as successive draws
    without replacement (what torch.multinomial does), but it is vectorised over sequences with
    different d and never fails when fewer than D columns have positive probability.
    """
    batch, heads, length = probabilities.shape
    uniform = torch.rand(batch, heads, length, generator=generator, device=real.device, dtype=torch.float64)
    tiny = torch.finfo(torch.float64).tiny
    gumbel = -torch.log(-torch.log(uniform.clamp(min=tiny)))
    # Real columns with p_hat = 0 get the smallest positive probability: drawn only when the
    # positive ones are exhausted. Padding can never be drawn in a used slot (d <= m).
    log_p = probabilities.to(torch.float64).clamp(min=tiny).log()
    keys = (log_p + gumbel).masked_fill(~real[:, None, :], float("-inf"))
    return keys.topk(slots, dim=-1, sorted=True).indices


def _exact_log_row_sums(scaled_query: Tensor, key: Tensor, real: Tensor) -> Tensor:
    """log sum_j exp(q_i k_j * scale) over real keys, [B, H, N], in key chunks (no N x N tensor).

    Each chunk is checkpointed so that backward recomputes its scores instead of storing them.
    """
    bias = _padding_bias(real, key.dtype)

    def chunk_log_sum(q: Tensor, k: Tensor, chunk_bias: Tensor) -> Tensor:
        return (q @ k.transpose(-1, -2) + chunk_bias[:, None, None, :]).logsumexp(-1)

    log_sums = None
    for start in range(0, key.shape[2], _EXACT_ROW_SUM_CHUNK):
        stop = start + _EXACT_ROW_SUM_CHUNK
        part = checkpoint(chunk_log_sum, scaled_query, key[:, :, start:stop], bias[:, start:stop], use_reentrant=False)
        log_sums = part if log_sums is None else torch.logaddexp(log_sums, part)
    return log_sums


# ----------------------------------------------------------------------------- deterministic core

# Elements of one [B, H, rows, D] intermediate of the core (8 MB in float32).
_CORE_BLOCK_ELEMENTS = 1 << 21


def _query_block_rows(row_elements: int) -> int:
    """Query rows per block so that a [B, H, rows, D] tensor has about _CORE_BLOCK_ELEMENTS."""
    return max(1, _CORE_BLOCK_ELEMENTS // max(1, row_elements))


def _skein_core(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    real: Tensor,
    sample: SkeinSample,
    row_normalization: str,
    pilot_reuse: bool,
    scale: float,
    pilot_out: Tensor | None,
) -> Tensor:
    """Alg. 1 lines 6-12 on compute-dtype tensors whose padded rows are already zero.

    ``pilot_out``: B_J V [B, H, D, P] when the sampling step already computed it (pilot
    reutilisation); None computes it here if ``pilot_reuse``.
    """
    slot_mask = sample.slot_mask()  # [B, 1, D]
    counts = sample.sample_counts.to(query.dtype)[:, None, None, None]  # d, [B, 1, 1, 1]
    m = real.sum(-1).to(query.dtype)[:, None, None, None]
    key_cols = _gather_rows(key, sample.column_indices)
    value_cols = _gather_rows(value, sample.column_indices)
    # Unused slots are removed by adding -inf (exp gives 0, and its gradient stays 0, not NaN).
    unused = torch.zeros(slot_mask.shape, dtype=query.dtype, device=query.device)
    unused = unused.masked_fill(~slot_mask, float("-inf"))[:, :, None, :]  # [B, 1, 1, D]

    # Row-independent pieces, computed once for all query blocks.
    if row_normalization == "none":
        sketch_weights = counts[..., 0] * sample.column_probabilities.to(query.dtype)  # d p_hat, [B, H, D]
        log_weights = -torch.where(slot_mask, sketch_weights, 1.0).log()[:, :, None, :] + unused
    elif row_normalization == "adaptive":
        # mean_k s_ik = q_i . mean_k k_j'k (no [N, D] pass needed for the geometric mean)
        used_keys = (key_cols * slot_mask[..., None].to(key_cols.dtype)).sum(2, keepdim=True)
        mean_key = used_keys / counts.clamp(min=1)  # [B, H, 1, Dh]
        # Line 10: v = V^T 1 over the real, un-selected tokens.
        selected = torch.zeros(real.shape[0], query.shape[1], real.shape[1], dtype=torch.int32, device=real.device)
        selected = selected.scatter_add(2, sample.column_indices, slot_mask.expand_as(sample.column_indices).to(torch.int32))
        unselected = (real[:, None, :] & (selected == 0)).to(value.dtype)
        unselected_sum = (value * unselected[..., None]).sum(2, keepdim=True)  # [B, H, 1, P]

    def rows_output(scaled_query: Tensor) -> Tensor:
        """Lines 7-11 for a block of query rows (every row is independent given the sample)."""
        scores = scaled_query @ key_cols.transpose(-1, -2)  # log A_J', [B, H, rows, D] (line 7)
        if row_normalization == "none":
            # Sketch D^-1 A S S^T V (Sec. 4.1) with the exact D and weights 1/(d p_hat) (Def. 3.1).
            log_d = _exact_log_row_sums(scaled_query, key, real)[..., None]
            return torch.exp(scores + log_weights - log_d) @ value_cols
        # A per-row constant c_i cancels between numerator and denominator of eq. (6); with
        # c_i = max_k s_ik every exponent below is <= 0, so nothing overflows in fp32/bf16.
        scores = scores + unused
        row_max = scores.amax(-1, keepdim=True).detach()
        row_max = torch.where(torch.isfinite(row_max), row_max, torch.zeros_like(row_max))
        shifted = torch.exp(scores - row_max)  # a_ij' / e^c
        numerator = shifted @ value_cols  # R_J' (line 7)
        denominator = shifted.sum(-1, keepdim=True)
        if row_normalization == "adaptive":
            # Line 8: g_i / e^c = exp(mean_k s_ik - c_i), the geometric mean of the selected a_ij'.
            mean_score = scaled_query @ mean_key.transpose(-1, -2)  # [B, H, rows, 1]
            geometric = torch.exp(torch.where(counts > 0, mean_score - row_max, float("-inf")))
            # Lines 9 and 11, eq. (6): d_hat = A_J' 1 + (m - d) g;  R = diag(d_hat^-1)(R_J' + g v^T).
            numerator = numerator + geometric * unselected_sum
            denominator = denominator + (m - counts) * geometric
        # denominator >= 1 unless the sequence has no real token (then the output is 0).
        return numerator / torch.where(denominator > 0, denominator, torch.ones_like(denominator))

    # Query blocks keep every [B, H, rows, D] intermediate small (forward and backward): cache
    # friendly, and below the allocator's mmap threshold, so large N pays no page-fault cost per
    # tensor and the time grows linearly. split/cat give one gradient copy, not one per block.
    scaled_query = query * scale  # scaling the [N, Dh] side is cheaper than the [N, D] scores
    rows = _query_block_rows(query.shape[0] * query.shape[1] * key_cols.shape[2])
    out = torch.cat([rows_output(block) for block in scaled_query.split(rows, dim=2)], dim=2)

    if pilot_reuse:
        if pilot_out is None:  # B_J V, [B, H, D, P]
            _, pilot_out = _pilot_pass(
                query, key, value, real, sample.pilot_indices, slot_mask.expand_as(sample.pilot_indices),
                scale, square_sums=False, output=True,
            )
        out = _reuse_pilot_rows(out, pilot_out, sample.pilot_indices, slot_mask)
    return out


def _reuse_pilot_rows(out: Tensor, pilot_out: Tensor, pilot_indices: Tensor, slot_mask: Tensor) -> Tensor:
    """Line 12: rows in J get their exact output B_J V ([B, H, D, P]). A pilot row drawn twice is written by
    one slot only, so its gradient is not counted twice."""
    slot_ids = torch.arange(slot_mask.shape[-1], device=out.device).expand_as(pilot_indices)
    slot_ids = torch.where(slot_mask, slot_ids, -1)
    slot_of_row = torch.full(out.shape[:3], -1, dtype=torch.long, device=out.device)
    slot_of_row = slot_of_row.scatter_reduce(2, pilot_indices, slot_ids, reduce="amax")
    reused = _gather_rows(pilot_out, slot_of_row.clamp(min=0))
    return torch.where((slot_of_row >= 0)[..., None], reused, out)


def _prepare(query: Tensor, key: Tensor, value: Tensor, attention_mask: Tensor | None) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Cast to the compute dtype and zero padded rows, so padded content cannot reach anything."""
    batch, _, length, _ = key.shape
    real = _real_token_mask(attention_mask, batch, length, key.device)
    dtype = compute_dtype(query.dtype)  # the authors run attention in fp32
    q, k, v = (t.to(dtype) for t in (query, key, value))
    if attention_mask is not None:
        padded = ~real[:, None, :, None]
        q, k, v = (t.masked_fill(padded, 0.0) for t in (q, k, v))
    return q, k, v, real


def _check_sample(sample: SkeinSample, real: Tensor, heads: int, row_normalization: str) -> None:
    if not isinstance(sample, SkeinSample):
        raise AttentionError(f"sample must be a SkeinSample, got {type(sample).__name__}")
    batch, length = real.shape
    pilot, columns, counts = sample.pilot_indices, sample.column_indices, sample.sample_counts
    for label, t in (("pilot_indices", pilot), ("column_indices", columns)):
        if t.dtype != torch.long or t.dim() != 3 or t.shape[:2] != (batch, heads):
            raise AttentionError(f"{label} must be long [B={batch}, H={heads}, D], got {t.dtype} {list(t.shape)}")
        if t.numel() and (t.min() < 0 or t.max() >= length):
            raise AttentionError(f"{label} must lie in [0, {length})")
    if pilot.shape != columns.shape:
        raise AttentionError(f"pilot_indices {list(pilot.shape)} and column_indices {list(columns.shape)} differ")
    if counts.dtype != torch.long or counts.shape != (batch,):
        raise AttentionError(f"sample_counts must be long [B={batch}], got {counts.dtype} {list(counts.shape)}")
    m = real.sum(-1)
    if (counts < 0).any() or (counts > columns.shape[-1]).any() or (counts > m).any():
        raise AttentionError("sample_counts must lie in [0, min(D, number of real tokens)] per sequence")
    used = sample.slot_mask().expand_as(columns)
    real_heads = real[:, None, :].expand(-1, heads, -1)
    for label, t in (("pilot_indices", pilot), ("column_indices", columns)):
        if not real_heads.gather(2, t)[used].all():
            raise AttentionError(f"{label} point at padded tokens; only real tokens may be drawn")
    # Columns are drawn without replacement: duplicates would count a column twice in eq. (6).
    slots = torch.arange(columns.shape[-1], device=columns.device)
    distinct_keys = torch.where(used, columns, length + slots).sort(-1).values
    if (distinct_keys[..., 1:] == distinct_keys[..., :-1]).any():
        raise AttentionError("column_indices must be distinct within each sequence and head")
    if row_normalization == "none":
        probs = sample.column_probabilities
        if probs is None or probs.shape != columns.shape or not (probs[used] > 0).all():
            raise AttentionError('row_normalization="none" needs positive column_probabilities [B, H, D]')


# ----------------------------------------------------------------------------- GPU path


def gpu_slots(length: int, samples: int) -> int:
    """Index slots D of the GPU path: the largest d = min(samples, m - 1) any sequence of ``length`` tokens can
    have (so that d is never read back from the device); at least 1."""
    return max(1, min(samples, length - 1))


def _gpu_inputs(query: Tensor, key: Tensor, value: Tensor, attention_mask: Tensor | None
                ) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Cast to the GEMM dtype (the autocast dtype) and zero padded rows (the module's projections give
    padded tokens their bias), so padded content cannot reach anything."""
    dtype = output_dtype(query)
    real = _real_token_mask(attention_mask, key.shape[0], key.shape[2], key.device)
    q, k, v = (t.to(dtype) for t in (query, key, value))
    if attention_mask is not None:
        padded = ~real[:, None, :, None]
        q, k, v = (t.masked_fill(padded, 0.0) for t in (q, k, v))
    return q, k, v, real


def _some_real(real: Tensor) -> Tensor:
    """``real`` with every token of a sequence without real tokens marked real, [B, N]: a softmax over such a
    sequence's (all-zero) keys is then finite instead of 0 / 0, and its rows are zeroed by the caller."""
    return real | ~real.any(-1, keepdim=True)


@pytorch_path_where_kernels_do_not_fit
def _pilot_square_sums_gpu(q: Tensor, k: Tensor, real: Tensor, pilot: Tensor, used: Tensor, scale: float) -> Tensor:
    """sum_k b_{j_k i}^2 of eq. (5), [B, H, N], no gradient: the Triton kernels where they run (B_J stays in
    registers), else B_J materialised ([B, H, D, N] in float32)."""
    if kernels_run_on(q) and not float32_takes_pytorch_path(q):
        from longattn.attention._skein_triton import pilot_square_sums

        return pilot_square_sums(q, k, real, pilot, used, scale)
    acc = compute_dtype(q.dtype)
    scores = (_gather_rows(q, pilot) @ k.transpose(-1, -2)).to(acc) * scale
    weights = (scores + _padding_bias(_some_real(real), acc)[:, None, None, :]).softmax(dim=-1)
    return (weights.square() * used[..., None].to(acc)).sum(2)


def _pilot_output_gpu(q: Tensor, k: Tensor, v: Tensor, real: Tensor, pilot: Tensor, scale: float,
                      padded: bool) -> Tensor:
    """B_J V (line 12, with gradient), [B, H, D, P]: fused attention of the pilot rows over the real keys. Without
    padding there is no mask, so that the flash kernel (which splits the keys of few queries) can run."""
    mask = _some_real(real)[:, None, None, :] if padded else None
    return F.scaled_dot_product_attention(_gather_rows(q, pilot), k, v, attn_mask=mask, scale=scale)


def _draw_sample_gpu(q: Tensor, k: Tensor, v: Tensor, real: Tensor, samples: int, column_sampling: str,
                     generator: torch.Generator | None, scale: float, keep_pilot_output: bool, padded: bool
                     ) -> tuple[SkeinSample, Tensor | None]:
    """:func:`_draw_sample` on the GPU path: the same draws (pilot rows with replacement, columns by
    Gumbel-top-k), with D = :func:`gpu_slots` slots fixed by the length (no read-back of d) and the pilot
    statistics by :func:`_pilot_square_sums_gpu`. ``padded``: whether ``real`` has padding."""
    counts = sample_counts_for(real, samples)
    slots = gpu_slots(real.shape[1], samples)
    pilot = _draw_pilot(real, q.shape[1], slots, generator)
    pilot_out = _pilot_output_gpu(q, k, v, real, pilot, scale, padded) if keep_pilot_output else None
    with torch.no_grad():
        square_sums = None
        if column_sampling == "importance":
            square_sums = _pilot_square_sums_gpu(q, k, real, pilot, _slot_mask(counts, slots), scale)
        value_norms = torch.linalg.vector_norm(v, dim=-1, dtype=compute_dtype(v.dtype))
        probabilities = _column_probabilities(square_sums, value_norms, real, column_sampling)
        columns = _draw_columns(probabilities, real, slots, generator)
    return SkeinSample(pilot, columns, counts, probabilities.gather(2, columns)), pilot_out


def _value_tile(width: int) -> int:
    """Value width rounded up to a multiple of 8 (the alignment fused attention kernels need)."""
    return -(-width // 8) * 8


def _with_weight_column(values: Tensor, weights: Tensor) -> Tensor:
    """[values, weights, 0...] on the last axis, padded to :func:`_value_tile`: fused attention then returns a
    weighted sum of the values and of the weights in one pass."""
    width = values.shape[-1] + 1
    return F.pad(torch.cat([values, weights[..., None].to(values.dtype)], dim=-1), (0, _value_tile(width) - width))


def _skein_core_gpu(q: Tensor, k: Tensor, v: Tensor, real: Tensor, sample: SkeinSample, row_normalization: str,
                    pilot_reuse: bool, scale: float, pilot_out: Tensor | None, dense: bool) -> Tensor:
    """Alg. 1 lines 6-12 as fused attention of every query over the D sampled columns (plus one or N extra
    keys), on GEMM-dtype inputs with zeroed padded rows; result in the GEMM dtype (the ratio below taken in
    float32).

    * ``"adaptive"`` (eq. 6): one extra key per (sequence, head), the mean of the used sampled keys, so that
      its score is mean_k s_ik = log g_i (line 8); its value is v = the sum of V over the real unselected
      tokens (line 10) and a weight column holds 1 for the sampled keys and m - d for the extra one. The
      attention then returns (R_J' + g v) / Z and (A_J' 1 + (m - d) g) / Z for the same normaliser Z, whose
      ratio is eq. (6) (Z cancels: the softmax's float32 max-shift is the stabiliser of the CPU path).
    * ``"simple"``: softmax over the used sampled columns.
    * ``"none"``: D^-1 A S S^T V with exact row sums D (Sec. 4.1), as attention over all N keys (value 0,
      weight 1) and the sampled columns (value v_k, weight 0, score bias -log(d p_k)): the ratio of the two
      returned parts is sum_k a_ik v_k / (d p_k) over sum_j a_ij. O(N^2) time as in the paper, O(N) memory.

    ``dense``: no padding and every slot used (a sample drawn for an unpadded batch), so no mask is needed.
    """
    acc = compute_dtype(q.dtype)
    used = sample.slot_mask()  # [B, 1, D]
    counts = sample.sample_counts
    has_real = real.any(-1)[:, None, None]  # a sequence without real tokens: every slot masked otherwise
    key_cols, value_cols = _gather_rows(k, sample.column_indices), _gather_rows(v, sample.column_indices)
    p = v.shape[-1]
    if row_normalization == "simple":
        mask = None if dense else (used | ~has_real)[:, :, None, :]
        out = F.scaled_dot_product_attention(q, key_cols, value_cols, attn_mask=mask, scale=scale)
    else:
        if row_normalization == "adaptive":
            used_cols = used[..., None].to(acc)
            mean_key = (key_cols.to(acc) * used_cols).sum(2, keepdim=True) / counts.clamp(min=1)[:, None, None, None]
            selected_sum = (value_cols.to(acc) * used_cols).sum(2, keepdim=True)
            unselected_sum = v.sum(2, keepdim=True, dtype=acc) - selected_sum  # [B, H, 1, P]
            rest = (real.sum(-1) - counts).to(acc)[:, None, None].expand(-1, q.shape[1], 1)  # m - d
            keys = torch.cat([key_cols, mean_key.to(q.dtype)], dim=2)
            values = torch.cat([_with_weight_column(value_cols, torch.ones_like(value_cols[..., 0])),
                                _with_weight_column(unselected_sum.to(q.dtype), rest)], dim=2)
            mask = torch.cat([used | ~has_real, torch.ones_like(used[..., :1])], dim=-1)[:, :, None, :]
            mask = None if dense else mask
        else:
            # padded keys and unused slots are masked; a sequence without real tokens keeps all keys (zeros)
            log_weights = torch.where(used, sample.column_probabilities.to(acc) * counts.to(acc)[:, None, None],
                                      1.0).log().neg()
            bias = torch.cat([_padding_bias(_some_real(real), acc)[:, None, :].expand(-1, q.shape[1], -1),
                              torch.where(used | ~has_real, log_weights, float("-inf"))], dim=-1)
            keys = torch.cat([k, key_cols], dim=2)
            values = torch.cat([_with_weight_column(torch.zeros_like(v), torch.ones_like(v[..., 0])),
                                _with_weight_column(value_cols, torch.zeros_like(value_cols[..., 0]))], dim=2)
            mask = bias.to(q.dtype)[:, :, None, :]
        parts = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, scale=scale)
        denominator = parts[..., p].to(acc)
        out = normalised(parts[..., :p], torch.where(denominator > 0, denominator, 1.0), q.dtype)
    if pilot_reuse:
        if pilot_out is None:
            pilot_out = _pilot_output_gpu(q, k, v, real, sample.pilot_indices, scale, not dense)
        out = _reuse_pilot_rows(out, pilot_out, sample.pilot_indices, used)
    return out


def _skein_gpu(query: Tensor, key: Tensor, value: Tensor, attention_mask: Tensor | None, samples: int,
               column_sampling: str, row_normalization: str, pilot_reuse: bool, generator: torch.Generator | None,
               scale: float) -> Tensor:
    q, k, v, real = _gpu_inputs(query, key, value, attention_mask)
    padded = attention_mask is not None
    sample, pilot_out = _draw_sample_gpu(q, k, v, real, samples, column_sampling, generator, scale, pilot_reuse,
                                         padded)
    return _skein_core_gpu(q, k, v, real, sample, row_normalization, pilot_reuse, scale, pilot_out, not padded)


# ----------------------------------------------------------------------------- public functions


@padding_safe
def skein_sample(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attention_mask: Tensor | None = None,
    *,
    samples: int = 256,
    column_sampling: ColumnSampling = "importance",
    generator: torch.Generator | None = None,
    scale: float | None = None,
) -> SkeinSample:
    """Draw the pilot rows and sampled columns of Alg. 1 (lines 1-5); no gradient.

    The draws depend on the mask and on real tokens only, never on padded content. With the same
    generator state, :func:`skein_attention` draws exactly these indices.
    """
    check_qkv(query, key, value, attention_mask)
    _check_sampling_options(samples, column_sampling)
    with torch.no_grad():
        scale = 1.0 / math.sqrt(query.shape[-1]) if scale is None else scale
        if uses_gpu_path(query):
            q, k, v, real = _gpu_inputs(query, key, value, attention_mask)
            return _draw_sample_gpu(q, k, v, real, samples, column_sampling, generator, scale, False,
                                    attention_mask is not None)[0]
        q, k, v, real = _prepare(query, key, value, attention_mask)
        return _draw_sample(q, k, v, real, samples, column_sampling, generator, scale, False)[0]


def _draw_sample(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    real: Tensor,
    samples: int,
    column_sampling: str,
    generator: torch.Generator | None,
    scale: float,
    keep_pilot_output: bool,
) -> tuple[SkeinSample, Tensor | None]:
    """Shared by skein_sample and skein_attention (same draws in the same order).

    ``keep_pilot_output``: also return B_J V with gradient (for pilot reutilisation); otherwise
    B_J is computed only if eq. 5 needs it, without gradient, and None is returned.
    """
    counts = sample_counts_for(real, samples)
    slots = max(int(counts.max()), 1)
    # the GPU path's draws, cut to the slots in use: both paths draw the same indices from one generator state
    pilot = _draw_pilot(real, q.shape[1], gpu_slots(real.shape[1], samples), generator)[..., :slots]
    square_sums, pilot_out = _pilot_pass(
        q, k, v, real, pilot, _slot_mask(counts, slots).expand_as(pilot), scale,
        square_sums=column_sampling == "importance", output=keep_pilot_output,
    )
    with torch.no_grad():
        probabilities = _column_probabilities(square_sums, v.detach().norm(dim=-1), real, column_sampling)
        columns = _draw_columns(probabilities, real, slots, generator)
    sample = SkeinSample(pilot, columns, counts, probabilities.gather(2, columns))
    return sample, pilot_out


@padding_safe
def skein_attention_from_sample(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attention_mask: Tensor | None = None,
    *,
    sample: SkeinSample,
    row_normalization: RowNormalization = "adaptive",
    pilot_reuse: bool = True,
    scale: float | None = None,
) -> Tensor:
    """Deterministic Skeinformer attention given the drawn indices (Alg. 1 lines 6-12).

    Computed in fp32 for half/bfloat16 inputs and cast back. Outputs at padded query positions
    are zeros (:func:`padding_safe`).
    """
    check_qkv(query, key, value, attention_mask)
    _check_output_options(row_normalization, pilot_reuse)
    scale = 1.0 / math.sqrt(query.shape[-1]) if scale is None else scale
    if uses_gpu_path(query):
        q, k, v, real = _gpu_inputs(query, key, value, attention_mask)
        _check_sample(sample, real, query.shape[1], row_normalization)
        return _skein_core_gpu(q, k, v, real, sample, row_normalization, pilot_reuse, scale, None, dense=False)
    q, k, v, real = _prepare(query, key, value, attention_mask)
    _check_sample(sample, real, query.shape[1], row_normalization)
    out = _skein_core(q, k, v, real, sample, row_normalization, pilot_reuse, scale, None)
    return out.to(query.dtype)


@padding_safe
def skein_attention(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attention_mask: Tensor | None = None,
    *,
    samples: int = 256,
    column_sampling: ColumnSampling = "importance",
    row_normalization: RowNormalization = "adaptive",
    pilot_reuse: bool = True,
    generator: torch.Generator | None = None,
    scale: float | None = None,
) -> Tensor:
    """Skeinformer attention (Alg. 1): draw the indices, then compute the output.

    Args:
        samples: the sub-sample size cap; d = min(samples, m - 1) per sequence.
        column_sampling: "importance" (eq. 5) or "uniform" (ablation "w/o column sampling").
        row_normalization: "adaptive" (eq. 6), "simple" (softmax over the sampled columns only,
            Informer-style) or "none" (the plain sketch D^-1 A S S^T V with exact row sums: O(N^2)
            time, O(N) memory).
        pilot_reuse: give the pilot rows their exact output B_J V (Sec. 4.3).
        generator: the torch.Generator for all draws (default: the global RNG).
    """
    check_qkv(query, key, value, attention_mask)
    _check_sampling_options(samples, column_sampling)
    _check_output_options(row_normalization, pilot_reuse)
    scale = 1.0 / math.sqrt(query.shape[-1]) if scale is None else scale
    if uses_gpu_path(query):
        return _skein_gpu(query, key, value, attention_mask, samples, column_sampling, row_normalization,
                          pilot_reuse, generator, scale)
    q, k, v, real = _prepare(query, key, value, attention_mask)
    sample, pilot_out = _draw_sample(q, k, v, real, samples, column_sampling, generator, scale, pilot_reuse)
    out = _skein_core(q, k, v, real, sample, row_normalization, pilot_reuse, scale, pilot_out)
    return out.to(query.dtype)


@padding_safe
def skein_attention_reference(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attention_mask: Tensor | None = None,
    *,
    sample: SkeinSample,
    row_normalization: RowNormalization = "adaptive",
    pilot_reuse: bool = True,
    scale: float | None = None,
) -> Tensor:
    """Plain dense version of :func:`skein_attention_from_sample`, literally eq. (6); tests only.

    Materialises A = exp(Q K^T * scale) (no stabilisation: use moderate scores, float64) and
    loops over sequences and heads.
    """
    batch, heads, length, _ = query.shape
    real = _real_token_mask(attention_mask, batch, length, query.device)
    scale = 1.0 / math.sqrt(query.shape[-1]) if scale is None else scale
    rows = []
    for b in range(batch):
        d = int(sample.sample_counts[b])
        m = int(real[b].sum())
        head_rows = []
        for h in range(heads):
            q, k, v = query[b, h], key[b, h], value[b, h]
            cols = sample.column_indices[b, h, :d]
            scores = q @ k.T * scale
            a_sel = torch.exp(scores[:, cols])  # A_J'
            if row_normalization == "adaptive":
                g = a_sel.prod(-1) ** (1.0 / d)  # geometric mean (line 8)
                unselected = real[b].clone()
                unselected[cols] = False
                v_rest = v[unselected].sum(0)  # line 10
                d_hat = a_sel.sum(-1) + (m - d) * g  # eq. (6)
                out = (a_sel @ v[cols] + g[:, None] * v_rest) / d_hat[:, None]
            elif row_normalization == "simple":
                out = a_sel @ v[cols] / a_sel.sum(-1, keepdim=True)
            else:
                row_sums = (torch.exp(scores) * real[b]).sum(-1)  # exact D
                weights = 1.0 / (d * sample.column_probabilities[b, h, :d])
                out = (a_sel * weights) @ v[cols] / row_sums[:, None]
            if pilot_reuse:
                exact = torch.softmax(scores.masked_fill(~real[b], float("-inf")), -1) @ v
                is_pilot = torch.zeros(length, dtype=torch.bool, device=query.device)
                is_pilot[sample.pilot_indices[b, h, :d]] = True
                out = torch.where(is_pilot[:, None], exact, out)
            head_rows.append(out)
        rows.append(torch.stack(head_rows))
    return torch.stack(rows)


# ----------------------------------------------------------------------------- module


@register_attention(
    "skein",
    capabilities=Capabilities(stochastic_eval=True, subquadratic=True),
    functional=skein_attention,
    reference=skein_attention_reference,
    paper="Skeinformer: Sketching as a Tool for Understanding and Accelerating Self-attention "
    "for Long Sequences (Chen et al., NAACL 2022)",
)
class SkeinAttention(AttentionBase):
    """Skeinformer: column importance sampling, adaptive row normalisation, pilot reutilisation.

    Samples are redrawn at every forward pass, also in eval mode (as in the authors' code), from
    the global torch RNG: seed it for reproducible outputs.
    """

    def __init__(
        self,
        dim: int,
        heads: int,
        max_len: int | None = None,
        causal: bool = False,
        samples: int = 256,
        column_sampling: ColumnSampling = "importance",
        row_normalization: RowNormalization = "adaptive",
        pilot_reuse: bool = True,
        bias: bool = True,
    ) -> None:
        super().__init__(dim, heads, max_len, causal)
        _check_sampling_options(samples, column_sampling)
        _check_output_options(row_normalization, pilot_reuse)
        self.proj = QKVProjection(dim, heads, bias=bias)
        self.samples = samples
        self.column_sampling = column_sampling
        self.row_normalization = row_normalization
        self.pilot_reuse = pilot_reuse

    def attend(self, x: Tensor, attention_mask: Tensor | None, layer_state: dict | None) -> Tensor:
        q, k, v = self.proj.qkv(x)
        out = skein_attention(
            q, k, v, attention_mask,
            samples=self.samples,
            column_sampling=self.column_sampling,
            row_normalization=self.row_normalization,
            pilot_reuse=self.pilot_reuse,
        )
        return self.proj.out(out)

    def extra_repr(self) -> str:
        return (
            f"{super().extra_repr()}, samples={self.samples}, column_sampling={self.column_sampling!r}, "
            f"row_normalization={self.row_normalization!r}, pilot_reuse={self.pilot_reuse}"
        )
