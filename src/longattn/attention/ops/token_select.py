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
    per_head = torch.relu(index_query @ index_key[:, None].transpose(-1, -2))  # [B, HI, R, S]
    return torch.einsum("bjrs,bjr->brs", per_head, index_weights)


def visible_keys(key_valid: Tensor, rows: slice, causal: bool, first_position: int = 0) -> Tensor:
    """Which keys the query rows ``rows`` (at positions ``first_position + r``) may select: [B, R, S] bool."""
    visible = key_valid[:, None, :]
    if causal:
        positions = torch.arange(rows.start, rows.stop, device=key_valid.device) + first_position
        keys = torch.arange(key_valid.shape[1], device=key_valid.device)
        visible = visible & (keys[None, :] <= positions[:, None])[None]
    return visible.expand(-1, rows.stop - rows.start, -1)


@torch.no_grad()
def select_top_k(index_query: Tensor, index_key: Tensor, index_weights: Tensor, key_valid: Tensor, top_k: int,
                 causal: bool, first_position: int = 0) -> tuple[Tensor, Tensor]:
    """The ``top_k`` visible keys of every query row by the indexer's score: (indices, selected), [B, R, K] with
    K = min(top_k, S). A row with fewer visible keys fills its last slots with unselected ones. Ties go to the
    earlier key (a stable sort), so a row's selection depends on its scores only, not on how rows are chunked:
    ReLU makes exact ties (scores of 0) common. The selection is discrete: no gradient flows through it."""
    b, heads, rows, _ = index_query.shape
    keys = index_key.shape[1]
    count = min(top_k, keys)
    indices = torch.empty(b, rows, count, dtype=torch.long, device=index_query.device)
    selected = torch.empty(b, rows, count, dtype=torch.bool, device=index_query.device)
    for part in row_chunks(rows, b * heads * keys, index_query):
        scores = index_scores(index_query[:, :, part], index_key, index_weights[:, :, part])
        scores = scores.masked_fill(~visible_keys(key_valid, part, causal, first_position), float("-inf"))
        values, order = torch.sort(scores, dim=-1, descending=True, stable=True)
        indices[:, part], selected[:, part] = order[..., :count], values[..., :count] > float("-inf")
    return indices, selected


def _gather(t: Tensor, indices: Tensor) -> Tensor:
    """Keys or values t [B, H, S, D] at indices [B, R, K]: [B, R, K, H, D] (one gather of token-major rows)."""
    b, heads, s, d = t.shape
    flat = indices + (torch.arange(b, device=indices.device) * s)[:, None, None]
    return t.transpose(1, 2).reshape(b * s, heads, d)[flat]


def _scores(query: Tensor, keys: Tensor, selected: Tensor, scale: float) -> Tensor:
    """q . k_s * scale over the selected slots, -inf elsewhere: [B, H, R, K]."""
    scores = torch.einsum("bhrd,brkhd->bhrk", query, keys) * scale
    return scores.masked_fill(~selected[:, None], float("-inf"))


def _weights(scores: Tensor, lse: Tensor) -> Tensor:
    """softmax weights from the row log-sum-exp; rows without any selected key (lse = -inf) get zeros."""
    return torch.exp(scores - lse.nan_to_num(neginf=0.0)[..., None])


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
        with autocast_disabled(query.device):
            for part in chunks:
                idx, sel = indices[:, part], selected[:, part]
                scores = _scores(query[:, :, part].to(work), _gather(key, idx).to(work), sel, scale)
                lse[:, :, part] = torch.logsumexp(scores, dim=-1)
                weights = _weights(scores, lse[:, :, part])
                out[:, :, part] = torch.einsum("bhrk,brkhd->bhrd", weights, _gather(value, idx).to(work)).to(out.dtype)
        ctx.save_for_backward(query, key, value, indices, selected, out, lse)
        ctx.scale, ctx.chunks = scale, chunks
        return out

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_out: Tensor) -> tuple[Tensor | None, ...]:  # type: ignore[override]
        query, key, value, indices, selected, out, lse = ctx.saved_tensors
        b, heads, s, _ = key.shape
        work = lse.dtype
        grad_q = torch.zeros_like(query, dtype=work)
        grad_k = key.new_zeros(b * s, heads, key.shape[-1], dtype=work)  # token-major, as _gather reads them
        grad_v = value.new_zeros(b * s, heads, value.shape[-1], dtype=work)
        offsets = (torch.arange(b, device=key.device) * s)[:, None, None]
        with autocast_disabled(query.device):
            for part in ctx.chunks:
                idx, sel = indices[:, part], selected[:, part]
                q_rows, d_out = query[:, :, part].to(work), grad_out[:, :, part].to(work)
                keys, values = _gather(key, idx).to(work), _gather(value, idx).to(work)
                weights = _weights(_scores(q_rows, keys, sel, ctx.scale), lse[:, :, part])
                # softmax backward: dS = P (dP - rowsum(dO * O)), dP = dO V^T
                d_weights = torch.einsum("bhrd,brkhd->bhrk", d_out, values)
                row_term = (d_out * out[:, :, part].to(work)).sum(-1, keepdim=True)
                d_scores = weights * (d_weights - row_term) * ctx.scale
                flat = (idx + offsets).reshape(-1)
                grad_q[:, :, part] = torch.einsum("bhrk,brkhd->bhrd", d_scores, keys)
                grad_k.index_add_(0, flat, torch.einsum("bhrk,bhrd->brkhd", d_scores, q_rows).flatten(0, 2))
                grad_v.index_add_(0, flat, torch.einsum("bhrk,bhrd->brkhd", weights, d_out).flatten(0, 2))

        def heads_first(g: Tensor, like: Tensor) -> Tensor:
            return g.view(b, s, heads, -1).transpose(1, 2).to(like.dtype)

        return grad_q.to(query.dtype), heads_first(grad_k, key), heads_first(grad_v, value), None, None, None


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
        scores = _scores(query.to(work), _gather(key, indices).to(work), selected, scale)
        target = torch.softmax(scores, dim=-1).nan_to_num(0.0).mean(1)  # [B, R, K]
    keys = _gather(index_key[:, None], indices)[:, :, :, 0].to(work)  # [B, R, K, DI]
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
