"""Luna: Linear Unified Nested Attention (Ma et al., NeurIPS 2021).

Two nested softmax attentions replace the N x N one (Sec. 3):

* **pack**: a fixed-length sequence ``P`` of ``l`` tokens attends to the context,
  ``Y_P = Attn(P, C)`` (O(l N)); padded context tokens get weight exactly 0;
* **unpack**: the input attends to the packed sequence, ``Y_X = Attn(X, Y_P)`` (O(N l)).

Each is a multi-head attention with its own projections (``Attn(X, C) = softmax(X W^Q (C W^K)^T /
sqrt(d)) C W^V``, no output map on ``Y_P``; by default ``W^K = W^V`` per attention, as the
authors' code, ``tie_kv``); the unpacked output goes through the usual output map. In a Luna layer
``P`` is an extra input and output: the next layer receives ``P' = LayerNorm(Y_P + P)``. In
longattn's single-layer module form ``P`` is a learned parameter of the module (used by the first
layer of a stack); when the model passes a ``layer_state`` dict, each layer reads the incoming
``P`` from ``layer_state["luna_p"]`` (if an earlier layer left one there) and writes its ``P'``
back, so ``P`` flows through the layers as in the paper.
"""

from __future__ import annotations

import math
from typing import Callable

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from longattn.attention.base import (
    AttentionBase,
    AttentionError,
    Capabilities,
    check_qkv,
    compute_dtype,
    merge_heads,
    padding_safe,
    register_attention,
    split_heads,
)
from longattn.attention.decoding import RecurrentState
from longattn.attention.softmax import softmax_attention

__all__ = [
    "LunaAttention",
    "luna_attention",
    "luna_attention_reference",
    "luna_causal_attention",
    "luna_causal_attention_reference",
    "luna_pack",
    "luna_unpack",
]

#: ``layer_state`` key of the packed sequence P' that a layer hands to the next one.
P_KEY = "luna_p"


def _positive_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value > 0


def _scale(head_dim: int, scale: float | None) -> float:
    return 1.0 / math.sqrt(head_dim) if scale is None else scale


def luna_pack(
    pack_query: Tensor,
    key: Tensor,
    value: Tensor,
    attention_mask: Tensor | None = None,
    *,
    scale: float | None = None,
    dropout_p: float = 0.0,
) -> Tensor:
    """Pack attention: the l queries of P attend to the N context tokens -> [B, H, l, Dh].

    Padded context tokens get weight exactly 0; a context with no real token packs to zeros.
    """
    queries = pack_query.expand(key.shape[0], -1, -1, -1)  # P may be one [1, H, l, Dh] for the whole batch
    return softmax_attention(queries, key, value, attention_mask, scale=scale, dropout_p=dropout_p)


def luna_unpack(
    query: Tensor,
    packed_key: Tensor,
    packed_value: Tensor,
    *,
    scale: float | None = None,
    dropout_p: float = 0.0,
) -> Tensor:
    """Unpack attention: the N queries attend to the l packed tokens -> [B, H, N, Dh]."""
    return softmax_attention(query, packed_key, packed_value, scale=scale, dropout_p=dropout_p)


@padding_safe
def luna_attention(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attention_mask: Tensor | None = None,
    *,
    pack_query: Tensor,
    unpack_kv: Callable[[Tensor], tuple[Tensor, Tensor]] | None = None,
    scale: float | None = None,
    dropout_p: float = 0.0,
) -> Tensor:
    """Luna on [B, H, N, Dh]: pack with ``pack_query`` ([B or 1, H, l, Dh]), then unpack.

    ``unpack_kv`` maps the packed [B, H, l, Dh] to the unpack keys and values (the module uses its
    output/key/value projections); None uses the packed sequence as both.
    """
    check_qkv(query, key, value, attention_mask)
    if (
        not isinstance(pack_query, Tensor)
        or pack_query.dim() != 4
        or pack_query.shape[1] != query.shape[1]
        or pack_query.shape[-1] != key.shape[-1]
        or pack_query.shape[0] not in (1, query.shape[0])
    ):
        shape = list(pack_query.shape) if isinstance(pack_query, Tensor) else pack_query
        raise AttentionError(
            f"pack_query must be [B or 1, H, l, Dh] matching H={query.shape[1]}, "
            f"Dh={key.shape[-1]}, got {shape}"
        )
    packed = luna_pack(pack_query, key, value, attention_mask, scale=scale, dropout_p=dropout_p)
    packed_key, packed_value = (packed, packed) if unpack_kv is None else unpack_kv(packed)
    return luna_unpack(query, packed_key, packed_value, scale=scale, dropout_p=dropout_p)


def _plain_attention(q: Tensor, k: Tensor, v: Tensor, key_real: Tensor | None, scale: float) -> Tensor:
    scores = q @ k.transpose(-1, -2) * scale
    weights = torch.exp(scores - scores.amax(-1, keepdim=True))
    if key_real is not None:
        weights = weights * key_real[:, None, None, :]
    total = weights.sum(-1, keepdim=True)  # rows with nothing visible stay 0, finite gradients
    return weights / total.masked_fill(total == 0, 1.0) @ v


@padding_safe
def luna_attention_reference(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attention_mask: Tensor | None = None,
    *,
    pack_query: Tensor,
    unpack_kv: Callable[[Tensor], tuple[Tensor, Tensor]] | None = None,
    scale: float | None = None,
) -> Tensor:
    """Plain exp-normalise version of the two nested attentions; for tests only."""
    s = _scale(query.shape[-1], scale)
    packed = _plain_attention(pack_query, key, value, attention_mask, s)
    packed_key, packed_value = (packed, packed) if unpack_kv is None else unpack_kv(packed)
    return _plain_attention(query, packed_key, packed_value, None, s)


def _causal_product(x: Tensor, y: Tensor, z: Tensor, chunk_size: int) -> Tensor:
    """out_t = sum_{s <= t} (x_t . y_s) z_s on [B, H, N, *], chunk by chunk: an explicit C x C
    block inside a chunk and a carried sum of y_s z_s^T across chunks (never N x N), that sum in
    float32 for half inputs. All chunks at once: batched products, no loop."""
    b, h, n, _ = x.shape
    chunks = -(-n // chunk_size)
    tail = chunks * chunk_size - n
    x_c, y_c, z_c = (F.pad(t, (0, 0, 0, tail)).view(b, h, chunks, chunk_size, t.shape[-1]) for t in (x, y, z))
    within = torch.ones(chunk_size, chunk_size, dtype=torch.bool, device=x.device).tril()
    out = (x_c @ y_c.transpose(-1, -2)).masked_fill(~within, 0.0) @ z_c
    state = y_c.transpose(-1, -2) @ z_c  # [B, H, C, dy, dz]
    earlier = torch.cumsum(state, dim=2, dtype=compute_dtype(state.dtype)) - state  # earlier chunks only
    out = out + x_c @ earlier.to(x.dtype)
    return out.reshape(b, h, chunks * chunk_size, -1)[:, :, :n]


def _causal_counts(attention_mask: Tensor | None, batch: int, length: int, like: Tensor) -> Tensor:
    """Real tokens up to each position, at least 1: the causal pack's running-mean divisor [B, 1, N, 1],
    float32 for half ``like`` (bfloat16 counts stop being exact above 256)."""
    work = compute_dtype(like.dtype)
    if attention_mask is None:
        counts = torch.arange(1, length + 1, dtype=work, device=like.device).expand(batch, length)
    else:
        counts = torch.cumsum(attention_mask.to(work), dim=1).clamp_min(1.0)
    return counts[:, None, :, None]


def _pack_weights(
    pack_key: Tensor, pack_query: Tensor, attention_mask: Tensor | None, scale: float
) -> Tensor:
    """Causal pack weights elu(K_P P_Q^T) + 1 >= 0 per token and packed slot: [B, H, N, l]; 0 at padding."""
    weights = F.elu(pack_key @ pack_query.transpose(-1, -2) * scale) + 1.0
    if attention_mask is not None:
        weights = weights * attention_mask[:, None, :, None].to(weights.dtype)
    return weights


def luna_causal_attention(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attention_mask: Tensor | None = None,
    *,
    pack_key: Tensor,
    pack_query: Tensor,
    chunk_size: int = 64,
    scale: float | None = None,
    dropout_p: float = 0.0,
) -> Tensor:
    """Causal Luna on [B, H, N, Dh] (the autoregressive form): position t packs only tokens s <= t.

    Pack weights ``A_s = elu(pack_key_s . pack_query) + 1`` (a softmax over the sequence would
    look at the future); the packed keys/values at step t are running means over real tokens,
    ``(1/n_t) sum_{s<=t} A_s k_s``; query t then attends to the l packed slots with a softmax.
    Both nested products are computed chunk by chunk in O(N (C + l d)) memory.
    """
    check_qkv(query, key, value, attention_mask)
    check_qkv(pack_key, key, value, attention_mask)
    if not isinstance(chunk_size, int) or isinstance(chunk_size, bool) or chunk_size <= 0:
        raise AttentionError(f"chunk_size must be a positive int, got {chunk_size!r}")
    b, h, n, d = query.shape
    s = _scale(d, scale)
    pack = _pack_weights(pack_key, pack_query, attention_mask, s)  # [B, H, N, l]
    counts = _causal_counts(attention_mask, b, n, query)
    # q_t . packed keys at t; the scores, their softmax and the running means in float32 for half inputs
    scores = _causal_product(query, key, pack, chunk_size).to(counts.dtype) * s / counts
    probs = torch.softmax(scores, dim=-1)
    if dropout_p > 0:
        probs = F.dropout(probs, p=dropout_p)
    packed = _causal_product(probs.to(query.dtype), pack, value, chunk_size)  # probs_t . packed values at t
    return (packed.to(counts.dtype) / counts).to(query.dtype)


def luna_causal_attention_reference(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attention_mask: Tensor | None = None,
    *,
    pack_key: Tensor,
    pack_query: Tensor,
    scale: float | None = None,
) -> Tensor:
    """Plain version: packed keys/values for every step t, explicitly. Tests only."""
    b, h, n, d = query.shape
    s = _scale(d, scale)
    real = torch.ones(b, n, dtype=query.dtype) if attention_mask is None else attention_mask.to(query.dtype)
    pack = (F.elu(pack_key @ pack_query.transpose(-1, -2) * s) + 1.0) * real[:, None, :, None]
    past = torch.ones(n, n, dtype=query.dtype).tril()  # [t, s]: s <= t
    counts = (real @ past.T).clamp_min(1.0)[:, None, :, None]  # real tokens up to t
    packed_keys = torch.einsum("ts,bhsl,bhsd->bhtld", past, pack, key) / counts[..., None]
    packed_values = torch.einsum("ts,bhsl,bhsd->bhtld", past, pack, value) / counts[..., None]
    scores = torch.einsum("bhtd,bhtld->bhtl", query, packed_keys) * s
    return torch.einsum("bhtl,bhtld->bhtd", torch.softmax(scores, -1), packed_values)


@register_attention(
    "luna",
    capabilities=Capabilities(causal=True, subquadratic=True, uses_layer_state=True),
    functional=luna_attention,
    reference=luna_attention_reference,
    paper="Luna: Linear Unified Nested Attention (Ma et al., NeurIPS 2021)",
)
class LunaAttention(AttentionBase):
    """Luna attention: pack the sequence into l tokens with a learned P, unpack back to N.

    Options (paper defaults):
        pack_length: l, the length of P (16; the paper also reports 128 and 256).
        pack_heads: heads of the pack attention (None = ``heads``; the authors' code allows
            a different number).
        tie_kv: one shared key/value projection per attention (True, the authors' default);
            False = separate W^K and W^V.
        pass_p: with a ``layer_state`` dict, read the incoming P from the previous layer and write
            ``P' = LayerNorm(Y_P + P)`` for the next (True); False = every layer uses its own P.
            Causal layers read P but write nothing (their packed context differs per position).
        chunk_size: causal only -- chunk length of the prefix sums (64; speed/memory only).
        dropout: attention dropout while training.
        bias: biases of the projections.
    """

    def __init__(
        self,
        dim: int,
        heads: int,
        max_len: int | None = None,
        causal: bool = False,
        pack_length: int = 16,
        pack_heads: int | None = None,
        tie_kv: bool = True,
        pass_p: bool = True,
        chunk_size: int = 64,
        dropout: float = 0.0,
        bias: bool = True,
    ) -> None:
        super().__init__(dim, heads, max_len, causal)
        if not isinstance(pack_length, int) or isinstance(pack_length, bool) or pack_length <= 0:
            raise AttentionError(f"pack_length must be a positive int, got {pack_length!r}")
        pack_heads = heads if pack_heads is None else pack_heads
        if not _positive_int(pack_heads) or dim % pack_heads:
            raise AttentionError(
                f"pack_heads must be a positive divisor of dim={dim} or None, got {pack_heads!r}"
            )
        if not 0.0 <= dropout < 1.0:
            raise AttentionError(f"dropout must be in [0, 1), got {dropout!r}")
        if not isinstance(chunk_size, int) or isinstance(chunk_size, bool) or chunk_size <= 0:
            raise AttentionError(f"chunk_size must be a positive int, got {chunk_size!r}")
        if causal and pack_heads != heads:
            raise AttentionError("causal Luna packs and unpacks with the same heads: leave pack_heads unset")
        self.chunk_size = chunk_size
        self.pack_length = pack_length
        self.pack_heads = pack_heads
        self.tie_kv = tie_kv
        self.pass_p = pass_p
        self.dropout = dropout
        self.p = nn.Parameter(torch.randn(pack_length, dim) * dim**-0.5)  # the extra input P
        # pack attention Attn(P, X): queries from P, keys/values from the context X
        self.pack_q = nn.Linear(dim, dim, bias=bias)
        self.pack_k = nn.Linear(dim, dim, bias=bias)
        # causal Luna packs the unpack keys/values themselves: no separate pack values
        self.pack_v = None if tie_kv or causal else nn.Linear(dim, dim, bias=bias)
        # unpack attention Attn(X, Y_P): queries from X, keys/values from the packed Y_P
        self.unpack_q = nn.Linear(dim, dim, bias=bias)
        self.unpack_k = nn.Linear(dim, dim, bias=bias)
        self.unpack_v = None if tie_kv else nn.Linear(dim, dim, bias=bias)
        self.to_out = nn.Linear(dim, dim, bias=bias)
        # P' = LayerNorm(Y_P + P) for the next layer (bidirectional only)
        self.p_norm = None if causal else nn.LayerNorm(dim)

    def incoming_p(self, batch: int, layer_state: dict | None) -> Tensor:
        """P for this layer: the previous layer's P' if it left one, else this layer's parameter."""
        if self.pass_p and layer_state is not None and P_KEY in layer_state:
            p = layer_state[P_KEY]
            if not isinstance(p, Tensor) or p.shape != (batch, self.pack_length, self.dim):
                shape = list(p.shape) if isinstance(p, Tensor) else type(p).__name__
                raise AttentionError(
                    f"layer_state[{P_KEY!r}] must be [B, l, dim] = [{batch}, {self.pack_length}, "
                    f"{self.dim}], got {shape}: consecutive Luna layers need the same pack_length and dim"
                )
            return p
        return self.p.unsqueeze(0).expand(batch, -1, -1)

    def pack(self, x: Tensor, p_in: Tensor, attention_mask: Tensor | None) -> Tensor:
        """Y_P = Attn(P, X): [B, l, dim] (heads merged, no output map)."""
        key = self.pack_k(x)
        value = key if self.pack_v is None else self.pack_v(x)
        packed = luna_pack(
            split_heads(self.pack_q(p_in), self.pack_heads),
            split_heads(key, self.pack_heads),
            split_heads(value, self.pack_heads),
            attention_mask,
            dropout_p=self.dropout if self.training else 0.0,
        )
        return merge_heads(packed)

    def attend(self, x: Tensor, attention_mask: Tensor | None, layer_state: dict | None) -> Tensor:
        p_in = self.incoming_p(x.shape[0], layer_state)
        if self.causal:
            return self.attend_causal(x, p_in, attention_mask)
        y_p = self.pack(x, p_in, attention_mask)
        key = self.unpack_k(y_p)
        value = key if self.unpack_v is None else self.unpack_v(y_p)
        out = luna_unpack(
            split_heads(self.unpack_q(x), self.heads),
            split_heads(key, self.heads),
            split_heads(value, self.heads),
            dropout_p=self.dropout if self.training else 0.0,
        )
        if self.pass_p and layer_state is not None:
            layer_state[P_KEY] = self.p_norm(y_p + p_in)
        return self.to_out(merge_heads(out))

    def attend_causal(self, x: Tensor, p_in: Tensor, attention_mask: Tensor | None) -> Tensor:
        """Autoregressive Luna: the keys/values packed up to each position, then unpacked."""
        key = self.unpack_k(x)
        value = key if self.unpack_v is None else self.unpack_v(x)
        out = luna_causal_attention(
            split_heads(self.unpack_q(x), self.heads),
            split_heads(key, self.heads),
            split_heads(value, self.heads),
            attention_mask,
            pack_key=split_heads(self.pack_k(x), self.heads),
            pack_query=split_heads(self.pack_q(p_in), self.heads),
            chunk_size=self.chunk_size,
            dropout_p=self.dropout if self.training else 0.0,
        )
        return self.to_out(merge_heads(out))

    def extra_repr(self) -> str:
        return (
            f"{super().extra_repr()}, causal={self.causal}, pack_length={self.pack_length}, "
            f"pack_heads={self.pack_heads}, "
            f"tie_kv={self.tie_kv}, pass_p={self.pass_p}"
        )

    # -- decoding: the packed sums and the count of real tokens -----------------------------------
    decode_state = "recurrent"

    def _causal_parts(self, x: Tensor, layer_state: dict | None) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
        """Queries, keys, values, pack keys [B, H, N, d] and the pack queries [B, H, l, d] of causal Luna."""
        key = self.unpack_k(x)
        value = key if self.unpack_v is None else self.unpack_v(x)
        p_in = self.incoming_p(x.shape[0], layer_state)
        return (split_heads(self.unpack_q(x), self.heads), split_heads(key, self.heads), split_heads(value, self.heads),
                split_heads(self.pack_k(x), self.heads), split_heads(self.pack_q(p_in), self.heads))

    def prefill_attend(self, x: Tensor, attention_mask: Tensor | None,
                       layer_state: dict | None) -> tuple[Tensor, RecurrentState]:
        query, key, value, pack_key, pack_query = self._causal_parts(x, layer_state)
        out = luna_causal_attention(query, key, value, attention_mask, pack_key=pack_key, pack_query=pack_query,
                                    chunk_size=self.chunk_size, dropout_p=self.dropout if self.training else 0.0)
        pack = _pack_weights(pack_key, pack_query, attention_mask, _scale(self.head_dim, None))  # [B, H, N, l]
        b, n = x.shape[:2]
        count = (query.new_full((b,), n) if attention_mask is None else attention_mask.sum(1).to(query.dtype))
        count = count[:, None, None, None]  # real tokens so far (the running means' divisor, floored at 1 when used)
        state = RecurrentState(length=x.shape[1], sums=key.transpose(-1, -2) @ pack,  # sum_s k_s A_s^T [d, l]
                               extra={"packed_values": pack.transpose(-1, -2) @ value, "count": count})
        return self.to_out(merge_heads(out)), state

    def step_attend(self, x: Tensor, state: RecurrentState, real: Tensor | None,
                    layer_state: dict | None) -> tuple[Tensor, RecurrentState]:
        """A_t = elu(pack_key_t . P_Q) + 1 joins both packed sums; q_t attends to the l running means."""
        query, key, value, pack_key, pack_query = self._causal_parts(x, layer_state)
        scale = _scale(self.head_dim, None)
        pack = _pack_weights(pack_key, pack_query, None if real is None else real[:, None], scale)  # [B, H, 1, l]
        state.sums = state.sums + key.transpose(-1, -2) @ pack
        state.extra["packed_values"] = state.extra["packed_values"] + pack.transpose(-1, -2) @ value
        added = 1.0 if real is None else real.to(query.dtype)[:, None, None, None]
        state.extra["count"] = state.extra["count"] + added
        counts = state.extra["count"].clamp_min(1.0)
        probs = torch.softmax(query @ state.sums * scale / counts, dim=-1)
        if self.training and self.dropout > 0:
            probs = F.dropout(probs, p=self.dropout)
        return self.to_out(merge_heads(probs @ state.extra["packed_values"] / counts)), state
