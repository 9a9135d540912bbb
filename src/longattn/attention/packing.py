"""Packed sequences: several sequences flattened into one row, kept apart.

Padding-free training (transformers' ``DataCollatorWithFlattening``) concatenates a batch's sequences into
one row and marks where each starts, with ``position_ids`` that restart at 0 or with the cumulative lengths
``cu_seqlens`` of flash-attention's variable-length kernels. Every mechanism here keeps such sequences apart
by computing them side by side: the packed row is gathered into a batch of its sequences (each padded at the
end to the longest, under the padding mask), the mechanism runs on that batch, and its output is scattered
back into the packed layout. The numbers are the mechanism's own on each sequence alone, outputs and
gradients, for every mechanism whose output does not depend on the padded length (longattn's padding rule).
Those whose output does (listed in :data:`PADDED_LENGTH_DEPENDENT`: the sequence length enters their formula,
so the longest sequence would change the others) refuse packed input, unless the option that fixes the
length is set.

* module form: ``layer.forward_packed(x, cu_seqlens=..., position_ids=...)`` on ``x`` [B, N, dim];
* functional form: ``packed_call(fn, query, key, value, cu_seqlens=..., **options)`` on [B, H, N, Dh];
* transformers: the bridge reads the packing from the model's mask (see :mod:`longattn.hf.bridge`).

The cost is that of the padded batch of the sequences (the tokens of every sequence padded to the longest),
not of the packed row; sorting the sequences by length in the collator keeps that padding small.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Any, Callable

import torch
from torch import Tensor

from longattn.attention.base import AttentionBase, AttentionError, available, check_attention_mask, get_spec

__all__ = [
    "PADDED_LENGTH_DEPENDENT",
    "PackingPlan",
    "check_cu_seqlens",
    "check_packable",
    "forward_packed",
    "packed_call",
    "packing_plan",
    "segment_ids",
]

# Mechanisms whose outputs depend on the padded length, why, and the option that makes them independent of it
# (None: inherent). The padding-invariance test through transformers (tests/hf/test_convert.py) checks the list.
PADDED_LENGTH_DEPENDENT: dict[str, tuple[str, str | None]] = {
    "cosformer": ("M of eq. 9 is the padded sequence length unless max_positions is set", "max_positions"),
    "fsat": ("its predicted indices are scaled by lmax, the padded length unless lmax is set", "lmax"),
    "fnet": ("its DFT runs over the padded length", None),
    "bigbird": ("its random blocks are drawn per number of blocks of the padded length and its last block is "
                "global", None),
    "sinkhorn": ("its learned sorting permutes every block of the padded length", None),
    "ponet": ("its segments split the padded length", None),
}


def check_packable(name: str, options: dict[str, Any] | AttentionBase) -> None:
    """Raise when mechanism ``name`` with ``options`` (a dict, or the built module) cannot keep packed
    sequences apart."""
    if name not in PADDED_LENGTH_DEPENDENT:
        return
    reason, fix = PADDED_LENGTH_DEPENDENT[name]
    if fix is not None:
        value = getattr(options, fix, None) if isinstance(options, AttentionBase) else (options or {}).get(fix)
        if value is not None:
            return
    remedy = f"set {fix}= to the longest sequence" if fix else "pad the batch instead of packing it"
    raise AttentionError(
        f"{name} cannot take packed sequences: {reason}, so the longest sequence of a packed batch would change "
        f"the others' outputs; {remedy}"
    )


def check_cu_seqlens(cu_seqlens: Any, shape: tuple[int, int]) -> Tensor:
    """``cu_seqlens`` of a [B, N] packed batch as a 1-D long tensor, or AttentionError naming the fault. The rule:
    an integer tensor, or a list / tuple of Python ints (made a tensor as it is; floats and bools are refused,
    never truncated), 1-D, from 0, rising strictly (no empty sequence), to the B * N tokens, and with B > 1 each
    row boundary b * N among its entries (a sequence lies within one row)."""
    b, n = shape
    if isinstance(cu_seqlens, (list, tuple)):
        if not all(isinstance(v, int) and not isinstance(v, bool) for v in cu_seqlens):
            raise AttentionError(f"cu_seqlens as a list must hold Python ints, got {list(cu_seqlens)[:8]}")
        cu_seqlens = torch.tensor(cu_seqlens, dtype=torch.long)
    if not isinstance(cu_seqlens, Tensor):
        raise AttentionError(f"cu_seqlens must be an integer tensor (or a list of ints), got "
                             f"{type(cu_seqlens).__name__}")
    if cu_seqlens.dtype == torch.bool or cu_seqlens.is_floating_point() or cu_seqlens.is_complex():
        raise AttentionError(f"cu_seqlens must be an integer tensor, got {cu_seqlens.dtype} (it would be truncated)")
    if cu_seqlens.dim() != 1 or cu_seqlens.numel() < 2:
        raise AttentionError(f"cu_seqlens must be 1-D with at least 2 entries [0, ..., B * N], got shape "
                             f"{list(cu_seqlens.shape)}")
    cu = cu_seqlens.to(torch.long)
    if int(cu[0]) != 0 or int(cu[-1]) != b * n or bool((cu[1:] <= cu[:-1]).any()):
        raise AttentionError(
            f"cu_seqlens must rise strictly from 0 to the {b * n} tokens of the batch, got {cu.tolist()[:8]}..."
        )
    rows = torch.arange(1, b, device=cu.device) * n
    crossed = rows[~torch.isin(rows, cu)]
    if crossed.numel():
        raise AttentionError(f"cu_seqlens: a sequence crosses from row {int(crossed[0]) // n - 1} into the next of "
                             f"the [{b}, {n}] batch (no entry at token {int(crossed[0])}); sequences lie within a row")
    return cu


def segment_ids(*, cu_seqlens: Tensor | list[int] | None = None, position_ids: Tensor | None = None,
                shape: tuple[int, int], attention_mask: Tensor | None = None) -> Tensor:
    """Which sequence each token of a [B, N] packed batch belongs to: [B, N] ints, a new one wherever a sequence
    starts. ``cu_seqlens``: [S + 1] cumulative lengths over the flattened batch (0, l_1, l_1 + l_2, ..., B * N;
    see :func:`check_cu_seqlens`); ``position_ids``: [B, N] or [1, N] integers, restarting at 0 (or any value that
    does not continue the previous position plus one, transformers' rule) at each sequence. The one validator of
    packed inputs (module form, functional form, bridge): ``attention_mask`` beside them must be bool [B, N]."""
    b, n = shape
    if (cu_seqlens is None) == (position_ids is None):
        raise AttentionError("packed sequences are given by exactly one of cu_seqlens and position_ids")
    if attention_mask is not None:
        check_attention_mask(attention_mask, b, n, attention_mask.device if isinstance(attention_mask, Tensor)
                             else torch.device("cpu"))
    if cu_seqlens is not None:
        cu = check_cu_seqlens(cu_seqlens, shape)
        positions = torch.arange(b * n, device=cu.device)
        return (torch.searchsorted(cu, positions, right=True) - 1).view(b, n)
    if not isinstance(position_ids, Tensor) or position_ids.is_floating_point() or position_ids.dtype == torch.bool:
        got = position_ids.dtype if isinstance(position_ids, Tensor) else type(position_ids).__name__
        raise AttentionError(f"position_ids must be an integer tensor, got {got}")
    if position_ids.dim() != 2 or position_ids.shape[1] != n or position_ids.shape[0] not in (1, b):
        raise AttentionError(f"position_ids must be [B, N] = [{b}, {n}] (or [1, N]), got {list(position_ids.shape)}")
    positions = position_ids.expand(b, n)
    starts = torch.ones_like(positions, dtype=torch.bool)
    starts[:, 1:] = positions[:, 1:] != positions[:, :-1] + 1
    return starts.cumsum(dim=1) - 1


@dataclass(frozen=True)
class PackingPlan:
    """Where each sequence of a packed [B, N] batch lies: ``index`` [S, L] the flat positions b * N + n of its
    tokens (L the longest sequence; 0 past a sequence's end), ``valid`` [S, L] which entries are tokens."""

    index: Tensor
    valid: Tensor
    shape: tuple[int, int]

    def unpack(self, t: Tensor, dim: int = 1) -> Tensor:
        """A tensor with the batch B first and the N tokens at ``dim`` -> the batch of sequences S first and
        their L tokens at ``dim``, zeros past each sequence's end."""
        moved = t.movedim(dim, 1)
        flat = moved.reshape(-1, *moved.shape[2:])[self.index]  # [S, L, ...]
        flat = flat.masked_fill(~self.valid.view(*self.valid.shape, *([1] * (flat.dim() - 2))), 0)
        return flat.movedim(1, dim)

    def repack(self, t: Tensor, dim: int = 1) -> Tensor:
        """The inverse of :meth:`unpack`: [S, ..., L at ``dim``, ...] back to the packed [B, ..., N, ...]."""
        moved = t.movedim(dim, 1)
        b, n = self.shape
        out = moved.new_zeros(b * n, *moved.shape[2:]).index_put((self.index[self.valid],), moved[self.valid])
        return out.view(b, n, *moved.shape[2:]).movedim(1, dim)


def packing_plan(segments: Tensor) -> PackingPlan:
    """The :class:`PackingPlan` of [B, N] sequence ids (:func:`segment_ids`): a sequence is a run of equal ids
    within one row."""
    b, n = segments.shape
    starts = torch.ones_like(segments, dtype=torch.bool)
    starts[:, 1:] = segments[:, 1:] != segments[:, :-1]
    sequence = starts.flatten().cumsum(0) - 1  # [B * N]: the sequence of each token, counted over the batch
    lengths = torch.bincount(sequence)
    first = lengths.cumsum(0) - lengths
    offset = torch.arange(b * n, device=segments.device) - first[sequence]
    count, longest = lengths.numel(), int(lengths.max())
    index = torch.zeros(count, longest, dtype=torch.long, device=segments.device)
    valid = torch.zeros(count, longest, dtype=torch.bool, device=segments.device)
    index[sequence, offset] = torch.arange(b * n, device=segments.device)
    valid[sequence, offset] = True
    return PackingPlan(index, valid, (b, n))


def _spec_of(fn: Callable[..., Any]) -> str | None:
    for name in available():
        if get_spec(name).functional is fn:
            return name
    return None


def packed_call(fn: Callable[..., Tensor], *args: Any, cu_seqlens: Tensor | None = None,
                position_ids: Tensor | None = None, **kwargs: Any) -> Tensor:
    """A functional form ``fn(query, key, value, attention_mask=None, **options)`` on a packed batch: its sequence
    tensors (the positional parameters before ``attention_mask``, [B, H, N, Dh]) and any keyword tensor laid out
    per token ([B, H, N, *]) are unpacked, ``fn`` runs on the batch of sequences and its output [B, H, N, Dv] is
    packed again. ``attention_mask`` ([B, N], optional) still marks padding inside the packed row."""
    signature = inspect.signature(fn)
    bound = signature.bind(*args, **kwargs)
    names = list(signature.parameters)
    sequence_names = names[: names.index("attention_mask")]
    first = bound.arguments[sequence_names[0]]
    if not isinstance(first, Tensor) or first.dim() != 4:
        got = list(first.shape) if isinstance(first, Tensor) else type(first).__name__
        raise AttentionError(f"{sequence_names[0]} must be [B, H, N, Dh], got {got}")
    b, n = first.shape[0], first.shape[2]
    name = _spec_of(fn)
    if name is not None:
        check_packable(name, {k: v for k, v in bound.arguments.items() if k not in sequence_names})
    segments = segment_ids(cu_seqlens=cu_seqlens, position_ids=position_ids, shape=(b, n),
                           attention_mask=bound.arguments.get("attention_mask"))
    plan = packing_plan(segments.to(first.device))
    for key, value in list(bound.arguments.items()):
        per_token = isinstance(value, Tensor) and value.dim() == 4 and value.shape[0] == b and value.shape[2] == n
        if key in sequence_names or per_token:
            bound.arguments[key] = plan.unpack(value, dim=2)
    mask = bound.arguments.get("attention_mask")
    bound.arguments["attention_mask"] = plan.valid if mask is None else plan.valid & plan.unpack(mask)
    out = fn(*bound.args, **bound.kwargs)
    return plan.repack(out, dim=2)


def forward_packed(module: AttentionBase, x: Tensor, *, cu_seqlens: Tensor | None = None,
                   position_ids: Tensor | None = None, attention_mask: Tensor | None = None,
                   layer_state: dict | None = None) -> Tensor:
    """:meth:`AttentionBase.forward_packed`."""
    check_packable(module.name, module)
    if not isinstance(x, Tensor) or x.dim() != 3:
        raise AttentionError(f"input must be [B, N, dim], got {getattr(x, 'shape', type(x).__name__)}")
    segments = segment_ids(cu_seqlens=cu_seqlens, position_ids=position_ids, shape=tuple(x.shape[:2]),
                           attention_mask=attention_mask)
    plan = packing_plan(segments.to(x.device))
    mask = plan.valid if attention_mask is None else plan.valid & plan.unpack(attention_mask)
    return plan.repack(module(plan.unpack(x), mask, layer_state))
