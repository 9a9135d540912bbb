"""Synthesizer (Tay et al., ICML 2021): attention weights synthesised without token-token dot products.

``Y_h = softmax(B_h) G_h(X)`` where ``G_h(X)`` is the head's value projection and the N x N logits
``B_h`` come from one of the paper's variants (Sec. 3):

* ``dense`` (eq. 1): every token predicts its own row of logits, ``B_i = F2(ReLU(F1(X_i)))`` with
  ``F2`` mapping to ``max_len`` key positions;
* ``random`` (Sec. 3.2): ``B = R``, an ``max_len x max_len`` matrix per head, independent of the
  input, trainable or fixed;
* ``factorized_dense`` (Sec. 3.3): ``A = F_A(X_i)`` of width ``a`` and ``B = F_B(X_i)`` of width
  ``b`` with ``a b = max_len``, repeated to full width and multiplied elementwise;
* ``factorized_random`` (Sec. 3.3): ``R = R1 R2^T`` with ``R1, R2`` of shape ``max_len x k``.

Optionally the synthetic logits are mixed with ordinary dot-product logits with learned weights
(the "mixture of Synthesizers", Sec. 3.4). All variants are quadratic in N by construction (the
attention matrix is N x N) and need ``max_len``; inputs shorter than ``max_len`` use the leading
rows/columns.
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
    check_attention_mask,
    merge_heads,
    padding_safe,
    register_attention,
    split_heads,
)
from longattn.attention.decoding import KVState

__all__ = ["SynthesizerAttention", "synthesizer_attention", "synthesizer_attention_reference"]

VARIANTS = ("dense", "random", "factorized_dense", "factorized_random")


def _check_inputs(
    query: Tensor | None, key: Tensor | None, value: Tensor, synthetic_logits: Tensor,
    attention_mask: Tensor | None, dot_product_weight: Tensor | float,
) -> None:
    if not isinstance(value, Tensor) or value.dim() != 4 or not value.is_floating_point():
        raise AttentionError("value must be a floating-point [B, H, N, Dh] tensor")
    b, h, n, _ = value.shape
    if (
        not isinstance(synthetic_logits, Tensor)
        or synthetic_logits.dim() != 4
        or synthetic_logits.shape[1:] != (h, n, n)
        or synthetic_logits.shape[0] not in (1, b)
    ):
        shape = list(synthetic_logits.shape) if isinstance(synthetic_logits, Tensor) else synthetic_logits
        raise AttentionError(
            f"synthetic_logits must be [B or 1, H, N, N] = [{b}, {h}, {n}, {n}], got {shape}"
        )
    uses_dot = isinstance(dot_product_weight, Tensor) or dot_product_weight != 0
    if uses_dot and (
        not isinstance(query, Tensor) or not isinstance(key, Tensor)
        or query.shape != value.shape[:3] + query.shape[-1:] or key.shape != query.shape
    ):
        raise AttentionError("mixing in dot-product attention needs query and key of shape [B, H, N, Dh]")
    check_attention_mask(attention_mask, b, n, value.device)


@padding_safe
def synthesizer_attention(
    query: Tensor | None,
    key: Tensor | None,
    value: Tensor,
    attention_mask: Tensor | None = None,
    *,
    synthetic_logits: Tensor,
    synthetic_weight: Tensor | float = 1.0,
    dot_product_weight: Tensor | float = 0.0,
    is_causal: bool = False,
    scale: float | None = None,
    dropout_p: float = 0.0,
) -> Tensor:
    """softmax(w_s B + w_d Q K^T * scale) V on [B, H, N, Dh] (Sec. 3.4; w_d = 0: pure Synthesizer).

    ``synthetic_logits`` B: [B or 1, H, N, N]. ``query``/``key`` are only used (and may be None
    otherwise) when ``dot_product_weight`` is non-zero. A query with no visible key gets zeros.
    """
    _check_inputs(query, key, value, synthetic_logits, attention_mask, dot_product_weight)
    n = value.shape[2]
    # skip no-op arithmetic: every extra op here is a full N x N pass
    unit_weight = not isinstance(synthetic_weight, Tensor) and synthetic_weight == 1.0
    logits = synthetic_logits if unit_weight else synthetic_weight * synthetic_logits
    if isinstance(dot_product_weight, Tensor) or dot_product_weight != 0:
        scale = 1.0 / math.sqrt(query.shape[-1]) if scale is None else scale
        logits = logits + dot_product_weight * (query @ key.transpose(-1, -2)) * scale
    if attention_mask is None and not is_causal:
        weights = torch.softmax(logits, dim=-1)
    else:
        keep = torch.ones(1, 1, 1, n, dtype=torch.bool, device=value.device)
        if attention_mask is not None:
            keep = keep & attention_mask[:, None, None, :]
        if is_causal:
            keep = keep & torch.ones(n, n, dtype=torch.bool, device=value.device).tril()
        weights = torch.softmax(logits.masked_fill(~keep, torch.finfo(logits.dtype).min), dim=-1)
    if dropout_p > 0:
        weights = F.dropout(weights, p=dropout_p)
    out = weights @ value
    if attention_mask is not None:  # a query with no visible key (uniform over masked ones) gives 0
        out = out.masked_fill(~keep.any(-1, keepdim=True), 0.0)
    return out


@padding_safe
def synthesizer_attention_reference(
    query: Tensor | None,
    key: Tensor | None,
    value: Tensor,
    attention_mask: Tensor | None = None,
    *,
    synthetic_logits: Tensor,
    synthetic_weight: Tensor | float = 1.0,
    dot_product_weight: Tensor | float = 0.0,
    is_causal: bool = False,
    scale: float | None = None,
) -> Tensor:
    """Plain exp-normalise version; for tests only."""
    n = value.shape[2]
    logits = synthetic_weight * synthetic_logits
    if isinstance(dot_product_weight, Tensor) or dot_product_weight != 0:
        scale = 1.0 / math.sqrt(query.shape[-1]) if scale is None else scale
        logits = logits + dot_product_weight * torch.einsum("bhid,bhjd->bhij", query, key) * scale
    weights = torch.exp(logits - logits.amax(-1, keepdim=True))
    if attention_mask is not None:
        weights = weights * attention_mask[:, None, None, :]
    if is_causal:
        weights = weights * torch.ones(n, n).tril()
    total = weights.sum(-1, keepdim=True)  # rows with nothing visible stay 0, finite gradients
    return weights / total.masked_fill(total == 0, 1.0) @ value


def _default_factor(max_len: int) -> int:
    """The largest divisor a of max_len with a <= sqrt(max_len), so a * b = max_len with a <= b."""
    return max(a for a in range(1, math.isqrt(max_len) + 1) if max_len % a == 0)


@register_attention(
    "synthesizer",
    capabilities=Capabilities(causal=True, needs_max_len=True, subquadratic=False),
    functional=synthesizer_attention,
    reference=synthesizer_attention_reference,
    paper="Synthesizer: Rethinking Self-Attention for Transformer Models (Tay et al., ICML 2021)",
)
class SynthesizerAttention(AttentionBase):
    """Synthesizer: dense / random (optionally factorized, optionally mixed) synthetic attention.

    Options (paper defaults):
        variant: "dense" (default), "random", "factorized_dense" or "factorized_random", or a
            mixture of them joined by "+" (e.g. "dense+random"): ``softmax(sum_i a_i B_i) G(X)``
            with learned weights a_i (the paper's mixtures of Synthesizers).
        trainable_random: the random variants' R is learned (True) or fixed at init ("Fixed").
        factor_a: a of the factorized dense variant (a * b = max_len); None = the largest divisor
            of max_len not above sqrt(max_len).
        random_rank: k of the factorized random variant (8).
        mix_dot_product: also mix in dot-product logits Q K^T / sqrt(d) with a learned weight
            (the "+ Vanilla" mixtures), False.
        dropout: attention dropout while training.
        bias: biases of the projections.
    """

    def __init__(
        self,
        dim: int,
        heads: int,
        max_len: int | None = None,
        causal: bool = False,
        variant: str = "dense",
        trainable_random: bool = True,
        factor_a: int | None = None,
        random_rank: int = 8,
        mix_dot_product: bool = False,
        dropout: float = 0.0,
        bias: bool = True,
    ) -> None:
        super().__init__(dim, heads, max_len, causal)
        if max_len is None:
            raise AttentionError("synthesizer needs a fixed max_len; pass max_len=...")
        parts = tuple(variant.split("+")) if isinstance(variant, str) else ()
        if not parts or any(p not in VARIANTS for p in parts) or len(set(parts)) != len(parts):
            raise AttentionError(
                f"variant must be one of {VARIANTS} or a '+'-joined mixture of distinct ones, got {variant!r}"
            )
        if not 0.0 <= dropout < 1.0:
            raise AttentionError(f"dropout must be in [0, 1), got {dropout!r}")
        self.variant = variant
        self.parts = parts
        self.dropout = dropout
        if "dense" in parts:
            self.dense_hidden = nn.Linear(dim, dim, bias=bias)  # F1 (eq. 1)
            self.dense_out = nn.Linear(dim, heads * max_len, bias=bias)  # F2: a row of l logits per head
        if "factorized_dense" in parts:
            factor_a = _default_factor(max_len) if factor_a is None else factor_a
            valid = isinstance(factor_a, int) and not isinstance(factor_a, bool) and factor_a > 0
            if not valid or max_len % factor_a:
                raise AttentionError(
                    f"factor_a must be a positive divisor of max_len={max_len}, got {factor_a!r}"
                )
            self.factor_a, self.factor_b = factor_a, max_len // factor_a
            self.factorized_hidden = nn.Linear(dim, dim, bias=bias)
            self.to_a = nn.Linear(dim, heads * self.factor_a, bias=bias)  # F_A
            self.to_b = nn.Linear(dim, heads * self.factor_b, bias=bias)  # F_B
        if "random" in parts:
            self.random_logits = nn.Parameter(
                torch.randn(heads, max_len, max_len), requires_grad=trainable_random
            )
        if "factorized_random" in parts:
            if not isinstance(random_rank, int) or isinstance(random_rank, bool) or random_rank <= 0:
                raise AttentionError(f"random_rank must be a positive int, got {random_rank!r}")
            # R1 R2^T has unit-variance entries when R1, R2 are N(0, 1/sqrt(k))
            self.random_left = nn.Parameter(
                torch.randn(heads, max_len, random_rank) * random_rank**-0.25, requires_grad=trainable_random
            )
            self.random_right = nn.Parameter(
                torch.randn(heads, max_len, random_rank) * random_rank**-0.25, requires_grad=trainable_random
            )
        self.to_v = nn.Linear(dim, dim, bias=bias)  # G(X)
        self.to_out = nn.Linear(dim, dim, bias=bias)
        self.mix_dot_product = mix_dot_product
        if mix_dot_product:
            self.to_q = nn.Linear(dim, dim, bias=bias)
            self.to_k = nn.Linear(dim, dim, bias=bias)
        terms = len(parts) + int(mix_dot_product)
        # one learned weight per mixed term (synthetic parts first, dot product last), init 1/terms
        self.mix_weights = nn.Parameter(torch.full((terms,), 1.0 / terms)) if terms > 1 else None

    def part_logits(self, x: Tensor, part: str) -> Tensor:
        """B of one variant for the current input: [B, H, N, N] (dense ones) or [1, H, N, N] (random)."""
        b, n, _ = x.shape
        if part == "dense":
            rows = self.dense_out(torch.relu(self.dense_hidden(x)))  # [B, N, H * l]
            return rows.view(b, n, self.heads, self.max_len)[..., :n].transpose(1, 2)
        if part == "factorized_dense":
            hidden = torch.relu(self.factorized_hidden(x))
            a = self.to_a(hidden).view(b, n, self.heads, self.factor_a).transpose(1, 2)
            bb = self.to_b(hidden).view(b, n, self.heads, self.factor_b).transpose(1, 2)
            # column j pairs a[j mod a] with b[j div a]: every (a, b) combination appears once
            full = a.repeat(1, 1, 1, self.factor_b) * bb.repeat_interleave(self.factor_a, dim=-1)
            return full[..., :n]
        if part == "random":
            return self.random_logits[:, :n, :n].unsqueeze(0)
        return (self.random_left[:, :n] @ self.random_right[:, :n].transpose(-1, -2)).unsqueeze(0)

    def synthetic_logits(self, x: Tensor) -> Tensor:
        """The synthetic logits: one variant's B, or the weighted sum of a mixture's."""
        if len(self.parts) == 1:
            logits = self.part_logits(x, self.parts[0])
            return logits if self.mix_weights is None else self.mix_weights[0] * logits
        return sum(w * self.part_logits(x, part) for w, part in zip(self.mix_weights, self.parts))

    def attend(self, x: Tensor, attention_mask: Tensor | None, layer_state: dict | None) -> Tensor:
        value = split_heads(self.to_v(x), self.heads)
        logits = self.synthetic_logits(x).to(x.dtype)  # mixture weights already applied
        query = key = None
        dot_weight: Tensor | float = 0.0
        if self.mix_dot_product:
            query = split_heads(self.to_q(x), self.heads)
            key = split_heads(self.to_k(x), self.heads)
            dot_weight = self.mix_weights[-1]
        out = synthesizer_attention(
            query, key, value, attention_mask,
            synthetic_logits=logits,
            dot_product_weight=dot_weight,
            is_causal=self.causal,
            dropout_p=self.dropout if self.training else 0.0,
        )
        return self.to_out(merge_heads(out))

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, variant={self.variant!r}, mix_dot_product={self.mix_dot_product}"

    # -- decoding: the cached values (and keys of a dot-product mixture); the new token's logit row --
    decode_state = "kv_cache"

    def part_row(self, x: Tensor, part: str, position: int) -> Tensor:
        """Row ``position`` of one variant's logits B for the token ``x`` [B, 1, dim] there: [B or 1, H, 1, position + 1]
        (its keys 0 .. position; the causal mask hides the rest)."""
        b = x.shape[0]
        keys = position + 1
        if part == "dense":
            rows = self.dense_out(torch.relu(self.dense_hidden(x)))
            return rows.view(b, 1, self.heads, self.max_len)[..., :keys].transpose(1, 2)
        if part == "factorized_dense":
            hidden = torch.relu(self.factorized_hidden(x))
            a = self.to_a(hidden).view(b, 1, self.heads, self.factor_a).transpose(1, 2)
            bb = self.to_b(hidden).view(b, 1, self.heads, self.factor_b).transpose(1, 2)
            return (a.repeat(1, 1, 1, self.factor_b) * bb.repeat_interleave(self.factor_a, dim=-1))[..., :keys]
        if part == "random":
            return self.random_logits[:, position:keys, :keys].unsqueeze(0)
        return (self.random_left[:, position:keys] @ self.random_right[:, :keys].transpose(-1, -2)).unsqueeze(0)

    def prefill_attend(self, x: Tensor, attention_mask: Tensor | None,
                       layer_state: dict | None) -> tuple[Tensor, KVState]:
        key = split_heads(self.to_k(x), self.heads) if self.mix_dot_product else None
        state = KVState.start(key, split_heads(self.to_v(x), self.heads), attention_mask)
        return self.attend(x, attention_mask, layer_state), state

    def step_attend(self, x: Tensor, state: KVState, real: Tensor | None,
                    layer_state: dict | None) -> tuple[Tensor, KVState]:
        t = state.length
        key = split_heads(self.to_k(x), self.heads) if self.mix_dot_product else None
        state.append(key, split_heads(self.to_v(x), self.heads), real)
        keys, values, visible = state.view()
        rows = [self.part_row(x, part, t) for part in self.parts]
        weights = [1.0] * len(rows) if self.mix_weights is None else list(self.mix_weights)
        logits = sum(w * row for w, row in zip(weights, rows)).to(x.dtype)
        if self.mix_dot_product:
            query = split_heads(self.to_q(x), self.heads)
            logits = logits + self.mix_weights[-1] * (query @ keys.transpose(-1, -2)) / math.sqrt(self.head_dim)
        keep = visible[:, None, None, :]
        probs = torch.softmax(logits.masked_fill(~keep, torch.finfo(logits.dtype).min), dim=-1)
        if self.training and self.dropout > 0:
            probs = F.dropout(probs, p=self.dropout)
        out = (probs @ values).masked_fill(~keep.any(-1, keepdim=True), 0.0)
        return self.to_out(merge_heads(out)), state
