"""Informer's ProbSparse self-attention (Zhou et al., AAAI 2021), padding-aware.

Only the u = c * ceil(ln L) "active" queries attend (Section 3.1, eq. 3-4)::

    M_bar(q_i, K) = max_j (q_i k_j^T / sqrt(d)) - 1/L_K sum_j q_i k_j^T / sqrt(d)      (eq. 4)

evaluated on U = c * ceil(ln L_K) randomly sampled keys per query ("filling other pairs with zero",
so the sum runs over the samples and is divided by L_K). The top-u queries by M_bar get exact
softmax attention over all keys; every other query outputs the mean of V (the "lazy" queries).

Padding (Skeinformer Section 4.4 applies the same fix to Informer): L_K and L_Q are the number m of
real tokens of each sequence, keys are sampled among the real tokens only, padded queries are never
selected, padded keys get no weight, and the mean of V runs over the real tokens. u and U are per
sequence (c * ceil(ln m), at least 1, at most m).

The sampling uses the global torch RNG (or ``key_samples`` given explicitly), once per call, shared
by all heads (as in the authors' implementation), so the output is random also in eval mode.

GPU path (:func:`~longattn.attention.base.uses_gpu_path`): the same steps as a few batched programs
with no read-back from the device: U and u have static bounds from the length (the slots past a
sequence's own U_b and u_b unused), the sparsity measure by the Triton kernel of
``_informer_triton`` where it runs (else the sampled keys gathered at once), the active queries'
softmax attention by fused scaled-dot-product attention (autocast dtype, float32 softmax), the
mean of V in float32.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor

from longattn.attention._triton import kernels_run_on, pytorch_path_where_kernels_do_not_fit
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

# Budget (elements) of one chunk of gathered sampled keys while scoring the queries.
_SAMPLE_CHUNK_ELEMENTS = 1 << 20


def probsparse_counts(real_counts: Tensor, factor: float) -> Tensor:
    """c * ceil(ln m) per sequence, clamped to [1, m] (ln 1 = 0 would select nothing)."""
    m = real_counts.clamp(min=1)
    counts = torch.floor(factor * torch.ceil(torch.log(m.double()))).long()
    return torch.minimum(counts.clamp(min=1), m)


def sample_informer_keys(
    attention_mask: Tensor | None,
    batch: int,
    length: int,
    factor: float,
    device: torch.device,
    generator: torch.Generator | None = None,
) -> Tensor:
    """Key indices [B, N, U_max] drawn uniformly with replacement among each sequence's real tokens.

    Sequence b uses its first U_b = c * ceil(ln m_b) columns; the rest are padding of the tensor.
    The draws depend only on the mask, never on the content, so padded content cannot change them.
    U_max is :func:`probsparse_slots` of the length, the static count the GPU path draws, so that both paths
    draw the same keys from one seed whatever the padding.
    """
    real = torch.ones(batch, length, dtype=torch.bool, device=device) if attention_mask is None else attention_mask
    return _draw_key_samples(real, probsparse_slots(length, factor), generator)


def _draw_key_samples(real: Tensor, slots: int, generator: torch.Generator | None) -> Tensor:
    """[B, N, slots] key indices, uniform with replacement among each sequence's real tokens."""
    batch, length = real.shape
    m = real.sum(dim=-1)
    # real_positions[b, r] = position of the r-th real token of sequence b
    real_positions = torch.argsort((~real).to(torch.int8), dim=-1, stable=True)
    uniform = torch.rand(batch, length, slots, generator=generator, device=real.device)
    rank = (uniform * m.clamp(min=1)[:, None, None]).long()
    rank = torch.minimum(rank, (m.clamp(min=1) - 1)[:, None, None])
    return real_positions.gather(-1, rank.reshape(batch, -1)).reshape(batch, length, slots)


def probsparse_slots(length: int, factor: float) -> int:
    """The largest c * ceil(ln m) (clamped to [1, m]) any sequence of ``length`` tokens can have: the static
    number of sample and query slots of the GPU path (never read back from the device)."""
    return min(length, max(1, math.floor(factor * math.ceil(math.log(max(length, 1))))))


@torch.no_grad()
def sparsity_measure(query: Tensor, key: Tensor, key_samples: Tensor, sample_counts: Tensor, m: Tensor) -> Tensor:
    """M_bar of eq. 4 from the sampled keys, [B, H, N]; only used to rank queries (no gradient), so
    the positive 1/sqrt(d) factor, which does not change the ranking, is left out."""
    b, h, n, d = query.shape
    n_samples = key_samples.shape[-1]
    sample_valid = torch.arange(n_samples, device=query.device)[None, :] < sample_counts[:, None]  # [B, U]
    # token-major rows [B * N, H * D]: the sampled keys of all heads are gathered as whole rows (index_select
    # copies rows; advanced indexing [B, C, U] into [B, N, H, D] went element by element, ~2x slower)
    key_rows = key.transpose(1, 2).reshape(b * n, h * d)
    sample_rows = key_samples + n * torch.arange(b, device=query.device)[:, None, None]  # [B, N, U]
    chunk = max(1, _SAMPLE_CHUNK_ELEMENTS // max(1, b * h * n_samples * d))
    measures = []
    for start in range(0, n, chunk):  # chunks of queries bound the gathered [.., U, D] block
        stop = min(n, start + chunk)
        sampled_keys = key_rows.index_select(0, sample_rows[:, start:stop].flatten()).view(
            b, stop - start, n_samples, h, d)  # [B, C, U, H, D]
        scores = torch.einsum("bhcd,bcuhd->bhcu", query[:, :, start:stop], sampled_keys)
        valid = sample_valid[:, None, None, :]
        top = scores.masked_fill(~valid, float("-inf")).amax(dim=-1)
        total = scores.masked_fill(~valid, 0.0).sum(dim=-1)
        measures.append(top - total / m.clamp(min=1)[:, None, None].to(scores.dtype))
    return torch.cat(measures, dim=-1)


def _check_key_samples(key_samples: Tensor, batch: int, length: int, needed: int) -> None:
    if key_samples.dim() != 3 or key_samples.shape[:2] != (batch, length) or key_samples.shape[-1] < needed:
        raise AttentionError(f"key_samples must be [B, N, >= {needed}] indices, got {list(key_samples.shape)}")
    if key_samples.numel() and (int(key_samples.min()) < 0 or int(key_samples.max()) >= length):
        raise AttentionError(f"key_samples must index keys in [0, {length}), got values outside")


@pytorch_path_where_kernels_do_not_fit
def _sparsity_measure_gpu(query: Tensor, key: Tensor, key_samples: Tensor, counts: Tensor, m: Tensor) -> Tensor:
    """M_bar of eq. 4 on the GPU path, [B, H, N], no gradient: the Triton kernel where it runs, else the
    sampled keys of every query gathered at once ([B, H, N, U, Dh] in the GEMM dtype)."""
    if kernels_run_on(query):
        from longattn.attention._informer_triton import sparsity_measure

        return sparsity_measure(query, key, key_samples, counts, m)
    b, h, n, d = query.shape
    index = key_samples[:, None, :, :, None].expand(b, h, n, key_samples.shape[-1], d)
    sampled = key.gather(2, index.reshape(b, h, -1, d)).view(b, h, n, -1, d)
    scores = (sampled @ query[..., None])[..., 0].to(compute_dtype(query.dtype))  # [B, H, N, U]
    valid = (torch.arange(key_samples.shape[-1], device=query.device) < counts[:, None])[:, None, None, :]
    top = scores.masked_fill(~valid, float("-inf")).amax(dim=-1)
    total = scores.masked_fill(~valid, 0.0).sum(dim=-1)
    return top - total / m.clamp(min=1)[:, None, None].to(scores.dtype)


def _probsparse_gpu(query: Tensor, key: Tensor, value: Tensor, real: Tensor, m: Tensor, counts: Tensor, slots: int,
                    scale: float | None, dropout_p: float, key_samples: Tensor | None, padded: bool) -> Tensor:
    """ProbSparse attention as batched programs: ``slots`` = the static bound of U and u (each sequence uses
    its first counts[b]); padded rows of q, k, v must already be zero or masked by ``real``. Without padding the
    active queries' attention has no mask, so that the flash kernel (which splits the keys of few queries) can
    run."""
    dtype = output_dtype(query)
    b, h, n, d = query.shape
    q, k, v = (t.to(dtype) for t in (query, key, value))
    v = v.masked_fill(~real[:, None, :, None], 0.0)
    if key_samples is None:
        key_samples = _draw_key_samples(real, slots, None)
    with torch.no_grad():
        measure = _sparsity_measure_gpu(q, k, key_samples, counts, m)
        measure = measure.masked_fill(~real[:, None, :], float("-inf"))  # padded queries are never active
        top = measure.topk(slots, dim=-1).indices  # [B, H, u_max]
    active = torch.arange(slots, device=query.device)[None, :] < counts[:, None]  # [B, u_max]
    lazy = (v.sum(dim=-2, keepdim=True, dtype=compute_dtype(dtype))
            / m.clamp(min=1)[:, None, None, None]).to(dtype)  # the mean of V over the real tokens
    top_q = q.gather(2, top[..., None].expand(b, h, slots, d))
    keys_real = real | ~real.any(-1, keepdim=True)  # a sequence without real tokens: softmax over zeros, not 0/0
    attended = F.scaled_dot_product_attention(top_q, k, v, attn_mask=keys_real[:, None, None, :] if padded else None,
                                              dropout_p=dropout_p, scale=scale)  # [B, H, u_max, Dv]
    active_out = torch.where(active[:, None, :, None], attended, lazy)
    return lazy.expand(b, h, n, v.shape[-1]).scatter(2, top[..., None].expand(b, h, slots, v.shape[-1]), active_out)


@padding_safe
def probsparse_attention(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attention_mask: Tensor | None = None,
    *,
    factor: float = 5.0,
    scale: float | None = None,
    dropout_p: float = 0.0,
    key_samples: Tensor | None = None,
) -> Tensor:
    """ProbSparse self-attention on [B, H, N, Dh]; ``key_samples`` [B, N, U] (see
    :func:`sample_informer_keys`) fixes the random draw, otherwise one is drawn."""
    check_qkv(query, key, value, attention_mask)
    b, h, n, d = query.shape
    if key.shape[-2] != n:
        raise AttentionError("ProbSparse attention here is self-attention: queries and keys must have equal N")
    if factor <= 0:
        raise AttentionError(f"factor must be > 0, got {factor}")
    real = torch.ones(b, n, dtype=torch.bool, device=query.device) if attention_mask is None else attention_mask
    m = real.sum(dim=-1)
    counts = probsparse_counts(m, factor)  # u_b = U_b = c * ceil(ln m_b)
    if uses_gpu_path(query):
        if key_samples is not None:  # given by the caller: checked (a read-back from the device)
            _check_key_samples(key_samples, b, n, int(counts.max()))
        return _probsparse_gpu(query, key, value, real, m, counts, probsparse_slots(n, factor), scale, dropout_p,
                               key_samples, padded=attention_mask is not None)
    if key_samples is None:
        key_samples = sample_informer_keys(attention_mask, b, n, factor, query.device)
    _check_key_samples(key_samples, b, n, int(counts.max()))
    scale = 1.0 / math.sqrt(d) if scale is None else scale

    measure = sparsity_measure(query, key, key_samples, counts, m)
    measure = measure.masked_fill(~real[:, None, :], float("-inf"))  # padded queries are never active
    n_top = int(counts.max())
    top = measure.topk(n_top, dim=-1).indices  # [B, H, u_max]
    active = torch.arange(n_top, device=query.device)[None, :] < counts[:, None]  # [B, u_max]

    value = value * real[:, None, :, None].to(value.dtype)
    lazy = value.sum(dim=-2, keepdim=True) / m.clamp(min=1)[:, None, None, None].to(value.dtype)  # mean of V
    top_q = query.gather(2, top[..., None].expand(b, h, n_top, d))
    scores = (top_q @ key.transpose(-1, -2)) * scale  # [B, H, u_max, N]: u rows only
    scores = scores.masked_fill(~real[:, None, None, :], torch.finfo(scores.dtype).min)
    weights = torch.softmax(scores, dim=-1)
    if dropout_p > 0:
        weights = torch.nn.functional.dropout(weights, dropout_p)
    active_out = torch.where(active[:, None, :, None], weights @ value, lazy)
    out = lazy.expand(b, h, n, value.shape[-1]).contiguous()
    return out.scatter(2, top[..., None].expand(b, h, n_top, value.shape[-1]), active_out)


@padding_safe
def probsparse_attention_reference(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attention_mask: Tensor | None = None,
    *,
    factor: float = 5.0,
    scale: float | None = None,
    key_samples: Tensor,
) -> Tensor:
    """Plain per-sequence, per-head version with the full score matrix; for tests only."""
    b, h, n, d = query.shape
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    out = torch.zeros(b, h, n, value.shape[-1], dtype=value.dtype)
    for bi in range(b):
        real = torch.ones(n, dtype=torch.bool) if attention_mask is None else attention_mask[bi].cpu()
        m = int(real.sum())
        if m == 0:
            continue
        count = max(1, min(m, math.floor(factor * math.ceil(math.log(m)))))
        samples = key_samples[bi, :, :count]
        for hi in range(h):
            scores = query[bi, hi] @ key[bi, hi].T * scale  # [N, N]
            sampled = scores.gather(1, samples)
            measure = sampled.max(1).values - sampled.sum(1) / m
            measure[~real] = float("-inf")
            chosen = measure.topk(count).indices
            v = value[bi, hi][real]
            row = v.mean(0)
            out[bi, hi] = row
            weights = torch.softmax(scores[chosen][:, real], dim=-1)
            out[bi, hi, chosen] = weights @ v
    return out


@register_attention(
    "informer",
    capabilities=Capabilities(stochastic_eval=True),
    functional=probsparse_attention,
    reference=probsparse_attention_reference,
    paper="Informer: Beyond Efficient Transformer for Long Sequence Time-Series Forecasting (Zhou et al., AAAI 2021)",
)
class InformerAttention(AttentionBase):
    """Informer ProbSparse self-attention: top-u queries by sampled sparsity, mean of V elsewhere."""

    def __init__(
        self,
        dim: int,
        heads: int,
        max_len: int | None = None,
        causal: bool = False,
        factor: float = 5.0,
        dropout: float = 0.0,
        bias: bool = True,
    ) -> None:
        super().__init__(dim, heads, max_len, causal)
        if not isinstance(factor, (int, float)) or factor <= 0:
            raise AttentionError(f"factor must be a positive number, got {factor!r}")
        self.proj = QKVProjection(dim, heads, bias=bias)
        self.factor = float(factor)
        self.dropout = dropout

    def attend(self, x: Tensor, attention_mask: Tensor | None, layer_state: dict | None) -> Tensor:
        q, k, v = self.proj.qkv(x)
        out = probsparse_attention(
            q, k, v, attention_mask,
            factor=self.factor,
            dropout_p=self.dropout if self.training else 0.0,
        )
        return self.proj.out(out)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, factor={self.factor}"
