"""Sequence-parallel forms against the single-process layer, with 2 and 3 gloo processes on CPU.

Every rank builds the same float64 layer and input (same seed), runs it whole as the reference,
then a copy on its shard through longattn.parallel; outputs, input gradients and the parameter
gradients (summed over the ranks) must match. Lengths are odd; one scenario cuts the sequence
unevenly without a mask, the other uses shard_sequence (padding on the last rank) and a mask
with padding inside the sequence too.
"""

from __future__ import annotations

import copy
import datetime

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from longattn import attention
from longattn.attention.base import AttentionError
from longattn.parallel import count_communication, gather_sequence, parallel_forms, sequence_parallel, shard_sequence

DIM, HEADS, LENGTH, BATCH = 8, 2, 37, 2

#: (label, mechanism, build options, training mode)
CASES = [
    ("skeleton", "skeleton", dict(max_len=64, s1=12, s2=3, dropout=0.0, smoother_dropout=0.0), True),
    ("skeleton-eval-valid", "skeleton", dict(max_len=40, s1=40, s2=4, column_scale="valid", smoother_kernel_size=5), False),
    ("skeleton-no-smoother", "skeleton", dict(max_len=64, smoother=False, mask_padded_samples=False), False),
    ("singular", "singular", dict(rank=5), True),
    ("singular-unshared", "singular", dict(rank=3, shared_factors=False), True),
    ("nystrom", "nystrom", dict(num_landmarks=8, conv_kernel=5), False),
    ("linear", "linear", {}, False),
    ("linear-causal", "linear", dict(causal=True), False),
    ("performer", "performer", dict(nb_features=16), True),
    ("performer-causal", "performer", dict(causal=True, nb_features=16), False),
    ("cosformer", "cosformer", {}, False),
    ("cosformer-causal", "cosformer", dict(causal=True, max_positions=50, chunk_size=4), False),
    ("linformer", "linformer", dict(max_len=45, k=6), True),
    ("linformer-unshared-heads", "linformer", dict(max_len=40, k=5, headwise=False, share_kv=True), False),
    ("softmax", "softmax", {}, False),
    ("softmax-causal", "softmax", dict(causal=True), False),
]


def _uneven_lengths(world: int) -> list[int]:
    lengths = [LENGTH // world + (2 if r == 0 else -1 if r == 1 else 0) for r in range(world)]
    lengths[-1] += LENGTH - sum(lengths)
    return lengths


def _check_case(label: str, name: str, options: dict, training: bool, padded: bool) -> str | None:
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(1)
    options = dict(options)
    layer = attention.build(name, dim=DIM, heads=HEADS, max_len=options.pop("max_len", None),
                            causal=options.pop("causal", False), **options).double().train(training)
    x = torch.randn(BATCH, LENGTH, DIM, dtype=torch.float64)
    if padded:
        mask = torch.ones(BATCH, LENGTH, dtype=torch.bool)
        mask[1, -6:] = False
        mask[1, 3] = mask[0, LENGTH // 2] = False
        x_local, mask_local = shard_sequence(x, mask)
        part = x_local.shape[1]
        x_whole = torch.cat((x, x.new_zeros(BATCH, part * world - LENGTH, DIM)), 1)
        mask_whole = torch.cat((mask, mask.new_zeros(BATCH, part * world - LENGTH)), 1)
        start = rank * part
    else:
        lengths = _uneven_lengths(world)
        start, part = sum(lengths[:rank]), lengths[rank]
        x_whole, mask_whole, mask_local = x, None, None
        x_local = x[:, start : start + part]
    cotangent = torch.randn(x_whole.shape, dtype=torch.float64)

    reference = copy.deepcopy(layer)
    x_ref = x_whole.clone().requires_grad_()
    out_ref = reference(x_ref, mask_whole)
    loss = (out_ref * cotangent).sum() + sum(attention.collect_aux_losses(reference).values())
    loss.backward()

    if padded:  # padded contents never matter, not even NaN
        x_local = x_local.masked_fill(~mask_local.unsqueeze(-1), float("nan"))
    x_mine = x_local.clone().requires_grad_()
    sharded = sequence_parallel(layer)
    out = sharded(x_mine, mask_local)
    local_loss = (out * cotangent[:, start : start + part]).sum() + sum(attention.collect_aux_losses(layer).values())
    local_loss.backward()
    problems = []
    try:
        torch.testing.assert_close(out, out_ref[:, start : start + part].detach(), rtol=1e-9, atol=1e-10)
    except AssertionError as e:
        problems.append(f"output: {e}")
    try:
        torch.testing.assert_close(x_mine.grad, x_ref.grad[:, start : start + part], rtol=1e-9, atol=1e-10)
    except AssertionError as e:
        problems.append(f"input gradient: {e}")
    for (pname, p_ref), p in zip(reference.named_parameters(), layer.parameters()):
        grad = torch.zeros_like(p) if p.grad is None else p.grad.clone()
        dist.all_reduce(grad)
        try:
            torch.testing.assert_close(grad, torch.zeros_like(p_ref) if p_ref.grad is None else p_ref.grad,
                                       rtol=1e-9, atol=1e-10)
        except AssertionError as e:
            problems.append(f"gradient of {pname}: {e}")
    return f"{label} ({'padded' if padded else 'uneven'}) rank {rank}: " + "; ".join(problems) if problems else None


def _worker(rank: int, world: int, init_file: str) -> None:
    torch.set_num_threads(1)
    # a short timeout turns a mismatched collective into an error instead of a hang
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=60))
    try:
        failures = [f for case in CASES for padded in (False, True) if (f := _check_case(*case, padded))]
        assert not failures, "\n".join(failures)
        _check_helpers_and_errors()
        _check_inside_ddp()
    finally:
        dist.destroy_process_group()


def _check_helpers_and_errors() -> None:
    world = dist.get_world_size()
    x = torch.randn(BATCH, LENGTH, DIM)
    x_local, mask_local = shard_sequence(x)
    assert mask_local.all() or dist.get_rank() == world - 1
    torch.testing.assert_close(gather_sequence(x_local, LENGTH), x)
    # communication of the sketch forms does not depend on N
    torch.manual_seed(0)
    layer = attention.build("skeleton", dim=DIM, heads=HEADS, max_len=256, dropout=0.0)
    sharded = sequence_parallel(layer)
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


def _check_inside_ddp() -> None:
    """DDP over the sequence-parallel group averages gradients: with each rank's loss scaled by the
    group size the parameters get the single-process gradients."""
    from torch.nn.parallel import DistributedDataParallel

    world = dist.get_world_size()
    torch.manual_seed(2)
    layer = attention.build("nystrom", dim=DIM, heads=HEADS, num_landmarks=4, conv_kernel=3).double()
    reference = copy.deepcopy(layer)
    x = torch.randn(BATCH, LENGTH, DIM, dtype=torch.float64)
    x_local, mask_local = shard_sequence(x)
    pad = x_local.shape[1] * world - LENGTH  # the reference sees the same padded sequence
    mask = torch.arange(LENGTH + pad).expand(BATCH, -1) < LENGTH
    reference(torch.cat((x, x.new_zeros(BATCH, pad, DIM)), 1), mask).square().sum().backward()
    model = DistributedDataParallel(sequence_parallel(layer))
    (model(x_local, mask_local).square().sum() * world).backward()
    for (pname, p_ref), p in zip(reference.named_parameters(), layer.parameters()):
        torch.testing.assert_close(p.grad, p_ref.grad, rtol=1e-9, atol=1e-10, msg=lambda m: f"{pname}: {m}")


@pytest.mark.parametrize("world", [2, 3])
def test_sequence_parallel_matches_single_process(world: int, tmp_path) -> None:
    mp.spawn(_worker, args=(world, str(tmp_path / "init")), nprocs=world, join=True)


def test_capabilities_match_forms() -> None:
    declared = sorted(n for n in attention.available() if attention.capabilities(n).sequence_parallel)
    assert declared == parallel_forms()


def test_needs_a_process_group() -> None:
    layer = attention.build("linear", dim=DIM, heads=HEADS)
    with pytest.raises(AttentionError, match="process group"):
        sequence_parallel(layer)(torch.randn(1, 5, DIM))
