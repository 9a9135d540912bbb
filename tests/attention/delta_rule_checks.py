"""Shared inputs and peers of the delta-rule tests (test_deltanet.py, test_gated_deltanet.py): flash-linear-
attention's naive recurrences take [B, H, T, .] (delta rule) or [B, T, H, .] (gated) and compute in float32."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from longattn.testing import random_qkv

HEAD_DIM = 8


def rule_inputs(n: int, gated: bool, seed: int = 0, batch: int = 2, heads: int = 2) -> list[torch.Tensor]:
    """float64 leaves q, k (unit rows), v, beta in (0, 1) [B, H, N] and, gated, g < 0 [B, H, N]."""
    q, k, v = random_qkv(batch, heads, n, HEAD_DIM, seed=seed)
    k = F.normalize(k.detach(), dim=-1).requires_grad_()
    g = torch.Generator().manual_seed(seed + 1)
    beta = torch.rand(batch, heads, n, generator=g, dtype=torch.float64).requires_grad_()
    tensors = [q, k, v, beta]
    if gated:
        tensors.append((-torch.rand(batch, heads, n, generator=g, dtype=torch.float64)).requires_grad_())
    return tensors



def fla_peer(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, beta: torch.Tensor,
             g: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(o [B, H, N, Dv] in q's dtype, final state in float32) of fla's naive recurrence, scale 1 / sqrt(Dk)."""
    if g is None:
        from fla.ops.delta_rule.naive import delta_rule_recurrence

        return delta_rule_recurrence(q, k, v, beta)
    from fla.ops.gated_delta_rule.naive import naive_recurrent_gated_delta_rule

    out, state = naive_recurrent_gated_delta_rule(*(t.transpose(1, 2) for t in (q, k, v, beta, g)),
                                                  output_final_state=True)
    return out.transpose(1, 2).to(q.dtype), state


def upstream_grads(out: torch.Tensor, inputs: list[torch.Tensor], seed: int = 7) -> list[torch.Tensor]:
    """Gradients of ``inputs`` for one fixed random upstream gradient."""
    upstream = torch.randn(out.shape, generator=torch.Generator().manual_seed(seed), dtype=out.dtype)
    return list(torch.autograd.grad(out, inputs, upstream.to(out.dtype)))
