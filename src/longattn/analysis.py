"""Matrix diagnostics used by the papers' analyses (e.g. SKTformer Appendix I, Table 14)."""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["mu_incoherence", "pooled_attention", "row_pearson"]


def mu_incoherence(x: Tensor, rank: int) -> float:
    """The smallest mu for which the token matrix ``x`` [n, d] is mu-incoherent at ``rank``.

    Definition 1 of SKTformer: with the compact SVD X = W S V^T of a rank-r matrix,
    ``max_i ||e_i^T W|| <= sqrt(mu r / n)`` and ``max_i ||e_i^T V|| <= sqrt(mu r / d)``, so

        mu = max(n / r * max_i ||W_i||^2, d / r * max_i ||V_i||^2).

    Token matrices are not exactly low-rank, so (as in Appendix I, "rank = 16 / 32") W and V are
    the top-``rank`` singular vectors, i.e. the rank-``rank`` truncation of X. mu lies in
    [1, max(n, d) / rank]; the SVD runs in float64. Raises ValueError for a non-2-D input or a
    rank outside [1, min(n, d)].
    """
    if not isinstance(x, Tensor) or x.dim() != 2:
        raise ValueError(f"mu_incoherence expects a 2-D [n, d] tensor, got {getattr(x, 'shape', type(x))}")
    n, d = x.shape
    if isinstance(rank, bool) or not isinstance(rank, int) or not 1 <= rank <= min(n, d):
        raise ValueError(f"rank must be an int in [1, min(n, d) = {min(n, d)}], got {rank!r}")
    w, _, vh = torch.linalg.svd(x.detach().to(torch.float64), full_matrices=False)
    w, v = w[:, :rank], vh[:rank].T
    left = w.square().sum(-1).max() * n / rank
    right = v.square().sum(-1).max() * d / rank
    return float(torch.maximum(left, right))


def pooled_attention(layer_maps: list[Tensor]) -> Tensor:
    """Singularformer's A^{*,*} (eqs. 19-20): each layer's [B, H, N, N] maps max-pooled over heads, then
    averaged over layers -> [B, N, N]."""
    if not layer_maps:
        raise ValueError("pooled_attention needs the maps of at least one layer")
    shapes = {tuple(m.shape) for m in layer_maps}
    if len(shapes) != 1 or len(next(iter(shapes))) != 4:
        raise ValueError(f"every layer's map must be [B, H, N, N] of one shape, got {sorted(shapes)}")
    return torch.stack([m.amax(dim=1) for m in layer_maps]).mean(dim=0)


def row_pearson(a: Tensor, b: Tensor, attention_mask: Tensor | None = None) -> Tensor:
    """The attention correlation of Singularformer Sec. 5.2 per example: the Pearson correlation of row i
    of ``a`` with row i of ``b`` ([B, N, N]), over the real keys, averaged over the real rows -> [B].

    Rows where either map is constant (a correlation without a value, e.g. one real token) are left out
    of the average; an example without any such row gets NaN. Computed in float64.
    """
    if a.shape != b.shape or a.dim() != 3 or a.shape[-1] != a.shape[-2]:
        raise ValueError(f"row_pearson expects two [B, N, N] maps of one shape, got {list(a.shape)}, {list(b.shape)}")
    real = torch.ones(a.shape[:2], dtype=torch.bool, device=a.device) if attention_mask is None else attention_mask
    if real.shape != a.shape[:2] or real.dtype != torch.bool:
        raise ValueError(f"attention_mask must be bool {list(a.shape[:2])}, got {real.dtype} {list(real.shape)}")
    keys = real[:, None, :].to(torch.float64)
    count = keys.sum(-1, keepdim=True).clamp_min(1)
    centred = []
    for m in (a, b):
        m = m.to(torch.float64) * keys
        centred.append((m - m.sum(-1, keepdim=True) / count) * keys)
    covariance = (centred[0] * centred[1]).sum(-1)
    scale = (centred[0].square().sum(-1) * centred[1].square().sum(-1)).sqrt()
    valid = real & (scale > 0)
    per_row = torch.where(valid, covariance / scale.where(valid, torch.ones_like(scale)), torch.zeros_like(scale))
    rows = valid.sum(-1)
    return torch.where(rows > 0, per_row.sum(-1) / rows.clamp_min(1), torch.full_like(covariance[:, 0], float("nan")))
