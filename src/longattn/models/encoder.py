"""The standard Long Range Arena encoder, with any registered attention mechanism.

Token embedding + learned positions, ``layers`` residual blocks (attention, then a GELU
feed-forward network), a final LayerNorm (pre-LN) and pooling over real tokens only. This is
the model of Nystromformer's PyTorch LRA code that SKTformer, Skeinformer and FSAT build on,
without its quirks: padding never enters the pooled vector and no token id means "padding"
(the bool ``attention_mask`` does).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn

from longattn import attention as attention_registry

POOLINGS = ("mean", "cls", "maxmean")
NORMS = ("pre", "post")


def check_index_ranges(*checks: tuple[str, Tensor, int]) -> None:
    """Raise a ValueError naming the first ``(label, integer tensor, bound)`` with a value outside [0, bound).

    The extrema of every tensor are read back to the host together: one device sync per call (on a GPU an
    out-of-range index would otherwise be a device-side assert that names nothing)."""
    present = [(label, values, bound) for label, values, bound in checks if values.numel()]
    if not present:
        return
    extrema = torch.stack([e.long() for _, values, _ in present for e in (values.min(), values.max())]).tolist()
    for (label, _, bound), low, high in zip(present, extrema[::2], extrema[1::2]):
        if low < 0 or high >= bound:
            raise ValueError(f"{label} must lie in [0, {bound}), got [{low}, {high}]")


class FeedForward(nn.Sequential):
    def __init__(self, dim: int, hidden: int, dropout: float) -> None:
        super().__init__(nn.Linear(dim, hidden), nn.GELU(), nn.Dropout(dropout), nn.Linear(hidden, dim))


class EncoderBlock(nn.Module):
    """One residual block: pre-LN ``x + f(LN(x))`` (default) or post-LN ``LN(x + f(x))``.

    A mechanism that declares ``replaces_ffn`` (FLASH's GAU) is attention and FFN in one: the
    block is then its single residual sublayer, without a feed-forward network; ``hidden=0`` leaves
    the feed-forward network out for any mechanism (attention-only blocks).
    """

    def __init__(self, attention: nn.Module, dim: int, hidden: int, dropout: float, norm: str) -> None:
        super().__init__()
        self.attention = attention
        has_ffn = hidden > 0 and not getattr(attention, "capabilities", attention_registry.Capabilities()).replaces_ffn
        self.ffn = FeedForward(dim, hidden, dropout) if has_ffn else None
        self.norm_attention = nn.LayerNorm(dim)
        self.norm_ffn = nn.LayerNorm(dim) if has_ffn else None
        self.dropout = nn.Dropout(dropout)
        self.pre_norm = norm == "pre"

    def forward(self, x: Tensor, attention_mask: Tensor, layer_state: dict) -> Tensor:
        if self.pre_norm:
            x = x + self.dropout(self.attention(self.norm_attention(x), attention_mask, layer_state))
            return x if self.ffn is None else x + self.dropout(self.ffn(self.norm_ffn(x)))
        x = self.norm_attention(x + self.dropout(self.attention(x, attention_mask, layer_state)))
        return x if self.ffn is None else self.norm_ffn(x + self.dropout(self.ffn(x)))


class LRAEncoder(nn.Module):
    """Maps tokens [B, N] (+ bool mask, True = real) to token features [B, N', dim].

    With ``pooling="cls"`` a learned CLS token is prepended (N' = N + 1, mask True there), so
    ``max_len`` counts real tokens only. :meth:`pool` reduces the features over real tokens.
    """

    def __init__(
        self,
        vocab_size: int,
        max_len: int,
        attention: str = "softmax",
        attention_options: dict[str, Any] | None = None,
        layers: int = 2,
        dim: int = 64,
        hidden: int = 128,
        heads: int = 2,
        dropout: float = 0.1,
        embedding_dropout: float = 0.1,
        norm: str = "pre",
        pooling: str = "mean",
        input_dim: int | None = None,
    ) -> None:
        super().__init__()
        if pooling not in POOLINGS:
            raise ValueError(f"pooling must be one of {POOLINGS}, got {pooling!r}")
        if norm not in NORMS:
            raise ValueError(f"norm must be one of {NORMS}, got {norm!r}")
        if input_dim is not None and input_dim <= 0:
            raise ValueError(f"input_dim must be positive, got {input_dim}")
        if (vocab_size <= 0 and input_dim is None) or max_len <= 0:
            raise ValueError(f"vocab_size and max_len must be positive, got {vocab_size}, {max_len}")
        self.vocab_size = vocab_size
        self.input_dim = input_dim
        self.max_len = max_len
        self.pooling = pooling
        self.dim = dim
        self.use_cls = pooling == "cls"
        seq_len = max_len + int(self.use_cls)
        # Token ids through an embedding table, or real-valued input vectors (CIFAR-100's 2x2 patches,
        # Singularformer section 4.1) through a linear map.
        self.token_embedding = nn.Embedding(vocab_size, dim) if input_dim is None else nn.Linear(input_dim, dim)
        self.position_embedding = nn.Embedding(seq_len, dim)
        self.cls_token = nn.Parameter(torch.zeros(1, 1, dim)) if self.use_cls else None
        self.embedding_dropout = nn.Dropout(embedding_dropout)
        options = dict(attention_options or {})
        self.blocks = nn.ModuleList(
            EncoderBlock(
                attention_registry.build(attention, dim=dim, heads=heads, max_len=seq_len, **options),
                dim, hidden, dropout, norm,
            )
            for _ in range(layers)
        )
        # Post-LN blocks already end in a LayerNorm; the final one belongs to the pre-LN layout.
        self.final_norm = nn.LayerNorm(dim) if norm == "pre" else nn.Identity()
        if input_dim is None:
            nn.init.normal_(self.token_embedding.weight, std=0.02)
        nn.init.normal_(self.position_embedding.weight, std=0.02)
        if self.cls_token is not None:
            nn.init.normal_(self.cls_token, std=0.02)

    def forward(self, tokens: Tensor, attention_mask: Tensor | None = None) -> tuple[Tensor, Tensor]:
        """Returns (features [B, N', dim], mask [B, N']) with N' = N (+1 with a CLS token).

        ``tokens``: integer ids [B, N], or float vectors [B, N, input_dim] for an encoder built with ``input_dim``.
        """
        if self.input_dim is not None:
            if tokens.dim() != 3 or not tokens.is_floating_point() or tokens.shape[-1] != self.input_dim:
                raise ValueError(f"inputs must be a float tensor [B, N, {self.input_dim}], got {tokens.dtype} "
                                 f"{list(tokens.shape)}")
        elif tokens.dim() != 2 or tokens.dtype not in (torch.long, torch.int, torch.int16, torch.uint8):
            raise ValueError(f"tokens must be an integer tensor [B, N], got {tokens.dtype} {list(tokens.shape)}")
        batch, length = tokens.shape[:2]
        if length > self.max_len:
            raise ValueError(f"sequence length {length} exceeds the model's max_len={self.max_len}")
        if attention_mask is None:
            attention_mask = torch.ones(batch, length, dtype=torch.bool, device=tokens.device)
        if attention_mask.shape != (batch, length) or attention_mask.dtype != torch.bool:
            raise ValueError(
                f"attention_mask must be bool {[batch, length]} (True = real token), "
                f"got {attention_mask.dtype} {list(attention_mask.shape)}"
            )
        if self.input_dim is None:
            check_index_ranges(("token ids", tokens, self.vocab_size))
        x = self.token_embedding(tokens)
        if self.use_cls:
            x = torch.cat([self.cls_token.expand(batch, 1, -1), x], dim=1)
            attention_mask = torch.cat([attention_mask.new_ones(batch, 1), attention_mask], dim=1)
        positions = torch.arange(x.shape[1], device=tokens.device)
        x = self.embedding_dropout(x + self.position_embedding(positions))
        x = x * attention_mask.unsqueeze(-1).to(x.dtype)
        layer_state: dict = {}  # one dict per forward, shared by every layer in order (Singularformer)
        for block in self.blocks:
            x = block(x, attention_mask, layer_state)
        return self.final_norm(x), attention_mask

    def pool(self, features: Tensor, attention_mask: Tensor) -> Tensor:
        """[B, N', dim] -> [B, dim] ("mean", "cls") or [B, 2*dim] ("maxmean": max then mean)."""
        return pool_features(features, attention_mask, self.pooling)

    @property
    def pooled_dim(self) -> int:
        return 2 * self.dim if self.pooling == "maxmean" else self.dim


def pool_features(features: Tensor, attention_mask: Tensor, pooling: str) -> Tensor:
    """Pool over real tokens only; a sequence without real tokens pools to zeros."""
    if pooling == "cls":
        return features[:, 0]
    real = attention_mask.unsqueeze(-1)
    count = real.sum(1).clamp(min=1).to(features.dtype)
    mean = (features * real.to(features.dtype)).sum(1) / count
    if pooling == "mean":
        return mean
    if pooling == "maxmean":
        lowest = torch.finfo(features.dtype).min
        maximum = features.masked_fill(~real, lowest).amax(1)
        maximum = maximum.masked_fill(~real.any(1), 0.0)
        return torch.cat([maximum, mean], dim=-1)
    raise ValueError(f"pooling must be one of {POOLINGS}, got {pooling!r}")
