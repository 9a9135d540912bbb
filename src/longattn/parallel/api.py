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

import zlib
from typing import Callable

import torch
import torch.distributed as dist
from torch import Tensor, nn

from longattn.attention.base import AttentionBase, AttentionError, get_spec
from longattn.parallel.comm import (CollectiveMismatch, Shard, all_gather_sequence, device_code, dtype_code,
                                    locate_shard)

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
        empty = isinstance(x, Tensor) and x.dim() == 3 and x.shape[1] == 0
        if empty:
            # A rank that holds no token (a sequence shorter than the group) still takes part in every
            # collective: it runs the form on one padding token of its own, after the sequence's end.
            if attention_mask is None:
                attention_mask = torch.ones(x.shape[0], 0, dtype=torch.bool, device=x.device)
            x = torch.cat((x, x.new_zeros(x.shape[0], 1, x.shape[2])), dim=1)
            attention_mask = torch.cat((attention_mask, attention_mask.new_zeros(x.shape[0], 1)), dim=1)
        if not isinstance(x, Tensor):
            raise AttentionError(f"input must be a torch.Tensor, got {type(x).__name__}")
        try:  # a bad input fails here, before the first collective, on every rank (see below)
            layer.check_input(x, attention_mask)
            problem = None
        except AttentionError as error:
            problem = error
        # the one small all-gather that gives the shard lengths also checks that every rank runs the same
        # layer (name, options, parameter shapes) on an input of the same batch, width, dtype and device, and
        # that no rank's input failed its checks (that rank raises its own error, the others name it)
        describe = {"input check": int(problem is None), **_describe(layer, x, attention_mask)}
        try:
            shard = locate_shard(x.shape[1] if x.dim() == 3 else 0, self.group, x.device, describe=describe,
                                 virtual=int(empty))
        except CollectiveMismatch:
            if problem is not None:
                raise problem from None
            raise
        if problem is not None:  # every rank's input failed alike
            raise problem
        if layer.capabilities.needs_max_len and shard.total > layer.max_len:
            raise AttentionError(
                f"sequence length {shard.total} (all shards) exceeds max_len={layer.max_len} of this "
                f"{layer.name!r} layer"
            )
        form = _FORMS[layer.name]
        out = layer.forward_with(lambda *args: form(layer, *args, shard), x, attention_mask, layer_state)
        return out[:, :0] if empty else out

    def extra_repr(self) -> str:
        return f"group={'WORLD' if self.group is None else self.group}"


_FINGERPRINT_ATTR = "_longattn_weights_fingerprint"  # on the layer: its fingerprint, None once it is forgotten


def _forget_fingerprint(module: nn.Module, incompatible_keys: object) -> None:
    module.__dict__[_FINGERPRINT_ATTR] = None


def weights_fingerprint(layer: AttentionBase) -> int:
    """A CRC-32 of the names and bytes of the parameters of ``layer`` (buffers such as Performer's redraw counter
    follow the calls, which the collectives' own checks compare), computed on the first sequence-parallel
    call and again after ``load_state_dict`` (a post-hook forgets it); in between it is read from the layer, so a
    forward pays nothing for it. Ranks whose layers differ in their values (not only their shapes) would give a
    wrong output: the fingerprint is among the fields the first all-gather compares."""
    known = layer.__dict__.get(_FINGERPRINT_ATTR)
    if known is None:
        if _FINGERPRINT_ATTR not in layer.__dict__:  # the first time: forget the fingerprint on every load
            layer.register_load_state_dict_post_hook(_forget_fingerprint)
        known = 0
        for name, t in layer.named_parameters():
            data = t.detach().reshape(-1).contiguous().view(torch.uint8).cpu().numpy().tobytes()
            known = zlib.crc32(data, zlib.crc32(name.encode(), known))
        layer.__dict__[_FINGERPRINT_ATTR] = known
    return known


def _describe(layer: AttentionBase, x: Tensor, attention_mask: Tensor | None) -> dict[str, int]:
    """What must be equal on every rank of the group, as integers (one all-gather compares them)."""
    signature = f"{layer.name} {layer.extra_repr()} " + " ".join(
        f"{name}{list(t.shape)}{t.dtype}" for name, t in layer.state_dict().items())
    batch, _, width = x.shape if x.dim() == 3 else (-1, -1, -1)  # not [B, N, dim]: check_input says so
    return {"batch size": batch, "feature size": width, "dtype": dtype_code(x.dtype),
            "device": device_code(x.device), "mask": int(attention_mask is not None),
            "training mode": int(layer.training), "layer": zlib.crc32(signature.encode()),
            "weights": weights_fingerprint(layer)}


def sequence_parallel(layer: AttentionBase, group: dist.ProcessGroup | None = None) -> SequenceParallelAttention:
    """Wrap ``layer`` (trained or fresh) to run on one shard of a sequence split across ``group``."""
    _ensure_forms_loaded()
    return SequenceParallelAttention(layer, group)


def shard_bounds(length: int, world: int, rank: int) -> tuple[int, int]:
    """[start, end) of rank's part when ``length`` tokens are cut into ``world`` contiguous parts whose lengths
    differ by at most one (the first ``length % world`` parts hold one token more; with fewer tokens than
    ranks, the last ranks hold none)."""
    part, extra = divmod(length, world)
    start = rank * part + min(rank, extra)
    return start, start + part + (rank < extra)


def shard_sequence(
    x: Tensor, attention_mask: Tensor | None = None, group: dist.ProcessGroup | None = None
) -> tuple[Tensor, Tensor]:
    """This rank's contiguous part of ``x`` [B, N, ...] and of its mask (True = real token; all True when
    no mask is given). The parts' lengths differ by at most one token (:func:`shard_bounds`) and nothing is
    padded, so every mechanism sees the sequence's own length N (cosFormer's M, for one); a rank may get no
    token when N is smaller than the group."""
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    batch, length = x.shape[:2]
    mask = torch.ones(batch, length, dtype=torch.bool, device=x.device) if attention_mask is None else attention_mask
    start, end = shard_bounds(length, world, rank)
    return x[:, start:end], mask[:, start:end]


def gather_sequence(y_local: Tensor, length: int | None = None, group: dist.ProcessGroup | None = None) -> Tensor:
    """The whole sequence from every rank's part [B, N_local, ...] (rank order), cut to ``length``
    tokens (dropping the padding :func:`shard_sequence` added). Differentiable."""
    shard = locate_shard(y_local.shape[1], group, y_local.device,
                         describe={"dtype": dtype_code(y_local.dtype), "device": device_code(y_local.device),
                                   "number of dimensions": y_local.dim()})
    whole = all_gather_sequence(y_local, shard, dim=1)
    return whole if length is None else whole[:, :length]


def _ensure_forms_loaded() -> None:
    # importing the package registers every form module it contains
    import longattn.parallel  # noqa: F401
