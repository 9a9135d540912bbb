"""The causal scan with a data-dependent decay, shared by GLA (a decay per key channel) and Mamba-2's SSD (one
decay per head).

Both layers run the same recurrence over a [K, V] state per head (GLA, Yang et al. 2024, eq. 3; Mamba-2,
Dao and Gu 2024, eq. 2 in the SSD form of Section 3)::

    S_t = Diag(alpha_t) S_{t-1} + k_t v_t^T,   o_t = S_t^T q_t,   alpha_t = exp(g_t) in (0, 1]

with ``log_decay`` g of shape [B, H, N, K] (GLA's diagonal decay) or [B, H, N, 1] (Mamba-2's scalar decay, the
same for every key channel of a head). Queries come already scaled.

Four forms compute it:

* :func:`gated_scan_reference`: the recurrence token by token, for the tests (any dtype, float64 exact);
* :func:`gated_scan_chunked` (CPU path): the chunkwise form of GLA (Section 4.2) and SSD (Section 6): inside a
  chunk of C tokens the masked product with the decays between every pair, across chunks a running [K, V] state,
  carried by a Python loop over the chunks. Every exponent is a sum of log decays over a stretch of tokens, so it
  is <= 0: nothing overflows however strong the decay (the factorised q exp(G) / k exp(-G) form would). Memory:
  one chunk's [C, C] (diagonal: [C, C, K]) weights at a time, no N x N and no N x K x V tensor;
* :func:`gated_scan_batched` (GPU path): the same algebra for every chunk at once, the states entering each chunk
  from the decayed sums of the chunk states before it (the "segsum" of SSD's listing 1): no Python loop over
  chunks, tokens, batch or heads, so its op count does not depend on N. Memory: the [N / C, K, V] chunk states
  and an [N / C, N / C] (diagonal: [N / C, N / C, K]) matrix of decays between chunks;
* :func:`gated_scan_step`: one token of the recurrence (decoding).

:func:`gated_scan` picks one: fla's Triton chunk kernels (``fla.ops.gla.chunk_gla``, ``fla.ops.simple_gla.
chunk_simple_gla``) on CUDA when ``fla-core`` is installed, else the batched path on the GPU path, else the chunked
one. :func:`bidirectional_gated_scan` adds the backward scan for encoders.
"""

from __future__ import annotations

import functools
import importlib.util
from typing import Callable

import torch
import torch.nn.functional as F
from torch import Tensor

from longattn.attention.base import AttentionError, check_qkv, compute_dtype, output_dtype, uses_gpu_path

__all__ = [
    "SCAN_CHUNK",
    "bidirectional_gated_scan",
    "check_log_decay",
    "fla_runs_on",
    "gated_scan",
    "gated_scan_batched",
    "gated_scan_chunked",
    "gated_scan_reference",
    "gated_parallel_reference",
    "gated_scan_step",
    "masked_gated_scan",
    "without_padding",
]

SCAN_CHUNK = 64  # fla's chunk size for both kernels
# The sub-chunk of GLA's secondary chunking (Section 4.3): the per-channel weights inside a chunk go through it,
# and the result does not depend on its size. On CUDA fla's (chunk_gla's BC); on the CPU 16 spends most of its
# time in the kernel, faulting in the fresh pages of [C, sub, K] temporaries above the allocator's mmap threshold,
# and 8 takes 0.5-0.75x the time at MQAR's lengths (docs/performance.md, "GLA and DSA at MQAR's lengths")
SUB_CHUNK = 16
CPU_SUB_CHUNK = 8


def _sub_chunk(t: Tensor) -> int:
    return CPU_SUB_CHUNK if t.device.type == "cpu" else SUB_CHUNK



def check_log_decay(log_decay: Tensor, key: Tensor) -> None:
    """``log_decay`` must be [B, H, N, K] (per key channel) or [B, H, N, 1] (per head), like ``key`` [B, H, N, K]."""
    if not isinstance(log_decay, Tensor) or not log_decay.is_floating_point():
        raise AttentionError(f"log_decay must be a floating-point tensor, got {type(log_decay).__name__}")
    if log_decay.shape[:3] != key.shape[:3] or log_decay.shape[-1] not in (1, key.shape[-1]):
        raise AttentionError(f"log_decay must be [B, H, N, K] = {list(key.shape)} or [B, H, N, 1], "
                             f"got {list(log_decay.shape)}")


def _is_scalar(log_decay: Tensor, key: Tensor) -> bool:
    return log_decay.shape[-1] == 1 and key.shape[-1] != 1


# ----------------------------------------------------------------------------- reference


def gated_scan_reference(query: Tensor, key: Tensor, value: Tensor, log_decay: Tensor,
                         state: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """The recurrence S_t = Diag(exp(g_t)) S_{t-1} + k_t v_t^T, o_t = S_t^T q_t token by token, in the inputs'
    dtype: (o [B, H, N, V], final state [B, H, K, V]). For tests; ``state``: the state before the first token."""
    b, h, n, dk = key.shape
    if state is None:
        state = key.new_zeros(b, h, dk, value.shape[-1])
    outputs = []
    for t in range(n):
        state = log_decay[:, :, t, :, None].exp() * state + key[:, :, t, :, None] * value[:, :, t, None, :]
        outputs.append((query[:, :, t, :, None] * state).sum(dim=-2))
    return torch.stack(outputs, dim=2), state


# ----------------------------------------------------------------------------- one chunk


def _within_chunk_weights(query: Tensor, key: Tensor, cumulative: Tensor, scalar: bool) -> Tensor:
    """[..., C, C] weights of key j for query i inside a chunk: (q_i . k_j) exp(G_i - G_j) for j <= i, with G the
    inclusive cumulative log decay (the scalar case), or sum_d q_id k_jd exp(G_id - G_jd) (per channel: see
    :func:`_channel_weights`). The upper triangle is masked before the exponential: there G_i - G_j >= 0 could
    overflow."""
    c = query.shape[-2]
    upper = torch.ones(c, c, dtype=torch.bool, device=query.device).triu_(1)
    if scalar:
        gaps = (cumulative - cumulative.transpose(-1, -2)).masked_fill(upper, float("-inf"))
        return (query @ key.transpose(-1, -2)) * gaps.exp().to(query.dtype)
    size = _sub_chunk(query)
    if c % size or c == size:
        return _channel_weights_explicit(query, key, cumulative)
    return _channel_weights(query, key, cumulative, size)


def _channel_weights_explicit(query: Tensor, key: Tensor, cumulative: Tensor) -> Tensor:
    """sum_d q_id k_jd exp(G_id - G_jd) for j <= i from the [..., C, C, K] exponents themselves."""
    c = query.shape[-2]
    upper = torch.ones(c, c, dtype=torch.bool, device=query.device).triu_(1)
    gaps = (cumulative[..., :, None, :] - cumulative[..., None, :, :]).masked_fill(upper[..., None], float("-inf"))
    return (query[..., :, None, :] * key[..., None, :, :] * gaps.exp().to(query.dtype)).sum(dim=-1)


def _channel_weights(query: Tensor, key: Tensor, cumulative: Tensor, size: int) -> Tensor:
    """The per-channel weights of :func:`_within_chunk_weights` through sub-chunks of ``size`` tokens (GLA's
    secondary chunking, Section 4.3): inside a sub-chunk from the exponents themselves; between query sub-chunk s
    and an earlier key sub-chunk t factorised as q_i exp(G_i - B_s) . exp(B_s - E_t) . k_j exp(E_t - G_j), with B_s
    the cumulative decay before s and E_t at the end of t. Each exponent is <= 0 (nothing overflows), and the
    [C, C, K] tensor becomes [C, size, K] plus [C, C / size, K]."""
    *lead, c, dk = query.shape
    count = c // size
    q_s, k_s, g_s = (t.unflatten(-2, (count, size)) for t in (query, key, cumulative))  # [..., S, c, K]
    inside = _channel_weights_explicit(q_s, k_s, g_s)  # [..., S, c, c]
    ends = g_s[..., -1:, :]  # E_t [..., S, 1, K]
    befores = torch.cat([torch.zeros_like(ends[..., :1, :, :]), ends[..., :-1, :, :]], dim=-3)  # B_s
    q_hat = q_s * (g_s - befores).exp().to(query.dtype)
    k_hat = k_s * (ends - g_s).exp().to(key.dtype)
    not_before = torch.ones(count, count, dtype=torch.bool, device=query.device).triu_()  # t >= s
    between = (befores[..., :, None, :, :] - ends[..., None, :, :, :]).masked_fill(not_before[..., None, None],
                                                                                   float("-inf"))
    across = (q_hat[..., :, None, :, :] * between.exp().to(query.dtype)) @ k_hat[..., None, :, :, :].transpose(-1, -2)
    eye = torch.eye(count, dtype=query.dtype, device=query.device)[..., None, None]
    blocks = across + eye * inside[..., :, None, :, :]  # [..., S (queries), S (keys), c, c]
    return blocks.transpose(-3, -2).reshape(*lead, c, c)


def _chunk_parts(query: Tensor, key: Tensor, value: Tensor, log_decay: Tensor, scalar: bool
                 ) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """What a chunk contributes, given its tokens [..., C, *]: (outputs from within the chunk [..., C, V],
    q_i exp(G_i), the factor of the incoming state [..., C, K], the chunk's own state sum_j exp(G_C - G_j) k_j
    v_j^T [..., K, V], and its total log decay G_C [..., 1, K or 1])."""
    cumulative = log_decay.to(compute_dtype(log_decay.dtype)).cumsum(dim=-2)
    total = cumulative[..., -1:, :]
    within = _within_chunk_weights(query, key, cumulative, scalar) @ value
    query_decayed = query * cumulative.exp().to(query.dtype)
    key_to_end = key * (total - cumulative).exp().to(key.dtype)
    return within, query_decayed, key_to_end.transpose(-1, -2) @ value, total


# ----------------------------------------------------------------------------- CPU path


def gated_scan_chunked(query: Tensor, key: Tensor, value: Tensor, log_decay: Tensor, chunk: int = SCAN_CHUNK,
                       state: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """The chunkwise scan with a running state (the CPU path): (o [B, H, N, V], final state [B, H, K, V]).

    Per chunk: o = q exp(G) S_in + (masked decayed q k^T) v, S_out = exp(G_C) S_in + sum_j exp(G_C - G_j) k_j v_j^T
    (GLA eq. 5-6; SSD Section 6, steps 1-4). The last chunk may be shorter: no padding is copied."""
    b, h, _, dk = key.shape
    scalar = _is_scalar(log_decay, key)
    if state is None:
        state = key.new_zeros(b, h, dk, value.shape[-1])
    outputs = []
    # split, not sliced chunk by chunk: the backward of a split is one concatenation, that of N / C slices as many
    # N-long zero tensors (quadratic time)
    for parts in zip(*(t.split(chunk, dim=2) for t in (query, key, value, log_decay))):
        within, query_decayed, chunk_state, total = _chunk_parts(*parts, scalar)
        outputs.append(within + query_decayed @ state)
        state = total.transpose(-1, -2).exp().to(state.dtype) * state + chunk_state
    return torch.cat(outputs, dim=2), state


# ----------------------------------------------------------------------------- GPU path


def gated_scan_batched(query: Tensor, key: Tensor, value: Tensor, log_decay: Tensor,
                       chunk: int = SCAN_CHUNK) -> tuple[Tensor, Tensor]:
    """The chunkwise scan as one batched tensor program (the GPU path): (o [B, H, N, V], final state [B, H, K, V]).

    Every chunk's parts at once (:func:`_chunk_parts`), then the state leaving chunk c,
    S_c = sum_{c' <= c} exp(L_c - L_c') U_c' with L the cumulative log decay at chunk ends and U_c' the chunk
    states (SSD listing 1's segsum between chunks; per key channel for GLA), and the state entering chunk c is
    S_{c-1}. Log decays and exponentials in float32 for half inputs (:func:`compute_dtype`), the products in the
    input dtype (autocast's)."""
    b, h, n, dk = key.shape
    dv = value.shape[-1]
    scalar = _is_scalar(log_decay, key)
    count = -(-n // chunk)
    pad = count * chunk - n
    if pad:  # padded tokens: no key, no value, no decay (log 0 = 1)
        query, key, value, log_decay = (F.pad(t, (0, 0, 0, pad)) for t in (query, key, value, log_decay))
    q_c, k_c = query.reshape(b, h, count, chunk, dk), key.reshape(b, h, count, chunk, dk)
    v_c = value.reshape(b, h, count, chunk, dv)
    g_c = log_decay.reshape(b, h, count, chunk, log_decay.shape[-1])
    within, query_decayed, chunk_states, totals = _chunk_parts(q_c, k_c, v_c, g_c, scalar)
    ends = totals[:, :, :, 0].cumsum(dim=2)  # [B, H, C, K or 1]: L_c
    later = torch.ones(count, count, dtype=torch.bool, device=key.device).triu_(1)  # c' > c
    gaps = (ends[:, :, :, None] - ends[:, :, None, :]).masked_fill(later[..., None], float("-inf"))
    weights = gaps.exp().to(chunk_states.dtype)  # [B, H, C, C', K or 1]
    if scalar:
        leaving = (weights[..., 0] @ chunk_states.flatten(-2)).view(b, h, count, dk, dv)
    else:
        leaving = torch.einsum("bhcdk,bhdkv->bhckv", weights, chunk_states)
    entering = torch.cat([leaving.new_zeros(b, h, 1, dk, dv), leaving[:, :, :-1]], dim=2)
    out = (within + query_decayed @ entering).reshape(b, h, count * chunk, dv)[:, :, :n]
    return out, leaving[:, :, -1]


# ----------------------------------------------------------------------------- fla's kernels (CUDA)


@functools.cache
def fla_installed() -> bool:
    return importlib.util.find_spec("fla") is not None


def fla_runs_on(t: Tensor) -> bool:
    """Whether fla's Triton chunk kernels take inputs like ``t``: CUDA tensors in float16, bfloat16 or float32 with
    ``fla-core`` installed (its kernels autotune, which needs a GPU driver: they do not run in Triton's CPU
    interpreter)."""
    return t.device.type == "cuda" and t.dtype in (torch.float16, torch.bfloat16, torch.float32) and fla_installed()


def _gated_scan_fla(query: Tensor, key: Tensor, value: Tensor, log_decay: Tensor) -> tuple[Tensor, Tensor]:
    """fla's chunk kernels on fla's [B, N, H, D] layout, scale 1 (the queries come scaled)."""
    q, k, v = (t.transpose(1, 2) for t in (query, key, value))
    if _is_scalar(log_decay, key):
        from fla.ops.simple_gla import chunk_simple_gla

        out, state = chunk_simple_gla(q, k, v, g=log_decay[..., 0].transpose(1, 2).float(), scale=1.0,
                                      output_final_state=True)
    else:
        from fla.ops.gla import chunk_gla

        out, state = chunk_gla(q, k, v, log_decay.transpose(1, 2).float(), scale=1.0, output_final_state=True)
    return out.transpose(1, 2), state


# ----------------------------------------------------------------------------- dispatch


def gated_scan(query: Tensor, key: Tensor, value: Tensor, log_decay: Tensor,
               chunk: int = SCAN_CHUNK) -> tuple[Tensor, Tensor]:
    """(o, final state) of the scan: fla's kernels where they run (:func:`fla_runs_on`; their chunk is fla's 64),
    else the batched form on the GPU path, else the chunked form."""
    if uses_gpu_path(query):
        if fla_runs_on(query):
            return _gated_scan_fla(query, key, value, log_decay)
        return gated_scan_batched(query, key, value, log_decay, chunk)
    return gated_scan_chunked(query, key, value, log_decay, chunk)


def bidirectional_gated_scan(query: Tensor, key: Tensor, value: Tensor, log_decay: Tensor,
                             scan: Callable[..., tuple[Tensor, Tensor]] = gated_scan, **options) -> Tensor:
    """The encoder form: query i sees every key j with the decay of the tokens between them,
    o_i = sum_j (q_i . Diag(prod_{t = min(i, j) + 1}^{max(i, j)} alpha_t) k_j) v_j: the forward scan, plus the scan
    of the reversed sequence (whose decays are shifted by one token, so that token j's own gate applies between j
    and j - 1), less the diagonal that both include (the bidirectional form of Hydra, Hwang et al. 2024)."""
    forward, _ = scan(query, key, value, log_decay, **options)
    shifted = F.pad(log_decay[:, :, 1:], (0, 0, 0, 1))  # token t takes the gate of t + 1; none after the last
    flip = functools.partial(torch.flip, dims=(2,))
    backward, _ = scan(flip(query), flip(key), flip(value), flip(shifted), **options)
    return forward + flip(backward) - (query * key).sum(dim=-1, keepdim=True) * value


def without_padding(attention_mask: Tensor | None, key: Tensor, value: Tensor, log_decay: Tensor
                    ) -> tuple[Tensor, Tensor, Tensor]:
    """Keys, values and log decays [B, H, N, *] with the padded tokens' replaced by zeros (``attention_mask``
    [B, N], True = real; None: all real): no key, no value, no decay, so the state passes a padded token unchanged."""
    if attention_mask is None:
        return key, value, log_decay
    pad = ~attention_mask[:, None, :, None]
    return key.masked_fill(pad, 0.0), value.masked_fill(pad, 0.0), log_decay.masked_fill(pad, 0.0)


def masked_gated_scan(query: Tensor, key: Tensor, value: Tensor, log_decay: Tensor, attention_mask: Tensor | None,
                      *, is_causal: bool, scale: float, chunk: int) -> tuple[Tensor, Tensor | None]:
    """The body of the functional forms on [B, H, N, *]: checks, padded tokens taken out of the scan (no key, no
    value, no decay: the state passes them unchanged, wherever they sit), queries scaled by ``scale``, then the
    causal scan (:func:`gated_scan`) or the bidirectional one. Returns (o in the output dtype, the final state, or
    None for the bidirectional form)."""
    check_qkv(query, key, value, attention_mask)
    check_log_decay(log_decay, key)
    if query.shape[-2] != key.shape[-2]:
        raise AttentionError(f"the gated scan needs as many queries as keys, got {query.shape[-2]} and {key.shape[-2]}")
    if not isinstance(chunk, int) or chunk <= 0:
        raise AttentionError(f"chunk_size must be a positive int, got {chunk!r}")
    dtype = output_dtype(query)
    key, value, log_decay = without_padding(attention_mask, key, value, log_decay)
    if uses_gpu_path(query):  # the products in the autocast dtype
        query, key, value = query.to(dtype), key.to(dtype), value.to(dtype)
    query = query * scale
    if is_causal:
        out, state = gated_scan(query, key, value, log_decay, chunk)
        return out.to(dtype), state
    return bidirectional_gated_scan(query, key, value, log_decay, chunk=chunk).to(dtype), None


def gated_parallel_reference(query: Tensor, key: Tensor, value: Tensor, log_decay: Tensor, *, is_causal: bool) -> Tensor:
    """The parallel form (GLA eq. 4; SSD's quadratic form, eq. 16): o_i = sum_j (q_i . Diag(exp(G_i - G_j)) k_j) v_j
    over j <= i with G the cumulative log decay, and for the bidirectional form exp(G_j - G_i) over j > i. Builds
    the [N, N, K] weights: for tests."""
    cumulative = log_decay.cumsum(dim=2)
    gaps = cumulative[:, :, :, None, :] - cumulative[:, :, None, :, :]  # [B, H, N, N, K or 1]: G_i - G_j
    n = key.shape[2]
    before = torch.ones(n, n, dtype=torch.bool, device=key.device).tril()[..., None]
    weights = torch.where(before, gaps, -gaps).exp()
    if is_causal:
        weights = weights * before
    scores = (query[:, :, :, None, :] * key[:, :, None, :, :] * weights).sum(dim=-1)
    return scores @ value


# ----------------------------------------------------------------------------- decoding


def gated_scan_step(query: Tensor, key: Tensor, value: Tensor, log_decay: Tensor, state: Tensor) -> tuple[Tensor, Tensor]:
    """One token [B, H, 1, *] of the recurrence after ``state`` [B, H, K, V]: (o [B, H, 1, V], new state)."""
    key, value = key.to(state.dtype), value.to(state.dtype)
    state = log_decay.transpose(-1, -2).exp().to(state.dtype) * state + key.transpose(-1, -2) @ value
    return (query.to(state.dtype) @ state).to(output_dtype(query)), state
