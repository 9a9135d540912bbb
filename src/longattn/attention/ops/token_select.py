"""Top-k token selection by a lightning indexer, and softmax attention over the selected keys.

DeepSeek-V3.2's sparse attention (DSA; DeepSeek-AI, 2025, section 2.1) scores every key with a small
indexer and lets each query attend to the ``top_k`` keys it scores highest. The pieces here never hold
an N x N tensor on the CPU path: the indexer's scores are computed for a chunk of query rows at a time
(at most :data:`CHUNK_ELEMENTS` scores) and only the selected indices are kept; the attention over the
selected keys gathers them chunk by chunk and keeps, for backward, only its inputs, its output and the
log-sum-exp of every row (as flash attention does), recomputing each chunk's scores in backward. On the
GPU path every piece runs over all rows at once (one chunk, a constant number of launches).

Shapes: queries [B, H, R, D], keys and values [B, H, S, D]; the indexer's queries [B, HI, R, DI], its keys
[B, S, DI] (one key per token, shared by its heads) and its head weights [B, HI, R]; a selection is
``indices`` [B, R, K] (long) with ``selected`` [B, R, K] (bool: the slot holds a visible key), shared by
the attention heads, as in DSA.
"""

from __future__ import annotations

import torch
from torch import Tensor
from torch.autograd.function import once_differentiable

from longattn.attention.base import autocast_disabled, compute_dtype, recomputed, uses_gpu_path

__all__ = ["CHUNK_ELEMENTS", "index_scores", "indexer_kl_loss", "select_top_k", "selected_attention", "selected_kl_loss",
           "visible_keys"]

# Elements of one chunk's largest temporary (the indexer's per-head scores, the gathered keys): 2^20 keeps a
# chunk inside a core's cache-sized working set and far below N x N at any length the tests use.
CHUNK_ELEMENTS = 1 << 20


def row_chunks(rows: int, elements_per_row: int, like: Tensor) -> list[slice]:
    """Consecutive row slices whose temporaries hold at most CHUNK_ELEMENTS elements; one slice on the GPU path."""
    if uses_gpu_path(like):
        return [slice(0, rows)]
    size = max(1, CHUNK_ELEMENTS // max(1, elements_per_row))
    return [slice(start, min(start + size, rows)) for start in range(0, rows, size)]


def index_scores(index_query: Tensor, index_key: Tensor, index_weights: Tensor) -> Tensor:
    """The lightning indexer (DSA eq. 1): I_{t,s} = sum_j w_{t,j} ReLU(q^I_{t,j} . k^I_s), as [B, R, S]."""
    b, heads, rows, dim = index_query.shape
    # one [HI * R, DI] x [DI, S] product per sequence: broadcasting the key over the heads would copy it HI times
    per_head = torch.relu(index_query.reshape(b, heads * rows, dim) @ index_key.transpose(-1, -2))
    return (per_head.view(b, heads, rows, -1) * index_weights[..., None]).sum(1)


def visible_keys(key_valid: Tensor, rows: slice, causal: bool, first_position: int = 0) -> Tensor:
    """Which keys the query rows ``rows`` (at positions ``first_position + r``) may select: [B, R, S] bool."""
    visible = key_valid[:, None, :]
    if causal:
        positions = torch.arange(rows.start, rows.stop, device=key_valid.device) + first_position
        keys = torch.arange(key_valid.shape[1], device=key_valid.device)
        visible = visible & (keys[None, :] <= positions[:, None])[None]
    return visible.expand(-1, rows.stop - rows.start, -1)


def _top_k_earliest_ties(scores: Tensor, count: int) -> tuple[Tensor, Tensor]:
    """The ``count`` largest scores of every row [..., S], ties at the threshold going to the earliest keys: (indices,
    values), the scores above the threshold first. Two top-k passes (O(S) each), where a stable sort is O(S log S)."""
    values, indices = torch.topk(scores, count, dim=-1)
    threshold = values[..., -1:]
    above = (values > threshold).sum(-1, keepdim=True)  # every score above the threshold is in the top-k
    positions = torch.arange(scores.shape[-1], 0, -1, device=scores.device)  # larger for earlier keys
    tied = torch.topk(torch.where(scores == threshold, positions, 0), count, dim=-1).indices
    slot = torch.arange(count, device=scores.device)
    from_ties = tied.gather(-1, (slot - above).clamp_min(0))
    return torch.where(slot < above, indices, from_ties), torch.where(slot < above, values, threshold)


@torch.no_grad()
def select_top_k(index_query: Tensor, index_key: Tensor, index_weights: Tensor, key_valid: Tensor, top_k: int,
                 causal: bool, first_position: int = 0) -> tuple[Tensor, Tensor]:
    """The ``top_k`` visible keys of every query row by the indexer's score: (indices, selected), [B, R, K] with
    K = min(top_k, S). A row with fewer visible keys fills its last slots with unselected ones. Ties go to the
    earlier key, so a row's selection depends on its scores only, not on how rows are chunked: ReLU makes exact
    ties (scores of 0) common. The selection is discrete: no gradient flows through it."""
    b, heads, rows, _ = index_query.shape
    keys = index_key.shape[1]
    count = min(top_k, keys)
    indices = torch.empty(b, rows, count, dtype=torch.long, device=index_query.device)
    selected = torch.empty(b, rows, count, dtype=torch.bool, device=index_query.device)
    for part in row_chunks(rows, b * heads * keys, index_query):
        scores = index_scores(index_query[:, :, part], index_key, index_weights[:, :, part])
        scores = scores.masked_fill(~visible_keys(key_valid, part, causal, first_position), float("-inf"))
        order, values = _top_k_earliest_ties(scores, count)
        indices[:, part], selected[:, part] = order, values > float("-inf")
    return indices, selected


def _flat_indices(indices: Tensor, heads: int, length: int) -> Tensor:
    """Selections [B, R, K] as rows of a head-major [B * H * S, D] view of keys or values: [B, H, R, K]."""
    b = indices.shape[0]
    base = (torch.arange(b * heads, device=indices.device) * length).view(b, heads, 1, 1)
    return indices[:, None] + base


def _gather(t: Tensor, flat: Tensor) -> Tensor:
    """Keys or values t [B, H, S, D] at the rows ``flat`` [B, H, R, K] of _flat_indices: [B, H, R, K, D]."""
    return t.reshape(-1, t.shape[-1])[flat]


def _scores(query: Tensor, keys: Tensor, selected: Tensor, scale: float) -> Tensor:
    """q . k_s * scale over the selected slots, -inf elsewhere: [B, H, R, K]."""
    scores = (query[..., None, :] @ keys.transpose(-1, -2))[..., 0, :] * scale
    return scores.masked_fill(~selected[:, None], float("-inf"))


def _weights(scores: Tensor, lse: Tensor) -> Tensor:
    """softmax weights from the row log-sum-exp; rows without any selected key (lse = -inf) get zeros."""
    return torch.exp(scores - lse.nan_to_num(neginf=0.0)[..., None])


def _weighted(weights: Tensor, values: Tensor) -> Tensor:
    """sum_k weights[..., k] values[..., k, :]: [B, H, R, D]."""
    return (weights[..., None, :] @ values)[..., 0, :]


class _SelectedAttention(torch.autograd.Function):
    """softmax(q . k_s * scale over s in the selection) v_s, chunk by chunk; backward recomputes each chunk."""

    @staticmethod
    def forward(ctx, query: Tensor, key: Tensor, value: Tensor, indices: Tensor, selected: Tensor,  # type: ignore[override]
                scale: float) -> Tensor:
        b, heads, rows, _ = query.shape
        work = compute_dtype(query.dtype)
        out = query.new_empty(b, heads, rows, value.shape[-1])
        lse = torch.empty(b, heads, rows, dtype=work, device=query.device)
        chunks = row_chunks(rows, b * indices.shape[-1] * heads * max(query.shape[-1], value.shape[-1]), query)
        length = key.shape[2]
        with autocast_disabled(query.device):
            for part in chunks:
                flat, sel = _flat_indices(indices[:, part], heads, length), selected[:, part]
                scores = _scores(query[:, :, part].to(work), _gather(key, flat).to(work), sel, scale)
                lse[:, :, part] = torch.logsumexp(scores, dim=-1)
                weights = _weights(scores, lse[:, :, part])
                out[:, :, part] = _weighted(weights, _gather(value, flat).to(work)).to(out.dtype)
        ctx.save_for_backward(query, key, value, indices, selected, out, lse)
        ctx.scale, ctx.chunks = scale, chunks
        return out

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_out: Tensor) -> tuple[Tensor | None, ...]:  # type: ignore[override]
        query, key, value, indices, selected, out, lse = ctx.saved_tensors
        b, heads, length, _ = key.shape
        work = lse.dtype
        grad_q = torch.zeros_like(query, dtype=work)
        grad_k = key.new_zeros(b * heads * length, key.shape[-1], dtype=work)  # head-major rows, as _gather reads
        grad_v = value.new_zeros(b * heads * length, value.shape[-1], dtype=work)
        with autocast_disabled(query.device):
            for part in ctx.chunks:
                flat, sel = _flat_indices(indices[:, part], heads, length), selected[:, part]
                q_rows, d_out = query[:, :, part].to(work), grad_out[:, :, part].to(work)
                keys, values = _gather(key, flat).to(work), _gather(value, flat).to(work)
                weights = _weights(_scores(q_rows, keys, sel, ctx.scale), lse[:, :, part])
                # softmax backward: dS = P (dP - rowsum(dO * O)), dP = dO V^T
                d_weights = (d_out[..., None, :] @ values.transpose(-1, -2))[..., 0, :]
                row_term = (d_out * out[:, :, part].to(work)).sum(-1, keepdim=True)
                d_scores = weights * (d_weights - row_term) * ctx.scale
                grad_q[:, :, part] = _weighted(d_scores, keys)
                grad_k.index_add_(0, flat.reshape(-1), (d_scores[..., None] * q_rows[..., None, :]).flatten(0, 3))
                grad_v.index_add_(0, flat.reshape(-1), (weights[..., None] * d_out[..., None, :]).flatten(0, 3))
        return (grad_q.to(query.dtype), grad_k.view_as(key).to(key.dtype), grad_v.view_as(value).to(value.dtype),
                None, None, None)


def selected_attention(query: Tensor, key: Tensor, value: Tensor, indices: Tensor, selected: Tensor,
                       scale: float) -> Tensor:
    """softmax attention of each query row over its selected keys only (DSA eq. 2): [B, H, R, Dv] in the inputs'
    dtype (the scores in float32 for half inputs). A key outside a row's selection neither changes the row nor
    receives gradient from it; a row with nothing selected outputs zeros."""
    return _SelectedAttention.apply(query, key, value, indices, selected, scale)


def _kl_rows(query: Tensor, key: Tensor, index_query: Tensor, index_key: Tensor, index_weights: Tensor,
             visible: Tensor, scale: float) -> Tensor:
    """sum over rows of KL(p_t || softmax(I_t)) over the visible keys (DSA eq. 3): p_t is the main attention's
    distribution summed over heads and L1-normalised (the heads' mean), a fixed target (no gradient)."""
    work = compute_dtype(index_query.dtype)
    with torch.no_grad():
        scores = (query.to(work) @ key.to(work).transpose(-1, -2)) * scale
        target = torch.softmax(scores.masked_fill(~visible[:, None], float("-inf")), dim=-1).nan_to_num(0.0).mean(1)
    log_index = torch.log_softmax(
        index_scores(index_query.to(work), index_key.to(work), index_weights.to(work))
        .masked_fill(~visible, float("-inf")), dim=-1)
    terms = torch.where(target > 0, target * (target.clamp_min(torch.finfo(work).tiny).log() - log_index), 0.0)
    return terms.sum()


def indexer_kl_loss(query: Tensor, key: Tensor, key_valid: Tensor, index_query: Tensor, index_key: Tensor,
                    index_weights: Tensor, causal: bool, scale: float) -> Tensor:
    """The indexer's dense warm-up loss (DSA eq. 3), averaged over the real query tokens: query rows a chunk at a
    time, each chunk's [B, H, R, S] scores recomputed in backward instead of kept, so no N x N tensor exists on the
    CPU path. Only the indexer's tensors receive gradient; ``query`` and ``key`` give the target."""
    b, heads, rows, _ = query.shape
    index_heads = index_query.shape[1]
    total = query.new_zeros((), dtype=compute_dtype(index_query.dtype))
    for part in row_chunks(rows, b * (heads + index_heads) * key.shape[2], query):
        visible = visible_keys(key_valid, part, causal) & key_valid[:, part, None]  # padded queries add nothing
        total = total + recomputed(_kl_rows, query[:, :, part].detach(), key.detach(), index_query[:, :, part],
                                   index_key, index_weights[:, :, part], visible, scale)
    return total / key_valid.sum().clamp_min(1)


def _selected_kl_rows(query: Tensor, key: Tensor, index_query: Tensor, index_key: Tensor, index_weights: Tensor,
                      indices: Tensor, selected: Tensor, scale: float) -> Tensor:
    """sum over rows of KL(p_{t,S_t} || softmax(I_{t,S_t})) over each row's selected keys (DSA eq. 4)."""
    work = compute_dtype(index_query.dtype)
    with torch.no_grad():
        scores = _scores(query.to(work), _gather(key, _flat_indices(indices, key.shape[1], key.shape[2])).to(work),
                         selected, scale)
        target = torch.softmax(scores, dim=-1).nan_to_num(0.0).mean(1)  # [B, R, K]
    keys = _gather(index_key[:, None], _flat_indices(indices, 1, index_key.shape[1]))[:, 0].to(work)  # [B, R, K, DI]
    per_head = torch.relu(torch.einsum("bjrd,brkd->bjrk", index_query.to(work), keys))
    index = torch.einsum("bjrk,bjr->brk", per_head, index_weights.to(work)).masked_fill(~selected, float("-inf"))
    log_index = torch.log_softmax(index, dim=-1)
    terms = torch.where(target > 0, target * (target.clamp_min(torch.finfo(work).tiny).log() - log_index), 0.0)
    return terms.sum()


def selected_kl_loss(query: Tensor, key: Tensor, key_valid: Tensor, index_query: Tensor, index_key: Tensor,
                     index_weights: Tensor, indices: Tensor, selected: Tensor, scale: float) -> Tensor:
    """The indexer's loss of DSA's sparse training stage (eq. 4), averaged over the real query tokens: O(N K)."""
    b, heads, rows, _ = query.shape
    width = indices.shape[-1] * (heads * query.shape[-1] + index_query.shape[-1] * index_query.shape[1])
    total = query.new_zeros((), dtype=compute_dtype(index_query.dtype))
    for part in row_chunks(rows, b * width, query):
        total = total + recomputed(_selected_kl_rows, query[:, :, part].detach(), key.detach(),
                                   index_query[:, :, part], index_key, index_weights[:, :, part],
                                   indices[:, part], selected[:, part] & key_valid[:, part, None], scale)
    return total / key_valid.sum().clamp_min(1)
