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
from typing import Any, Callable, NamedTuple

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
    "L2_EPS",
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

# L: on a CPU thread at Dk = Dv = 32, 32 costs less than 64 (the [L, L] factors grow with L, the states' work
# does not), the most with the decay; speed and memory only
DELTA_CHUNK = 32
# added to the squared norm of l2_normalised (a zero row, a padded token's, stays zero)
L2_EPS = 1e-12
# The GPU path's doubling scan runs this many levels whatever N (levels past the sequence's chunks compose
# with the identity): enough for 2^16 chunks, 2M tokens at chunk 32.
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


def _chunks(query: Tensor, key: Tensor, value: Tensor, beta: Tensor, log_decay: Tensor | None,
            chunk: int) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor | None]:
    """The inputs cut into chunks of ``chunk`` tokens ([B, H, C, L, .], beta and g [B, H, C, L]); the tail that
    rounds N up to whole chunks gets beta = 0 and g = 0, so its tokens leave the state as it is."""
    b, h, n, _ = key.shape
    count = max(1, -(-n // chunk))
    pad = count * chunk - n
    if pad:
        query, key, value = (F.pad(t, (0, 0, 0, pad)) for t in (query, key, value))
        beta = F.pad(beta, (0, pad))
        log_decay = None if log_decay is None else F.pad(log_decay, (0, pad))
    q, k, v = (t.reshape(b, h, count, chunk, t.shape[-1]) for t in (query, key, value))
    g = None if log_decay is None else log_decay.reshape(b, h, count, chunk)
    return q, k, v, beta.reshape(b, h, count, chunk), g


class _Factors(NamedTuple):
    """What the chunkwise form computes per chunk, for many chunks at once ([.., L, .] per chunk); the decays
    are None without a decay (Gamma = 1 on and below the diagonal, exp(gamma) = 1)."""

    decay: Tensor | None  # Gamma, zero above the diagonal
    decayed_gram: Tensor  # Gamma o K K^T (without a decay: K K^T); A is the strictly lower part of its rows * beta
    inverse: Tensor  # (I + A)^-1, unit lower-triangular (eq. 8-9)
    u_wy: Tensor  # (I + A)^-1 diag(beta) V
    w: Tensor  # (I + A)^-1 diag(beta) exp(gamma) K
    scores: Tensor  # Gamma o Q K^T * scale, zero above the diagonal
    q_decayed: Tensor  # exp(gamma) Q * scale
    k_to_end: Tensor  # exp(gamma_L - gamma) K
    token_decay: Tensor | None  # exp(gamma) [.., L]
    end_decay: Tensor | None  # exp(gamma_L - gamma) [.., L]
    chunk_decay: Tensor | None  # exp(gamma_L) [..]


def _chunk_factors(q: Tensor, k: Tensor, v: Tensor, beta: Tensor, g: Tensor | None, scale: float) -> _Factors:
    """The chunk-local part of the chunkwise form (module docstring) for chunked inputs [.., L, .]. The UT
    transform's (I + A)^-1 is formed once (a unit-triangular solve against the identity, which reads only the
    strictly lower part of its matrix): U_wy and W are then two products, and so is the backward's
    (I + A)^-T, where two more solves would cost several times as much."""
    gram = k @ k.transpose(-1, -2)
    qk = (q * scale) @ k.transpose(-1, -2)
    decay = token_decay = end_decay = chunk_decay = None
    k_scaled = k
    if g is not None:
        gamma = g.cumsum(-1)
        token_decay = gamma.exp()
        lower = torch.ones(g.shape[-1], g.shape[-1], dtype=torch.bool, device=g.device).tril()
        # Gamma_ri = exp(gamma_r - gamma_i) for i <= r; the exponent is masked before exp (above it may overflow)
        decay = (gamma[..., :, None] - gamma[..., None, :]).masked_fill(~lower, float("-inf")).exp()
        gram = gram * decay
        qk = qk * decay
        last = gamma[..., -1:]
        end_decay = (last - gamma).exp()
        chunk_decay = last[..., 0].exp()
        k_scaled = k * token_decay[..., None]
    eye = torch.eye(k.shape[-2], dtype=k.dtype, device=k.device)
    inverse = torch.linalg.solve_triangular(gram * beta[..., None], eye, upper=False, unitriangular=True)
    inverse_beta = inverse * beta[..., None, :]  # (I + A)^-1 diag(beta)
    return _Factors(decay, gram, inverse, inverse_beta @ v, inverse_beta @ k_scaled,
                    qk if decay is not None else qk.tril_(),
                    q * scale if g is None else q * (token_decay[..., None] * scale),
                    k if g is None else k * end_decay[..., None], token_decay, end_decay, chunk_decay)


def delta_rule_chunked(query: Tensor, key: Tensor, value: Tensor, beta: Tensor, log_decay: Tensor | None = None,
                       *, scale: float, chunk: int = DELTA_CHUNK) -> tuple[Tensor, Tensor]:
    """The CPU path: the chunkwise form with one running state carried chunk by chunk (:class:`_RunningRule`).
    Returns (o [B, H, N, Dv], final state [B, H, Dk, Dv]); memory O(N L + N / L Dk Dv). Computed in the
    accumulation dtype (float32 for half inputs: the triangular solve has no half kernel and the state needs
    float32's range), the output returned in the autocast dtype, or the input's."""
    _check(query, key, value, beta, log_decay, chunk)
    dtype = output_dtype(query)
    work = compute_dtype(dtype)
    b, h, n = key.shape[:3]
    with autocast_disabled(query.device):
        chunked = _chunks(*(t.to(work) for t in (query, key, value, beta)),
                          None if log_decay is None else log_decay.to(work), chunk)
        out, final = _RunningRule.apply(*(None if t is None else t.flatten(0, 1) for t in chunked), scale)
    return out.view(b, h, -1, value.shape[-1])[:, :, :n].to(dtype), final.view(b, h, *final.shape[1:])


class _RunningRule(torch.autograd.Function):
    """The CPU path of the chunkwise form as one function on chunked inputs [B H, C, L, .]: every chunk's factors
    at once (:func:`_chunk_factors`), then chunk by chunk the running state, u_c = U_c - W_c S_c and
    S_{c+1} = exp(gamma_L) S_c + K_c'^T u_c (K_c' the keys decayed to the chunk's end), then every chunk's output
    O_c = (exp(gamma) Q) S_c + scores u_c at once. Its backward runs the reverse recurrence of the state and
    then the gradients of the factors by hand, batched over the chunks (:func:`_factor_grads`): autograd would
    record and replay the loop's small products one by one."""

    @staticmethod
    def forward(ctx, q: Tensor, k: Tensor, v: Tensor, beta: Tensor, g: Tensor | None,
                scale: float) -> tuple[Tensor, Tensor]:
        f = _chunk_factors(q, k, v, beta, g, scale)
        batch, count = k.shape[:2]
        starts = v.new_empty(batch, count, k.shape[-1], v.shape[-1])
        u = torch.empty_like(f.u_wy)
        k_end_t = f.k_to_end.transpose(-1, -2)
        state = v.new_zeros(batch, k.shape[-1], v.shape[-1])
        for c in range(count):
            starts[:, c] = state
            torch.baddbmm(f.u_wy[:, c], f.w[:, c], state, alpha=-1, out=u[:, c])
            decayed = state if f.chunk_decay is None else state * f.chunk_decay[:, c, None, None]
            state = torch.baddbmm(decayed, k_end_t[:, c], u[:, c])
        out = torch.matmul(f.q_decayed, starts).add_(f.scores @ u)
        ctx.save_for_backward(q, k, v, beta, starts, u, *(t for t in f if t is not None))
        ctx.scale, ctx.gated = scale, g is not None
        return out, state

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, d_out: Tensor, d_final: Tensor) -> tuple[Tensor | None, ...]:
        q, k, v, beta, starts, u, *saved = ctx.saved_tensors
        f = _Factors(*saved) if ctx.gated else _Factors(None, *saved[:7], None, None, None)
        # the reverse recurrence: dL/du_c = scores^T dO_c + K_c' dS_{c+1},
        # dL/dS_c = (exp(gamma) Q)^T dO_c + exp(gamma_L) dS_{c+1} - W_c^T dL/du_c
        d_u = f.scores.transpose(-1, -2) @ d_out
        d_start = f.q_decayed.transpose(-1, -2) @ d_out
        d_next = torch.empty_like(starts)  # dL / dS_{c+1} of every chunk
        grad = d_final.clone()
        w_t = f.w.transpose(-1, -2)
        for c in reversed(range(k.shape[1])):
            d_next[:, c] = grad
            d_u[:, c].baddbmm_(f.k_to_end[:, c], grad)
            decayed = grad if f.chunk_decay is None else grad * f.chunk_decay[:, c, None, None]
            grad = torch.baddbmm(decayed, w_t[:, c], d_u[:, c], alpha=-1).add_(d_start[:, c])
        return (*_factor_grads(f, q, k, v, beta, ctx.scale, starts, u, d_out, d_u, d_next), None)


def _factor_grads(f: _Factors, q: Tensor, k: Tensor, v: Tensor, beta: Tensor, scale: float, s0: Tensor,
                  u: Tensor, d_o: Tensor, d_u: Tensor, d_next: Tensor) -> tuple[Tensor, ...]:
    """(dq, dk, dv, dbeta, dg or None) from the gradients of the outputs dO, of the pseudo-values (dL/du, the
    reverse recurrence's) and of the chunks' end states (dL/dS_{c+1}): the derivatives of the module
    docstring's equations. With P the scores and R_v = diag(beta) V, R_k = diag(beta) exp(gamma) K:
    dP = dO u^T, dL/dU_wy = dL/du, dL/dW = -dL/du S_c^T, dR = (I + A)^-T dL/d[U_wy | W],
    dA = -dR [U_wy | W]^T (strictly lower); the decay's gradient is gathered per token as dL/dgamma and summed
    back to g (gamma = cumsum g)."""
    inverse_t = f.inverse.transpose(-1, -2)
    d_rhs_v = inverse_t @ d_u
    d_rhs_k = -(inverse_t @ (d_u @ s0.transpose(-1, -2)))
    d_a = d_rhs_v @ f.u_wy.transpose(-1, -2)
    d_a.flatten(0, 1).baddbmm_(d_rhs_k.flatten(0, 1), f.w.transpose(-1, -2).flatten(0, 1))
    d_a.neg_().tril_(-1)
    gram_part = d_a * f.decayed_gram  # dL/dA o (Gamma o K K^T): dbeta's share, and the decay's times beta
    d_gram = d_a if f.decay is None else d_a.mul_(f.decay)
    d_gram.mul_(beta[..., None])  # dL/d(K K^T) from A = diag(beta) (Gamma o K K^T)
    d_scores = d_o @ u.transpose(-1, -2)  # dL/dP
    rhs_k_dot = (d_rhs_k * k).sum(-1)  # dL/d(beta exp(gamma)) per token
    d_beta = (d_rhs_v * v).sum(-1) + gram_part.sum(-1)
    d_k_end = u @ d_next.transpose(-1, -2)  # dL/dK'
    d_q_decayed = d_o @ s0.transpose(-1, -2)  # dL/d(exp(gamma) Q scale)
    d_g = None
    if f.decay is None:
        d_beta += rhs_k_dot
        d_k = d_k_end.add_(d_rhs_k * beta[..., None])
        d_scores.tril_()
    else:
        # dL/dGamma o Gamma from P and from A: dL/dgamma_r gets its row sums, dL/dgamma_i minus its column sums
        from_scores = d_scores * f.scores
        d_gamma = (from_scores.sum(-1) - from_scores.sum(-2) + gram_part.sum(-1) * beta
                   - (gram_part.transpose(-1, -2) @ beta[..., None])[..., 0])
        d_scores.mul_(f.decay)
        rhs_scale = beta * f.token_decay
        d_beta += rhs_k_dot * f.token_decay
        to_end = (d_k_end * f.k_to_end).sum(-1)  # K' = exp(gamma_L - gamma) K: minus each token's share
        d_gamma += (d_q_decayed * f.q_decayed).sum(-1) + rhs_k_dot * rhs_scale - to_end
        # gamma_L's share, from K' and from exp(gamma_L) S_c
        d_gamma[..., -1] += to_end.sum(-1) + f.chunk_decay * (d_next * s0).sum((-1, -2))
        d_g = d_gamma.flip(-1).cumsum(-1).flip(-1)  # gamma = cumsum(g)
        d_k = d_k_end.mul_(f.end_decay[..., None]).add_(d_rhs_k * rhs_scale[..., None])
        d_q_decayed.mul_(f.token_decay[..., None])
    d_k.add_(d_gram.add(d_gram.transpose(-1, -2)) @ k).add_((d_scores.transpose(-1, -2) @ q).mul_(scale))
    d_q = (d_scores @ k).add_(d_q_decayed).mul_(scale)
    return d_q, d_k, d_rhs_v.mul_(beta[..., None]), d_beta, d_g


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
    b, h, n, dk = key.shape
    with autocast_disabled(query.device):
        f = _chunk_factors(*_chunks(*(t.to(work) for t in (query, key, value, beta)),
                                    None if log_decay is None else log_decay.to(work), chunk), scale)
        u_wy, w = f.u_wy, f.w
        k_end_t = f.k_to_end.transpose(-1, -2)
        eye = torch.eye(dk, dtype=work, device=key.device)
        kept = eye if f.chunk_decay is None else f.chunk_decay[..., None, None] * eye
        starts, final = _chunk_start_states(kept - k_end_t @ w, k_end_t @ u_wy)
        out = f.q_decayed @ starts + f.scores @ (u_wy - w @ starts)
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
    return (work * torch.rsqrt(work.square().sum(-1, keepdim=True) + L2_EPS)).to(t.dtype)


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
