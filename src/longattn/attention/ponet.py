"""PoNet (Tan et al., 2021): multi-granularity pooling in place of self-attention, in O(N d).

Six linear maps of the input give H_Q, H_K, H_V (global aggregation), H_s (segment max-pooling),
H_l (local max-pooling) and H_o (the fusion's token features). Per head, on [B, H, N, Dh]:

* Global aggregation, two steps: g = mean_n H_Q^n over the real tokens (eq. 1), then g is the
  single query of a cross-attention over the tokens, g' = Attention{g, H_K, H_V} (eq. 2);
* Segment max-pooling: s^j = max_{n in segment j} H_s^n, channel-wise (eq. 3);
* Local max-pooling: l^n = max_{|m - n| <= k // 2} H_l^m, stride 1, length kept (eq. 4);
* Pooling fusion: G^n = g' o H_o^n, S^n = s^{seg(n)} o H_o^n (eq. 5) and O = G + S + L (eq. 6),
  i.e. ``(g' + s^{seg(n)}) o H_o^n + l^n``, followed by the output projection.

Padded tokens take no part in any pooling (they are -inf for the max-poolings and have zero
weight in the mean and the softmax); segments and windows are positional, so padding between
real tokens still separates them (see docs/ponet.md).

Equation numbers follow the paper's Section 3 as recalled without its text; docs/ponet.md
lists every choice made where the recollection is uncertain, each an option.
"""

from __future__ import annotations

import math

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
    merge_heads,
    register_attention,
    split_heads,
    uses_gpu_path,
)

__all__ = ["PoNetMixing", "fixed_segment_ids", "ponet_mixing", "ponet_mixing_reference"]

#: The three poolings fused in eq. 6; leaving one out is the paper's ablation of that component.
PARTS = ("global", "segment", "local")

#: ``layer_state`` key where a model may put segment ids [B, N] (e.g. sentence numbers) for SMP.
SEGMENT_IDS_KEY = "segment_ids"


def fixed_segment_ids(batch: int, length: int, segment_num: int, device: torch.device | None = None) -> Tensor:
    """Segment ids [B, N] splitting the positions into ``segment_num`` equal runs of
    ``length // segment_num + 1`` tokens (the last shorter), the split the authors' LRA code uses."""
    segment_len = length // segment_num + 1
    return (torch.arange(length, device=device) // segment_len).expand(batch, length)


def _check_segment_ids(segment_ids: Tensor, batch: int, length: int, device: torch.device,
                       read_values: bool = True) -> None:
    if not isinstance(segment_ids, Tensor) or segment_ids.dtype not in (torch.int32, torch.int64):
        raise AttentionError("segment_ids must be an integer (int32/int64) tensor [B, N]")
    if segment_ids.shape != (batch, length):
        raise AttentionError(
            f"segment_ids must have shape [B, N] = [{batch}, {length}], got {list(segment_ids.shape)}"
        )
    if segment_ids.device != device:
        raise AttentionError(f"segment_ids are on {segment_ids.device} but the input is on {device}")
    if read_values and segment_ids.numel() and int(segment_ids.min()) < 0:
        raise AttentionError("segment_ids must be non-negative")


def _compact_segments(segment_ids: Tensor, num_segments: int | None) -> tuple[Tensor, int]:
    """Segment ids as 0..S-1 and the buffer size S for the segment maxima (eq. 3). CPU path: the labels
    that occur (``torch.unique``); GPU path, which must not read values back: ids already in
    0..num_segments-1 as they are, any others ranked within their own sequence (a sort, then a running
    count of label changes), in a buffer of N slots."""
    if not uses_gpu_path(segment_ids):
        labels, compact = torch.unique(segment_ids, return_inverse=True)  # any labels -> 0..S-1
        return compact, labels.numel()
    if num_segments is not None:
        return segment_ids, num_segments
    ordered, order = segment_ids.sort(dim=1, stable=True)
    change = F.pad(ordered[:, 1:] != ordered[:, :-1], (1, 0), value=False)
    return torch.empty_like(ordered).scatter_(1, order, change.long().cumsum(1)), segment_ids.shape[1]


def _check_pooling_inputs(tensors: dict[str, Tensor], like: Tensor, kernel_size: int) -> None:
    for label, t in tensors.items():
        if not isinstance(t, Tensor) or t.shape != like.shape or t.dtype != like.dtype:
            raise AttentionError(
                f"{label} must be a {like.dtype} tensor shaped like query {list(like.shape)}, "
                f"got {getattr(t, 'dtype', type(t).__name__)} {list(getattr(t, 'shape', []))}"
            )
    if not isinstance(kernel_size, int) or kernel_size < 1 or kernel_size % 2 == 0:
        raise AttentionError(f"local max-pooling kernel_size must be a positive odd int, got {kernel_size!r}")


def _check_parts(parts: tuple[str, ...]) -> None:
    if not isinstance(parts, (tuple, list)) or not parts or any(p not in PARTS for p in parts):
        raise AttentionError(f"parts must be a non-empty subset of {PARTS}, got {parts!r}")


def _real(attention_mask: Tensor | None, like: Tensor) -> Tensor:
    """Bool [B, 1, N, 1] of real tokens."""
    if attention_mask is None:
        return torch.ones(like.shape[0], 1, like.shape[2], 1, dtype=torch.bool, device=like.device)
    return attention_mask[:, None, :, None]


@padding_safe
def ponet_mixing(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attention_mask: Tensor | None = None,
    *,
    segment: Tensor,
    local: Tensor,
    gate: Tensor,
    segment_ids: Tensor,
    kernel_size: int = 3,
    scale: float | None = None,
    parts: tuple[str, ...] = PARTS,
    num_segments: int | None = None,
) -> Tensor:
    """PoNet's token mixing (eqs. 1-6) on [B, H, N, Dh]: ``query, key, value`` are H_Q, H_K, H_V,
    ``segment, local, gate`` are H_s, H_l, H_o; ``segment_ids`` [B, N] name each token's segment
    (``num_segments``: they are already 0..num_segments-1, as :func:`fixed_segment_ids` makes them).

    Returns ``(g' + s^{seg(n)}) o H_o^n + l^n``; rows of padded tokens are zero. The GPU path reads no
    value back to the host (negative ids are then not refused: they work like any other label).
    """
    check_qkv(query, key, value, attention_mask)
    _check_pooling_inputs({"segment": segment, "local": local, "gate": gate}, query, kernel_size)
    _check_parts(parts)
    batch, heads, length, head_dim = query.shape
    _check_segment_ids(segment_ids, batch, length, query.device, read_values=not uses_gpu_path(query))
    real = _real(attention_mask, query)
    gate = gate.masked_fill(~real, 0.0)  # replaced, not multiplied: whatever padding holds stays out
    # eq. 1: g = mean of H_Q over the real tokens
    work = compute_dtype(query.dtype)  # the mean over N tokens summed in float32 for half inputs
    count = real.sum(2, keepdim=True).clamp_min(1).to(work)
    g = (query.masked_fill(~real, 0.0).sum(2, keepdim=True, dtype=work) / count).to(query.dtype)  # [B, H, 1, Dh]
    # eq. 2: g' = Attention{g, H_K, H_V}, a one-query cross-attention (SDPA)
    sdpa_mask = None
    if attention_mask is not None:  # a sequence without real tokens attends to all (zeroed below): no NaN
        sdpa_mask = (attention_mask | ~attention_mask.any(-1, keepdim=True))[:, None, None, :]
    g_prime = F.scaled_dot_product_attention(g, key, value, attn_mask=sdpa_mask, scale=scale)
    g_prime = g_prime.masked_fill(~real.any(2, keepdim=True), 0.0)
    # eq. 3: channel-wise max over each segment's real tokens, broadcast back to its tokens
    lowest = float("-inf")
    flat = segment.masked_fill(~real, lowest).transpose(1, 2).reshape(batch, length, heads * head_dim)
    compact, slots = _compact_segments(segment_ids, num_segments)
    index = compact.unsqueeze(-1).expand_as(flat)
    seg_max = flat.new_full((batch, slots, heads * head_dim), lowest)
    seg_max = seg_max.scatter_reduce(1, index, flat, reduce="amax", include_self=False)
    seg = seg_max.gather(1, index).view(batch, length, heads, head_dim).transpose(1, 2)
    # eq. 4: sliding max over k positions (stride 1), padded tokens at -inf
    pooled = F.max_pool1d(
        local.masked_fill(~real, lowest).flatten(0, 1).transpose(1, 2),
        kernel_size, stride=1, padding=kernel_size // 2,
    )
    loc = pooled.transpose(1, 2).view_as(local)
    # eqs. 5-6: O = G + S + L. Padded rows are -inf in seg and loc (an all-padded segment or
    # window): zero them before the product, or its backward computes 0 * inf = NaN.
    zero = torch.zeros((), dtype=query.dtype, device=query.device)
    seg, loc = torch.where(real, seg, zero), torch.where(real, loc, zero)
    pooled = (g_prime if "global" in parts else zero) + (seg if "segment" in parts else zero)
    return (pooled * gate + (loc if "local" in parts else zero)).masked_fill(~real, 0.0)


@padding_safe
def ponet_mixing_reference(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attention_mask: Tensor | None = None,
    *,
    segment: Tensor,
    local: Tensor,
    gate: Tensor,
    segment_ids: Tensor,
    kernel_size: int = 3,
    scale: float | None = None,
    parts: tuple[str, ...] = PARTS,
) -> Tensor:
    """Eqs. 1-6 written plainly with loops over sequences, segments and positions; tests only."""
    batch, heads, length, head_dim = query.shape
    scale = 1.0 / math.sqrt(head_dim) if scale is None else scale
    real = _real(attention_mask, query)[:, 0, :, 0]  # [B, N]
    radius = kernel_size // 2
    out = torch.zeros_like(query)
    for b in range(batch):
        tokens = real[b].nonzero().flatten()
        if tokens.numel() == 0:
            continue
        g = query[b][:, tokens].mean(1)  # eq. 1, [H, Dh]
        scores = torch.einsum("hd,hnd->hn", g, key[b][:, tokens]) * scale
        weights = torch.exp(scores - scores.amax(-1, keepdim=True))
        g_prime = torch.einsum("hn,hnd->hd", weights / weights.sum(-1, keepdim=True), value[b][:, tokens])  # eq. 2
        for n in tokens.tolist():
            members = tokens[segment_ids[b][tokens] == segment_ids[b, n]]
            s = segment[b][:, members].amax(1)  # eq. 3
            window = tokens[(tokens - n).abs() <= radius]
            l_n = local[b][:, window].amax(1)  # eq. 4
            fused = {"global": g_prime * gate[b, :, n], "segment": s * gate[b, :, n], "local": l_n}  # eq. 5
            out[b, :, n] = sum(fused[part] for part in parts)  # eq. 6
    return out


@register_attention(
    "ponet",
    capabilities=Capabilities(subquadratic=True, uses_layer_state=True),
    functional=ponet_mixing,
    reference=ponet_mixing_reference,
    paper="PoNet: Pooling Network for Efficient Token Mixing in Long Sequences (Tan et al., ICLR 2022)",
)
class PoNetMixing(AttentionBase):
    """PoNet's multi-granularity pooling (global aggregation, segment and local max-pooling, fusion).

    Options:
        segment_num: without segment ids, split the N positions into this many equal segments
            (``N // segment_num + 1`` tokens each, the authors' LRA split). A model can pass its own
            segment ids [B, N] (e.g. sentence numbers) as ``layer_state["segment_ids"]``; they win.
        kernel_size: local max-pooling window k (odd).
        share_key_value: H_V = H_K (the authors' code) instead of a separate H_V (eq. 2 as written).
        scale: score scale of the global cross-attention; None = 1/sqrt(head dim).
        parts: the poolings fused in eq. 6, a subset of ("global", "segment", "local"); leaving one
            out is the paper's component ablation.
        bias: biases of the projections.
    """

    def __init__(
        self,
        dim: int,
        heads: int,
        max_len: int | None = None,
        causal: bool = False,
        segment_num: int = 16,
        kernel_size: int = 3,
        share_key_value: bool = False,
        scale: float | None = None,
        parts: tuple[str, ...] | list[str] = PARTS,
        bias: bool = True,
    ) -> None:
        super().__init__(dim, heads, max_len, causal)
        if not isinstance(segment_num, int) or isinstance(segment_num, bool) or segment_num < 1:
            raise AttentionError(f"segment_num must be a positive int, got {segment_num!r}")
        if not isinstance(kernel_size, int) or kernel_size < 1 or kernel_size % 2 == 0:
            raise AttentionError(f"kernel_size must be a positive odd int, got {kernel_size!r}")
        if scale is not None and not scale > 0:
            raise AttentionError(f"scale must be positive or None, got {scale!r}")
        self.segment_num = segment_num
        self.kernel_size = kernel_size
        self.share_key_value = share_key_value
        _check_parts(parts)
        self.scale = scale
        self.parts = tuple(parts)
        # H_Q, H_K, [H_V,] H_s, H_l, H_o in one matmul, only those the chosen parts use
        uses = {
            "query": "global" in parts, "key": "global" in parts,
            "value": "global" in parts and not share_key_value, "segment": "segment" in parts,
            "local": "local" in parts, "gate": "global" in parts or "segment" in parts,
        }
        self.branches = tuple(name for name, used in uses.items() if used)
        self.to_branches = nn.Linear(dim, len(self.branches) * dim, bias=bias)
        self.to_out = nn.Linear(dim, dim, bias=bias)

    def project(self, x: Tensor) -> dict[str, Tensor]:
        """The branch features H_* of eqs. 1-6 split into heads, [B, H, N, Dh] each; zeros for those
        the chosen parts leave out."""
        chunks = self.to_branches(x).chunk(len(self.branches), dim=-1)
        features = {name: split_heads(chunk, self.heads) for name, chunk in zip(self.branches, chunks)}
        if self.share_key_value and "key" in features:
            features["value"] = features["key"]
        unused = torch.zeros_like(next(iter(features.values())))
        return {name: features.get(name, unused) for name in ("query", "key", "value", "segment", "local", "gate")}

    def num_fixed_segments(self, length: int) -> int:
        """How many segments :func:`fixed_segment_ids` makes of ``length`` positions."""
        return (length - 1) // (length // self.segment_num + 1) + 1

    def segment_ids(self, x: Tensor, layer_state: dict | None) -> Tensor:
        given = None if layer_state is None else layer_state.get(SEGMENT_IDS_KEY)
        if given is None:
            return fixed_segment_ids(x.shape[0], x.shape[1], self.segment_num, x.device)
        return given

    def attend(self, x: Tensor, attention_mask: Tensor | None, layer_state: dict | None) -> Tensor:
        features = self.project(x)
        gpu = uses_gpu_path(x)
        if not gpu:  # float32 features for half inputs; the GPU path keeps the projections' dtype (the maxima
            # are exact in any dtype, the mean sums in float32), not six float32 copies of the sequence
            features = {name: t.to(compute_dtype(x.dtype)) for name, t in features.items()}
        given = layer_state is not None and layer_state.get(SEGMENT_IDS_KEY) is not None
        mixed = ponet_mixing(
            features["query"], features["key"], features["value"], attention_mask,
            segment=features["segment"], local=features["local"], gate=features["gate"],
            segment_ids=self.segment_ids(x, layer_state), kernel_size=self.kernel_size, scale=self.scale,
            parts=self.parts, num_segments=None if given else self.num_fixed_segments(x.shape[1]),
        )
        mixed = merge_heads(mixed)
        return self.to_out(mixed if gpu else mixed.to(x.dtype))

    def extra_repr(self) -> str:
        return (
            f"{super().extra_repr()}, segment_num={self.segment_num}, kernel_size={self.kernel_size}, "
            f"share_key_value={self.share_key_value}"
        )
