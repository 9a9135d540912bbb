"""FLASH (Hua et al., 2022, "Transformer Quality in Linear Time"): the gated attention unit (GAU)
with mixed chunk attention.

GAU (Sec. 2) fuses attention and the GLU feed-forward network into one single-head layer:

* ``U = phi_u(X W_u)``, ``V = phi_v(X W_v)`` (eq. 2, both SiLU as in the paper's code) and a small
  shared ``Z = phi_z(X W_z)`` of width s = 128 (eq. 4);
* queries and keys are cheap per-dim scale-and-offset maps of Z (``Z * gamma + beta``, like a
  LayerNorm's affine part), with RoPE on top;
* ``O = (U o A V) W_o`` (eq. 3) with a squared-ReLU attention ``A = relu^2(Q K^T + b)`` (eq. 4).

Mixed chunk attention (Sec. 3.2) makes it linear in N: the sequence is cut into G chunks of
c = 256 tokens; four scale-and-offset maps of Z give Q^quad, K^quad, Q^lin, K^lin, and per chunk g

* ``V^quad_g = relu^2(Q^quad_g K^quad_g^T + b) V_g``, quadratic only within the chunk (eq. 6;
  causally masked for a decoder);
* ``V^lin_g = Q^lin_g sum_h K^lin_h^T V_h`` over all chunks (eq. 7), or for a decoder over the
  earlier chunks h < g only (eq. 8, a prefix sum over chunks);
* ``O_g = [U_g o (V^quad_g + V^lin_g)] W_o`` (eq. 9).

The normalisers (1/c, 1/n, 1/sqrt(s)) are the ``scaling`` option; docs/flash.md says which of
them the paper shows and which are our choice.
GAU replaces attention *and* the feed-forward network: the mechanism declares
``replaces_ffn=True`` and the longattn models drop their FFN around it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from longattn.attention.base import (
    AttentionBase,
    AttentionError,
    Capabilities,
    check_qkv,
    compute_dtype,
    padding_safe,
    register_attention,
    uses_gpu_path,
)
from longattn.attention.decoding import DecodingState, ones_or

__all__ = ["FlashGAU", "FlashState", "SCALINGS", "mixed_chunk_attention", "mixed_chunk_attention_reference", "rotary"]

#: "length": (1/c) relu^2(QK^T/sqrt(s) + b) within chunks, linear term / (tokens summed);
#: "none": eqs. 6-8 exactly as printed, no normaliser.
SCALINGS = ("length", "none")


def rotary(x: Tensor, base: float = 10000.0, start: int = 0) -> Tensor:
    """RoPE (Su et al.) on [..., N, s], half-split pairs: rotates pair i by angle n * base^(-2i/s) at positions
    n = start .. start + N - 1."""
    length, width = x.shape[-2:]
    half = width // 2
    freq = base ** (-torch.arange(half, dtype=torch.float64, device=x.device) / half)
    angle = torch.arange(start, start + length, dtype=torch.float64, device=x.device)[:, None] * freq
    cos, sin = angle.cos().to(x.dtype), angle.sin().to(x.dtype)
    x1, x2 = x[..., :half], x[..., half : 2 * half]
    return torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos, x[..., 2 * half :]], dim=-1)


def _check_flash_inputs(
    query: Tensor, key: Tensor, value: Tensor, attention_mask: Tensor | None,
    linear_query: Tensor, linear_key: Tensor, chunk_size: int, position_bias: Tensor | None, scaling: str,
) -> None:
    check_qkv(query, key, value, attention_mask)
    for label, t in (("linear_query", linear_query), ("linear_key", linear_key)):
        if not isinstance(t, Tensor) or t.shape != query.shape or t.dtype != query.dtype:
            raise AttentionError(f"{label} must be a {query.dtype} tensor shaped like query {list(query.shape)}")
    if query.shape[2] != key.shape[2]:
        raise AttentionError("mixed chunk attention is self-attention: query and key lengths must match")
    if not isinstance(chunk_size, int) or chunk_size < 1:
        raise AttentionError(f"chunk_size must be a positive int, got {chunk_size!r}")
    if position_bias is not None and position_bias.shape != (2 * chunk_size - 1,):
        raise AttentionError(
            f"position_bias must hold one bias per relative offset, [2 * chunk_size - 1] = "
            f"[{2 * chunk_size - 1}], got {list(position_bias.shape)}"
        )
    if scaling not in SCALINGS:
        raise AttentionError(f"scaling must be one of {SCALINGS}, got {scaling!r}")


def _relative_bias(position_bias: Tensor, chunk: int, chunk_size: int) -> Tensor:
    """[chunk, chunk] bias b[i, j] = position_bias[j - i + chunk_size - 1] within one chunk."""
    offsets = torch.arange(chunk, device=position_bias.device)
    return position_bias[offsets[None, :] - offsets[:, None] + chunk_size - 1]


@padding_safe
def mixed_chunk_attention(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attention_mask: Tensor | None = None,
    *,
    linear_query: Tensor,
    linear_key: Tensor,
    chunk_size: int = 256,
    causal: bool = False,
    position_bias: Tensor | None = None,
    scaling: str = "length",
) -> Tensor:
    """``V^quad + V^lin`` of eqs. 6-8 on [B, H, N, s] queries/keys and [B, H, N, e] values.

    ``query, key`` are Q^quad, K^quad; ``linear_query, linear_key`` Q^lin, K^lin. Sequences with
    N <= chunk_size are one chunk; longer ones are padded (as padding) to whole chunks.
    Memory is O(N c + (N / c) s e): no N x N tensor.
    """
    _check_flash_inputs(query, key, value, attention_mask, linear_query, linear_key, chunk_size, position_bias, scaling)
    batch, heads, length, width = query.shape
    chunk = min(chunk_size, length)
    chunks = -(-length // chunk)
    pad = chunks * chunk - length
    real = (
        torch.ones(batch, length, dtype=torch.bool, device=query.device)
        if attention_mask is None else attention_mask
    )
    padded = ~real[:, None, :, None]  # replaced (not multiplied) by zeros: padding contributes nothing
    value = value.masked_fill(padded, 0.0)
    linear_query, linear_key = linear_query.masked_fill(padded, 0.0), linear_key.masked_fill(padded, 0.0)

    def chunked(t: Tensor) -> Tensor:  # [B, H, N, w] -> [B, H, G, c, w]
        return F.pad(t, (0, 0, 0, pad)).unflatten(2, (chunks, chunk))

    q, k, v = chunked(query), chunked(key), chunked(value)
    q_lin, k_lin = chunked(linear_query), chunked(linear_key)
    # eq. 6: squared-ReLU attention within each chunk, relu^2 in float32 for half inputs (it overflows float16)
    scores = (q @ k.transpose(-1, -2)).to(compute_dtype(q.dtype))  # [B, H, G, c, c]
    if scaling == "length":
        scores = scores / math.sqrt(width)
    if position_bias is not None:
        scores = scores + _relative_bias(position_bias, chunk, chunk_size)
    weights = F.relu(scores).square()
    if causal:
        weights = weights.tril()
    if scaling == "length":
        weights = weights / chunk
    quad = weights.to(v.dtype) @ v
    # eqs. 7-8: linear attention across chunks
    if causal:
        kv = k_lin.transpose(-1, -2) @ v  # [B, H, G, s, e], one summary per chunk
        kv = kv.cumsum(2, dtype=compute_dtype(kv.dtype)) - kv  # eq. 8: chunks h < g only, summed in float32
        if scaling == "length":  # / the real tokens of the earlier chunks (before the product: half's range)
            per_chunk = F.pad(real, (0, pad)).view(batch, chunks, chunk).sum(-1)
            before = (per_chunk.cumsum(1) - per_chunk).clamp_min(1).to(kv.dtype)
            kv = kv / before[:, None, :, None, None]
        lin = q_lin @ kv.to(q_lin.dtype)
    else:
        if scaling == "length":  # / the real tokens, before the sum over them: it stays in half precision's range
            count = real.sum(-1).clamp_min(1).to(compute_dtype(linear_key.dtype))[:, None, None, None]
            linear_key = (linear_key / count).to(value.dtype)
        kv = linear_key.transpose(-1, -2) @ value  # eq. 7: [B, H, s, e], all chunks at once
        lin = q_lin @ kv[:, :, None]
    return (quad + lin).flatten(2, 3)[:, :, :length]


@padding_safe
def mixed_chunk_attention_reference(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attention_mask: Tensor | None = None,
    *,
    linear_query: Tensor,
    linear_key: Tensor,
    chunk_size: int = 256,
    causal: bool = False,
    position_bias: Tensor | None = None,
    scaling: str = "length",
) -> Tensor:
    """Eqs. 6-8 written plainly: a loop over chunks, the quadratic part as an explicit c x c
    matrix with masks, the linear part as an explicit sum over the chunks h it may see. Tests only."""
    batch, heads, length, width = query.shape
    chunk = min(chunk_size, length)
    real = (
        torch.ones(batch, length, dtype=torch.bool) if attention_mask is None else attention_mask
    ).to(query.dtype)[:, None, :, None]  # [B, 1, N, 1]
    starts = list(range(0, length, chunk))
    out = []
    for g, start in enumerate(starts):
        rows = slice(start, min(start + chunk, length))
        size = rows.stop - rows.start
        # eq. 6
        scores = query[:, :, rows] @ key[:, :, rows].transpose(-1, -2)
        if scaling == "length":
            scores = scores / math.sqrt(width)
        if position_bias is not None:
            i = torch.arange(size)
            scores = scores + position_bias[(i[None, :] - i[:, None]) + chunk_size - 1]
        allowed = real[:, :, rows].transpose(-1, -2).expand(batch, heads, size, size)
        if causal:
            allowed = allowed * torch.ones(size, size, dtype=query.dtype).tril()
        a = torch.relu(scores) ** 2 * allowed
        if scaling == "length":
            a = a / chunk
        quad = a @ value[:, :, rows]
        # eq. 7 (all chunks) or eq. 8 (earlier chunks)
        seen = starts[:g] if causal else starts
        total = torch.zeros(batch, heads, width, value.shape[-1], dtype=query.dtype)
        count = torch.zeros(batch, 1, 1, 1, dtype=query.dtype)
        for h_start in seen:
            cols = slice(h_start, min(h_start + chunk, length))
            keep = real[:, :, cols]
            key_h = torch.where(keep.bool(), linear_key[:, :, cols], 0.0)
            total = total + key_h.transpose(-1, -2) @ torch.where(keep.bool(), value[:, :, cols], 0.0)
            count = count + keep.sum(2, keepdim=True)
        if scaling == "length":
            total = total / count.clamp_min(1)
        out.append(quad + linear_query[:, :, rows] @ total)
    return torch.cat(out, dim=2)


@register_attention(
    "flash",
    capabilities=Capabilities(causal=True, subquadratic=True, replaces_ffn=True),
    functional=mixed_chunk_attention,
    reference=mixed_chunk_attention_reference,
    paper="Transformer Quality in Linear Time (Hua, Dai, Liu and Le, ICML 2022)",
)
class FlashGAU(AttentionBase):
    """FLASH: one gated attention unit with mixed chunk attention (single head: ``heads`` unused).

    Replaces a Transformer block's attention *and* feed-forward network (``replaces_ffn``); the
    paper stacks twice as many GAU layers as Transformer layers for the same parameters.

    Options (paper defaults):
        expansion_factor: e = expansion_factor * dim, the width of U and V (2).
        query_key_dim: s, the width of Z (128).
        chunk_size: c, the chunk length of mixed chunk attention (256).
        scaling: "length" or "none", the normalisers (see docs/flash.md).
        relative_bias: a learned bias per relative offset within a chunk (b of eqs. 4, 6).
        rotary: RoPE on the four query/key maps.
        bias: biases of the dense layers.
    """

    def __init__(
        self,
        dim: int,
        heads: int,
        max_len: int | None = None,
        causal: bool = False,
        expansion_factor: float = 2.0,
        query_key_dim: int = 128,
        chunk_size: int = 256,
        scaling: str = "length",
        relative_bias: bool = True,
        rotary: bool = True,
        bias: bool = True,
    ) -> None:
        super().__init__(dim, heads, max_len, causal)
        hidden = int(expansion_factor * dim)
        if hidden < 1:
            raise AttentionError(f"expansion_factor * dim must be at least 1, got {expansion_factor!r} * {dim}")
        if not isinstance(query_key_dim, int) or query_key_dim < 1:
            raise AttentionError(f"query_key_dim must be a positive int, got {query_key_dim!r}")
        if not isinstance(chunk_size, int) or chunk_size < 1:
            raise AttentionError(f"chunk_size must be a positive int, got {chunk_size!r}")
        if scaling not in SCALINGS:
            raise AttentionError(f"scaling must be one of {SCALINGS}, got {scaling!r}")
        self.hidden, self.query_key_dim, self.chunk_size = hidden, query_key_dim, chunk_size
        self.scaling, self.rotary = scaling, rotary
        # [U, V, Z] = SiLU(X [W_u, W_v, W_z]) in one dense layer (eqs. 2, 4)
        self.to_hidden = nn.Linear(dim, 2 * hidden + query_key_dim, bias=bias)
        # per-dim scale and offset for Q^quad, K^quad, Q^lin, K^lin; the paper inits gamma ~ N(0, 0.02)
        self.gamma = nn.Parameter(torch.randn(4, query_key_dim) * 0.02)
        self.beta = nn.Parameter(torch.zeros(4, query_key_dim))
        self.position_bias = nn.Parameter(torch.zeros(2 * chunk_size - 1)) if relative_bias else None
        self.to_out = nn.Linear(hidden, dim, bias=bias)

    def gates_and_queries(self, x: Tensor, keep_dtype: bool = False,
                          start: int = 0) -> tuple[Tensor, Tensor, list[Tensor]]:
        """(U [B, N, e], V [B, N, e], [Q^quad, K^quad, Q^lin, K^lin] each [B, 1, N, s]) of the tokens at positions
        start .. start + N - 1; with ``keep_dtype`` the four maps in Z's dtype (the autocast dtype under
        autocast), not promoted by gamma and beta."""
        u, v, z = F.silu(self.to_hidden(x)).split([self.hidden, self.hidden, self.query_key_dim], dim=-1)
        maps = z.unsqueeze(-2) * self.gamma + self.beta
        maps = (maps.to(z.dtype) if keep_dtype else maps).unbind(-2)
        maps = [rotary(m, start=start) if self.rotary else m for m in maps]
        return u, v, [m.unsqueeze(1) for m in maps]

    def attend(self, x: Tensor, attention_mask: Tensor | None, layer_state: dict | None) -> Tensor:
        if uses_gpu_path(x):
            # U, V and the maps stay in the projections' dtype; mixed chunk attention takes relu^2 and its sums
            # in float32 (no float32 copy of the [B, N, e] gates)
            u, v, (q_quad, k_quad, q_lin, k_lin) = self.gates_and_queries(x, keep_dtype=True)
            mixed = mixed_chunk_attention(
                q_quad, k_quad, v.unsqueeze(1), attention_mask, linear_query=q_lin, linear_key=k_lin,
                chunk_size=self.chunk_size, causal=self.causal, position_bias=self.position_bias, scaling=self.scaling,
            )
            return self.to_out(u * mixed[:, 0])  # eq. 9
        work = compute_dtype(x.dtype)  # relu^2 and the chunk sums overflow half precision
        u, v, (q_quad, k_quad, q_lin, k_lin) = self.gates_and_queries(x)
        bias = None if self.position_bias is None else self.position_bias.to(work)
        mixed = mixed_chunk_attention(
            q_quad.to(work), k_quad.to(work), v.unsqueeze(1).to(work), attention_mask,
            linear_query=q_lin.to(work), linear_key=k_lin.to(work), chunk_size=self.chunk_size,
            causal=self.causal, position_bias=bias, scaling=self.scaling,
        )
        return self.to_out((u.to(work) * mixed[:, 0]).to(x.dtype))  # eq. 9

    def extra_repr(self) -> str:
        return (
            f"{super().extra_repr()}, hidden={self.hidden}, query_key_dim={self.query_key_dim}, "
            f"chunk_size={self.chunk_size}, scaling={self.scaling!r}, rotary={self.rotary}, causal={self.causal}"
        )

    # -- decoding: the current chunk's tokens and the linear-attention sum over the completed chunks --
    decode_state = "chunked"

    def prefill_attend(self, x: Tensor, attention_mask: Tensor | None,
                       layer_state: dict | None) -> tuple[Tensor, FlashState]:
        b, n = x.shape[:2]
        if self.scaling == "length" and n < self.chunk_size:
            raise AttentionError(
                f"FLASH decodes a prompt of {n} tokens only from one whole chunk (chunk_size={self.chunk_size}) on: "
                "below it its causal normaliser 1/min(c, N) follows the sequence length, so the earlier positions' "
                "outputs change as the sequence grows and no state can carry them; prefill at least chunk_size "
                "tokens, use scaling='none', or recompute (use_cache=False)"
            )
        work = compute_dtype(x.dtype)
        _, v, (_, k_quad, _, k_lin) = self.gates_and_queries(x)
        real = torch.ones(b, n, dtype=torch.bool, device=x.device) if attention_mask is None else attention_mask
        v = v.unsqueeze(1).to(work).masked_fill(~real[:, None, :, None], 0.0)
        k_lin = k_lin.to(work).masked_fill(~real[:, None, :, None], 0.0)
        start = (n - 1) // self.chunk_size * self.chunk_size  # the chunk of the last token: kept whole
        state = FlashState(length=n, key=k_quad[:, :, start:].to(work), linear_key=k_lin[:, :, start:],
                           value=v[:, :, start:], real=real[:, start:],
                           summary=k_lin[:, :, :start].transpose(-1, -2) @ v[:, :, :start],
                           count=real[:, :start].sum(1).to(work))
        return self.attend(x, attention_mask, layer_state), state

    def step_attend(self, x: Tensor, state: FlashState, real: Tensor | None,
                    layer_state: dict | None) -> tuple[Tensor, FlashState]:
        """Eq. 6 over the new token's chunk so far plus eq. 8 over the completed chunks (their summed K^lin^T V)."""
        t, c = state.length, self.chunk_size
        work = compute_dtype(x.dtype)
        real = ones_or(real, x.shape[0], x.device)
        if t % c == 0:  # a new chunk starts: the finished one joins the linear part
            state.summary = state.summary + state.linear_key.transpose(-1, -2) @ state.value
            state.count = state.count + state.real.sum(1).to(work)
            state.key, state.linear_key = state.key[:, :, :0], state.linear_key[:, :, :0]
            state.value, state.real = state.value[:, :, :0], state.real[:, :0]
        u, v, (q_quad, k_quad, q_lin, k_lin) = self.gates_and_queries(x, start=t)
        keep = real[:, None, None, None]
        state.key = torch.cat([state.key, k_quad.to(work)], 2)
        state.linear_key = torch.cat([state.linear_key, k_lin.to(work).masked_fill(~keep, 0.0)], 2)
        state.value = torch.cat([state.value, v.unsqueeze(1).to(work).masked_fill(~keep, 0.0)], 2)
        state.real = torch.cat([state.real, real[:, None]], 1)
        scores = q_quad.to(work) @ state.key.transpose(-1, -2)  # [B, 1, 1, keys of the chunk so far]
        if self.scaling == "length":
            scores = scores / math.sqrt(self.query_key_dim)
        if self.position_bias is not None:
            offsets = torch.arange(-state.key.shape[2] + 1, 1, device=x.device)  # j - t
            scores = scores + self.position_bias.to(work)[offsets + c - 1]
        quad = F.relu(scores).square() @ state.value
        lin = q_lin.to(work).masked_fill(~keep, 0.0) @ state.summary
        if self.scaling == "length":
            quad = quad / min(c, t + 1)
            lin = lin / state.count.clamp_min(1)[:, None, None, None]
        return self.to_out((u.to(work) * (quad + lin)[:, 0]).to(x.dtype)), state


@dataclass
class FlashState(DecodingState):
    """FLASH's decoding state: K^quad, K^lin, V and real flags of the tokens of the current chunk, and the completed
    chunks' sum of K^lin^T V (``summary``, [B, 1, s, e]) with their number of real tokens (``count``, [B])."""

    key: Tensor | None = None
    linear_key: Tensor | None = None
    value: Tensor | None = None
    real: Tensor | None = None
    summary: Tensor | None = None
    count: Tensor | None = None
