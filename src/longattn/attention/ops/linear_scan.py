"""Kernel (linear) attention's shared algebra (Katharopoulos et al., 2020, "Transformers are RNNs").

With a feature map phi, attention is V'_i = phi(Q_i)^T sum_j phi(K_j) V_j^T / (phi(Q_i)^T sum_j phi(K_j))
(eq. 4-6), linear in N; its causal form (eq. 8-9) is a prefix sum over keys. Linear attention, Performer,
cosFormer, Skeinformer's normalisation and the sequence-parallel forms use these sums:

* :func:`kernel_sums` / :func:`kernel_attention`: the non-causal sums (eq. 5-6);
* :func:`causal_kernel_sums` / :func:`causal_kernel_attention`: the causal sums, chunk by chunk (quadratic
  only inside a chunk, a running [F, Dv] state across chunks), so that neither an N x N matrix nor an
  N x F x Dv tensor of all prefix states is ever built;
* on the GPU path (:func:`~longattn.attention.base.uses_gpu_path`) :func:`kernel_sums_gpu`: batched GEMMs in
  the autocast dtype, the causal sums by :func:`causal_scan` (the Triton kernels of ``_linear_scan_triton``
  where they run, else :func:`causal_scan_chunked`) with the running state in float32, and
  :func:`normalised` for the division in float32.
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F
from torch import Tensor

from longattn.attention._triton import float32_takes_pytorch_path, kernels_run_on, pytorch_path_where_kernels_do_not_fit
from longattn.attention.base import compute_dtype

CAUSAL_CHUNK = 64


def elu_feature_map(x: Tensor) -> Tensor:
    """phi(x) = elu(x) + 1 (eq. 7): positive, so the normaliser never vanishes."""
    return F.elu(x) + 1.0


def mask_keys(phi_k: Tensor, value: Tensor, attention_mask: Tensor | None) -> tuple[Tensor, Tensor]:
    # A padded key must add nothing to either sum: zero its features and its value.
    if attention_mask is None:
        return phi_k, value
    keep = attention_mask[:, None, :, None].to(phi_k.dtype)
    return phi_k * keep, value * keep


def kernel_sums(
    phi_q: Tensor, phi_k: Tensor, value: Tensor, sum_over_keys: Callable[[Tensor], Tensor] | None = None
) -> tuple[Tensor, Tensor]:
    """Non-causal numerator phi(Q) (phi(K)^T V) [B, H, N, Dv] and normaliser phi(Q) sum_j phi(K_j)
    [B, H, N, 1] (eq. 5-6); padded keys' features must already be zero.

    ``sum_over_keys`` completes the two sums over the keys held here (longattn.parallel passes an
    all-reduce: with the sequence split across processes each holds part of the keys)."""
    context = phi_k.transpose(-1, -2) @ value  # [B, H, F, Dv]
    key_sum = phi_k.sum(dim=-2, keepdim=True)  # [B, H, 1, F]
    if sum_over_keys is not None:
        context, key_sum = sum_over_keys(context), sum_over_keys(key_sum)
    return phi_q @ context, phi_q @ key_sum.transpose(-1, -2)


def causal_chunks(n: int, chunk: int = CAUSAL_CHUNK) -> tuple[int, int]:
    """How the causal sums cut N tokens: (number of chunks, tokens per chunk), equal chunks of at most ``chunk``
    tokens, so that less than one token per chunk is padding (144 = 3 x 48, 145 = 3 x 49 - 2)."""
    count = max(1, -(-n // chunk))
    return count, -(-n // count)


def causal_kernel_sums(phi_q: Tensor, phi_k: Tensor, value: Tensor, chunk: int = CAUSAL_CHUNK) -> tuple[Tensor, Tensor]:
    """Causal numerator and normaliser (eq. 8-9): query i sees keys j <= i.

    The sequence is cut into equal chunks of at most ``chunk`` tokens (so that it needs less than one
    token of padding per chunk, usually none: padding copies the [N, F] features): inside a chunk the
    masked product is exact, across chunks an exclusive prefix sum of per-chunk states
    sum_j phi(K_j) [V_j, 1]^T carries the past (the normaliser is the numerator of a value column of
    ones, so one product gives both). Memory O(N * chunk + N / chunk * F * Dv), no loop over tokens.
    """
    b, h, n, f = phi_q.shape
    dv = value.shape[-1]
    c, chunk = causal_chunks(n, chunk)
    pad = c * chunk - n
    value = torch.cat([value, value.new_ones(b, h, n, 1)], dim=-1)
    if pad:
        # zero features on the padded tail: they add nothing to any sum
        phi_q, phi_k, value = (F.pad(t, (0, 0, 0, pad)) for t in (phi_q, phi_k, value))
    q_c = phi_q.reshape(b, h, c, chunk, f)
    k_c = phi_k.reshape(b, h, c, chunk, f)
    v_c = value.reshape(b, h, c, chunk, dv + 1)

    states = k_c.transpose(-1, -2) @ v_c  # [B, H, C, F, Dv+1] per chunk
    past_states = states.cumsum(dim=2) - states  # exclusive prefix: chunks strictly before
    within = (q_c @ k_c.transpose(-1, -2)).tril_()  # [B, H, C, chunk, chunk], j <= i inside chunk
    sums = (q_c @ past_states + within @ v_c).reshape(b, h, c * chunk, dv + 1)[:, :, :n]
    return sums[..., :dv], sums[..., dv:]


def kernel_attention(
    phi_q: Tensor, phi_k: Tensor, value: Tensor, eps: float, sum_over_keys: Callable[[Tensor], Tensor] | None = None
) -> Tensor:
    """Non-causal kernel attention (eq. 5-6) from features; padded keys must already be zeroed."""
    numerator, normaliser = kernel_sums(phi_q, phi_k, value, sum_over_keys)
    return numerator / (normaliser + eps)


def causal_kernel_attention(
    phi_q: Tensor, phi_k: Tensor, value: Tensor, eps: float, chunk: int = CAUSAL_CHUNK
) -> Tensor:
    """Causal kernel attention (eq. 8-9), chunked (see :func:`causal_kernel_sums`)."""
    numerator, normaliser = causal_kernel_sums(phi_q, phi_k, value, chunk)
    return numerator / (normaliser + eps)


# ----------------------------------------------------------------------------- GPU path


def causal_scan_chunked(q: Tensor, k: Tensor, v: Tensor, chunk: int = CAUSAL_CHUNK) -> tuple[Tensor, Tensor]:
    """The causal sums o_i = sum_{j <= i} (q_i . k_j) v_j and z_i = sum_{j <= i} q_i . k_j (eq. 8-9) as one
    batched tensor program, no loop over chunks: per-chunk states k_c^T [v_c, 1] in the input dtype (the
    GEMM dtype), their exclusive prefix sum over chunks in float32 (float64 stays float64), then
    o_c = q_c h_c + tril(q_c k_c^T) [v_c, 1]. Returns o in the input dtype (rounded once from the accumulation
    dtype) and z in the accumulation dtype.

    The GPU path where the Triton kernels do not run; memory: the states of all chunks,
    [B, H, N / chunk, K, V + 1] in float32."""
    b, h, n, f = q.shape
    dv = v.shape[-1]
    acc = compute_dtype(q.dtype)
    count = -(-n // chunk)
    pad = count * chunk - n
    v1 = torch.cat([v, v.new_ones(b, h, n, 1)], dim=-1)  # the normaliser is the sum of a column of ones
    if pad:
        q, k, v1 = (F.pad(t, (0, 0, 0, pad)) for t in (q, k, v1))
    q_c, k_c = q.reshape(b, h, count, chunk, f), k.reshape(b, h, count, chunk, f)
    v_c = v1.reshape(b, h, count, chunk, dv + 1)
    states = (k_c.transpose(-1, -2) @ v_c).to(acc)
    past = (states.cumsum(dim=2) - states).to(q.dtype)  # chunks strictly before, summed in `acc`
    within = (q_c @ k_c.transpose(-1, -2)).tril_()
    sums = ((q_c @ past).to(acc) + (within @ v_c).to(acc)).reshape(b, h, count * chunk, dv + 1)[:, :, :n]
    return sums[..., :dv].to(q.dtype), sums[..., dv]


# the values of a head are one tile of the scan kernels: wider values take causal_scan_chunked
MAX_KERNEL_VALUE_DIM = 256


@pytorch_path_where_kernels_do_not_fit
def causal_scan(q: Tensor, k: Tensor, v: Tensor, chunk: int = CAUSAL_CHUNK) -> tuple[Tensor, Tensor]:
    """(o, z) of :func:`causal_scan_chunked`, by the Triton kernels where they run (:func:`kernels_run_on`;
    values wider than MAX_KERNEL_VALUE_DIM, and float32 on a GPU (:func:`float32_takes_pytorch_path`), take
    the PyTorch form). The
    kernels' chunk is ``chunk`` when it is a power of two from 16 to 128 (a tile), else CAUSAL_CHUNK: the
    chunking changes only the order of the sums."""
    if kernels_run_on(q) and v.shape[-1] <= MAX_KERNEL_VALUE_DIM and not float32_takes_pytorch_path(q):
        from longattn.attention._linear_scan_triton import CausalScan

        tile = chunk if chunk in (16, 32, 64, 128) else CAUSAL_CHUNK
        return CausalScan.apply(q, k, v, tile)
    return causal_scan_chunked(q, k, v, chunk)


def kernel_sums_gpu(phi_q: Tensor, phi_k: Tensor, value: Tensor, is_causal: bool,
                    chunk: int = CAUSAL_CHUNK) -> tuple[Tensor, Tensor]:
    """Numerator [B, H, N, Dv] and normaliser [B, H, N] of kernel attention (eq. 5-6, causal eq. 8-9) on the
    GPU path. Features and values must be in the GEMM dtype (the autocast dtype) with padded keys' features
    zero. Not causal: one GEMM phi(K)^T [V, 1] (float32 accumulation inside the GEMM), then phi(Q) times it;
    causal: :func:`causal_scan`. The numerator is in the GEMM dtype, the normaliser in the accumulation dtype
    (see :func:`normalised`)."""
    if is_causal:
        return causal_scan(phi_q, phi_k, value, chunk)
    dv = value.shape[-1]
    context = phi_k.transpose(-1, -2) @ torch.cat([value, value.new_ones(*value.shape[:-1], 1)], dim=-1)
    sums = phi_q @ context
    return sums[..., :dv], sums[..., dv].to(compute_dtype(phi_q.dtype))


def normalised(numerator: Tensor, normaliser: Tensor, dtype: torch.dtype) -> Tensor:
    """numerator / normaliser in ``dtype``: the reciprocal in the normaliser's (accumulation) dtype, rounded
    once; multiplying by it keeps no copy of the numerator in float32 for the backward pass."""
    return (numerator * (1.0 / normaliser).to(numerator.dtype)[..., None]).to(dtype)
