"""The (gated) delta rule: the recurrence of DeltaNet and Gated DeltaNet, and its chunkwise WY / UT form.

With a state S_t [Dk, Dv] per head (the transpose of the papers' [Dv, Dk]), keys k_t, values v_t, writing
strengths beta_t in (0, 1] and an optional per-step decay alpha_t = exp(g_t) (g_t <= 0):

    S_t = alpha_t (I - beta_t k_t k_t^T) S_{t-1} + beta_t k_t v_t^T,      o_t = S_t^T q_t * scale

(DeltaNet: Schlag et al. 2021, eq. 2 of Yang et al., NeurIPS 2024, "Parallelizing Linear Transformers with the
Delta Rule over Sequence Length"; Gated DeltaNet: eq. 10 of Yang, Kautz, Hatamizadeh, ICLR 2025; alpha = 1
without a decay). :func:`delta_rule_reference` runs it token by token (the float64 reference and, one token
at a time, :func:`delta_rule_step`, the decoding step).

Chunkwise form (Sec. 3 of Yang et al. 2024, with the decay of Sec. 3.3 of Yang et al. 2025). Cut the sequence
into chunks of L tokens; inside a chunk let gamma_r = g_1 + ... + g_r, Gamma_ri = exp(gamma_r - gamma_i) for
i <= r and S_0 the state at the chunk's start. Writing S_r = exp(gamma_r) S_0 + sum_{i <= r} Gamma_ri k_i u_i^T
gives the pseudo-values u from one unit lower-triangular solve (the UT transform, eq. 8-9 of 2024):

    (I + A) [U_wy | W] = diag(beta) [V | exp(gamma) K],   A = strictly lower part of diag(beta) (Gamma o K K^T)
    U = U_wy - W S_0
    O = (exp(gamma) Q) S_0 + (Gamma o Q K^T)_{i <= r} U                                   (times scale)
    S_L = exp(gamma_L) S_0 + (exp(gamma_L - gamma) K)^T U

Everything but the last three lines is independent per chunk, so it is computed for all chunks at once; the
state S_0 runs across the chunks. The CPU path (:func:`delta_rule_chunked`) carries it chunk by chunk (one
running [Dk, Dv] state, never a tensor of every token's state). The GPU path (:func:`delta_rule_gpu`) composes
the chunks' affine state maps S -> M_c S + B_c (M_c = exp(gamma_L) I - (exp(gamma_L - gamma) K)^T W,
B_c = (exp(gamma_L - gamma) K)^T U_wy) by a doubling (Hillis-Steele) scan with a fixed number of levels, so
its launches do not depend on N, then applies all chunks' states at once; on CUDA tensors with
flash-linear-attention installed it calls fla's chunk kernels instead (half inputs only: they refuse float32).

Padding: a padded token must leave the state unchanged, so callers give it beta = 0 and g = 0 (then
S_t = S_{t-1} whatever its key and value); the tail that rounds N up to whole chunks is padded so.
"""

from __future__ import annotations

import importlib.util
from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch import Tensor

from longattn.attention.base import (
    AttentionError,
    autocast_disabled,
    check_qkv,
    compute_dtype,
    output_dtype,
    padding_safe,
    uses_gpu_path,
)

__all__ = [
    "DELTA_CHUNK",
    "MAX_SCAN_LEVELS",
    "delta_rule",
    "delta_rule_attention",
    "delta_rule_attention_reference",
    "delta_rule_chunked",
    "delta_rule_gpu",
    "delta_rule_reference",
    "delta_rule_step",
    "l2_normalised",
    "rule_inputs",
]

DELTA_CHUNK = 64
# The GPU path's doubling scan runs this many levels whatever N (levels past the sequence's chunks compose
# with the identity): enough for 2^16 chunks, 4M tokens at chunk 64.
MAX_SCAN_LEVELS = 16


def _check(query: Tensor, key: Tensor, value: Tensor, beta: Tensor, log_decay: Tensor | None,
           chunk: int = 1) -> None:
    if not isinstance(chunk, int) or chunk < 1:
        raise AttentionError(f"chunk_size must be a positive int, got {chunk!r}")
    b, h, n, _ = key.shape
    if query.shape != key.shape:
        raise AttentionError(f"the delta rule needs queries shaped like keys, got {list(query.shape)} "
                             f"and {list(key.shape)}")
    if value.shape[:3] != (b, h, n):
        raise AttentionError(f"value must be [B, H, N, Dv] with [B, H, N] = {[b, h, n]}, got {list(value.shape)}")
    for label, t in (("beta", beta), ("log_decay", log_decay)):
        if t is not None and t.shape != (b, h, n):
            raise AttentionError(f"{label} must be [B, H, N] = {[b, h, n]}, got {list(t.shape)}")


def delta_rule_step(query: Tensor, key: Tensor, value: Tensor, beta: Tensor, log_decay: Tensor | None,
                    state: Tensor, scale: float) -> tuple[Tensor, Tensor]:
    """One token of the recurrence: ``query``/``key`` [B, H, Dk], ``value`` [B, H, Dv], ``beta`` and
    ``log_decay`` [B, H], ``state`` [B, H, Dk, Dv]; returns (o_t [B, H, Dv], S_t)."""
    if log_decay is not None:
        state = state * log_decay.exp()[..., None, None]
    # S_t = S - beta k (k^T S) + beta k v^T = S + k (beta (v - S^T k))^T
    correction = beta[..., None] * (value - (key[..., None] * state).sum(-2))
    state = state + key[..., :, None] * correction[..., None, :]
    return (query[..., :, None] * state).sum(-2) * scale, state


def delta_rule_reference(query: Tensor, key: Tensor, value: Tensor, beta: Tensor, log_decay: Tensor | None = None,
                         *, scale: float) -> tuple[Tensor, Tensor]:
    """The recurrence token by token (tests and short prompts only): (o [B, H, N, Dv], final state [B, H, Dk, Dv])."""
    _check(query, key, value, beta, log_decay)
    b, h, n, dk = key.shape
    state = key.new_zeros(b, h, dk, value.shape[-1])
    outputs = []
    for t in range(n):
        out, state = delta_rule_step(query[:, :, t], key[:, :, t], value[:, :, t], beta[:, :, t],
                                     None if log_decay is None else log_decay[:, :, t], state, scale)
        outputs.append(out)
    return torch.stack(outputs, dim=2), state


def _chunk_factors(query: Tensor, key: Tensor, value: Tensor, beta: Tensor, log_decay: Tensor | None,
                   chunk: int, scale: float) -> tuple[Tensor, ...]:
    """Per chunk, for all chunks at once ([B, H, C, L, .]): the decayed, scaled queries exp(gamma) Q, the masked
    scores Gamma o Q K^T (i <= r), U_wy, W, the keys decayed to the chunk's end and exp(gamma_L) [B, H, C]."""
    b, h, n, dk = key.shape
    dv = value.shape[-1]
    count = max(1, -(-n // chunk))
    pad = count * chunk - n
    g = torch.zeros_like(beta) if log_decay is None else log_decay
    if pad:  # beta = 0 and g = 0 on the tail: its tokens leave the state as it is
        query, key, value = (F.pad(t, (0, 0, 0, pad)) for t in (query, key, value))
        beta, g = F.pad(beta, (0, pad)), F.pad(g, (0, pad))
    q, k, v = (t.reshape(b, h, count, chunk, t.shape[-1]) for t in (query, key, value))
    beta, g = beta.reshape(b, h, count, chunk), g.reshape(b, h, count, chunk)
    gamma = g.cumsum(-1)
    k_beta = k * beta[..., None]
    rhs = torch.cat([v, gamma.exp()[..., None] * k], dim=-1) * beta[..., None]
    if log_decay is None:  # Gamma = 1 on and below the diagonal
        a_full, scores = k_beta @ k.transpose(-1, -2), ((q * scale) @ k.transpose(-1, -2)).tril_()
    else:
        lower = torch.ones(chunk, chunk, dtype=torch.bool, device=key.device).tril()
        # Gamma_ri = exp(gamma_r - gamma_i) for i <= r; the exponent is masked before exp (above it may overflow)
        decay = (gamma[..., :, None] - gamma[..., None, :]).masked_fill(~lower, float("-inf")).exp()
        a_full, scores = (k_beta @ k.transpose(-1, -2)) * decay, ((q * scale) @ k.transpose(-1, -2)) * decay
    # I + A with A the strictly lower part of a_full: a unit-triangular solve reads only that part (eq. 8-9)
    solved = torch.linalg.solve_triangular(a_full, rhs, upper=False, unitriangular=True)
    u_wy, w = solved[..., :dv], solved[..., dv:]
    q_decayed = q * (gamma.exp()[..., None] * scale)
    last = gamma[..., -1:]
    k_to_end = k * (last - gamma).exp()[..., None]
    return q_decayed, scores, u_wy, w, k_to_end, last[..., 0].exp()


def delta_rule_chunked(query: Tensor, key: Tensor, value: Tensor, beta: Tensor, log_decay: Tensor | None = None,
                       *, scale: float, chunk: int = DELTA_CHUNK) -> tuple[Tensor, Tensor]:
    """The CPU path: the chunkwise form with one running state carried chunk by chunk. Returns
    (o [B, H, N, Dv], final state [B, H, Dk, Dv]); memory O(N L + N / L Dk Dv) with the autograd graph. Computed
    in the accumulation dtype (float32 for half inputs: the triangular solve has no half kernel and the state
    needs float32's range), the output returned in the autocast dtype, or the input's."""
    _check(query, key, value, beta, log_decay, chunk)
    dtype = output_dtype(query)
    work = compute_dtype(dtype)
    b, h, n = key.shape[:3]
    with autocast_disabled(query.device):
        q_decayed, scores, u_wy, w, k_to_end, chunk_decay = _chunk_factors(
            *(t.to(work) for t in (query, key, value, beta)), None if log_decay is None else log_decay.to(work),
            chunk, scale)
        starts, u, final = _RunningState.apply(u_wy, w, k_to_end.transpose(-1, -2), chunk_decay)
        out = q_decayed @ starts + scores @ u
    return out.reshape(b, h, -1, value.shape[-1])[:, :, :n].to(dtype), final


class _RunningState(torch.autograd.Function):
    """The sequential part of the CPU path, chunk by chunk with one running state:
    u_c = U_c - W_c S_c and S_{c+1} = d_c S_c + K_c'^T u_c (K_c' the keys decayed to the chunk's end, d_c its
    total decay). Returns every chunk's start state S_c [B, H, C, Dk, Dv], its pseudo-values u_c [B, H, C, L, Dv]
    and the final state. Its backward is the reverse recurrence (two products per chunk; the other gradients
    are batched over the chunks afterwards): the loop runs outside autograd, which would otherwise record and
    replay every small product of every chunk."""

    @staticmethod
    def forward(ctx, u_wy: Tensor, w: Tensor, k_end_t: Tensor, decay: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        b, h, count, _, dv = u_wy.shape
        starts = u_wy.new_empty(b, h, count, w.shape[-1], dv)
        u = torch.empty_like(u_wy)
        state = u_wy.new_zeros(b, h, w.shape[-1], dv)
        for c in range(count):
            starts[:, :, c] = state
            u[:, :, c] = u_wy[:, :, c] - w[:, :, c] @ state
            state = decay[:, :, c, None, None] * state + k_end_t[:, :, c] @ u[:, :, c]
        ctx.save_for_backward(w, k_end_t, decay, starts, u)
        return starts, u, state

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, d_starts: Tensor | None, d_u: Tensor | None,
                 d_final: Tensor | None) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        w, k_end_t, decay, starts, u = ctx.saved_tensors
        d_starts = torch.zeros_like(starts) if d_starts is None else d_starts
        d_u = torch.zeros_like(u) if d_u is None else d_u
        grad = torch.zeros_like(starts[:, :, 0]) if d_final is None else d_final  # dL / dS_{c+1}
        d_u_total = torch.empty_like(u)
        d_next = torch.empty_like(starts)  # dL / dS_{c+1} for every chunk
        for c in reversed(range(u.shape[2])):
            d_next[:, :, c] = grad
            d_u_total[:, :, c] = d_u[:, :, c] + k_end_t[:, :, c].transpose(-1, -2) @ grad
            grad = (d_starts[:, :, c] + decay[:, :, c, None, None] * grad
                    - w[:, :, c].transpose(-1, -2) @ d_u_total[:, :, c])
        d_w = -(d_u_total @ starts.transpose(-1, -2))
        d_k_end_t = d_next @ u.transpose(-1, -2)
        d_decay = (d_next * starts).sum((-1, -2))
        return d_u_total, d_w, d_k_end_t, d_decay


def _chunk_start_states(maps: Tensor, offsets: Tensor) -> tuple[Tensor, Tensor]:
    """States at each chunk's start and after the last one, from the chunks' affine maps S -> M_c S + B_c
    (``maps`` [B, H, C, Dk, Dk], ``offsets`` [B, H, C, Dk, Dv]), by a doubling scan of MAX_SCAN_LEVELS levels:
    at level l, with s = min(2^l, C), element c composes with element c - s, (M, B) <- (M_c M_{c-s},
    M_c B_{c-s} + B_c), elements c < s with the identity map. Every level has the same shapes, so the ops do
    not depend on N; the levels past log2(C) compose with the identity (wasted work: O(C Dk^2 (Dk + Dv)) each)."""
    b, h, count, dk, _ = maps.shape
    if count > 2 ** MAX_SCAN_LEVELS:
        raise AttentionError(f"the delta rule's GPU scan covers at most 2^{MAX_SCAN_LEVELS} chunks, got {count}")
    eye = torch.eye(dk, dtype=maps.dtype, device=maps.device)
    for level in range(MAX_SCAN_LEVELS):
        s = min(2 ** level, count)
        earlier_maps = torch.cat([eye.expand(b, h, s, dk, dk), maps[:, :, :count - s]], dim=2)
        earlier_offsets = F.pad(offsets[:, :, :count - s], (0, 0, 0, 0, s, 0))
        offsets = maps @ earlier_offsets + offsets
        maps = maps @ earlier_maps
    starts = F.pad(offsets[:, :, :-1], (0, 0, 0, 0, 1, 0))
    return starts, offsets[:, :, -1]


def _fla_runs_on(t: Tensor, dtype: torch.dtype) -> bool:
    """fla's chunk kernels take half inputs on CUDA only (they refuse float32)."""
    return (t.device.type == "cuda" and dtype in (torch.float16, torch.bfloat16)
            and importlib.util.find_spec("fla") is not None)


def _fla_chunk(query: Tensor, key: Tensor, value: Tensor, beta: Tensor, log_decay: Tensor | None,
               scale: float) -> tuple[Tensor, Tensor]:
    """fla's chunk kernels (layout [B, T, H, D]); the same recurrence, its state in float32."""
    q, k, v = (t.transpose(1, 2) for t in (query, key, value))
    b_t = beta.transpose(1, 2)
    if log_decay is None:
        from fla.ops.delta_rule import chunk_delta_rule

        out, state = chunk_delta_rule(q, k, v, b_t, scale=scale, output_final_state=True)
    else:
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule

        out, state = chunk_gated_delta_rule(q, k, v, log_decay.transpose(1, 2).float(), b_t, scale=scale,
                                            output_final_state=True)
    return out.transpose(1, 2), state


def delta_rule_gpu(query: Tensor, key: Tensor, value: Tensor, beta: Tensor, log_decay: Tensor | None = None,
                   *, scale: float, chunk: int = DELTA_CHUNK) -> tuple[Tensor, Tensor]:
    """The GPU path: fla's chunk kernels on CUDA in half precision when fla is installed, else a batched tensor
    program (the chunk factors of all chunks, the doubling scan of their state maps, then every chunk's output
    at once). The factors, the triangular solve and the states are computed in the accumulation dtype (float32
    for half inputs: the solve has no half kernel and the state sums need its range); the output comes back in
    the autocast dtype, or the input's."""
    _check(query, key, value, beta, log_decay, chunk)
    dtype = output_dtype(query)
    if _fla_runs_on(query, dtype):
        out, state = _fla_chunk(*(t.to(dtype) for t in (query, key, value, beta)), log_decay, scale)
        return out.to(dtype), state
    work = compute_dtype(dtype)
    n = key.shape[2]
    with autocast_disabled(query.device):
        q_decayed, scores, u_wy, w, k_to_end, chunk_decay = _chunk_factors(
            *(t.to(work) for t in (query, key, value, beta)), None if log_decay is None else log_decay.to(work),
            chunk, scale)
        k_end_t = k_to_end.transpose(-1, -2)
        eye = torch.eye(key.shape[-1], dtype=work, device=key.device)
        starts, final = _chunk_start_states(chunk_decay[..., None, None] * eye - k_end_t @ w, k_end_t @ u_wy)
        out = q_decayed @ starts + scores @ (u_wy - w @ starts)
    b, h = key.shape[:2]
    return out.reshape(b, h, -1, value.shape[-1])[:, :, :n].to(dtype), final


def delta_rule(query: Tensor, key: Tensor, value: Tensor, beta: Tensor, log_decay: Tensor | None = None,
               *, scale: float, chunk: int = DELTA_CHUNK) -> tuple[Tensor, Tensor]:
    """(o [B, H, N, Dv], final state [B, H, Dk, Dv]) of the (gated) delta rule, by the path the input takes
    (:func:`~longattn.attention.base.uses_gpu_path`)."""
    if uses_gpu_path(query):
        return delta_rule_gpu(query, key, value, beta, log_decay, scale=scale, chunk=chunk)
    return delta_rule_chunked(query, key, value, beta, log_decay, scale=scale, chunk=chunk)


RuleFn = Callable[..., tuple[Tensor, Tensor]]


def l2_normalised(t: Tensor) -> Tensor:
    """t / ||t|| over the last dim, the norm in the accumulation dtype (in half precision F.normalize's eps
    underflows and a zero row, a padded token's, gives 0 / 0)."""
    work = t.to(compute_dtype(t.dtype))
    return (work * torch.rsqrt(work.square().sum(-1, keepdim=True) + 1e-12)).to(t.dtype)


def _directions(rule: RuleFn, query: Tensor, key: Tensor, value: Tensor, beta: Tensor, log_decay: Tensor | None,
                is_causal: bool, scale: float, **options: Any) -> Tensor:
    """The causal rule's output, or without ``is_causal`` the bidirectional form: the rule over the sequence
    plus the rule over the reversed sequence, reversed back (every token reads a state of the tokens up to it
    and one of the tokens from it on; the token itself is in both)."""
    out = rule(query, key, value, beta, log_decay, scale=scale, **options)[0]
    if is_causal:
        return out
    flipped = [None if t is None else t.flip(2) for t in (query, key, value, beta, log_decay)]
    return out + rule(*flipped, scale=scale, **options)[0].flip(2)


def rule_inputs(key: Tensor, beta: Tensor | None, log_decay: Tensor | None, attention_mask: Tensor | None,
                l2_norm: bool) -> tuple[Tensor, Tensor, Tensor | None]:
    """(keys, beta, g) as the rule takes them: keys L2-normalised per head if asked (eq. 11 of Yang et al.
    2024: with ||k|| = 1 and beta in (0, 1] the transition I - beta k k^T is a contraction), beta = 1 where
    none is given, and beta = g = 0 on padded tokens, which then leave the state as it is."""
    b, h, n, _ = key.shape
    if l2_norm:
        key = l2_normalised(key)
    beta = key.new_ones(b, h, n) if beta is None else beta
    if attention_mask is not None:
        pad = ~attention_mask[:, None, :]
        beta = beta.masked_fill(pad, 0.0)
        log_decay = None if log_decay is None else log_decay.masked_fill(pad, 0.0)
    return key, beta, log_decay


@padding_safe
def delta_rule_attention(query: Tensor, key: Tensor, value: Tensor, attention_mask: Tensor | None = None, *,
                         beta: Tensor | None = None, log_decay: Tensor | None = None, is_causal: bool = False,
                         scale: float | None = None, l2_norm: bool = True, chunk_size: int = DELTA_CHUNK) -> Tensor:
    """The (gated) delta rule on [B, H, N, D] (``beta``, ``log_decay``: [B, H, N], see the module docstring);
    ``attention_mask`` bool [B, N], True = real; not causal: the bidirectional form (forward + backward scans).
    ``scale`` defaults to 1 / sqrt(Dk) and ``l2_norm`` normalises the keys (queries are the caller's)."""
    check_qkv(query, key, value, attention_mask)
    if query.shape[2] != key.shape[2]:
        raise AttentionError("the delta rule is self-attention: query and key lengths must match")
    key, beta, log_decay = rule_inputs(key, beta, log_decay, attention_mask, l2_norm)
    scale = key.shape[-1] ** -0.5 if scale is None else scale
    return _directions(delta_rule, query, key, value, beta, log_decay, is_causal, scale, chunk=chunk_size)


@padding_safe
def delta_rule_attention_reference(query: Tensor, key: Tensor, value: Tensor, attention_mask: Tensor | None = None,
                                   *, beta: Tensor | None = None, log_decay: Tensor | None = None,
                                   is_causal: bool = False, scale: float | None = None,
                                   l2_norm: bool = True) -> Tensor:
    """:func:`delta_rule_attention` by the token-by-token recurrence (tests only)."""
    key, beta, log_decay = rule_inputs(key, beta, log_decay, attention_mask, l2_norm)
    scale = key.shape[-1] ** -0.5 if scale is None else scale
    return _directions(delta_rule_reference, query, key, value, beta, log_decay, is_causal, scale)
