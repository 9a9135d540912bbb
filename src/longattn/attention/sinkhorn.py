"""Sparse Sinkhorn Attention (Tay et al., ICML 2020): learn to sort blocks, then attend locally.

The sequence is cut into ``N_B`` blocks of ``b`` tokens (Sec. 3):

1. **sorting network** (Sec. 3.1): each block is summarised by the sum of its (real) token
   embeddings, and a two-layer ReLU network ``F_P`` maps block ``i``'s summary to ``N_B`` logits,
   the row ``R_i`` of a block-to-block matrix ``R``;
2. **Sinkhorn balancing** (Sec. 3.2): ``S = Sinkhorn((R + eps) / tau)`` alternately normalises rows
   and columns (in log space) for ``k`` iterations, giving a doubly stochastic relaxation of a
   permutation; ``eps`` is Gumbel noise while training;
3. **sorted block-local attention** (Sec. 3.3): keys and values are re-ordered block-wise,
   ``psi_S(K)_i = sum_j S_ij K_j``, and each query block attends to its sorted block (plus, by
   default, its own local block) under one softmax.

Memory is O(N b) for the scores plus O(N_B^2) for ``S``; no N x N tensor is formed.
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
    QKVProjection,
    check_qkv,
    padding_safe,
    register_attention,
)

__all__ = [
    "SinkhornAttention",
    "gumbel_noise",
    "sinkhorn_attention",
    "sinkhorn_attention_reference",
    "sinkhorn_balance",
]


def sinkhorn_balance(logits: Tensor, iterations: int, temperature: float) -> Tensor:
    """Doubly stochastic S from block logits [..., N_B, N_B]: k row/column normalisations of exp(R / tau)."""
    log_s = logits / temperature
    for _ in range(iterations):  # k is a small constant (Sec. 3.2), not a loop over tokens
        log_s = log_s - torch.logsumexp(log_s, dim=-1, keepdim=True)  # rows sum to 1
        log_s = log_s - torch.logsumexp(log_s, dim=-2, keepdim=True)  # columns sum to 1
    return torch.exp(log_s)


def gumbel_noise(shape: torch.Size | tuple[int, ...], like: Tensor) -> Tensor:
    """Standard Gumbel samples -log(-log U) of ``shape`` on ``like``'s device and dtype."""
    tiny = torch.finfo(like.dtype).tiny
    uniform = torch.rand(shape, dtype=like.dtype, device=like.device)
    return -torch.log((-torch.log(uniform.clamp_min(tiny))).clamp_min(tiny))


def _check_sortcut(sortcut_blocks: int | None) -> None:
    if sortcut_blocks is not None and (
        not isinstance(sortcut_blocks, int) or isinstance(sortcut_blocks, bool) or sortcut_blocks <= 0
    ):
        raise AttentionError(f"sortcut_blocks must be a positive int or None, got {sortcut_blocks!r}")


def _check_local(local_attention: str) -> None:
    if local_attention not in LOCAL_MODES:
        raise AttentionError(f"local_attention must be one of {LOCAL_MODES}, got {local_attention!r}")


def _check(
    query: Tensor, key: Tensor, sort_logits: Tensor, block_size: int, iterations: int, temperature: float,
    sortcut_blocks: int | None,
    local_attention: str,
) -> int:
    if not isinstance(block_size, int) or isinstance(block_size, bool) or block_size <= 0:
        raise AttentionError(f"block_size must be a positive int, got {block_size!r}")
    if not isinstance(iterations, int) or isinstance(iterations, bool) or iterations < 0:
        raise AttentionError(f"sinkhorn_iters must be a non-negative int, got {iterations!r}")
    if not temperature > 0:
        raise AttentionError(f"temperature must be positive, got {temperature!r}")
    _check_sortcut(sortcut_blocks)
    _check_local(local_attention)
    b, h, n, _ = query.shape
    if key.shape[2] != n:
        raise AttentionError("Sinkhorn attention is self-attention: query and key lengths must match")
    blocks = -(-n // block_size)
    expected = (b, h, blocks, blocks)
    if not isinstance(sort_logits, Tensor) or sort_logits.shape not in (expected, (1, *expected[1:])):
        shape = list(sort_logits.shape) if isinstance(sort_logits, Tensor) else sort_logits
        raise AttentionError(f"sort_logits must be [B or 1, H, N_B, N_B] = {list(expected)}, got {shape}")
    return blocks


LOCAL_MODES = ("sum", "joint", "none")


def _block_attention(
    q_blocks: Tensor, groups: list[tuple[Tensor, Tensor, Tensor]], scale: float, dropout_p: float
) -> Tensor:
    """One softmax per query block over the union of key groups [(keys, values, visible), ...].

    keys/values: [B, H, N_B or 1, L, d]; visible: bool [B, 1 or H, N_B or 1, L]. Rows with nothing
    visible give zeros.
    """
    b, h, blocks = q_blocks.shape[:3]
    scores = torch.cat([q_blocks @ k.transpose(-1, -2) for k, _, _ in groups], dim=-1) * scale
    visible = torch.cat([m.expand(b, h, blocks, -1) for _, _, m in groups], dim=-1).unsqueeze(3)
    # scores is a fresh tensor: mask in place; rows with nothing visible come out uniform over
    # masked keys and their outputs are zeroed below (cheaper than masking the weights again)
    weights = torch.softmax(scores.masked_fill_(~visible, torch.finfo(scores.dtype).min), dim=-1)
    if dropout_p > 0:
        weights = F.dropout(weights, p=dropout_p)
    parts = weights.split([k.shape[3] for k, _, _ in groups], dim=-1)
    out = sum(w @ v for w, (_, v, _) in zip(parts, groups))
    return out.masked_fill(~visible.any(-1, keepdim=True), 0.0)


@padding_safe
def sinkhorn_attention(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attention_mask: Tensor | None = None,
    *,
    sort_logits: Tensor,
    block_size: int = 64,
    sinkhorn_iters: int = 5,
    temperature: float = 0.75,
    local_attention: str = "sum",
    sortcut_blocks: int | None = None,
    noise: Tensor | None = None,
    scale: float | None = None,
    dropout_p: float = 0.0,
) -> Tensor:
    """Sparse Sinkhorn attention on [B, H, N, Dh] in O(N b) memory.

    ``sort_logits``: R of the sorting network, [B or 1, H, N_B, N_B] with N_B = ceil(N / b).
    ``noise``: Gumbel noise added to R before balancing (the module passes it while training).
    ``local_attention``: how queries also see their own (unsorted) block: "sum" (a separate
    softmax whose output is added, as the authors' code), "joint" (one softmax over sorted and
    local keys) or "none" (sorted block only).
    ``sortcut_blocks``: SortCut variant: every query attends to the first n_cut sorted blocks
    instead of its own sorted block (fewer if the sequence has fewer blocks).
    Padded keys/values are zeroed before sorting so they never leak; a sorted slot that no real
    token contributes to is masked.
    """
    check_qkv(query, key, value, attention_mask)
    blocks = _check(
        query, key, sort_logits, block_size, sinkhorn_iters, temperature, sortcut_blocks, local_attention
    )
    b, h, n, d = query.shape
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    tail = blocks * block_size - n
    real = attention_mask
    if real is None:
        real = torch.ones(b, n, dtype=torch.bool, device=query.device)
    real_blocks = F.pad(real, (0, tail)).view(b, 1, blocks, block_size)
    keep = real_blocks.unsqueeze(-1).to(key.dtype)
    q_blocks = F.pad(query, (0, 0, 0, tail)).view(b, h, blocks, block_size, d)
    k_blocks = F.pad(key, (0, 0, 0, tail)).view(b, h, blocks, block_size, d) * keep
    v_blocks = F.pad(value, (0, 0, 0, tail)).view(b, h, blocks, block_size, value.shape[-1]) * keep

    logits = sort_logits if noise is None else sort_logits + noise
    sort = sinkhorn_balance(logits, sinkhorn_iters, temperature)  # [B, H, N_B, N_B]
    k_sorted = torch.einsum("bhij,bhjtd->bhitd", sort, k_blocks)  # psi_S(K), block-wise
    v_sorted = torch.einsum("bhij,bhjtd->bhitd", sort, v_blocks)
    real_sorted = torch.einsum("bhij,bhjt->bhit", sort, real_blocks.to(sort.dtype)) > 0

    if sortcut_blocks is None:  # query block i sees sorted block i
        sorted_group = (k_sorted, v_sorted, real_sorted)
    else:  # SortCut: every query sees the first n_cut sorted blocks (shared, never copied per block)
        cut = min(sortcut_blocks, blocks)
        sorted_group = tuple(
            t[:, :, :cut].flatten(2, 3).unsqueeze(2) for t in (k_sorted, v_sorted, real_sorted)
        )
    local_group = (k_blocks, v_blocks, real_blocks)
    if local_attention == "none":
        out = _block_attention(q_blocks, [sorted_group], scale, dropout_p)
    elif local_attention == "joint":
        out = _block_attention(q_blocks, [sorted_group, local_group], scale, dropout_p)
    else:  # "sum": separate softmaxes over the sorted and the local block, outputs added
        out = _block_attention(q_blocks, [sorted_group], scale, dropout_p)
        out = out + _block_attention(q_blocks, [local_group], scale, dropout_p)
    return out.reshape(b, h, blocks * block_size, -1)[:, :, :n]


@padding_safe
def sinkhorn_attention_reference(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attention_mask: Tensor | None = None,
    *,
    sort_logits: Tensor,
    block_size: int = 64,
    sinkhorn_iters: int = 5,
    temperature: float = 0.75,
    local_attention: str = "sum",
    sortcut_blocks: int | None = None,
    noise: Tensor | None = None,
    scale: float | None = None,
) -> Tensor:
    """Plain version: probability-space Sinkhorn, a dense N x N sorting matrix kron(S, I_b), full
    N x 2N scores with a block-diagonal mask. For tests only."""
    b, h, n, d = query.shape
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    blocks = -(-n // block_size)
    padded = blocks * block_size
    real = torch.ones(b, n, dtype=torch.bool) if attention_mask is None else attention_mask
    real = F.pad(real, (0, padded - n)).to(query.dtype)
    q = F.pad(query, (0, 0, 0, padded - n))
    k = F.pad(key, (0, 0, 0, padded - n)) * real[:, None, :, None]
    v = F.pad(value, (0, 0, 0, padded - n)) * real[:, None, :, None]
    s = torch.exp((sort_logits if noise is None else sort_logits + noise) / temperature)
    for _ in range(sinkhorn_iters):
        s = s / s.sum(-1, keepdim=True)
        s = s / s.sum(-2, keepdim=True)
    sorter = torch.kron(s.contiguous(), torch.eye(block_size, dtype=s.dtype))  # [B, H, N', N']
    k_sorted, v_sorted = sorter @ k, sorter @ v
    real_sorted = (sorter @ real[:, None, :, None]).squeeze(-1) > 0  # [B, H, N']
    block_of = torch.arange(padded) // block_size
    same_block = block_of[:, None] == block_of[None, :]
    if sortcut_blocks is None:
        allowed_sorted = same_block & real_sorted[:, :, None, :]
    else:
        allowed_sorted = (block_of[None, :] < sortcut_blocks) & real_sorted[:, :, None, :]
        allowed_sorted = allowed_sorted.expand(-1, -1, padded, -1)
    allowed_local = (same_block & (real[:, None, None, :] > 0)).expand(-1, h, -1, -1)

    def attend(groups: list[tuple[Tensor, Tensor, Tensor]]) -> Tensor:
        scores = torch.cat([q @ keys.transpose(-1, -2) * scale for keys, _, _ in groups], -1)
        visible = torch.cat([ok for _, _, ok in groups], -1)
        weights = torch.exp(scores - scores.amax(-1, keepdim=True)) * visible
        total = weights.sum(-1, keepdim=True)  # rows with nothing visible stay 0, finite gradients
        return weights / total.masked_fill(total == 0, 1.0) @ torch.cat([vals for _, vals, _ in groups], 2)

    sorted_group, local_group = (k_sorted, v_sorted, allowed_sorted), (k, v, allowed_local)
    if local_attention == "none":
        out = attend([sorted_group])
    elif local_attention == "joint":
        out = attend([sorted_group, local_group])
    else:
        out = attend([sorted_group]) + attend([local_group])
    return out[:, :, :n]


@register_attention(
    "sinkhorn",
    capabilities=Capabilities(needs_max_len=True, subquadratic=True),
    functional=sinkhorn_attention,
    reference=sinkhorn_attention_reference,
    paper="Sparse Sinkhorn Attention (Tay et al., ICML 2020)",
)
class SinkhornAttention(AttentionBase):
    """Sparse Sinkhorn attention: a learned block sorting (Sinkhorn-balanced) + block-local attention.

    Options (paper defaults where it gives them):
        block_size: b, tokens per block (64).
        sinkhorn_iters: k, Sinkhorn row/column normalisation rounds (5).
        temperature: tau of the Sinkhorn/Gumbel relaxation (0.75).
        gumbel: add Gumbel noise to R while training (True); never in eval.
        local_attention: queries also attend to their own (unsorted) block: "sum" (separate
            softmax, outputs added, as the authors' code; default), "joint" (one softmax over
            sorted and local keys) or "none" (sorted block only).
        sortcut_blocks: SortCut budget n_cut: every query attends to the first n_cut
            sorted blocks instead of its own sorted block; None = ordinary Sparse Sinkhorn.
        dropout: attention dropout while training.
        scale: score scale; None = 1/sqrt(head dim).
        bias: biases of the projections and of the sorting network.
    """

    def __init__(
        self,
        dim: int,
        heads: int,
        max_len: int | None = None,
        causal: bool = False,
        block_size: int = 64,
        sinkhorn_iters: int = 5,
        temperature: float = 0.75,
        gumbel: bool = True,
        local_attention: str = "sum",
        sortcut_blocks: int | None = None,
        dropout: float = 0.0,
        scale: float | None = None,
        bias: bool = True,
    ) -> None:
        super().__init__(dim, heads, max_len, causal)
        if max_len is None:
            raise AttentionError(
                "sinkhorn needs a fixed max_len (the sorting network has N_B outputs); pass max_len=..."
            )
        if not isinstance(block_size, int) or isinstance(block_size, bool) or block_size <= 0:
            raise AttentionError(f"block_size must be a positive int, got {block_size!r}")
        if not isinstance(sinkhorn_iters, int) or isinstance(sinkhorn_iters, bool) or sinkhorn_iters < 0:
            raise AttentionError(f"sinkhorn_iters must be a non-negative int, got {sinkhorn_iters!r}")
        if not temperature > 0:
            raise AttentionError(f"temperature must be positive, got {temperature!r}")
        if not 0.0 <= dropout < 1.0:
            raise AttentionError(f"dropout must be in [0, 1), got {dropout!r}")
        self.block_size = block_size
        self.max_blocks = -(-max_len // block_size)
        self.sinkhorn_iters = sinkhorn_iters
        self.temperature = temperature
        self.gumbel = gumbel
        _check_local(local_attention)
        self.local_attention = local_attention
        _check_sortcut(sortcut_blocks)
        self.sortcut_blocks = sortcut_blocks
        self.dropout = dropout
        self.scale = scale
        self.proj = QKVProjection(dim, heads, bias=bias)
        # F_P: block summary -> one row of N_B sorting logits per head (Sec. 3.1)
        self.sort_hidden = nn.Linear(dim, dim, bias=bias)
        self.sort_out = nn.Linear(dim, heads * self.max_blocks, bias=bias)

    def sort_logits(self, x: Tensor, attention_mask: Tensor | None) -> Tensor:
        """R = F_P(block sums of the real tokens of X): [B, H, N_B, N_B]."""
        b, n, dim = x.shape
        blocks = -(-n // self.block_size)
        if attention_mask is not None:
            x = x * attention_mask.unsqueeze(-1).to(x.dtype)
        padded = F.pad(x, (0, 0, 0, blocks * self.block_size - n))
        summary = padded.view(b, blocks, self.block_size, dim).sum(2)
        logits = self.sort_out(torch.relu(self.sort_hidden(summary)))
        logits = logits.view(b, blocks, self.heads, self.max_blocks)[..., :blocks]
        return logits.transpose(1, 2)

    def attend(self, x: Tensor, attention_mask: Tensor | None, layer_state: dict | None) -> Tensor:
        q, k, v = self.proj.qkv(x)
        logits = self.sort_logits(x, attention_mask)
        noise = gumbel_noise(logits.shape, logits) if self.training and self.gumbel else None
        out = sinkhorn_attention(
            q, k, v, attention_mask,
            sort_logits=logits,
            block_size=self.block_size,
            sinkhorn_iters=self.sinkhorn_iters,
            temperature=self.temperature,
            local_attention=self.local_attention,
            sortcut_blocks=self.sortcut_blocks,
            noise=noise,
            scale=self.scale,
            dropout_p=self.dropout if self.training else 0.0,
        )
        return self.proj.out(out)

    def extra_repr(self) -> str:
        return (
            f"{super().extra_repr()}, block_size={self.block_size}, sinkhorn_iters={self.sinkhorn_iters}, "
            f"temperature={self.temperature}, local_attention={self.local_attention!r}, "
            f"sortcut_blocks={self.sortcut_blocks}"
        )
