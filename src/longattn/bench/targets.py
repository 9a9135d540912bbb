"""What a benchmark can run: a registered mechanism, SDPA's forced math path, or a peer package.

Every target is an ``nn.Module``-like callable on ``x`` of shape [B, N, dim] with a bool key
padding mask, so all of them are timed the same way (projections included).
"""

from __future__ import annotations

import contextlib
import importlib.util
from dataclasses import dataclass
from typing import Callable, ContextManager

import torch
from torch import Tensor, nn

from longattn import attention

SDPA = "softmax"
SDPA_MATH = "softmax_math"


@dataclass
class Target:
    """A runnable benchmark subject: ``call(x, mask)`` under ``context()``."""

    name: str
    module: nn.Module
    call: Callable[[Tensor, Tensor], Tensor]
    context: Callable[[], ContextManager]


def math_backend() -> ContextManager:
    from torch.nn.attention import SDPBackend, sdpa_kernel

    return sdpa_kernel(SDPBackend.MATH)


# Peer packages (optional `peers` extra). Each builder takes (dim, heads, head_dim, length) and
# returns (module, call). Hyperparameters follow the defaults longattn's own versions use, so the
# pairs compute the same kind of thing; documented in docs/benchmarks.md.
def _peer_nystrom(dim: int, heads: int, head_dim: int, length: int):
    from nystrom_attention import NystromAttention

    m = NystromAttention(dim=dim, dim_head=head_dim, heads=heads, num_landmarks=256, pinv_iterations=6,
                         residual=True, residual_conv_kernel=33)
    return m, lambda x, mask: m(x, mask=mask)


def _peer_performer(dim: int, heads: int, head_dim: int, length: int):
    from performer_pytorch import SelfAttention

    m = SelfAttention(dim=dim, heads=heads, dim_head=head_dim, nb_features=256, causal=False)
    return m, lambda x, mask: m(x, mask=mask)


def _peer_linformer(dim: int, heads: int, head_dim: int, length: int):
    from linformer import LinformerSelfAttention

    m = LinformerSelfAttention(dim=dim, seq_len=length, k=256, heads=heads, dim_head=head_dim)
    # linformer's package takes no padding mask.
    return m, lambda x, mask: m(x)


def _peer_reformer(dim: int, heads: int, head_dim: int, length: int):
    from reformer_pytorch import LSHSelfAttention

    m = LSHSelfAttention(dim=dim, heads=heads, dim_head=head_dim, bucket_size=64, n_hashes=4,
                         attend_across_buckets=False)  # longattn default: only same-bucket keys (eq. 3)
    return m, lambda x, mask: m(x, input_mask=mask)


def _peer_local(dim: int, heads: int, head_dim: int, length: int):
    from local_attention import LocalMHA

    m = LocalMHA(dim=dim, window_size=256, dim_head=head_dim, heads=heads, causal=False)
    return m, lambda x, mask: m(x, mask=mask)


PEERS: dict[str, tuple[str, str, Callable]] = {
    # target name: (python module, longattn mechanism it corresponds to, builder)
    "peer_nystrom": ("nystrom_attention", "nystrom", _peer_nystrom),
    "peer_performer": ("performer_pytorch", "performer", _peer_performer),
    "peer_linformer": ("linformer", "linformer", _peer_linformer),
    "peer_reformer": ("reformer_pytorch", "reformer", _peer_reformer),
    "peer_local": ("local_attention", "local", _peer_local),
}


def available_peers() -> list[str]:
    """Peer targets whose package is installed."""
    return [name for name, (module, _, _) in PEERS.items() if importlib.util.find_spec(module)]


def peer_of(mechanism: str) -> str | None:
    """The peer target implementing ``mechanism``, if any is installed."""
    for name, (_, mech, _) in PEERS.items():
        if mech == mechanism and name in available_peers():
            return name
    return None


def all_target_names() -> list[str]:
    return attention.available() + [SDPA_MATH] + list(PEERS)


def make_target(name: str, dim: int, heads: int, length: int, options: dict | None = None) -> Target:
    """Build benchmark target ``name`` for sequences of ``length`` tokens."""
    options = dict(options or {})
    if name == SDPA_MATH:
        module = attention.build(SDPA, dim=dim, heads=heads, max_len=length, **options)
        return Target(name, module, module, math_backend)
    if name in PEERS:
        module_name, _, builder = PEERS[name]
        if importlib.util.find_spec(module_name) is None:
            raise ValueError(f"peer target {name!r} needs the package {module_name!r} (pip install '.[peers]')")
        module, call = builder(dim, heads, dim // heads, length)
        return Target(name, module, call, contextlib.nullcontext)
    if name not in attention.available():
        raise ValueError(f"unknown benchmark target {name!r}; choose from {', '.join(all_target_names())}")
    module = attention.build(name, dim=dim, heads=heads, max_len=length, **options)
    return Target(name, module, module, contextlib.nullcontext)
