"""DeepSeek Sparse Attention (DSA; DeepSeek-V3.2, DeepSeek-AI 2025, section 2.1): a lightning indexer picks
the top-k keys of every query, and the query attends to those keys only.

The indexer (eq. 1) scores query t against key s as I_{t,s} = sum_j w_{t,j} ReLU(q^I_{t,j} . k^I_s) with a few
small heads j, one indexer key per token shared by them, and per-query head weights w_{t,j}; each query then
attends to the ``top_k`` keys of highest I_{t,s} (eq. 2), the selection shared by the attention heads. The
indexer is trained by an auxiliary loss only (the selection is discrete): the KL divergence from the main
attention's distribution, summed over heads and L1-normalised, to softmax(I_t) -- over all keys in the dense
warm-up stage (eq. 3, ``indexer_loss="dense"``) or over the selected keys in the sparse stage (eq. 4,
``indexer_loss="selected"``) -- with the indexer's inputs detached from the main model, as the paper trains it.

Here the indexer reads the layer's queries and keys (as DeepSeek-V3.2's reads the query latent and the hidden
state; under :mod:`longattn.hf` they carry the model's rotary embedding, which DeepSeek's indexer applies
too). Cost: the indexer is O(N^2 HI DI) by design (cheap heads, as in the paper), the attention O(N top_k D)
(the CPU path's GEMM over every key up to the last selected one, where the keys are at most
``token_select.MASKED_UP_TO`` times top_k, is of the same order); the CPU path never holds an N x N tensor
(:mod:`longattn.attention.ops.token_select` chunks the query rows); the GPU path runs all rows at once. Non-causal (encoder) use selects from every real key.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
from torch import Tensor, nn

from longattn.attention.base import (
    AttentionBase,
    AttentionError,
    Capabilities,
    QKVProjection,
    check_qkv,
    merge_heads,
    output_dtype,
    padding_safe,
    register_attention,
    split_heads,
)
from longattn.attention.decoding import DecodingState, KVState
from longattn.attention.ops.token_select import (
    index_scores,
    indexer_kl_loss,
    select_top_k,
    selected_attention,
    selected_kl_loss,
)

INDEXER_LOSSES = ("dense", "selected", "off")


def _check_index_tensors(query: Tensor, index_query: Tensor, index_key: Tensor, index_weights: Tensor,
                         top_k: int) -> None:
    b, _, n, _ = query.shape
    if not isinstance(top_k, int) or top_k < 1:
        raise AttentionError(f"top_k must be a positive int, got {top_k!r}")
    if index_query.dim() != 4 or index_query.shape[0] != b or index_query.shape[2] != n:
        raise AttentionError(f"index_query must be [B, HI, N, DI] = [{b}, HI, {n}, DI], got {list(index_query.shape)}")
    heads, dim = index_query.shape[1], index_query.shape[3]
    if tuple(index_key.shape) != (b, n, dim):
        raise AttentionError(f"index_key must be [B, N, DI] = [{b}, {n}, {dim}], got {list(index_key.shape)}")
    if tuple(index_weights.shape) != (b, heads, n):
        raise AttentionError(f"index_weights must be [B, HI, N] = [{b}, {heads}, {n}], got {list(index_weights.shape)}")


@padding_safe
def dsa_attention(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attention_mask: Tensor | None = None,
    *,
    index_query: Tensor,
    index_key: Tensor,
    index_weights: Tensor,
    top_k: int,
    is_causal: bool = False,
    scale: float | None = None,
) -> Tensor:
    """DSA on [B, H, N, Dh]: each query attends to the ``top_k`` keys the indexer (``index_query`` [B, HI, N, DI],
    ``index_key`` [B, N, DI], ``index_weights`` [B, HI, N]) scores highest among the real (and, if causal, not
    later) keys; ``attention_mask`` bool [B, N], True = real key. Output in the autocast dtype inside autocast."""
    check_qkv(query, key, value, attention_mask)
    _check_index_tensors(query, index_query, index_key, index_weights, top_k)
    dtype = output_dtype(query)
    query, key, value = (t.to(dtype) for t in (query, key, value))
    b, _, n, d = query.shape
    valid = torch.ones(b, n, dtype=torch.bool, device=query.device) if attention_mask is None else attention_mask
    indices, selected = select_top_k(index_query, index_key, index_weights, valid, top_k, is_causal)
    return selected_attention(query, key, value, indices, selected, 1.0 / math.sqrt(d) if scale is None else scale,
                              causal=is_causal)


def _reference_selection(index_query: Tensor, index_key: Tensor, index_weights: Tensor, visible: Tensor,
                         top_k: int) -> Tensor:
    """The selected keys as a dense [B, N, N] mask: the top_k visible keys by eq. 1, ties to the earlier key."""
    per_head = torch.einsum("bjtd,bsd->bjts", index_query, index_key).relu()
    scores = torch.einsum("bjts,bjt->bts", per_head, index_weights).masked_fill(~visible, float("-inf"))
    order = torch.sort(scores, dim=-1, descending=True, stable=True).indices[..., :top_k]
    chosen = torch.zeros_like(visible).scatter(-1, order, True)
    return chosen & visible


def _reference_visible(attention_mask: Tensor | None, b: int, n: int, is_causal: bool) -> Tensor:
    visible = torch.ones(b, n, n, dtype=torch.bool)
    if attention_mask is not None:
        visible = visible & attention_mask[:, None, :]
    if is_causal:
        visible = visible & torch.ones(n, n, dtype=torch.bool).tril()
    return visible


@padding_safe
def dsa_attention_reference(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attention_mask: Tensor | None = None,
    *,
    index_query: Tensor,
    index_key: Tensor,
    index_weights: Tensor,
    top_k: int,
    is_causal: bool = False,
    scale: float | None = None,
) -> Tensor:
    """Dense N x N version: the full indexer score matrix, its top_k per row as a mask, softmax. Tests only."""
    b, _, n, d = query.shape
    chosen = _reference_selection(index_query, index_key, index_weights,
                                  _reference_visible(attention_mask, b, n, is_causal), top_k)
    scores = query @ key.transpose(-1, -2) * (1.0 / math.sqrt(d) if scale is None else scale)
    weights = torch.softmax(scores.masked_fill(~chosen[:, None], float("-inf")), dim=-1).nan_to_num(0.0)
    return weights @ value


def dsa_indexer_loss_reference(query: Tensor, key: Tensor, attention_mask: Tensor | None, index_query: Tensor,
                               index_key: Tensor, index_weights: Tensor, *, is_causal: bool, top_k: int | None = None,
                               scale: float | None = None) -> Tensor:
    """Dense eq. 3 (``top_k`` None) or eq. 4 (over the top_k selected keys), averaged over the real queries. Tests only."""
    b, _, n, d = query.shape
    visible = _reference_visible(attention_mask, b, n, is_causal)
    if top_k is not None:
        visible = _reference_selection(index_query, index_key, index_weights, visible, top_k)
    real = torch.ones(b, n, dtype=torch.bool) if attention_mask is None else attention_mask
    visible = visible & real[:, :, None]
    scores = query @ key.transpose(-1, -2) * (1.0 / math.sqrt(d) if scale is None else scale)
    target = torch.softmax(scores.masked_fill(~visible[:, None], float("-inf")), dim=-1).nan_to_num(0.0).mean(1)
    per_head = torch.einsum("bjtd,bsd->bjts", index_query, index_key).relu()
    index = torch.einsum("bjts,bjt->bts", per_head, index_weights).masked_fill(~visible, float("-inf"))
    log_index = torch.log_softmax(index, dim=-1)
    kl = torch.where(target > 0, target * (target.log() - log_index), 0.0)
    return kl.sum() / real.sum()


class LightningIndexer(nn.Module):
    """The indexer's projections (eq. 1): ``heads`` queries q^I_{t,j} and weights w_{t,j} from the layer's queries,
    one key k^I_s from its keys, all of size ``dim`` per head."""

    def __init__(self, model_dim: int, heads: int, dim: int) -> None:
        super().__init__()
        self.heads = heads
        self.to_query = nn.Linear(model_dim, heads * dim)
        self.to_key = nn.Linear(model_dim, dim)
        self.to_weights = nn.Linear(model_dim, heads)

    def forward(self, query: Tensor, key: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """[B, H, N, Dh] queries and keys -> (index_query [B, HI, N, DI], index_key [B, N, DI], weights [B, HI, N])."""
        q, k = merge_heads(query), merge_heads(key)
        return split_heads(self.to_query(q), self.heads), self.to_key(k), self.to_weights(q).transpose(1, 2)


@dataclass
class DSAState(DecodingState):
    """Every key and value so far and every indexer key (the next token may select any of them)."""

    cache: KVState = field(default_factory=KVState)
    index_keys: KVState = field(default_factory=KVState)


@register_attention(
    "dsa",
    capabilities=Capabilities(causal=True, aux_losses=True),
    functional=dsa_attention,
    reference=dsa_attention_reference,
    paper="DeepSeek-V3.2: Pushing the Frontier of Open Large Language Models (DeepSeek-AI, 2025), DSA",
)
class DSAAttention(AttentionBase):
    """DeepSeek Sparse Attention: a lightning indexer selects the top-k keys of each query."""

    def __init__(
        self,
        dim: int,
        heads: int,
        max_len: int | None = None,
        causal: bool = False,
        top_k: int = 128,
        indexer_heads: int = 4,
        indexer_dim: int = 32,
        indexer_loss: str = "dense",
        indexer_loss_weight: float = 1.0,
    ) -> None:
        super().__init__(dim, heads, max_len, causal)
        if not isinstance(top_k, int) or top_k < 1:
            raise AttentionError(f"top_k must be a positive int, got {top_k!r}")
        for label, size in (("indexer_heads", indexer_heads), ("indexer_dim", indexer_dim)):
            if not isinstance(size, int) or size < 1:
                raise AttentionError(f"{label} must be a positive int, got {size!r}")
        if indexer_loss not in INDEXER_LOSSES:
            raise AttentionError(f"indexer_loss must be one of {INDEXER_LOSSES}, got {indexer_loss!r}")
        if indexer_loss_weight < 0:
            raise AttentionError(f"indexer_loss_weight must be >= 0, got {indexer_loss_weight}")
        self.proj = QKVProjection(dim, heads)
        self.indexer = LightningIndexer(dim, indexer_heads, indexer_dim)
        self.top_k = top_k
        self.indexer_loss = indexer_loss
        self.indexer_loss_weight = indexer_loss_weight

    def _attend_heads(self, query: Tensor, key: Tensor, value: Tensor, attention_mask: Tensor | None) -> Tensor:
        """Selection and attention on [B, H, N, Dh], and in training the indexer's loss."""
        dtype = output_dtype(query)
        query, key, value = (t.to(dtype) for t in (query, key, value))
        b, _, n, d = query.shape
        scale = 1.0 / math.sqrt(d)
        # the indexer trains on its own loss only: its inputs are detached from the main model (section 2.1)
        index_query, index_key, index_weights = self.indexer(query.detach(), key.detach())
        valid = torch.ones(b, n, dtype=torch.bool, device=query.device) if attention_mask is None else attention_mask
        indices, selected = select_top_k(index_query, index_key, index_weights, valid, self.top_k, self.causal)
        out = selected_attention(query, key, value, indices, selected, scale, causal=self.causal)
        if self.training and self.indexer_loss != "off" and self.indexer_loss_weight:
            if self.indexer_loss == "dense":
                loss = indexer_kl_loss(query, key, valid, index_query, index_key, index_weights, self.causal, scale)
            else:
                loss = selected_kl_loss(query, key, valid, index_query, index_key, index_weights, indices, selected,
                                        scale)
            self.add_aux_loss("dsa_indexer_kl", self.indexer_loss_weight * loss)
        return out

    def attend(self, x: Tensor, attention_mask: Tensor | None, layer_state: dict | None) -> Tensor:
        q, k, v = self.proj.qkv(x)
        return self.proj.out(self._attend_heads(q, k, v, attention_mask))

    # -- decoding: every key and value, and every indexer key ----------------------------------------
    decode_state = "kv_cache"

    def prefill_heads(self, query: Tensor, key: Tensor, value: Tensor, attention_mask: Tensor | None,
                      layer_state: dict | None) -> tuple[Tensor, DSAState]:
        out = self._attend_heads(query, key, value, attention_mask)
        index_key = self.indexer(query, key)[1]
        state = DSAState(length=key.shape[2], cache=KVState.start(key, value, attention_mask),
                         index_keys=KVState.start(None, index_key[:, None], attention_mask))
        return out, state

    def step_heads(self, query: Tensor, key: Tensor, value: Tensor, state: DSAState, real: Tensor | None,
                   layer_state: dict | None) -> tuple[Tensor, DSAState]:
        """The new query selects its top_k among every cached key and itself (O(N) indexer scores, O(top_k) attention)."""
        index_query, index_key, index_weights = self.indexer(query, key)
        state.cache.append(key, value, real)
        state.index_keys.append(None, index_key[:, None], real)
        keys, values, visible = state.cache.view()
        index_keys = state.index_keys.view()[1][:, 0]
        indices, selected = select_top_k(index_query, index_keys, index_weights, visible, self.top_k, causal=True,
                                         first_position=state.length)
        return selected_attention(query, keys, values, indices, selected, 1.0 / math.sqrt(query.shape[-1])), state

    def extra_repr(self) -> str:
        return (f"{super().extra_repr()}, top_k={self.top_k}, indexer_heads={self.indexer.heads}, "
                f"indexer_loss={self.indexer_loss!r}")
