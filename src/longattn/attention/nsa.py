"""NSA, Native Sparse Attention (Yuan et al., ACL 2025, "Native Sparse Attention: Hardware-Aligned and Natively
Trainable Sparse Attention").

Every query attends through three branches whose outputs are mixed by per-branch sigmoid gates (eq. 5:
o_t = sum_c g_t^c Attn(q_t, K~_t^c, V~_t^c), c in {cmp, slc, win}):

* **compressed** (eq. 7): the keys and values cut into blocks of ``compress_block`` (l) positions every
  ``compress_stride`` (d) positions, each block mapped to one key and one value by a learned compressor phi
  (an MLP with an intra-block position encoding, initialised to the mean; ``compressor="mean"`` is fla's mean
  pooling), and softmax attention over those N / d compressed tokens;
* **selected** (eq. 8-12): the compressed attention probabilities, summed onto the selection blocks of
  ``select_block`` (l') positions they overlap (eq. 9) and over the heads of a group of ``selection_group``
  heads (eq. 10: the GQA group that shares one selection), choose the top ``select_count`` (n) blocks,
  ``initial_blocks`` leading and ``local_blocks`` trailing ones always among them (the paper's 1 initial and 2
  local blocks); softmax attention over the keys of the selected blocks (eq. 12);
* **window**: softmax attention over the last ``window`` (w) keys.

Causal as in the paper: a compressed block is visible once its last key is in the past, a selection block
once it starts at or before the query (its later keys masked), the window is [t - w + 1, t]. The encoder
form sees every compressed and selection block and the w keys centred on the query. ``branches`` switches
branches off for ablations (the compressed scores still choose the selection when the compressed branch
is off); ``gated=False`` adds the branches with weight 1.

Cost per query: N / d compressed scores (half of them on average in the causal form, which leaves out the
blocks after a chunk's last query), n x l' selected keys, w window keys; no N x N tensor. Eq. 9's sum onto
the selection blocks reads the W = ceil((l' + l) / d) compression blocks each one overlaps. The selected
branch runs :func:`longattn.attention.ops.block_select.selected_block_attention`; the window the band of
:func:`longattn.attention.chunked.windowed_attention`. The CPU path runs the compressed branch and the
selection in chunks of queries, then the selected branch in chunks of its own, both through SDPA's CPU flash
kernel with backwards that recompute their scores; the GPU path all queries at once. The float64 reference
builds the N x N masks; fla's ``naive_nsa_compression``, ``naive_nsa_topk`` and ``naive_nsa_selection`` are the tests' peers.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.autograd.function import once_differentiable

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
from longattn.attention.chunked import Band, SparsePattern, window_chunk, windowed_attention
from longattn.attention.decoding import KVState, attend_keys
from longattn.attention.ops.block_select import (FLASH_CPU, FLASH_CPU_BACKWARD, BlockCacheState, additive_mask,
                                                 completed_blocks, query_chunk, selected_block_attention, top_blocks)
from longattn.registry import signature_defaults

BRANCHES = ("compressed", "selected", "window")
COMPRESSORS = ("mlp", "mean")

# phi of eq. 7: blocks [B, H, blocks, l, D] and which of their keys are real [B, blocks, l] -> [B, H, blocks, D]
Compressor = Callable[[Tensor, Tensor], Tensor]


@dataclass(frozen=True)
class NsaOptions:
    compress_block: int
    compress_stride: int
    select_block: int
    select_count: int
    window: int
    initial_blocks: int
    local_blocks: int
    selection_group: int
    branches: tuple[str, ...]
    is_causal: bool
    scale: float


def check_nsa_options(compress_block: int, compress_stride: int, select_block: int, select_count: int, window: int,
                      initial_blocks: int, local_blocks: int, branches: tuple[str, ...]) -> None:
    for label, value in (("compress_block", compress_block), ("compress_stride", compress_stride),
                         ("select_block", select_block), ("select_count", select_count), ("window", window)):
        if not isinstance(value, int) or value < 1:
            raise AttentionError(f"{label} must be a positive int, got {value!r}")
    if compress_stride > compress_block:
        raise AttentionError(f"compress_stride ({compress_stride}) must be at most compress_block ({compress_block}): "
                             "a larger stride would skip keys")
    for label, value in (("initial_blocks", initial_blocks), ("local_blocks", local_blocks)):
        if not isinstance(value, int) or value < 0:
            raise AttentionError(f"{label} must be a non-negative int, got {value!r}")
    if initial_blocks + local_blocks > select_count:
        raise AttentionError(f"initial_blocks + local_blocks ({initial_blocks + local_blocks}) must not exceed "
                             f"select_count ({select_count}): they are part of the selection")
    unknown = sorted(set(branches) - set(BRANCHES))
    if unknown or not branches:
        raise AttentionError(f"branches must be a non-empty subset of {BRANCHES}, got {tuple(branches)!r}")


def compress_blocks(t: Tensor, real: Tensor, block: int, stride: int) -> tuple[Tensor, Tensor]:
    """The compression blocks of eq. 7: block i holds positions [i * d, i * d + l) (zeros past the end), for
    every i with i * d < N, so a sequence padded at the end has the same blocks with real keys as unpadded.
    Returns (blocks [B, H, ceil(N / d), l, D], real [B, ceil(N / d), l])."""
    n = t.shape[2]
    count = -(-n // stride)
    pad = (count - 1) * stride + block - n
    blocks = F.pad(t, (0, 0, 0, pad)).unfold(2, block, stride).transpose(-1, -2)
    return blocks, F.pad(real, (0, pad), value=False).unfold(1, block, stride)


def mean_compressor(blocks: Tensor, real: Tensor) -> Tensor:
    """phi = the mean of a block's real keys (fla's mean pooling, where the stride equals the block)."""
    weights = real.to(blocks.dtype)
    return (blocks * weights[:, None, :, :, None]).sum(3) / weights.sum(-1).clamp_min(1)[:, None, :, None]


def compressed_tokens(key: Tensor, value: Tensor, key_real: Tensor, options: NsaOptions, key_compressor: Compressor,
                      value_compressor: Compressor) -> tuple[Tensor, Tensor, Tensor]:
    """K~cmp, V~cmp of eq. 7 ([B, H, blocks, D]) and which blocks hold a real key ([B, blocks]). The compressor
    sees zeros at padded positions (whatever the projections put there), as the decoding cache holds them."""
    keep = key_real[:, None, :, None]
    key, value = key.masked_fill(~keep, 0.0), value.masked_fill(~keep, 0.0)
    key_blocks, real = compress_blocks(key, key_real, options.compress_block, options.compress_stride)
    value_blocks, _ = compress_blocks(value, key_real, options.compress_block, options.compress_stride)
    return key_compressor(key_blocks, real), value_compressor(value_blocks, real), real.any(-1)


def overlap_index(options: NsaOptions, compressed: int, selection: int, device: torch.device) -> Tensor:
    """[selection blocks, W]: the compression blocks i (positions [i d, i d + l)) that overlap selection block j
    (positions [j l', (j + 1) l')), the ones eq. 9 sums; W = ceil((l' + l) / d) bounds their count, and a
    missing one is ``compressed``, the index of the zero column :func:`block_importance` adds."""
    stride, block, select = options.compress_stride, options.compress_block, options.select_block
    j = torch.arange(selection, device=device)
    first = torch.div(j * select - block, stride, rounding_mode="floor") + 1  # the first i with i d + l > j l'
    stop = torch.div((j + 1) * select + stride - 1, stride, rounding_mode="floor")  # the first i with i d >= (j + 1) l'
    index = first[:, None] + torch.arange(-(-(select + block) // stride), device=device)
    inside = (index >= 0) & (index < stop[:, None]) & (index < compressed)
    return torch.where(inside, index, compressed)


def block_importance(probs: Tensor, options: NsaOptions, selection: int) -> Tensor:
    """Eq. 9: the compressed probabilities ``probs`` [B, H, Q, C] summed onto the ``selection`` blocks they
    overlap, [B, H, Q, selection]: windows of W compressed blocks (W independent of N), not a [C, selection]
    product. Where l' is a multiple of d the windows start every l' / d blocks (a view of the padded
    probabilities); otherwise W gathers of [Q, selection]."""
    probs = probs.detach()
    stride, block, select = options.compress_stride, options.compress_block, options.select_block
    if select % stride == 0:
        # selection block j reads the compressed blocks [j step - before, (j + 1) step)
        step, before = select // stride, -(-block // stride) - 1
        count = step + before
        after = max(0, (selection - 1) * step + count - before - probs.shape[-1])
        return F.pad(probs, (before, after)).unfold(-1, count, step)[..., :selection, :].sum(-1)
    index = overlap_index(options, probs.shape[-1], selection, probs.device)
    padded = F.pad(probs, (0, 1))
    importance = padded.index_select(-1, index[:, 0])
    for column in range(1, index.shape[1]):
        importance = importance + padded.index_select(-1, index[:, column])
    return importance


def nsa_select(importance: Tensor, positions: Tensor, key_real: Tensor, options: NsaOptions) -> tuple[Tensor, Tensor]:
    """Eq. 10-12: the selection blocks of each query from its block importance ``importance`` [B, H, Q, S]
    (eq. 9, the first S blocks): (blocks, valid) [B, H, Q, n], shared by the heads of each selection group."""
    b, h, q, blocks = importance.shape
    group = options.selection_group
    importance = importance.view(b, h // group, group, q, blocks).sum(2)  # eq. 10
    j = torch.arange(blocks, device=importance.device)
    own = torch.div(positions, options.select_block, rounding_mode="floor")[:, None]  # [Q, 1]
    forced = (j[None, :] < options.initial_blocks) | ((j[None, :] <= own) & (j[None, :] > own - options.local_blocks))
    length = blocks * options.select_block
    padded_real = F.pad(key_real[:, :length], (0, length - min(length, key_real.shape[1])), value=False)
    allowed = padded_real.view(b, blocks, options.select_block).any(-1)[:, None, None, :]  # [B, 1, 1, blocks]
    if options.is_causal:
        allowed = allowed & (j[None, :] <= own)[None, None]
    importance = importance.masked_fill(forced[None, None], float("inf"))  # eq. 11 with the fixed blocks first
    chosen, valid = top_blocks(importance, options.select_count, allowed)
    missing = options.select_count - chosen.shape[-1]  # fewer blocks than slots: empty slots, so that chunks align
    chosen, valid = F.pad(chosen, (0, missing)), F.pad(valid, (0, missing), value=False)
    return chosen.repeat_interleave(group, 1), valid.repeat_interleave(group, 1)


def compressed_visible(cmp_ok: Tensor, positions: Tensor, options: NsaOptions) -> Tensor:
    """[B, 1, Q, C]: the compressed tokens each query at ``positions`` sees (``cmp_ok`` [B, C]: those with a real
    key; causal, a block once its last key is in the past)."""
    visible = cmp_ok[:, None, None, :]
    if options.is_causal:
        ends = torch.arange(cmp_ok.shape[1], device=cmp_ok.device) * options.compress_stride + options.compress_block
        visible = visible & (ends[None, :] <= positions[:, None] + 1)[None, None]
    return visible


def compressed_branch(query: Tensor, key_cmp: Tensor, value_cmp: Tensor, cmp_ok: Tensor, positions: Tensor,
                      options: NsaOptions, selection: int) -> tuple[Tensor, Tensor]:
    """Eq. 8 of the queries at ``positions`` over their visible compressed tokens: the output [B, H, Q, Dv] and
    the importance of the first ``selection`` selection blocks (eq. 9, detached); through autograd."""
    scores = (query @ key_cmp.transpose(-1, -2)).to(compute_dtype(query.dtype)) * options.scale
    visible = compressed_visible(cmp_ok, positions, options)
    probs = torch.softmax(scores.masked_fill(~visible, float("-inf")), dim=-1).nan_to_num(0.0)
    compressed = (probs.to(value_cmp.dtype) @ value_cmp).to(probs.dtype)
    return compressed, block_importance(probs, options, selection)


class _CompressedBranch(torch.autograd.Function):
    """:func:`compressed_branch` on the CPU: eq. 8 through SDPA's CPU flash kernel, eq. 9's probabilities from its
    log-sum-exp (one more [Q, C] product, without gradient), the mask rebuilt in backward: nothing of size
    [Q, C] is kept. Inputs in one dtype; the output in it."""

    @staticmethod
    def forward(ctx: Any, query: Tensor, key_cmp: Tensor, value_cmp: Tensor, cmp_ok: Tensor, positions: Tensor,
                options: NsaOptions, selection: int) -> tuple[Tensor, Tensor]:
        mask = additive_mask(compressed_visible(cmp_ok, positions, options), query.dtype)
        out, log_sum = FLASH_CPU(query, key_cmp, value_cmp, attn_mask=mask, scale=options.scale)
        scores = (query @ key_cmp.transpose(-1, -2)).to(log_sum.dtype) * options.scale
        probs = scores.add_(mask).sub_(log_sum[..., None]).exp_()  # a row that sees nothing: exp(-inf) = 0
        importance = block_importance(probs, options, selection)
        ctx.save_for_backward(query, key_cmp, value_cmp, out, log_sum, cmp_ok, positions)
        ctx.options = options
        ctx.mark_non_differentiable(importance)
        return out, importance

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, grad_out: Tensor, grad_importance: Tensor | None) -> tuple[Tensor | None, ...]:
        query, key_cmp, value_cmp, out, log_sum, cmp_ok, positions = ctx.saved_tensors
        mask = additive_mask(compressed_visible(cmp_ok, positions, ctx.options), query.dtype)
        grads = FLASH_CPU_BACKWARD(grad_out.to(query.dtype), query, key_cmp, value_cmp, out, log_sum, 0.0, False,
                                   attn_mask=mask, scale=ctx.options.scale)
        return (*grads, None, None, None, None)


def compressed_and_selection(query: Tensor, key_cmp: Tensor, value_cmp: Tensor, cmp_ok: Tensor, key_real: Tensor,
                             n_keys: int, start: int, options: NsaOptions) -> tuple[Tensor, Tensor, Tensor]:
    """The compressed branch of the queries at positions [start, start + Q) and their selection: (compressed
    [B, H, Q, Dv], blocks, valid [B, H, Q, n]). Causal, the compressed and selection blocks after the last query
    are left out (none is visible to these queries)."""
    end = start + query.shape[2]
    positions = torch.arange(start, end, device=query.device)
    compressed = key_cmp.shape[2]
    selection = -(-n_keys // options.select_block)
    if options.is_causal:
        compressed = min(compressed, max(0, (end - options.compress_block) // options.compress_stride + 1))
        selection = min(selection, (end - 1) // options.select_block + 1)
    key_cmp, value_cmp, cmp_ok = key_cmp[:, :, :compressed], value_cmp[:, :, :compressed], cmp_ok[:, :compressed]
    if uses_gpu_path(query) or query.device.type != "cpu" or compressed == 0:
        out, importance = compressed_branch(query, key_cmp, value_cmp, cmp_ok, positions, options, selection)
    else:  # under autocast the products in the autocast dtype, as the GPU path's
        dtype = output_dtype(query)
        out, importance = _CompressedBranch.apply(query.to(dtype), key_cmp.to(dtype), value_cmp.to(dtype), cmp_ok,
                                                  positions, options, selection)
    blocks, valid = nsa_select(importance, positions, key_real, options)
    return out, blocks, valid


def selected_branch(query: Tensor, key: Tensor, value: Tensor, blocks: Tensor, valid: Tensor, key_real: Tensor,
                    start: int, options: NsaOptions) -> Tensor:
    """Eq. 12 for the queries at positions [start, start + Q): attention over the keys of their selected blocks,
    [B, H, Q, Dv]. Causal, the keys after the last query's block are not read."""
    end = start + query.shape[2]
    if options.is_causal:
        length = ((end - 1) // options.select_block + 1) * options.select_block
        key, value, key_real = key[:, :, :length], value[:, :, :length], key_real[:, :length]
    return selected_block_attention(query, key, value, blocks, valid, block_size=options.select_block,
                                    query_positions=torch.arange(start, end, device=query.device),
                                    key_real=key_real, causal=options.is_causal, scale=options.scale)


def nsa_queries(query: Tensor, key: Tensor, value: Tensor, key_cmp: Tensor, value_cmp: Tensor, cmp_ok: Tensor,
                key_real: Tensor, start: int, options: NsaOptions) -> tuple[Tensor, Tensor]:
    """The compressed and selected branches for the queries at positions [start, start + Q) at once (the GPU
    path and decoding): two [B, H, Q, Dv]."""
    compressed, blocks, valid = compressed_and_selection(query, key_cmp, value_cmp, cmp_ok, key_real, key.shape[2],
                                                         start, options)
    return compressed, selected_branch(query, key, value, blocks, valid, key_real, start, options)


def window_band(window: int, is_causal: bool) -> Band:
    """The window branch's w keys: [t - w + 1, t], or the w keys centred on t in the encoder form."""
    if is_causal:
        return Band(1, -(window - 1), 1)
    before = (window - 1) // 2
    return Band(1, -before, window - before)


def mix_branches(outputs: dict[str, Tensor], gates: Tensor | None, branches: tuple[str, ...]) -> Tensor:
    """Eq. 5: sum_c g^c o^c over the enabled branches (``gates`` [B, H, N, 3] in BRANCHES order, None: 1)."""
    total = None
    for index, name in enumerate(BRANCHES):
        if name not in branches:
            continue
        part = outputs[name] if gates is None else outputs[name] * gates[..., index:index + 1].to(outputs[name].dtype)
        total = part if total is None else total + part
    return total


@padding_safe
def nsa_attention(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attention_mask: Tensor | None = None,
    *,
    gates: Tensor | None = None,
    key_compressor: Compressor | None = None,
    value_compressor: Compressor | None = None,
    compress_block: int = 32,
    compress_stride: int = 16,
    select_block: int = 64,
    select_count: int = 16,
    window: int = 512,
    initial_blocks: int = 1,
    local_blocks: int = 2,
    selection_group: int = 1,
    branches: tuple[str, ...] = BRANCHES,
    is_causal: bool = False,
    scale: float | None = None,
) -> Tensor:
    """NSA on [B, H, N, Dh]; ``attention_mask`` bool [B, N], True = real key; ``gates`` [B, H, N, 3] the
    branch gates of eq. 5 (compressed, selected, window; None: 1 each); the compressors phi of eq. 7 (None:
    the mean of a block's real keys and values)."""
    check_qkv(query, key, value, attention_mask)
    check_nsa_options(compress_block, compress_stride, select_block, select_count, window, initial_blocks,
                      local_blocks, tuple(branches))
    b, h, n, d = query.shape
    if h % selection_group:
        raise AttentionError(f"selection_group ({selection_group}) must divide the number of heads ({h})")
    if gates is not None and gates.shape != (b, h, n, len(BRANCHES)):
        raise AttentionError(f"gates must have shape [B, H, N, 3] = {[b, h, n, 3]}, got {list(gates.shape)}")
    options = NsaOptions(compress_block, compress_stride, select_block, select_count, window, initial_blocks,
                         local_blocks, selection_group, tuple(branches), is_causal,
                         1.0 / math.sqrt(d) if scale is None else scale)
    dtype = output_dtype(query)
    key_real = torch.ones(b, n, dtype=torch.bool, device=query.device) if attention_mask is None else attention_mask
    outputs = {}
    if "window" in options.branches:
        band = window_band(window, is_causal)
        pattern = SparsePattern(band, is_causal, key_valid=attention_mask)
        outputs["window"] = windowed_attention(query.to(dtype), key.to(dtype), value.to(dtype), pattern,
                                               window_chunk(band), scale=options.scale).transpose(1, 2)
    if "compressed" in options.branches or "selected" in options.branches:
        outputs["compressed"], outputs["selected"] = _compressed_and_selected(
            query, key, value, key_real, options, key_compressor or mean_compressor, value_compressor or mean_compressor)
    return mix_branches(outputs, gates, options.branches).to(dtype)


def _compressed_and_selected(query: Tensor, key: Tensor, value: Tensor, key_real: Tensor, options: NsaOptions,
                             key_compressor: Compressor, value_compressor: Compressor) -> tuple[Tensor, Tensor]:
    key_cmp, value_cmp, cmp_ok = compressed_tokens(key, value, key_real, options, key_compressor, value_compressor)
    key, value = key.contiguous(), value.contiguous()  # once: every chunk reads them as whole blocks
    if uses_gpu_path(query):
        return nsa_queries(query, key, value, key_cmp, value_cmp, cmp_ok, key_real, 0, options)
    # the CPU path: the compressed branch and the selection in chunks sized for their [Q, N / d] scores, then the
    # selected branch in chunks sized for its tiles; the backward of both recomputes their scores
    n = query.shape[2]
    chunk = query_chunk(max(key_cmp.shape[2], -(-n // options.select_block)))
    parts = [compressed_and_selection(query[:, :, start:start + chunk], key_cmp, value_cmp, cmp_ok, key_real, n, start,
                                      options) for start in range(0, n, chunk)]
    compressed, blocks, valid = (torch.cat(part, dim=2) for part in zip(*parts))
    chunk = query_chunk(options.select_count * options.select_block)
    selected = [selected_branch(query[:, :, start:start + chunk], key, value, blocks[:, :, start:start + chunk],
                                valid[:, :, start:start + chunk], key_real, start, options)
                for start in range(0, n, chunk)]
    return compressed, torch.cat(selected, dim=2)


@padding_safe
def nsa_attention_reference(query: Tensor, key: Tensor, value: Tensor, attention_mask: Tensor | None = None,
                            **options: Any) -> Tensor:
    """Dense N x N NSA with :func:`nsa_attention`'s options and defaults: every branch as a masked softmax over
    all keys, the selection as a [N, N] mask of the chosen blocks' keys. Tests only."""
    defaults = signature_defaults(nsa_attention, skip=("attention_mask",))
    unknown = sorted(set(options) - set(defaults))
    if unknown:
        raise AttentionError(f"unknown NSA options {unknown}; the options are {sorted(defaults)}")
    o = SimpleNamespace(**{**defaults, **options})
    b, h, n, d = query.shape
    scale = 1.0 / math.sqrt(d) if o.scale is None else o.scale
    real = torch.ones(b, n, dtype=torch.bool) if attention_mask is None else attention_mask
    i = torch.arange(n)[:, None]
    j = torch.arange(n)[None, :]
    causal = (j <= i) if o.is_causal else torch.ones(n, n, dtype=torch.bool)

    def masked_softmax(scores: Tensor, allowed: Tensor) -> Tensor:
        return torch.softmax(scores.masked_fill(~allowed, float("-inf")), dim=-1).nan_to_num(0.0)

    # compressed tokens: block c holds positions [c d, c d + l) that exist
    count = -(-n // o.compress_stride)
    starts = torch.arange(count) * o.compress_stride
    member = (j >= starts[:, None]) & (j < starts[:, None] + o.compress_block)  # [C, N]
    blocks = torch.stack([F.pad(t, (0, 0, 0, o.compress_block + starts[-1] - n))[:, :, s:s + o.compress_block]
                          for t in (key, value) for s in starts.tolist()]).view(2, count, b, h, o.compress_block, d)
    tail = o.compress_block + starts[-1] - n
    block_real = torch.stack([F.pad(real, (0, tail), value=False)[:, s:s + o.compress_block]
                              for s in starts.tolist()], dim=1)  # [B, C, l]
    key_cmp = (o.key_compressor or mean_compressor)(blocks[0].permute(1, 2, 0, 3, 4), block_real)
    value_cmp = (o.value_compressor or mean_compressor)(blocks[1].permute(1, 2, 0, 3, 4), block_real)
    cmp_visible = (member & real[:, None, :]).any(-1)[:, None, None, :]  # [B, 1, 1, C]
    if o.is_causal:
        cmp_visible = cmp_visible & (starts[None, :] + o.compress_block - 1 <= i)
    probs = masked_softmax(query @ key_cmp.transpose(-1, -2) * scale, cmp_visible)
    out_cmp = probs @ value_cmp
    # selection blocks: importance summed over the compressed blocks each overlaps, and over the group
    sel_count = -(-n // o.select_block)
    sel_of = torch.arange(n) // o.select_block
    overlap = torch.stack([(member[:, sel_of == s]).any(-1) for s in range(sel_count)], dim=1)  # [C, S]
    group = o.selection_group
    importance = (probs @ overlap.to(probs.dtype)).view(b, h // group, group, n, sel_count).sum(2)
    s = torch.arange(sel_count)[None, :]
    own = sel_of[:, None]
    forced = (s < o.initial_blocks) | ((s <= own) & (s > own - o.local_blocks))
    allowed = torch.stack([(real[:, sel_of == c]).any(-1) for c in range(sel_count)], dim=1)[:, None, None, :]
    if o.is_causal:
        allowed = allowed & (s <= own)
    importance = importance.masked_fill(forced, float("inf")).masked_fill(~allowed, float("-inf"))
    top = importance.topk(min(o.select_count, sel_count), dim=-1).indices
    chosen = torch.zeros_like(importance, dtype=torch.bool).scatter(-1, top, True) & allowed
    chosen = chosen.repeat_interleave(group, 1)
    slc_allowed = chosen[..., sel_of] & real[:, None, None, :] & causal
    scores = query @ key.transpose(-1, -2) * scale
    out_slc = masked_softmax(scores, slc_allowed) @ value
    before = o.window - 1 if o.is_causal else (o.window - 1) // 2
    near = (j - i >= -before) & (j - i < o.window - before)
    out_win = masked_softmax(scores, near & real[:, None, None, :]) @ value
    return mix_branches({"compressed": out_cmp, "selected": out_slc, "window": out_win}, o.gates, tuple(o.branches))


class BlockCompressor(nn.Module):
    """phi of eq. 7: a block of l keys (or values) plus a learned intra-block position encoding, flattened
    and mapped to one vector by a linear layer; initialised to the mean of the block (the position encoding
    at zero, the weights l identity matrices / l), so training starts from mean pooling."""

    def __init__(self, block: int, head_dim: int) -> None:
        super().__init__()
        self.position = nn.Parameter(torch.zeros(block, head_dim))
        self.mix = nn.Linear(block * head_dim, head_dim)
        with torch.no_grad():
            self.mix.weight.copy_(torch.eye(head_dim).repeat(1, block) / block)
            self.mix.bias.zero_()

    def forward(self, blocks: Tensor, real: Tensor) -> Tensor:
        return self.mix((blocks + self.position).flatten(-2))


@register_attention(
    "nsa",
    capabilities=Capabilities(causal=True),
    functional=nsa_attention,
    reference=nsa_attention_reference,
    paper="Native Sparse Attention: Hardware-Aligned and Natively Trainable Sparse Attention (Yuan et al., ACL 2025)",
)
class NsaAttention(AttentionBase):
    """NSA: gated compressed, top-n selected-block and sliding-window attention branches."""

    def __init__(
        self,
        dim: int,
        heads: int,
        max_len: int | None = None,
        causal: bool = False,
        compress_block: int = 32,
        compress_stride: int = 16,
        select_block: int = 64,
        select_count: int = 16,
        window: int = 512,
        initial_blocks: int = 1,
        local_blocks: int = 2,
        selection_group: int = 1,
        compressor: str = "mlp",
        gated: bool = True,
        branches: tuple[str, ...] = BRANCHES,
    ) -> None:
        super().__init__(dim, heads, max_len, causal)
        branches = tuple(branches)
        check_nsa_options(compress_block, compress_stride, select_block, select_count, window, initial_blocks,
                          local_blocks, branches)
        if compressor not in COMPRESSORS:
            raise AttentionError(f"compressor must be one of {COMPRESSORS}, got {compressor!r}")
        if not isinstance(selection_group, int) or selection_group < 1 or heads % selection_group:
            raise AttentionError(f"selection_group must be a positive divisor of heads ({heads}), got {selection_group!r}")
        self.proj = QKVProjection(dim, heads)
        self.key_compressor = BlockCompressor(compress_block, self.head_dim) if compressor == "mlp" else None
        self.value_compressor = BlockCompressor(compress_block, self.head_dim) if compressor == "mlp" else None
        # the gates of eq. 5 from each head's query (the hidden state's projection, which the HF bridge hands over)
        self.gate = nn.Linear(self.head_dim, len(BRANCHES)) if gated else None
        self.compress_block, self.compress_stride = compress_block, compress_stride
        self.select_block, self.select_count, self.window = select_block, select_count, window
        self.initial_blocks, self.local_blocks, self.selection_group = initial_blocks, local_blocks, selection_group
        self.compressor, self.gated, self.branches = compressor, gated, branches

    def _options(self) -> NsaOptions:
        return NsaOptions(self.compress_block, self.compress_stride, self.select_block, self.select_count, self.window,
                          self.initial_blocks, self.local_blocks, self.selection_group, self.branches, self.causal,
                          1.0 / math.sqrt(self.head_dim))

    def _gates(self, query: Tensor) -> Tensor | None:
        return None if self.gate is None else torch.sigmoid(self.gate(query))

    def _compressors(self) -> tuple[Compressor, Compressor]:
        return self.key_compressor or mean_compressor, self.value_compressor or mean_compressor

    def _heads(self, query: Tensor, key: Tensor, value: Tensor, attention_mask: Tensor | None) -> Tensor:
        key_compressor, value_compressor = self._compressors()
        return nsa_attention(query, key, value, attention_mask, gates=self._gates(query), key_compressor=key_compressor,
                             value_compressor=value_compressor, compress_block=self.compress_block,
                             compress_stride=self.compress_stride, select_block=self.select_block,
                             select_count=self.select_count, window=self.window, initial_blocks=self.initial_blocks,
                             local_blocks=self.local_blocks, selection_group=self.selection_group,
                             branches=self.branches, is_causal=self.causal)

    def attend(self, x: Tensor, attention_mask: Tensor | None, layer_state: dict | None) -> Tensor:
        q, k, v = self.proj.qkv(x)
        return self.proj.out(self._heads(q, k, v, attention_mask))

    # -- decoding: the key cache and the compressed tokens of the completed blocks ----------------------------
    decode_state = "kv_cache"

    def prefill_heads(self, query: Tensor, key: Tensor, value: Tensor, attention_mask: Tensor | None,
                      layer_state: dict | None) -> tuple[Tensor, BlockCacheState]:
        """The key cache (what the selection and the window read) and the compressed keys and values of the
        completed compression blocks."""
        out = self._heads(query, key, value, attention_mask)
        b, _, n, _ = key.shape
        real = torch.ones(b, n, dtype=torch.bool, device=key.device) if attention_mask is None else attention_mask
        key_cmp, value_cmp, cmp_ok = compressed_tokens(key, value, real, self._options(), *self._compressors())
        complete = completed_blocks(n, self.compress_block, self.compress_stride)
        return out, BlockCacheState(length=n, cache=KVState.start(key, value, attention_mask),
                                    summaries=[key_cmp[:, :, :complete], value_cmp[:, :, :complete]],
                                    summary_ok=cmp_ok[:, :complete])

    def step_heads(self, query: Tensor, key: Tensor, value: Tensor, state: BlockCacheState, real: Tensor | None,
                   layer_state: dict | None) -> tuple[Tensor, BlockCacheState]:
        """The new query over the compressed tokens (O(N / d)), its selected blocks (O(n l')) and the window."""
        options = self._options()
        keys, values, key_real = state.append(key, value, real)
        t = state.length
        first = state.completed_block(self.compress_block, self.compress_stride)
        if first is not None:  # the new token completes a compression block, visible to it already
            key_cmp, value_cmp, ok = compressed_tokens(keys[:, :, first:], values[:, :, first:], key_real[:, first:],
                                                       options, *self._compressors())
            state.add_block([key_cmp[:, :, :1], value_cmp[:, :, :1]], ok[:, :1])
        outputs = {}
        if "compressed" in options.branches or "selected" in options.branches:
            key_cmp, value_cmp = state.summaries
            outputs["compressed"], outputs["selected"] = nsa_queries(
                query, keys, values, key_cmp, value_cmp, state.summary_ok, key_real, t, options)
        if "window" in options.branches:
            first = max(0, t + 1 - self.window)
            outputs["window"] = attend_keys(query, keys[:, :, first:], values[:, :, first:],
                                            key_real[:, None, None, first:], scale=options.scale)
        out = mix_branches(outputs, self._gates(query), options.branches)
        return out.to(output_dtype(query)), state
