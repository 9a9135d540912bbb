"""Sequence-parallel forms against the single-process layer, on gloo process groups of 1 to 4 CPU processes.

Every rank builds the same float64 layer and input (same seed) and runs it whole as the reference, then the
same layer on its shard through longattn.parallel; outputs, input gradients and the parameter gradients
(summed over the ranks) must match. One process group per group size serves the sequence lengths N from 1
to 70 (shard_sequence's cut, lengths not divisible by the group and fewer tokens than ranks included) and
every case, with padding inside the sequence and at its end; another scenario cuts the sequence unevenly by
hand. Then the ranks are given mismatched inputs: every mismatch must be one clear error naming the rank, on
every rank, and a rank that never comes must time out into one.
"""

from __future__ import annotations

import copy
import datetime
import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from longattn import attention
from longattn.attention.base import AttentionError
from longattn.parallel import count_communication, gather_sequence, parallel_forms, sequence_parallel, shard_sequence
from longattn.parallel.api import shard_bounds
from reliability import CLEAR_ERROR, CORRECT_RESULT, SEQUENCE_PARALLEL, SP_LENGTHS, bad_input

DIM, HEADS, BATCH = 8, 2, 2
# every N to 12 (three of each remainder modulo 2, 3 and 4, with fewer tokens than ranks), then lengths past the
# sketches' sample counts (skeleton's s1 = 40) up to 70
LENGTHS = (*range(1, 13), 29, 37, 41, 46, 53, 59, 67, 70)
UNEVEN = 37  # the hand-cut scenario's length
WORLDS = (1, 2, 3, 4)

#: (label, mechanism, build options, training mode)
CASES = [
    ("skeleton", "skeleton", dict(max_len=80, s1=12, s2=3, dropout=0.0, smoother_dropout=0.0), True),
    ("skeleton-eval-valid", "skeleton", dict(max_len=80, s1=40, s2=4, column_scale="valid", smoother_kernel_size=5),
     False),
    ("skeleton-no-smoother", "skeleton", dict(max_len=80, smoother=False, mask_padded_samples=False), False),
    ("singular", "singular", dict(rank=5), True),
    ("singular-unshared", "singular", dict(rank=3, shared_factors=False), True),
    ("nystrom", "nystrom", dict(num_landmarks=8, conv_kernel=5), False),
    ("linear", "linear", {}, False),
    ("linear-causal", "linear", dict(causal=True), False),
    ("performer", "performer", dict(nb_features=16), True),
    ("performer-causal", "performer", dict(causal=True, nb_features=16), False),
    ("cosformer", "cosformer", {}, False),
    ("cosformer-causal", "cosformer", dict(causal=True, chunk_size=4), False),
    ("linformer", "linformer", dict(max_len=80, k=6), True),
    ("linformer-unshared-heads", "linformer", dict(max_len=80, k=5, headwise=False, share_kv=True), False),
    ("softmax", "softmax", {}, False),
    ("softmax-causal", "softmax", dict(causal=True), False),
]


def _build(name: str, options: dict, training: bool):
    torch.manual_seed(1)
    options = dict(options)
    return attention.build(name, dim=DIM, heads=HEADS, max_len=options.pop("max_len", None),
                           causal=options.pop("causal", False), **options).double().train(training)


def _mask(length: int) -> torch.Tensor:
    """Padding inside the sequence and at its end (never every token of a sequence)."""
    mask = torch.ones(BATCH, length, dtype=torch.bool)
    if length > 2:
        mask[1, length // 2] = False
        mask[1, -max(1, length // 6):] = False
    return mask


def _close(got: torch.Tensor, expected: torch.Tensor) -> bool:
    """Equal up to float64 rounding: within 1e-9 of the tensor's largest magnitude (sums over up to 70 tokens in
    another order; an error of the forms is of the order of the values themselves)."""
    scale = expected.abs().max().item() if expected.numel() else 0.0
    return got.shape == expected.shape and bool(((got - expected).abs() <= 1e-10 + 1e-9 * scale).all())


def _gradients(layer) -> torch.Tensor:
    """Every parameter gradient of ``layer`` in one flat tensor (zeros where there is none), then cleared."""
    flat = torch.cat([(torch.zeros_like(p) if p.grad is None else p.grad).flatten() for p in layer.parameters()])
    layer.zero_grad(set_to_none=True)
    return flat


def _inputs(length: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(length)
    x = torch.randn(BATCH, length, DIM, dtype=torch.float64, generator=g)
    cotangent = torch.randn(BATCH, length, DIM, dtype=torch.float64, generator=g)
    return x, cotangent, _mask(length)


def _chosen(world: int, length: int) -> list[str]:
    """One variant of every form for this (group size, N), rotating so that each variant meets every remainder
    of N modulo the group size (the quotient steps through the variants at a fixed remainder) and, where there
    are enough of them, the lengths shorter than the group (the remainder steps through them at quotient 0)."""
    forms: dict[str, list[str]] = {}
    for label, name, _, _ in CASES:
        forms.setdefault(name, []).append(label)
    return [variants[(length // world + length % world) % len(variants)] for variants in forms.values()]


def _reference(layer, length: int) -> dict[str, torch.Tensor]:
    """The single-process layer on the whole length-N sequence: output, input gradient, parameter gradients."""
    x, cotangent, mask = _inputs(length)
    x_ref = x.clone().requires_grad_()
    out_ref = layer(x_ref, mask)
    ((out_ref * cotangent).sum() + sum(attention.collect_aux_losses(layer).values())).backward()
    return {"out": out_ref.detach(), "x_grad": x_ref.grad, "grads": _gradients(layer)}


class _Checks:
    """The problems found on this rank; the parameter gradients, which are sums over the group's ranks, are
    kept and compared at the end with one all-reduce for all of them."""

    def __init__(self, group) -> None:
        self.group, self.problems, self.grads = group, [], []

    def compare(self, label: str, out, out_ref, x_grad, x_ref_grad, grads, grads_ref) -> None:
        self.problems += [f"{label}: {what} differs by "
                          f"{(got - expected).abs().max().item() if got.shape == expected.shape else got.shape}"
                          for what, got, expected in (("output", out, out_ref), ("input gradient", x_grad, x_ref_grad))
                          if not _close(got, expected)]
        self.grads.append((label, grads, grads_ref))

    def finish(self) -> list[str]:
        if self.grads:
            summed = torch.cat([grads for _, grads, _ in self.grads])
            dist.all_reduce(summed, group=self.group)
            for (label, grads, grads_ref), mine in zip(self.grads, summed.split([g.numel() for _, g, _ in self.grads])):
                if not _close(mine, grads_ref):
                    self.problems.append(f"{label}: parameter gradients differ by {(mine - grads_ref).abs().max().item()}")
        return self.problems


def _check_sharded(checks: _Checks, label: str, layer, length: int, reference: dict[str, torch.Tensor]) -> None:
    """``shard_sequence`` of a length-N sequence with padding: the shard's part of the whole layer's result."""
    group = checks.group
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    x, cotangent, mask = _inputs(length)
    start, end = shard_bounds(length, world, rank)
    x_local, mask_local = shard_sequence(x, mask, group)
    assert x_local.shape[1] == end - start
    x_local = x_local.masked_fill(~mask_local.unsqueeze(-1), float("nan"))  # padded contents never matter
    x_mine = x_local.clone().requires_grad_()
    out = sequence_parallel(layer, group)(x_mine, mask_local)
    local_loss = (out * cotangent[:, start:end]).sum() + sum(attention.collect_aux_losses(layer).values())
    local_loss.backward()
    checks.compare(f"{label} N={length} rank {rank}/{world}", out.detach(), reference["out"][:, start:end],
                   x_mine.grad, reference["x_grad"][:, start:end], _gradients(layer), reference["grads"])


def _check_hand_cut(checks: _Checks, label: str, layer) -> None:
    """Uneven shards cut by hand (no mask): rank 0 holds two tokens more, rank 1 one fewer."""
    group = checks.group
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    lengths = [UNEVEN // world + (2 if r == 0 else -1 if r == 1 else 0) for r in range(world)]
    lengths[-1] += UNEVEN - sum(lengths)
    start, part = sum(lengths[:rank]), lengths[rank]
    g = torch.Generator().manual_seed(0)
    x = torch.randn(BATCH, UNEVEN, DIM, dtype=torch.float64, generator=g)
    cotangent = torch.randn(BATCH, UNEVEN, DIM, dtype=torch.float64, generator=g)
    x_ref = x.clone().requires_grad_()
    out_ref = layer(x_ref)
    ((out_ref * cotangent).sum() + sum(attention.collect_aux_losses(layer).values())).backward()
    grads_ref = _gradients(layer)
    x_mine = x[:, start:start + part].clone().requires_grad_()
    out = sequence_parallel(layer, group)(x_mine)
    ((out * cotangent[:, start:start + part]).sum() + sum(attention.collect_aux_losses(layer).values())).backward()
    checks.compare(f"{label} hand-cut rank {rank}/{world}", out.detach(), out_ref[:, start:start + part].detach(),
                   x_mine.grad, x_ref.grad[:, start:start + part], _gradients(layer), grads_ref)


def _worker(rank: int, world: int, init_file: str) -> None:
    """One process group of the largest size; a subgroup of its first ranks for every size of WORLDS (so that
    the processes start once). Ranks outside a subgroup wait at a barrier while it runs."""
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=120))
    try:
        groups = {size: dist.new_group(list(range(size))) for size in WORLDS}
        expected = _references(rank, world)
        layers = {label: _build(name, options, training) for label, name, options, training in CASES}
        failures = []
        for size, group in groups.items():
            if rank < size:
                checks = _Checks(group)
                for length in LENGTHS:
                    for label in _chosen(size, length):
                        _check_sharded(checks, label, layers[label], length, expected[f"{label} {length}"])
                if size > 1:
                    for label, layer in layers.items():
                        _check_hand_cut(checks, label, layer)
                failures += checks.finish()
                if size in (2, 3):
                    _check_helpers_and_errors(group)
                    _check_inside_ddp(group)
            dist.barrier()
        assert not failures, f"{len(failures)} failures:\n" + "\n".join(failures[:20])
    finally:
        dist.destroy_process_group()


def _check_helpers_and_errors(group) -> None:
    world = dist.get_world_size(group)
    x = torch.randn(BATCH, UNEVEN, DIM, generator=torch.Generator().manual_seed(3))  # the same on every rank
    x_local, mask_local = shard_sequence(x, group=group)
    assert mask_local.all()
    torch.testing.assert_close(gather_sequence(x_local, UNEVEN, group), x)
    # communication of the sketch forms does not depend on N
    torch.manual_seed(0)
    layer = attention.build("skeleton", dim=DIM, heads=HEADS, max_len=256, dropout=0.0)
    sharded = sequence_parallel(layer, group)
    sizes = []
    for length in (24, 240):
        with count_communication() as log:
            sharded(torch.randn(1, length // world, DIM, requires_grad=True)).sum().backward()
        sizes.append((log.forward_bytes, log.backward_bytes))
    assert sizes[0] == sizes[1] and sizes[0][1] > 0, sizes
    with pytest.raises(AttentionError, match="no sequence-parallel form"):
        sequence_parallel(attention.build("bigbird", dim=DIM, heads=HEADS))
    with pytest.raises(AttentionError, match="exceeds max_len"):
        sharded(torch.randn(1, 200, DIM))


def _check_inside_ddp(group) -> None:
    """DDP over the sequence-parallel group averages gradients: with each rank's loss scaled by the
    group size the parameters get the single-process gradients."""
    from torch.nn.parallel import DistributedDataParallel

    world = dist.get_world_size(group)
    torch.manual_seed(2)
    layer = attention.build("nystrom", dim=DIM, heads=HEADS, num_landmarks=4, conv_kernel=3).double()
    reference = copy.deepcopy(layer)
    x = torch.randn(BATCH, UNEVEN, DIM, dtype=torch.float64)
    reference(x).square().sum().backward()
    x_local, mask_local = shard_sequence(x, group=group)
    model = DistributedDataParallel(sequence_parallel(layer, group), process_group=group)
    (model(x_local, mask_local).square().sum() * world).backward()
    for (pname, p_ref), p in zip(reference.named_parameters(), layer.parameters()):
        torch.testing.assert_close(p.grad, p_ref.grad, rtol=1e-9, atol=1e-10, msg=lambda m: f"{pname}: {m}")


def _references(rank: int, world: int) -> dict[str, dict[str, torch.Tensor]]:
    """The single-process results of every (variant, N) the group sizes check, each computed once: every rank
    computes its share, then they exchange them."""
    layers = {label: _build(name, options, training) for label, name, options, training in CASES}
    wanted = sorted({(label, length) for size in WORLDS for length in LENGTHS for label in _chosen(size, length)})
    mine = {f"{label} {length}": _reference(layers[label], length) for label, length in wanted[rank::world]}
    shares: list = [None] * world
    dist.all_gather_object(shares, mine)
    return {key: value for share in shares for key, value in share.items()}


def test_rotation_meets_every_remainder_with_every_variant() -> None:
    met: dict[tuple[int, str], set[int]] = {}
    for world in WORLDS:
        for length in LENGTHS:
            for label in _chosen(world, length):
                met.setdefault((world, label), set()).add(length % world)
    assert len(met) == len(WORLDS) * len(CASES)
    assert all(len(remainders) == world for (world, _), remainders in met.items())


@bad_input(SP_LENGTHS, CORRECT_RESULT, cases=sum(1 for world in WORLDS for n in LENGTHS if n % world))
def test_sequence_parallel_matches_single_process_for_every_length(tmp_path) -> None:
    mp.spawn(_worker, args=(max(WORLDS), str(tmp_path / "init")), nprocs=max(WORLDS), join=True)


def test_capabilities_match_forms() -> None:
    declared = sorted(n for n in attention.available() if attention.capabilities(n).sequence_parallel)
    assert declared == parallel_forms()


def test_needs_a_process_group() -> None:
    layer = attention.build("linear", dim=DIM, heads=HEADS)
    with pytest.raises(AttentionError, match="process group"):
        sequence_parallel(layer)(torch.randn(1, 5, DIM))


def test_shards_cover_the_sequence_in_order() -> None:
    for world in WORLDS:
        for length in range(0, 12):
            bounds = [shard_bounds(length, world, rank) for rank in range(world)]
            assert bounds[0][0] == 0 and bounds[-1][1] == length
            assert all(a[1] == b[0] for a, b in zip(bounds, bounds[1:]))
            sizes = [end - start for start, end in bounds]
            assert max(sizes) - min(sizes) <= 1 and sizes == sorted(sizes, reverse=True)


# ----------------------------------------------------------------------------- ranks that do not agree

def _layer(**options):
    torch.manual_seed(0)
    return attention.build(options.pop("name", "linear"), dim=DIM, heads=HEADS, **options).double()


def _x(rank_one=None, **kwargs):
    """A 5-token shard, or ``rank_one``'s on rank 1."""
    x = torch.randn(BATCH, 5, DIM, dtype=torch.float64)
    return rank_one if dist.get_rank() == 1 and rank_one is not None else x


def _performer_redrawing_on_rank_1():
    layer = _layer(name="performer", nb_features=8, redraw_interval=3).train()
    if dist.get_rank() == 1:
        layer.calls_since_redraw.fill_(3)  # rank 1 redraws its features, rank 0 does not: the ranks desync
    return sequence_parallel(layer)(_x())


#: (the call every rank makes, what its error must say on rank 0, on rank 1)
MISMATCHES = {
    "dtype": (lambda: sequence_parallel(_layer())(_x(torch.randn(BATCH, 5, DIM))),
              r"rank 1's input check: failed its checks", r"input dtype torch.float32 differs from the torch.float64"),
    "batch size": (lambda: sequence_parallel(_layer())(_x(torch.randn(3, 5, DIM, dtype=torch.float64))),
                   r"rank 1's batch size is 3, rank 0's 2", r"rank 1's batch size is 3, rank 0's 2"),
    "feature size": (lambda: sequence_parallel(_layer())(_x(torch.randn(BATCH, 5, DIM + 1, dtype=torch.float64))),
                     r"rank 1's input check: failed", r"input feature size 9 does not match dim=8"),
    "layer options": (lambda: sequence_parallel(_layer(name="linformer", max_len=40,
                                                       k=6 if dist.get_rank() == 0 else 5))(_x()),
                      r"rank 1 runs another layer than rank 0", r"rank 1 runs another layer"),
    "mask on one rank only": (lambda: sequence_parallel(_layer())(
        _x(), torch.ones(BATCH, 5, dtype=torch.bool) if dist.get_rank() == 1 else None),
        r"rank 1's mask: given, rank 0's: not given", r"rank 1's mask"),
    "training mode": (lambda: sequence_parallel(_layer().train(dist.get_rank() == 1))(_x()),
                      r"rank 1's training mode: on, rank 0's: off", r"rank 1's training mode"),
    "collectives out of step": (_performer_redrawing_on_rank_1,
                                r"before (broadcast features|all_reduce max): rank 1's collective is broadcast features, "
                                r"rank 0's all_reduce max", r"rank 1's collective is broadcast features"),
    "gathered shards of another width": (lambda: gather_sequence(_x(torch.randn(BATCH, 5, DIM + 2,
                                                                                dtype=torch.float64))),
                                         r"before all_gather: rank 1's size of dimension 2 is 10, rank 0's 8",
                                         r"rank 1's size of dimension 2 is 10"),
}


def _weights_on_rank_1(after_load: bool):
    """Rank 1's layer holds other weights: from the start, or after a load_state_dict between two calls."""
    layer = _layer()
    other = {name: t + 0.5 for name, t in layer.state_dict().items()}
    if after_load:
        sequence_parallel(layer)(_x())  # equal weights: no error
    if dist.get_rank() == 1:
        layer.load_state_dict(other)
    return sequence_parallel(layer)(_x())


MISMATCHES.update({
    "weights": (lambda: _weights_on_rank_1(False), r"rank 1's layer holds other weights than rank 0's",
                r"rank 1's layer holds other weights"),
    "weights after load_state_dict": (lambda: _weights_on_rank_1(True), r"rank 1's layer holds other weights",
                                      r"rank 1's layer holds other weights"),
})
TIMEOUT_S = 3


def _mismatch_worker(rank: int, world: int, init_file: str, results: str) -> None:
    import json

    torch.set_num_threads(1)
    os.environ["LONGATTN_DIST_TIMEOUT_S"] = str(TIMEOUT_S)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=60))
    seen = {}
    try:
        for name, (call, *_) in MISMATCHES.items():
            torch.manual_seed(5)
            try:
                call()
                seen[name] = "no error"
            except AttentionError as error:
                seen[name] = f"{type(error).__name__}: {error}"
        # a rank that never comes to the collective: the other one's wait is bounded
        if rank == 0:
            try:
                sequence_parallel(_layer())(_x())
                seen["a rank that does not come"] = "no error"
            except AttentionError as error:
                seen["a rank that does not come"] = f"{type(error).__name__}: {error}"
        else:
            import time

            time.sleep(TIMEOUT_S + 3)
    finally:
        with open(f"{results}.{rank}", "w") as handle:
            json.dump(seen, handle)


@bad_input(SEQUENCE_PARALLEL, CLEAR_ERROR, cases=len(MISMATCHES) + 1)
def test_mismatched_ranks_get_one_clear_error_each_and_a_missing_rank_times_out(tmp_path) -> None:
    import json

    mp.spawn(_mismatch_worker, args=(2, str(tmp_path / "init"), str(tmp_path / "seen")), nprocs=2, join=True)
    seen = [json.loads((tmp_path / f"seen.{rank}").read_text()) for rank in (0, 1)]
    import re

    for name, (_, on_rank_0, on_rank_1) in MISMATCHES.items():
        assert re.search(on_rank_0, seen[0][name]), (name, seen[0][name])
        assert re.search(on_rank_1, seen[1][name]), (name, seen[1][name])
    assert re.search(rf"rank 0: the sequence-parallel lengths did not complete within {TIMEOUT_S} s: another rank of "
                     "the group is hung, stopped, or is not running this layer",
                     seen[0]["a rank that does not come"]), seen[0]["a rank that does not come"]
