"""The public face of sequence parallelism: wrap a trained attention layer so that each process
runs it on its part of one sequence, and split / gather a batch along the sequence.

Usage under torchrun (one process per shard; gloo on CPU, nccl on GPU)::

    dist.init_process_group("gloo")
    layer = attention.build("skeleton", dim=64, heads=2, max_len=1 << 20)   # or a trained one
    sharded = sequence_parallel(layer)                 # same parameters, no copy
    x_local, mask_local = shard_sequence(x, mask)      # this rank's [B, N_local, dim]
    y_local = sharded(x_local, mask_local)             # equals layer(x, mask)[:, this shard]
    y = gather_sequence(y_local, x.shape[1])           # the whole output, if wanted

Gradients: each rank back-propagates its own part of the loss; parameter gradients are then the
sum over the ranks of the sequence-parallel group. Inside DistributedDataParallel over that group
(which averages), scale each rank's loss by the group size.
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.distributed as dist
from torch import Tensor, nn

from longattn.attention.base import AttentionBase, AttentionError, get_spec
from longattn.parallel.comm import Shard, all_gather_sequence, locate_shard

__all__ = [
    "SequenceParallelAttention",
    "gather_sequence",
    "parallel_forms",
    "register_form",
    "sequence_parallel",
    "shard_sequence",
]

#: a form: (layer, local x [B, n, dim], local mask or None, layer_state, shard) -> local output
Form = Callable[[AttentionBase, Tensor, "Tensor | None", "dict | None", Shard], Tensor]

_FORMS: dict[str, Form] = {}


def register_form(*names: str) -> Callable[[Form], Form]:
    """Register the sequence-parallel form of the mechanisms ``names``."""

    def decorator(form: Form) -> Form:
        for name in names:
            if name in _FORMS:
                raise AttentionError(f"sequence-parallel form of {name!r} is registered twice")
            _FORMS[name] = form
        return form

    return decorator


def parallel_forms() -> list[str]:
    """Names of the mechanisms with a sequence-parallel form, sorted."""
    return sorted(_FORMS)


class SequenceParallelAttention(nn.Module):
    """An attention layer run on this process's shard of a sequence split across ``group``.

    ``forward(x, attention_mask=None, layer_state=None)`` takes the local shard [B, N_local, dim]
    (shards in rank order; uneven lengths and padding anywhere allowed) and returns the local part
    of ``layer(whole x)``. The wrapped layer's parameters and buffers are used as they are.
    """

    def __init__(self, layer: AttentionBase, group: dist.ProcessGroup | None = None) -> None:
        super().__init__()
        if not isinstance(layer, AttentionBase):
            raise AttentionError(f"sequence_parallel needs a longattn attention layer, got {type(layer).__name__}")
        if not get_spec(layer.name).capabilities.sequence_parallel or layer.name not in _FORMS:
            raise AttentionError(
                f"attention {layer.name!r} has no sequence-parallel form; mechanisms with one: "
                f"{', '.join(parallel_forms())}"
            )
        self.layer = layer
        self.group = group

    def forward(self, x: Tensor, attention_mask: Tensor | None = None, layer_state: dict | None = None) -> Tensor:
        layer = self.layer
        layer.check_input(x, attention_mask)  # before the first collective: a bad input fails here
        shard = locate_shard(x.shape[1], self.group, x.device)
        if layer.capabilities.needs_max_len and shard.total > layer.max_len:
            raise AttentionError(
                f"sequence length {shard.total} (all shards) exceeds max_len={layer.max_len} of this "
                f"{layer.name!r} layer"
            )
        form = _FORMS[layer.name]
        return layer.forward_with(lambda *args: form(layer, *args, shard), x, attention_mask, layer_state)

    def extra_repr(self) -> str:
        return f"group={'WORLD' if self.group is None else self.group}"


def sequence_parallel(layer: AttentionBase, group: dist.ProcessGroup | None = None) -> SequenceParallelAttention:
    """Wrap ``layer`` (trained or fresh) to run on one shard of a sequence split across ``group``."""
    _ensure_forms_loaded()
    return SequenceParallelAttention(layer, group)


def shard_sequence(
    x: Tensor, attention_mask: Tensor | None = None, group: dist.ProcessGroup | None = None
) -> tuple[Tensor, Tensor]:
    """This rank's contiguous part of ``x`` [B, N, ...] and of its mask (True = real token).

    The sequence is cut into equal parts of ceil(N / world) tokens; the last rank's part is
    padded at the end (zeros, mask False), so a mask is always returned."""
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    batch, length = x.shape[:2]
    mask = torch.ones(batch, length, dtype=torch.bool, device=x.device) if attention_mask is None else attention_mask
    part = -(-length // world)
    pad = part * world - length
    if pad:
        x = torch.cat((x, x.new_zeros((batch, pad) + tuple(x.shape[2:]))), dim=1)
        mask = torch.cat((mask, mask.new_zeros(batch, pad)), dim=1)
    return x[:, rank * part : (rank + 1) * part], mask[:, rank * part : (rank + 1) * part]


def gather_sequence(y_local: Tensor, length: int | None = None, group: dist.ProcessGroup | None = None) -> Tensor:
    """The whole sequence from every rank's part [B, N_local, ...] (rank order), cut to ``length``
    tokens (dropping the padding :func:`shard_sequence` added). Differentiable."""
    shard = locate_shard(y_local.shape[1], group, y_local.device)
    whole = all_gather_sequence(y_local, shard, dim=1)
    return whole if length is None else whole[:, :length]


def _ensure_forms_loaded() -> None:
    # importing the package registers every form module it contains
    import longattn.parallel  # noqa: F401
