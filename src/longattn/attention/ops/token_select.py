"""Top-k token selection by a lightning indexer, and softmax attention over the selected keys.

DeepSeek-V3.2's sparse attention (DSA; DeepSeek-AI, 2025, section 2.1) scores every key with a small
indexer and lets each query attend to the ``top_k`` keys it scores highest. The pieces here never hold
an N x N tensor on the CPU path: the indexer's scores are computed for a chunk of query rows at a time
(at most :data:`CHUNK_ELEMENTS` scores) and only the selected indices are kept; the attention over the
selected keys runs chunk by chunk of query rows and keeps, for backward, only its inputs, its output and the
log-sum-exp of every row (as flash attention does), recomputing each chunk's scores in backward. On the
GPU path every piece runs over all rows at once (one chunk, a constant number of launches).

The attention has two strategies on the CPU path, with the same result (:func:`selection_strategy` picks one):
"gather" copies each row's K selected keys and values and multiplies row by row (O(N K) work, but small batched
matrix-vector products and index copies); "masked" multiplies a chunk of rows with every key up to the last one
they selected in one GEMM and masks the unselected ones away (O(N S) work at GEMM speed). When the keys are few
against K (MQAR's lengths, DSA's top_k of 64-2048 over a few thousand keys) the GEMMs win; see
docs/performance.md, "GLA and DSA at MQAR's lengths".

Shapes: queries [B, H, R, D], keys and values [B, H, S, D]; the indexer's queries [B, HI, R, DI], its keys
[B, S, DI] (one key per token, shared by its heads) and its head weights [B, HI, R]; a selection is
``indices`` [B, R, K] (long) with ``selected`` [B, R, K] (bool: the slot holds a visible key), shared by
the attention heads, as in DSA.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor
from torch.autograd.function import once_differentiable

from longattn.attention.base import AttentionError, autocast_disabled, compute_dtype, recomputed, uses_gpu_path

__all__ = ["CHUNK_ELEMENTS", "MASKED_UP_TO", "SELECTION_STRATEGIES", "index_scores", "indexer_kl_loss", "select_top_k",
           "selected_attention", "selected_kl_loss", "selection_strategy", "visible_keys"]

# Elements of one chunk's largest temporary (the indexer's per-head scores, the gathered keys): 2^20 keeps a
# chunk inside a core's cache-sized working set and far below N x N at any length the tests use.
CHUNK_ELEMENTS = 1 << 20

SELECTION_STRATEGIES = ("gather", "masked")
# The CPU path masks (one GEMM over the keys) while the keys a row can reach are at most this many times its K
# selected ones, and gathers beyond: measured break-even 12-16 (docs/performance.md, "GLA and DSA at MQAR's lengths")
MASKED_UP_TO = 12


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
    return (_Gathered.scores(query, keys) * scale).masked_fill(~selected[:, None], float("-inf"))


def _weights(scores: Tensor, lse: Tensor) -> Tensor:
    """softmax weights from the row log-sum-exp; rows without any selected key (lse = -inf) get zeros."""
    return torch.exp(scores - lse.nan_to_num(neginf=0.0)[..., None])


def _key_span(indices: Tensor, selected: Tensor) -> int:
    """One past the last key any row of the chunk selected (at least 1): the keys its GEMMs need."""
    last = torch.where(selected, indices, 0).amax() if indices.numel() else indices.new_zeros(())
    return int(last) + 1


def selection_mask(indices: Tensor, selected: Tensor, span: int) -> Tensor:
    """The selections [B, R, K] as a [B, R, span] bool mask (True: the row selected the key). Unselected slots point
    at key 0 with a 0, and the max over a key's slots keeps any 1, so they never unselect it."""
    b, rows, _ = indices.shape
    mask = torch.zeros(b, rows, span, dtype=torch.uint8, device=indices.device)
    mask.scatter_reduce_(-1, torch.where(selected, indices, 0), selected.to(torch.uint8), reduce="amax")
    return mask.bool()


class _Gathered:
    """The "gather" strategy: each row's K selected keys and values copied out ([B, H, R, K, D]) and multiplied
    row by row; O(R K D) work and memory per chunk."""

    @staticmethod
    def elements_per_row(key: Tensor, value: Tensor, count: int) -> int:
        return key.shape[0] * key.shape[1] * count * max(key.shape[-1], value.shape[-1])

    @staticmethod
    def operands(key: Tensor, value: Tensor, indices: Tensor, selected: Tensor) -> tuple[Tensor, Tensor, Tensor, Any]:
        """(keys, values, which score slots are selected, where the keys' gradients go) of a chunk of rows."""
        flat = _flat_indices(indices, key.shape[1], key.shape[2])
        return _gather(key, flat), _gather(value, flat), selected[:, None], flat

    @staticmethod
    def scores(query: Tensor, keys: Tensor) -> Tensor:
        return (query[..., None, :] @ keys.transpose(-1, -2))[..., 0, :]

    @staticmethod
    def combine(weights: Tensor, rows: Tensor) -> Tensor:
        """sum_k weights[..., k] rows[..., k, :]: [B, H, R, D]."""
        return (weights[..., None, :] @ rows)[..., 0, :]

    @staticmethod
    def add_key_grads(grad_k: Tensor, grad_v: Tensor, flat: Any, d_scores: Tensor, weights: Tensor, q_rows: Tensor,
                      d_out: Tensor) -> None:
        rows = flat.reshape(-1)
        grad_k.view(-1, grad_k.shape[-1]).index_add_(0, rows, (d_scores[..., None] * q_rows[..., None, :]).flatten(0, 3))
        grad_v.view(-1, grad_v.shape[-1]).index_add_(0, rows, (weights[..., None] * d_out[..., None, :]).flatten(0, 3))


class _Masked:
    """The "masked" strategy: the chunk's rows against every key up to the last one they selected, in GEMMs, the
    unselected keys masked to -inf before the softmax (DSA eq. 2 unchanged); O(R S D) work at GEMM speed."""

    @staticmethod
    def elements_per_row(key: Tensor, value: Tensor, count: int) -> int:
        return key.shape[0] * key.shape[1] * key.shape[2]

    @staticmethod
    def operands(key: Tensor, value: Tensor, indices: Tensor, selected: Tensor) -> tuple[Tensor, Tensor, Tensor, Any]:
        span = _key_span(indices, selected)
        return key[:, :, :span], value[:, :, :span], selection_mask(indices, selected, span)[:, None], span

    @staticmethod
    def scores(query: Tensor, keys: Tensor) -> Tensor:
        return query @ keys.transpose(-1, -2)

    @staticmethod
    def combine(weights: Tensor, rows: Tensor) -> Tensor:
        return weights @ rows

    @staticmethod
    def add_key_grads(grad_k: Tensor, grad_v: Tensor, span: Any, d_scores: Tensor, weights: Tensor, q_rows: Tensor,
                      d_out: Tensor) -> None:
        grad_k[:, :, :span] += d_scores.transpose(-1, -2) @ q_rows
        grad_v[:, :, :span] += weights.transpose(-1, -2) @ d_out


_STRATEGIES = dict(zip(SELECTION_STRATEGIES, (_Gathered, _Masked)))


class _SelectedAttention(torch.autograd.Function):
    """softmax(q . k_s * scale over s in the selection) v_s, chunk by chunk of query rows with either strategy;
    backward recomputes each chunk's scores from the saved log-sum-exp (as flash attention does)."""

    @staticmethod
    def forward(ctx, query: Tensor, key: Tensor, value: Tensor, indices: Tensor, selected: Tensor,  # type: ignore[override]
                scale: float, strategy: str) -> Tensor:
        how = _STRATEGIES[strategy]
        b, heads, rows, _ = query.shape
        work = compute_dtype(query.dtype)
        out = query.new_empty(b, heads, rows, value.shape[-1])
        lse = torch.empty(b, heads, rows, dtype=work, device=query.device)
        chunks = row_chunks(rows, how.elements_per_row(key, value, indices.shape[-1]), query)
        with autocast_disabled(query.device):
            key_w, value_w = key.to(work), value.to(work)  # once: every chunk reads them
            for part in chunks:
                keys, values, valid, _ = how.operands(key_w, value_w, indices[:, part], selected[:, part])
                scores = (how.scores(query[:, :, part].to(work), keys) * scale).masked_fill(~valid, float("-inf"))
                lse[:, :, part] = torch.logsumexp(scores, dim=-1)
                out[:, :, part] = how.combine(_weights(scores, lse[:, :, part]), values).to(out.dtype)
        ctx.save_for_backward(query, key, value, indices, selected, out, lse)
        ctx.scale, ctx.chunks, ctx.how = scale, chunks, how
        return out

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_out: Tensor) -> tuple[Tensor | None, ...]:  # type: ignore[override]
        query, key, value, indices, selected, out, lse = ctx.saved_tensors
        how, work = ctx.how, lse.dtype
        grad_q = torch.zeros_like(query, dtype=work)
        grad_k = torch.zeros_like(key, dtype=work, memory_format=torch.contiguous_format)
        grad_v = torch.zeros_like(value, dtype=work, memory_format=torch.contiguous_format)
        with autocast_disabled(query.device):
            key_w, value_w = key.to(work), value.to(work)
            for part in ctx.chunks:
                keys, values, valid, where = how.operands(key_w, value_w, indices[:, part], selected[:, part])
                q_rows, d_out = query[:, :, part].to(work), grad_out[:, :, part].to(work)
                scores = (how.scores(q_rows, keys) * ctx.scale).masked_fill(~valid, float("-inf"))
                weights = _weights(scores, lse[:, :, part])
                # softmax backward: dS = P (dP - rowsum(dO * O)), dP = dO V^T
                row_term = (d_out * out[:, :, part].to(work)).sum(-1, keepdim=True)
                d_scores = weights * (how.scores(d_out, values) - row_term) * ctx.scale
                grad_q[:, :, part] = how.combine(d_scores, keys)
                how.add_key_grads(grad_k, grad_v, where, d_scores, weights, q_rows, d_out)
        return grad_q.to(query.dtype), grad_k.to(key.dtype), grad_v.to(value.dtype), None, None, None, None


def selection_strategy(query: Tensor, keys: int, count: int, causal: bool) -> str:
    """How :func:`selected_attention` computes: "gather" on the GPU path (one batched program over all rows) and on
    the CPU path when the keys are many against the ``count`` selected per row; "masked" when the keys a row can
    reach (on average half of them when ``causal``) are at most MASKED_UP_TO times ``count``."""
    if uses_gpu_path(query):
        return "gather"
    reachable = keys / 2 if causal else keys
    return "masked" if reachable <= MASKED_UP_TO * count else "gather"


def selected_attention(query: Tensor, key: Tensor, value: Tensor, indices: Tensor, selected: Tensor,
                       scale: float, causal: bool = False, strategy: str | None = None) -> Tensor:
    """softmax attention of each query row over its selected keys only (DSA eq. 2): [B, H, R, Dv] in the inputs'
    dtype (the scores in float32 for half inputs). A key outside a row's selection neither changes the row nor
    receives gradient from it; a row with nothing selected outputs zeros. The selected keys of a row must be
    distinct (as select_top_k's are). ``causal`` only informs the choice of strategy (the selection already
    holds the causal constraint); ``strategy``: one of SELECTION_STRATEGIES, None: :func:`selection_strategy`."""
    if strategy is None:
        strategy = selection_strategy(query, key.shape[2], indices.shape[-1], causal)
    if strategy not in SELECTION_STRATEGIES:
        raise AttentionError(f"selected_attention: strategy must be one of {SELECTION_STRATEGIES}, got {strategy!r}")
    return _SelectedAttention.apply(query, key, value, indices, selected, scale, strategy)


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
        span = part.stop if causal else key.shape[2]  # a causal chunk sees no key after its last row
        visible = visible_keys(key_valid[:, :span], part, causal) & key_valid[:, part, None]  # padded queries: none
        total = total + recomputed(_kl_rows, query[:, :, part].detach(), key[:, :, :span].detach(),
                                   index_query[:, :, part], index_key[:, :span], index_weights[:, :, part], visible,
                                   scale)
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
