"""Linformer (Wang et al., 2020) and the unreduced Johnson-Lindenstrauss sketch it starts from.

``linformer`` (Linformer eq. 7): keys and values are projected along the sequence by learned
[n, k] matrices E and F before softmax attention::

    head_i = softmax(Q W^Q (E K W^K)^T / sqrt(d_k)) (F V W^V)

E, F are sized for ``max_len``; a shorter input uses their first N rows (the columns of E, F for
missing positions are dropped), and a padded key is dropped the same way (its row of K, V is zeroed
before the projection). Sharing (Section 4): ``share_kv`` (E = F, key-value sharing) and
``headwise`` (one E, F for all heads; per-head matrices otherwise). Layerwise sharing is a model
choice: pass the same module to every layer.

``linformer_jl``: the form Linformer derives from the JL lemma (Linformer eq. 5) and Skeinformer
(Section 3.3.2) compares with as "Linformer with unreduced JL transform"::

    D^-1 A S S^T V = softmax(Q K^T / sqrt(p)) (S S^T V),  S in R^{n x d} with i.i.d. N(0, 1/d) entries

The product S S^T V ([n, Dh]) is formed first, so the cost is that of exact softmax attention on a
sketched V; softmax(Q K^T) is still needed in full, so this is *not* sub-quadratic in time (SDPA
keeps the memory low where its fused kernels apply).
"""

from __future__ import annotations

import math

import torch
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
from longattn.attention.softmax import softmax_attention, softmax_attention_reference


def _check_projection(name: str, proj: Tensor, n: int, heads: int) -> None:
    if proj.dim() not in (2, 3) or proj.shape[-2] < n or (proj.dim() == 3 and proj.shape[0] != heads):
        raise AttentionError(
            f"{name} must be [max_len >= N={n}, k] or [H={heads}, max_len, k], got {list(proj.shape)}"
        )


def _project_sequence(x: Tensor, proj: Tensor) -> Tensor:
    """E X along the sequence: x [B, H, N, D], proj [max_len, k] or [H, max_len, k] -> [B, H, k, D]."""
    b, h, n, d = x.shape
    proj = proj[..., :n, :].to(x.dtype)  # inputs shorter than max_len use the first N positions
    if proj.dim() == 3:
        return proj.transpose(-1, -2) @ x
    # One E for all heads: a single [k, N] @ [N, H * D] product per sequence (the [B, N, H, D] layout
    # is what the head split left, so the reshape is free in the module form).
    flat = x.transpose(1, 2).reshape(b, n, h * d)
    return (proj.T @ flat).view(b, -1, h, d).transpose(1, 2)


@padding_safe
def linformer_attention(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attention_mask: Tensor | None = None,
    *,
    proj_k: Tensor,
    proj_v: Tensor,
    scale: float | None = None,
    dropout_p: float = 0.0,
) -> Tensor:
    """Linformer eq. 7 on [B, H, N, Dh]; ``proj_k``/``proj_v`` are E^T, F^T as [max_len, k] or [H, max_len, k]."""
    check_qkv(query, key, value, attention_mask)
    n, heads = key.shape[-2], key.shape[1]
    _check_projection("proj_k", proj_k, n, heads)
    _check_projection("proj_v", proj_v, n, heads)
    if attention_mask is not None:
        keep = attention_mask[:, None, :, None].to(key.dtype)
        key, value = key * keep, value * keep  # a padded position contributes no column of E, F
    small_k = _project_sequence(key, proj_k)  # [B, H, k, Dh]
    small_v = _project_sequence(value, proj_v)
    # exact softmax attention against the k projected keys: SDPA's fused kernel keeps no [N, k] weights
    return torch.nn.functional.scaled_dot_product_attention(query, small_k, small_v, dropout_p=dropout_p, scale=scale)


@padding_safe
def linformer_attention_reference(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attention_mask: Tensor | None = None,
    *,
    proj_k: Tensor,
    proj_v: Tensor,
    scale: float | None = None,
) -> Tensor:
    """Plain eq. 7 with an explicit E: drop padded and out-of-range positions from E, F; for tests."""
    b, h, n, d = key.shape
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    outs = []
    for bi in range(b):
        keep = torch.ones(n, dtype=torch.bool) if attention_mask is None else attention_mask[bi].cpu()
        heads_out = []
        for hi in range(h):
            e = (proj_k if proj_k.dim() == 2 else proj_k[hi])[:n][keep].T  # [k, n_real]
            f = (proj_v if proj_v.dim() == 2 else proj_v[hi])[:n][keep].T
            k_small = e.to(key.dtype) @ key[bi, hi][keep]
            v_small = f.to(key.dtype) @ value[bi, hi][keep]
            scores = query[bi, hi] @ k_small.T * scale
            heads_out.append(torch.softmax(scores, dim=-1) @ v_small)
        outs.append(torch.stack(heads_out))
    return torch.stack(outs)


@register_attention(
    "linformer",
    capabilities=Capabilities(needs_max_len=True, sequence_parallel=True),
    functional=linformer_attention,
    reference=linformer_attention_reference,
    paper="Linformer: Self-Attention with Linear Complexity (Wang et al., 2020)",
)
class LinformerAttention(AttentionBase):
    """Linformer: keys and values projected along the sequence to length k by learned E, F."""

    def __init__(
        self,
        dim: int,
        heads: int,
        max_len: int | None = None,
        causal: bool = False,
        k: int = 256,
        share_kv: bool = False,
        headwise: bool = True,
        dropout: float = 0.0,
        bias: bool = True,
    ) -> None:
        super().__init__(dim, heads, max_len, causal)
        if max_len is None:
            raise AttentionError("linformer needs a fixed max_len (E and F are [max_len, k])")
        if not isinstance(k, int) or k <= 0:
            raise AttentionError(f"k must be a positive int, got {k!r}")
        self.proj = QKVProjection(dim, heads, bias=bias)
        self.k = k
        self.share_kv = share_kv
        self.dropout = dropout
        shape = (max_len, k) if headwise else (heads, max_len, k)
        # Initialised like a linear layer from k inputs: U(-1/sqrt(k), 1/sqrt(k)).
        bound = 1.0 / math.sqrt(k)
        self.proj_k = nn.Parameter(torch.empty(shape).uniform_(-bound, bound))
        self.proj_v = None if share_kv else nn.Parameter(torch.empty(shape).uniform_(-bound, bound))

    def attend(self, x: Tensor, attention_mask: Tensor | None, layer_state: dict | None) -> Tensor:
        q, k, v = self.proj.qkv(x)
        out = linformer_attention(
            q, k, v, attention_mask,
            proj_k=self.proj_k,
            proj_v=self.proj_k if self.proj_v is None else self.proj_v,
            dropout_p=self.dropout if self.training else 0.0,
        )
        return self.proj.out(out)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, k={self.k}, share_kv={self.share_kv}"


def gaussian_sketch(n: int, sketch_dim: int, *, dtype: torch.dtype, device: torch.device) -> Tensor:
    """S in R^{n x d} with i.i.d. N(0, 1/d) entries, so E[S S^T] = I (the JL sketch). Drawn in float32
    whatever ``dtype``, so that one seed gives the same S in every precision (and under autocast)."""
    return (torch.randn(n, sketch_dim, device=device) / math.sqrt(sketch_dim)).to(dtype)


@padding_safe
def linformer_jl_attention(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attention_mask: Tensor | None = None,
    *,
    sketch: Tensor,
    scale: float | None = None,
) -> Tensor:
    """softmax(Q K^T * scale) S S^T V with ``sketch`` S [N, d]; S^T V is taken over real tokens only."""
    check_qkv(query, key, value, attention_mask)
    if sketch.dim() != 2 or sketch.shape[0] != key.shape[-2]:
        raise AttentionError(f"sketch must be [N={key.shape[-2]}, d], got {list(sketch.shape)}")
    if attention_mask is not None:
        value = value * attention_mask[:, None, :, None].to(value.dtype)
    sketch = sketch.to(value.dtype)
    sketched_value = sketch @ (sketch.T @ value)  # S (S^T V): [B, H, N, Dh], never N x N
    return softmax_attention(query, key, sketched_value, attention_mask, scale=scale)


@padding_safe
def linformer_jl_attention_reference(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attention_mask: Tensor | None = None,
    *,
    sketch: Tensor,
    scale: float | None = None,
) -> Tensor:
    """Plain D^-1 A S S^T V with the full attention matrix; for tests only."""
    scale = 1.0 / math.sqrt(query.shape[-1]) if scale is None else scale
    scores = query @ key.transpose(-1, -2) * scale
    if attention_mask is not None:
        scores = scores.masked_fill(~attention_mask[:, None, None, :], float("-inf"))
        value = value * attention_mask[:, None, :, None].to(value.dtype)
    weights = torch.softmax(scores, dim=-1).nan_to_num(0.0)
    s = sketch.to(value.dtype)
    return ((weights @ s) @ s.T) @ value


@register_attention(
    "linformer_jl",
    capabilities=Capabilities(stochastic_eval=True, subquadratic=False),
    functional=linformer_jl_attention,
    reference=linformer_jl_attention_reference,
    paper="Linformer eq. 5 (Wang et al., 2020), as compared in Skeinformer (Chen et al., NAACL 2022) Section 3.3.2",
)
class LinformerJLAttention(AttentionBase):
    """Unreduced JL sketch softmax(QK^T/sqrt(p)) S S^T V with a fresh Gaussian S every call."""

    def __init__(
        self,
        dim: int,
        heads: int,
        max_len: int | None = None,
        causal: bool = False,
        sketch_dim: int = 256,
        bias: bool = True,
    ) -> None:
        super().__init__(dim, heads, max_len, causal)
        if not isinstance(sketch_dim, int) or sketch_dim <= 0:
            raise AttentionError(f"sketch_dim must be a positive int, got {sketch_dim!r}")
        self.proj = QKVProjection(dim, heads, bias=bias)
        self.sketch_dim = sketch_dim

    def attend(self, x: Tensor, attention_mask: Tensor | None, layer_state: dict | None) -> Tensor:
        q, k, v = self.proj.qkv(x)
        # A JL sketch is random, not learned: one S per call, shared by batch and heads.
        sketch = gaussian_sketch(x.shape[1], self.sketch_dim, dtype=v.dtype, device=v.device)
        return self.proj.out(linformer_jl_attention(q, k, v, attention_mask, sketch=sketch))
