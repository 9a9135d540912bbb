"""BigBird block-sparse attention (Zaheer et al., 2020), the ITC (internal transformer construction) variant.

The sequence is cut into blocks of ``block_size`` tokens. Every query block attends to
  * ``window_blocks`` blocks around it (sliding window, 3 by default: left, self, right),
  * the ``global_blocks`` global blocks (the first and the last block by default), and
  * ``random_blocks`` random blocks (3 by default), drawn per head and fixed per layer,
and the global query blocks attend to every key (BigBird section 2, Fig. 1). Each query sees
at most (window + global + random) * block_size keys, gathered per (head, block) and run through
SDPA's fused kernel, so memory is linear in N; sequences too
short to be sparse (no more blocks than one query block would see) use full attention, as the
reference implementation does. On a GPU every block runs at once (:func:`bigbird_attention_gpu`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from longattn.attention._triton import pytorch_path_where_kernels_do_not_fit, triton_runs_on
from longattn.attention.base import (
    AttentionBase,
    AttentionError,
    Capabilities,
    QKVProjection,
    check_qkv,
    output_dtype,
    padding_safe,
    register_attention,
    uses_gpu_path,
)
from longattn.attention.chunked import Band, Chunk, SparsePattern, chunked_attention, chunked_projected_attention
from longattn.attention.softmax import softmax_attention


def random_block_indices(num_blocks: int, heads: int, random_blocks: int, window_blocks: int,
                         generator: torch.Generator) -> Tensor:
    """[heads, num_blocks - 2, random_blocks]: for each middle query block, random key blocks
    outside its window and outside the global (first/last) blocks, without repetition."""
    if num_blocks < 2 + window_blocks + random_blocks:
        raise AttentionError(
            f"{num_blocks} blocks leave too few outside the 2 global and {window_blocks} window blocks to draw "
            f"{random_blocks} random ones: need at least {2 + window_blocks + random_blocks} (use full attention)"
        )
    half = window_blocks // 2
    rows = []
    for h in range(heads):
        scores = torch.rand(num_blocks - 2, num_blocks, generator=generator)
        query = torch.arange(1, num_blocks - 1)[:, None]
        key = torch.arange(num_blocks)[None, :]
        excluded = ((key - query).abs() <= half) | (key == 0) | (key == num_blocks - 1)
        # top-k of random scores among allowed blocks = uniform sample without replacement
        rows.append(scores.masked_fill(excluded, -1.0).topk(random_blocks, dim=-1).indices)
    return torch.stack(rows)


def key_block_indices(num_blocks: int, random_idx: Tensor, window_blocks: int) -> tuple[Tensor, Tensor]:
    """Key blocks of each middle query block: [heads, nb - 2, K] indices and a [heads, nb - 2, K]
    mask that drops out-of-range window blocks and blocks already listed (no double counting)."""
    heads = random_idx.shape[0]
    half = window_blocks // 2
    query = torch.arange(1, num_blocks - 1)[:, None]
    window = query + torch.arange(-half, half + 1)[None, :]
    glob = torch.tensor([0, num_blocks - 1]).expand(num_blocks - 2, 2)
    idx = torch.cat([glob, window], dim=-1).expand(heads, -1, -1)
    idx = torch.cat([idx, random_idx], dim=-1)
    in_range = (idx >= 0) & (idx < num_blocks)
    idx = idx.clamp(0, num_blocks - 1)
    first = torch.ones_like(in_range)
    for j in range(1, idx.shape[-1]):  # K is tiny (8 by default): a loop over slots, not tokens
        first[..., j] = ~(idx[..., :j] == idx[..., j:j + 1]).any(-1)
    return idx, in_range & first


# Query tokens per chunk of middle blocks: one chunk's gathered key/value blocks are the only
# such copies alive at a time (recomputed in backward).
BIGBIRD_CHUNK_TOKENS = 512


def _check_pattern(random_idx: Tensor, heads: int, n: int, block_size: int) -> int:
    nb = -(-n // block_size)
    if nb < 3 or random_idx.dim() != 3 or random_idx.shape[:2] != (heads, nb - 2):
        raise AttentionError(
            f"random_idx must be [H={heads}, nb - 2, r] for nb = ceil(N / block_size) = {nb} >= 3 blocks, "
            f"got {list(random_idx.shape)} (see random_block_indices; shorter inputs need full attention)"
        )
    return nb


def _plan(valid: Tensor, random_idx: Tensor, n: int, block_size: int, window_blocks: int, scale: float) -> list[Chunk]:
    """The global rows (first and last block) against every key, then chunks of middle query blocks,
    each reading the union of the key blocks its (head, block) pairs gather."""
    device = valid.device
    nb = random_idx.shape[1] + 2
    idx, keep = key_block_indices(nb, random_idx.cpu(), window_blocks)
    global_rows = torch.cat([torch.arange(block_size), torch.arange((nb - 1) * block_size, n)]).to(device)
    chunks = [Chunk(rows=global_rows, keys=slice(0, n), info=(valid, scale))]
    step = max(1, BIGBIRD_CHUNK_TOKENS // block_size)
    within = torch.arange(block_size)
    for start in range(0, nb - 2, step):
        stop = min(start + step, nb - 2)
        union = idx[:, start:stop].unique()  # sorted: only its last block can be the short block nb - 1
        local_idx = torch.searchsorted(union, idx[:, start:stop].contiguous())  # [H, chunk, K] into the union
        positions = (union[:, None] * block_size + within).flatten()
        positions = positions[positions < n].to(device)
        chunks.append(Chunk(rows=slice((start + 1) * block_size, (stop + 1) * block_size), keys=positions,
                            info=(valid, scale, block_size, local_idx.to(device), keep[:, start:stop].to(device))))
    return chunks


def _bigbird_chunk(chunk: Chunk, query: Tensor, key: Tensor, value: Tensor) -> Tensor:
    if isinstance(chunk.rows, Tensor):
        # global query blocks (first and last) attend to every key
        valid, scale = chunk.info
        visible = valid[:, None, None, :]
        out = F.scaled_dot_product_attention(query, key, value, attn_mask=visible, scale=scale)
        return torch.where(visible.any(-1, keepdim=True), out, 0.0)
    # Middle query blocks against their gathered key blocks, each (head, block) pair through SDPA's
    # fused kernel. The random blocks differ per head, so heads and blocks both go to the batch
    # axis, [B * H * chunk, 1, K*bs, D]: one index_select over (head, union block) rows copies whole
    # [bs, D] blocks straight into that layout. The mask depends only on the key (padding, and
    # blocks listed twice), so one [K*bs] row per (batch, head, block) serves the block's queries.
    valid, scale, block_size, local_idx, keep = chunk.info
    b, h, _, d = query.shape
    count, slots = local_idx.shape[1:]
    blocks = -(-key.shape[2] // block_size)  # union blocks read
    short = blocks * block_size - key.shape[2]
    rows = (torch.arange(h, device=query.device)[:, None, None] * blocks + local_idx).flatten()
    pairs, keys = b * h * count, slots * block_size

    def gather_blocks(t: Tensor) -> Tensor:  # [B, H, blocks*bs - short, D] -> [B*H*chunk, 1, K*bs, D]
        t = F.pad(t, (0, 0, 0, short)).reshape(b, h * blocks, -1)
        return t.index_select(1, rows).view(pairs, 1, keys, t.shape[-1] // block_size)

    real = F.pad(valid[:, chunk.keys], (0, short), value=False).view(b, blocks, block_size)
    visible = (real[:, local_idx] & keep[None, ..., None]).view(pairs, 1, 1, keys)
    q_mid = query.reshape(pairs, 1, block_size, d)
    out = F.scaled_dot_product_attention(q_mid, gather_blocks(key), gather_blocks(value), attn_mask=visible, scale=scale)
    out = torch.where(visible.any(-1, keepdim=True), out, 0.0)  # queries that see no key output zeros
    return out.view(b, h, count * block_size, -1)


@padding_safe
def bigbird_attention(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attention_mask: Tensor | None = None,
    *,
    random_idx: Tensor,
    block_size: int = 64,
    window_blocks: int = 3,
    scale: float | None = None,
) -> Tensor:
    """Block-sparse attention on [B, H, N, Dh] given random key blocks ``random_idx``
    ([H, nb - 2, r], from :func:`random_block_indices` for nb = ceil(N / block_size))."""
    check_qkv(query, key, value, attention_mask)
    b, h, n, d = query.shape
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    _check_pattern(random_idx, h, n, block_size)
    if uses_gpu_path(query):
        tables = gpu_tables(random_idx, window_blocks, query.device)
        return bigbird_attention_gpu(query, key, value, attention_mask, tables, block_size, window_blocks,
                                     scale).transpose(1, 2)
    valid = torch.ones(b, n, dtype=torch.bool, device=query.device) if attention_mask is None else attention_mask
    chunks = _plan(valid, random_idx, n, block_size, window_blocks, scale)
    return chunked_attention(_bigbird_chunk, chunks, [(query, key, value)])


@dataclass(frozen=True)
class GpuTables:
    """One random pattern as the GPU path reads it, on the device.

    ``random`` [H, nb - 2, r]: the random key blocks of each middle query block (the kernel's
    block lists); ``random_by_key`` [H, nb, L]: the middle query blocks that drew each key block,
    -1 = none (the kernel's backward reads keys by key block); ``idx``/``keep`` [H, nb - 2, K]:
    every key block of each middle query block and whether it counts (the PyTorch path)."""

    random: Tensor | None
    random_by_key: Tensor | None
    idx: Tensor
    keep: Tensor


def gpu_tables(random_idx: Tensor, window_blocks: int, device: torch.device) -> GpuTables:
    """Built on the CPU (where the pattern is drawn), vectorised, then copied to ``device``."""
    random_idx = random_idx.cpu()
    heads, middle, r = random_idx.shape
    nb = middle + 2
    idx, keep = key_block_indices(nb, random_idx, window_blocks)
    random = random_by_key = None
    if r:
        # invert the lists: group the (head, query block, slot) entries by (head, key block)
        code = (torch.arange(heads)[:, None] * nb + random_idx.reshape(heads, -1)).flatten()
        order = torch.argsort(code, stable=True)
        counts = torch.bincount(code, minlength=heads * nb)
        rank = torch.arange(code.numel()) - (torch.cumsum(counts, 0) - counts)[code[order]]
        table = torch.full((heads * nb, int(counts.max())), -1, dtype=torch.int32)
        table[code[order], rank] = torch.arange(middle).repeat_interleave(r).repeat(heads)[order].to(torch.int32)
        random = random_idx.to(torch.int32).to(device, non_blocking=True)
        random_by_key = table.view(heads, nb, -1).to(device, non_blocking=True)
    return GpuTables(random, random_by_key, idx.to(device, non_blocking=True), keep.to(device, non_blocking=True))


@pytorch_path_where_kernels_do_not_fit
def bigbird_attention_gpu(query: Tensor, key: Tensor, value: Tensor, attention_mask: Tensor | None,
                          tables: GpuTables, block_size: int, window_blocks: int, scale: float) -> Tensor:
    """The GPU path, every block at once. The two global query blocks attend to every key (one
    SDPA call). The middle blocks run through the block-sparse Triton kernel where it runs: their
    window as a band of blocks, their random blocks as per-head block lists, and the global key
    blocks as extra keys (kept out of the band, so block 0 in block 1's window counts once); else
    through one gather of each (head, block)'s key blocks and one SDPA call (as the CPU chunks do,
    all at once). Output token-major [B, N, H, Dv] in the autocast dtype."""
    dtype = output_dtype(query)
    query, key, value = (t.to(dtype) for t in (query, key, value))
    b, h, n, _ = query.shape
    bs = block_size
    nb = -(-n // bs)
    last = (nb - 1) * bs  # the last (global) block starts here

    def global_blocks(t: Tensor, dim: int = 2) -> Tensor:  # the first and the last block's rows
        return torch.cat([t.narrow(dim, 0, bs), t.narrow(dim, last, n - last)], dim=dim)

    visible = None if attention_mask is None else attention_mask[:, None, None, :]
    glob = F.scaled_dot_product_attention(global_blocks(query), key, value, attn_mask=visible, scale=scale)
    if visible is not None:
        glob = torch.where(visible.any(-1, keepdim=True), glob, 0.0)  # queries that see no key output zeros
    middle = query[:, :, bs:last]
    if triton_runs_on(query):
        from longattn.attention import _blocksparse_triton as kernels

        half = window_blocks // 2
        positions = torch.arange(n, device=query.device)
        is_global = (positions < bs) | (positions >= last)
        key_valid = (~is_global).expand(b, n)  # the global keys come as extras
        if attention_mask is not None:
            key_valid = key_valid & attention_mask
        pattern = SparsePattern(Band(bs, -half * bs, (half + 1) * bs), key_valid=key_valid, query_offset=bs,
                                block_size=bs, blocks=tables.random, blocks_by_key=tables.random_by_key,
                                extra_valid=None if attention_mask is None else global_blocks(attention_mask, dim=1))
        if kernels.kernel_supports(query, pattern):
            # the middle rows' output goes straight into the full output, the global rows' beside it
            return kernels.blocksparse_attention(middle, key, value, pattern, extra_key=global_blocks(key),
                                                 extra_value=global_blocks(value), scale=scale, output_length=n,
                                                 replace_rows=(global_blocks(positions, dim=0), glob))
    valid = torch.ones(b, n, dtype=torch.bool, device=query.device) if attention_mask is None else attention_mask
    chunk = Chunk(rows=slice(bs, last), keys=slice(0, n), info=(valid, scale, bs, tables.idx, tables.keep))
    mid = _bigbird_chunk(chunk, middle, key, value).transpose(1, 2)
    glob = glob.transpose(1, 2)
    return torch.cat([glob[:, :bs], mid, glob[:, bs:]], dim=1)


@padding_safe
def bigbird_attention_reference(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attention_mask: Tensor | None = None,
    *,
    random_idx: Tensor,
    block_size: int = 64,
    window_blocks: int = 3,
    scale: float | None = None,
) -> Tensor:
    """The same pattern as an explicit N x N mask (dense softmax). Tests only."""
    b, h, n, d = query.shape
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    nb = -(-n // block_size)
    idx, keep = key_block_indices(nb, random_idx, window_blocks)
    block_allowed = torch.zeros(h, nb, nb, dtype=torch.bool)
    block_allowed[:, 0] = block_allowed[:, -1] = True
    for head in range(h):
        for qb in range(nb - 2):
            block_allowed[head, qb + 1, idx[head, qb][keep[head, qb]]] = True
    token_block = torch.arange(n) // block_size
    allowed = block_allowed[:, token_block][:, :, token_block][None]
    if attention_mask is not None:
        allowed = allowed & attention_mask[:, None, None, :]
    scores = (query @ key.transpose(-1, -2) * scale).masked_fill(~allowed, float("-inf"))
    return torch.softmax(scores, -1).nan_to_num(0.0) @ value


def _refresh_seed(module: "BigBirdAttention", incompatible_keys: object) -> None:
    module._seed_value = int(module.seed)


@register_attention(
    "bigbird",
    capabilities=Capabilities(),
    functional=bigbird_attention,
    reference=bigbird_attention_reference,
    paper="Big Bird: Transformers for Longer Sequences (Zaheer et al., 2020)",
)
class BigBirdAttention(AttentionBase):
    """BigBird block-sparse attention: window + global + random blocks."""

    def __init__(
        self,
        dim: int,
        heads: int,
        max_len: int | None = None,
        causal: bool = False,
        block_size: int = 64,
        random_blocks: int = 3,
        window_blocks: int = 3,
        seed: int | None = None,
    ) -> None:
        super().__init__(dim, heads, max_len, causal)
        if block_size < 1 or random_blocks < 0 or window_blocks < 1 or window_blocks % 2 == 0:
            raise AttentionError(
                "bigbird needs block_size >= 1, random_blocks >= 0 and an odd window_blocks >= 1, got "
                f"{block_size}, {random_blocks}, {window_blocks}"
            )
        self.proj = QKVProjection(dim, heads)
        self.block_size = block_size
        self.random_blocks = random_blocks
        self.window_blocks = window_blocks
        # The random pattern is fixed per layer: drawn from this seed (saved with the model) for
        # each number of blocks met, so eval is deterministic and a reloaded model is identical.
        # (a host draw, so that a model built under ``with torch.device("meta")`` or "cuda" gets one too)
        seed = int(torch.randint(0, 2**31 - 1, (), device="cpu")) if seed is None else seed
        self.register_buffer("seed", torch.tensor(seed), persistent=True)
        # the seed as a host int: reading the buffer (on the GPU with the model) would wait for the device
        self._seed_value = seed
        self.register_load_state_dict_post_hook(_refresh_seed)
        self._random_cache: dict[tuple[int, int], Tensor] = {}
        self._gpu_cache: dict[tuple[int, int, torch.device], GpuTables] = {}

    def random_idx(self, num_blocks: int) -> Tensor:
        key = (self._seed_value, num_blocks)  # keyed by seed too: loading a state dict changes it
        if key not in self._random_cache:
            g = torch.Generator().manual_seed(key[0] * 100003 + num_blocks)
            self._random_cache[key] = random_block_indices(
                num_blocks, self.heads, self.random_blocks, self.window_blocks, g
            )
        return self._random_cache[key]

    def gpu_tables(self, num_blocks: int, device: torch.device) -> GpuTables:
        """The pattern's tables on ``device`` (built on the first call for each number of blocks)."""
        key = (self._seed_value, num_blocks, device)
        if key not in self._gpu_cache:
            self._gpu_cache[key] = gpu_tables(self.random_idx(num_blocks), self.window_blocks, device)
        return self._gpu_cache[key]

    def attend(self, x: Tensor, attention_mask: Tensor | None, layer_state: dict | None) -> Tensor:
        b, n, _ = x.shape
        nb = -(-n // self.block_size)
        if nb <= 2 + self.window_blocks + self.random_blocks:
            q, k, v = self.proj.qkv(x)
            return self.proj.out(softmax_attention(q, k, v, attention_mask))  # too short to be sparse
        if uses_gpu_path(x):
            q, k, v = self.proj.qkv(x)
            out = bigbird_attention_gpu(q, k, v, attention_mask, self.gpu_tables(nb, x.device), self.block_size,
                                        self.window_blocks, 1.0 / math.sqrt(self.head_dim))
            return self.proj.out(out.transpose(1, 2))
        if not isinstance(self.proj, QKVProjection):  # q, k, v handed over from outside (longattn.hf)
            q, k, v = self.proj.qkv(x)
            return self.proj.out(bigbird_attention(q, k, v, attention_mask, random_idx=self.random_idx(nb),
                                                   block_size=self.block_size, window_blocks=self.window_blocks))
        # the functional form's chunks, with the projections inside them (see chunked.py)
        valid = torch.ones(b, n, dtype=torch.bool, device=x.device) if attention_mask is None else attention_mask
        chunks = _plan(valid, self.random_idx(nb), n, self.block_size, self.window_blocks, 1.0 / math.sqrt(self.head_dim))
        proj = self.proj
        out = chunked_projected_attention(_bigbird_chunk, chunks, x, [(proj.to_q, proj.to_k, proj.to_v)], self.heads)
        return proj.out(out)
