import pytest
import torch
from gpu_path_checks import KERNEL_DEVICE, running_kernels

from longattn.attention import force_path, reformer
from longattn.attention.base import AttentionError
from longattn.attention.reformer import hash_buckets, hash_buckets_blocked, lsh_attention, lsh_attention_reference, num_buckets
from longattn.testing import LargestTensorRecorder


def inputs(n, rounds, bucket_size, d=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    qk = torch.randn(2, 2, n, d, generator=g, dtype=torch.float64, requires_grad=True)
    v = torch.randn(2, 2, n, d, generator=g, dtype=torch.float64, requires_grad=True)
    rot = torch.randn(d, rounds, num_buckets(n, bucket_size) // 2, generator=g, dtype=torch.float64)
    return qk, v, rot


@pytest.mark.parametrize("n", [5, 37, 64])
@pytest.mark.parametrize("across", [False, True])
@pytest.mark.parametrize("causal", [False, True])
def test_chunked_sort_matches_dense_pattern(n, across, causal):
    qk, v, rot = inputs(n, rounds=3, bucket_size=8)
    mask = torch.rand(2, n, generator=torch.Generator().manual_seed(1)) > 0.25
    kw = dict(rotations=rot, bucket_size=8, attend_across_buckets=across, is_causal=causal)
    out, ref = lsh_attention(qk, v, mask, **kw), lsh_attention_reference(qk, v, mask, **kw)
    torch.testing.assert_close(out, ref)
    g = torch.randn_like(out)
    for a, r in zip(torch.autograd.grad(out, (qk, v), g), torch.autograd.grad(ref, (qk, v), g)):
        torch.testing.assert_close(a, r)


@pytest.mark.parametrize("block_elements", [1, 2 * 8 * 8 * 2, 2 * 8 * 8 * 5])
@pytest.mark.parametrize("across", [False, True])
@pytest.mark.parametrize("causal", [False, True])
def test_blocks_of_chunks_match_the_dense_pattern(monkeypatch, block_elements, across, causal):
    """Blocks of 1, 2 and 5 chunks: blocks that start a head, wrap its look-back and end mid-round."""
    monkeypatch.setattr(reformer, "BLOCK_ELEMENTS", block_elements)
    qk, v, rot = inputs(61, rounds=3, bucket_size=8)  # 8 chunks per round, 24 per head
    mask = torch.rand(2, 61, generator=torch.Generator().manual_seed(2)) > 0.2
    kw = dict(rotations=rot, bucket_size=8, attend_across_buckets=across, is_causal=causal)
    out, ref = lsh_attention(qk, v, mask, **kw), lsh_attention_reference(qk, v, mask, **kw)
    torch.testing.assert_close(out, ref)
    g = torch.randn_like(out)
    for a, r in zip(torch.autograd.grad(out, (qk, v), g), torch.autograd.grad(ref, (qk, v), g)):
        torch.testing.assert_close(a, r)


def assert_matches_reference(qk, v, mask, **kw):
    out, ref = lsh_attention(qk, v, mask, **kw), lsh_attention_reference(qk, v, mask, **kw)
    torch.testing.assert_close(out, ref)
    g = torch.randn_like(out)
    for a, r in zip(torch.autograd.grad(out, (qk, v), g), torch.autograd.grad(ref, (qk, v), g)):
        torch.testing.assert_close(a, r)


@pytest.mark.parametrize("chunks_per_block", [1, 7, 31, 10_000])
@pytest.mark.parametrize("causal", [False, True])
def test_blocks_across_heads_at_the_forecasters_settings(monkeypatch, chunks_per_block, causal):
    """Bucket size 4 and 4 hashes (the Reformer forecaster's) on an odd length: blocks of chunks that cut
    heads anywhere (7, 31 chunks), one chunk, and one block for everything all match the dense reference."""
    m, rounds, n = 4, 4, 45  # padded to 48: 12 chunks per round, 48 per head, 4 (b, h) heads
    monkeypatch.setattr(reformer, "BLOCK_ELEMENTS", 2 * m * m * chunks_per_block)
    seen = []
    blocks = reformer._SlotLayout.blocks
    monkeypatch.setattr(reformer._SlotLayout, "blocks", lambda layout: seen.append(blocks(layout)) or seen[-1])
    qk, v, rot = inputs(n, rounds=rounds, bucket_size=m)
    mask = torch.rand(2, n, generator=torch.Generator().manual_seed(3)) > 0.2
    assert_matches_reference(qk, v, mask, rotations=rot, bucket_size=m, is_causal=causal)
    chunks_per_head, heads = rounds * 48 // m, 4
    forward_blocks = seen[0]
    assert forward_blocks[-1][1] == chunks_per_head * heads
    assert len(forward_blocks) == -(-chunks_per_head * heads // chunks_per_block)
    straddling = [(a, b) for a, b in forward_blocks if a // chunks_per_head != (b - 1) // chunks_per_head]
    assert bool(straddling) == (chunks_per_block > 1)


@pytest.mark.parametrize("causal", [False, True])
def test_rounds_gathered_and_summed_in_groups_of_heads_give_the_same_output(monkeypatch, causal):
    """The forward pass un-sorts the slots and sums the rounds a group of (batch, head) pairs at a time: groups of
    1, 2 and 3 of 5 pairs (a shorter last group) and one group give the same output bit for bit, under no_grad
    as with gradients, and match the dense reference, at the forecaster's bucket size 4 and 4 hashes on an odd
    length with padding."""
    m, rounds, n, d = 4, 4, 45, 8
    g = torch.Generator().manual_seed(9)
    qk, v = (torch.randn(5, 1, n, d, generator=g, dtype=torch.float64) for _ in range(2))
    rot = torch.randn(d, rounds, num_buckets(n, m) // 2, generator=g, dtype=torch.float64)
    mask = torch.rand(5, n, generator=g) > 0.2
    kw = dict(rotations=rot, bucket_size=m, is_causal=causal)
    groups_seen, head_groups = [], reformer._SlotLayout.head_groups
    outputs = []
    for per_group in (1, 2, 3, 5):
        monkeypatch.setattr(reformer._SlotLayout, "head_groups", lambda layout, width, size=per_group: [
            (first, min(first + size, layout.heads_total)) for first in range(0, layout.heads_total, size)])
        with torch.no_grad():
            outputs.append(lsh_attention(qk, v, mask, **kw))
        qk.requires_grad_(), v.requires_grad_()
        assert torch.equal(lsh_attention(qk, v, mask, **kw).detach(), outputs[-1])
        qk, v = qk.detach(), v.detach()
    assert all(torch.equal(out, outputs[-1]) for out in outputs[:-1])
    monkeypatch.setattr(reformer._SlotLayout, "head_groups",
                        lambda layout, width: groups_seen.append(head_groups(layout, width)) or groups_seen[-1])
    assert_matches_reference(qk.requires_grad_(), v.requires_grad_(), mask, **kw)
    assert groups_seen[0] == [(0, 5)]  # the block budget holds all five pairs' slots here


@pytest.mark.parametrize("rounds, n, m", [(1, 8, 8), (3, 8, 8), (2, 16, 8)])
def test_one_or_two_chunks_per_round(rounds, n, m):
    """No look-back (one chunk per head), every chunk looking back into the previous round (one chunk per
    round: the same tokens), and two chunks per head looking back to each other."""
    qk, v, rot = inputs(n, rounds=rounds, bucket_size=m)
    for across in (False, True):
        assert_matches_reference(qk, v, None, rotations=rot, bucket_size=m, attend_across_buckets=across)


def test_a_token_with_no_other_target_attends_to_itself_and_gets_no_score_gradient():
    """One round, two tokens, two buckets: each token is alone in its bucket, so it can only see itself."""
    qk = torch.tensor([[[[1.0, 0.0], [-1.0, 0.0]]]], dtype=torch.float64, requires_grad=True)
    v = torch.tensor([[[[1.0, 2.0], [3.0, 4.0]]]], dtype=torch.float64, requires_grad=True)
    rot = torch.tensor([[[1.0]], [[0.0]]], dtype=torch.float64)  # bucket 0 for x > 0, 1 for x < 0
    out = lsh_attention(qk, v, rotations=rot, bucket_size=1)
    torch.testing.assert_close(out, v.detach())
    grad_qk, = torch.autograd.grad(out.sum(), qk)
    torch.testing.assert_close(grad_qk, torch.zeros_like(qk))


@pytest.mark.parametrize("block_elements", [1, 100, 1 << 18])
def test_blocked_hashing_equals_argmax_over_both_signs(monkeypatch, block_elements):
    monkeypatch.setattr(reformer, "BLOCK_ELEMENTS", block_elements)
    x = torch.randn(2, 3, 50, 8)
    x[:, :, 7] = 0.0  # all projections tie at zero: both must pick bucket 0
    rot = torch.randn(8, 4, 5)
    assert torch.equal(hash_buckets_blocked(x, rot), hash_buckets(x, rot))


@pytest.mark.parametrize("half", [6, reformer.VECTOR_ARGMAX_MIN_HALF, 51])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_blocked_hashing_with_exact_ties_equals_argmax_over_both_signs(half, dtype):
    """Ties within xR (equal rotation columns), between xR and -xR (a negated column: the first half wins),
    zero rows; float32 and float64 with few projections (max / min with indices) and many (the float passes),
    bfloat16 (max / min with indices): the same buckets as argmax over [xR; -xR]."""
    g = torch.Generator().manual_seed(5)
    x = torch.randn(2, 3, 40, 8, generator=g, dtype=dtype)
    x[:, :, 3] = 0.0
    rot = torch.randn(8, 3, half, generator=g, dtype=dtype)
    rot[:, :, 4] = rot[:, :, 1]  # xR_4 == xR_1: the first of them
    rot[:, :, 5] = -rot[:, :, 2]  # xR_5 == -xR_2: bucket 5 over bucket half + 2 when that value wins
    buckets = hash_buckets_blocked(x, rot)
    assert torch.equal(buckets, hash_buckets(x, rot))
    assert (buckets == 4).sum() == 0 and (buckets == half + 2).sum() == 0 and (buckets == half + 5).sum() == 0
    assert (buckets[:, :, :, 3] == 0).all()


def test_blocked_hashing_of_nan_rows_takes_the_indexed_max_and_min():
    """A NaN projection equals nothing; such blocks take max / min with indices (NaN wins both), as before."""
    half = reformer.VECTOR_ARGMAX_MIN_HALF
    x = torch.randn(1, 1, 6, 4)
    x[0, 0, 2, 1] = float("nan")
    rot = torch.randn(4, 2, half)
    rotated = torch.einsum("bhnd,drk->bhrnk", x, rot)
    high, arg_high = rotated.max(-1)
    low, arg_low = rotated.min(-1)
    assert torch.equal(hash_buckets_blocked(x, rot), torch.where(high >= -low, arg_high, arg_low + half))


@pytest.mark.parametrize("block_elements", [2 * 8 * 8 * 2, 1 << 18])
@pytest.mark.parametrize("across", [False, True])
@pytest.mark.parametrize("causal", [False, True])
def test_weights_kept_for_backward_give_the_recomputed_gradients(monkeypatch, block_elements, across, causal):
    """Weights kept by the forward pass (KEEP_WEIGHTS_ELEMENTS) or recomputed in backward (0): the same
    gradients bit for bit, both the dense reference's, padded and odd lengths, blocks of 2 chunks or all."""
    monkeypatch.setattr(reformer, "BLOCK_ELEMENTS", block_elements)
    qk, v, rot = inputs(61, rounds=3, bucket_size=8)
    mask = torch.rand(2, 61, generator=torch.Generator().manual_seed(4)) > 0.2
    kw = dict(rotations=rot, bucket_size=8, attend_across_buckets=across, is_causal=causal)
    cotangent = torch.randn(2, 2, 61, 8, generator=torch.Generator().manual_seed(5), dtype=torch.float64)
    grads = []
    for keep_elements in (0, reformer.KEEP_WEIGHTS_ELEMENTS):
        monkeypatch.setattr(reformer, "KEEP_WEIGHTS_ELEMENTS", keep_elements)
        grads.append(torch.autograd.grad(lsh_attention(qk, v, mask, **kw), (qk, v), cotangent))
    assert all(torch.equal(a, b) for a, b in zip(*grads))
    ref = lsh_attention_reference(qk, v, mask, **kw)
    torch.testing.assert_close(grads[1], torch.autograd.grad(ref, (qk, v), cotangent))


def test_weights_are_kept_only_for_a_backward_pass(monkeypatch):
    """The kept weights [chunks, m, 2m] are the largest tensor of a step with gradients (blocks of 2 chunks),
    and are not formed without gradients (evaluation) or above KEEP_WEIGHTS_ELEMENTS."""
    monkeypatch.setattr(reformer, "BLOCK_ELEMENTS", 2 * 8 * 8 * 2)
    qk, v, rot = inputs(61, rounds=3, bucket_size=8)
    kept = 4 * (3 * 64 // 8) * 8 * 16  # (batch, head) pairs x chunks per head x m x 2m
    with LargestTensorRecorder() as recorder:
        lsh_attention(qk, v, rotations=rot, bucket_size=8)
    assert recorder.max_numel == kept
    with torch.no_grad(), LargestTensorRecorder() as recorder:
        lsh_attention(qk, v, rotations=rot, bucket_size=8)
    assert recorder.max_numel < kept
    monkeypatch.setattr(reformer, "KEEP_WEIGHTS_ELEMENTS", kept - 1)
    with LargestTensorRecorder() as recorder:
        lsh_attention(qk, v, rotations=rot, bucket_size=8)
    assert recorder.max_numel < kept


def test_one_bucket_one_chunk_is_shared_qk_attention_without_self():
    n, d = 16, 8
    qk, v, _ = inputs(n, rounds=1, bucket_size=16)
    rot = torch.zeros(d, 1, 1, dtype=torch.float64)  # every vector in bucket 0
    out = lsh_attention(qk, v, rotations=rot, bucket_size=16)
    keys = torch.nn.functional.normalize(qk, dim=-1)
    s = (qk @ keys.transpose(-1, -2)) / d**0.5
    s = s.masked_fill(torch.eye(n, dtype=torch.bool), -5e4)
    torch.testing.assert_close(out, torch.softmax(s, -1) @ v)


def test_padding_never_moves_real_tokens_in_the_sort():
    qk, v, rot = inputs(40, rounds=2, bucket_size=8)
    mask = torch.ones(2, 40, dtype=torch.bool)
    mask[:, 30:] = False
    out = lsh_attention(qk, v, mask, rotations=rot, bucket_size=8)
    qk2 = qk.detach().clone()
    qk2[:, :, 30:] = torch.randn(2, 2, 10, 8, dtype=torch.float64) * 50
    out2 = lsh_attention(qk2, v, mask, rotations=rot, bucket_size=8)
    torch.testing.assert_close(out2[:, :, :30], out[:, :, :30])


def test_matches_reformer_pytorch_given_the_same_rotations():
    peer = pytest.importorskip("reformer_pytorch", reason="peer package reformer-pytorch not installed")
    b, h, n, d, bucket, hashes = 2, 2, 128, 16, 16, 3
    qk, v = torch.randn(b * h, n, d), torch.randn(b * h, n, d)
    theirs_attn = peer.LSHAttention(bucket_size=bucket, n_hashes=hashes, causal=False, attend_across_buckets=False,
                                    allow_duplicate_attention=True, random_rotations_per_head=False)
    torch.manual_seed(7)
    theirs = theirs_attn(qk, v)[0]
    torch.manual_seed(7)  # the peer draws its rotations first thing: draw the same ones
    rot = torch.randn(1, d, hashes, num_buckets(n, bucket) // 2)[0]
    ours = lsh_attention(qk.view(b, h, n, d), v.view(b, h, n, d), rotations=rot, bucket_size=bucket)
    torch.testing.assert_close(ours.reshape(b * h, n, d), theirs, atol=1e-5, rtol=1e-4)


def test_bad_functional_inputs_get_clear_errors():
    qk, v, rot = inputs(16, rounds=2, bucket_size=8)
    with pytest.raises(AttentionError, match="rotations"):
        lsh_attention(qk, v, rotations=rot[:4], bucket_size=8)
    with pytest.raises(AttentionError, match="bucket_size"):
        lsh_attention(qk, v, rotations=rot, bucket_size=0)
    with pytest.raises(AttentionError):
        lsh_attention(qk, v[:, :, :5], rotations=rot, bucket_size=8)
    with pytest.raises(AttentionError):
        lsh_attention(qk, v, torch.ones(2, 15, dtype=torch.bool), rotations=rot, bucket_size=8)


# ----------------------------------------------------------------------------- GPU path (forced on CPU)


@pytest.mark.parametrize("n, bucket_size, rounds", [(37, 8, 3), (16, 16, 1), (5, 8, 2)])
@pytest.mark.parametrize("across", [False, True])
@pytest.mark.parametrize("causal", [False, True])
def test_gpu_path_matches_dense_pattern(n, bucket_size, rounds, across, causal):
    """Odd lengths, one chunk per head (no look-back: 16 tokens, bucket 16, one round), scattered padding."""
    qk, v, rot = inputs(n, rounds=rounds, bucket_size=bucket_size)
    mask = torch.rand(2, n, generator=torch.Generator().manual_seed(1)) > 0.25
    kw = dict(rotations=rot, bucket_size=bucket_size, attend_across_buckets=across, is_causal=causal)
    with force_path("gpu"):
        out = lsh_attention(qk, v, mask, **kw)
    ref = lsh_attention_reference(qk, v, mask, **kw)
    rows = mask[:, None, :, None].expand_as(out)
    torch.testing.assert_close(out[rows], ref[rows])
    g = torch.randn_like(out) * rows
    for a, r in zip(torch.autograd.grad(out, (qk, v), g), torch.autograd.grad(ref, (qk, v), g)):
        torch.testing.assert_close(a, r)


@pytest.mark.parametrize("across, causal", [(False, False), (True, True)])
@pytest.mark.parametrize("n, bucket_size, rounds", [(13, 8, 2), (16, 16, 1)])
def test_gpu_kernels_match_dense_pattern(n, bucket_size, rounds, across, causal):
    """Hashing and the chunks' attention by the Triton kernels (compiled on CUDA in float32, else interpreted in
    float64), forward and backward; one (batch, head) pair of few chunks keeps the interpreter fast."""
    dtype = torch.float32 if KERNEL_DEVICE == "cuda" else torch.float64
    qk, v, rot = (t[:1, :1] if t.dim() == 4 else t for t in inputs(n, rounds=rounds, bucket_size=bucket_size))
    qk, v = qk.detach().to(dtype).requires_grad_(), v.detach().to(dtype).requires_grad_()
    mask = torch.rand(1, n, generator=torch.Generator().manual_seed(3)) > 0.25
    mask[0, 0] = True
    kw = dict(bucket_size=bucket_size, attend_across_buckets=across, is_causal=causal)
    g = torch.randn(qk.shape, dtype=dtype) * mask[:, None, :, None]
    with running_kernels() as device, force_path("gpu"):
        out = lsh_attention(qk.to(device), v.to(device), mask.to(device), rotations=rot.to(device, dtype), **kw)
        got = torch.autograd.grad(out, (qk, v), g.to(device))
    ref = lsh_attention_reference(qk, v, mask, rotations=rot.to(dtype), **kw)
    rows = mask[:, None, :, None].expand_as(ref)
    tol = {} if dtype == torch.float64 else dict(rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(out.cpu()[rows], ref[rows], **tol)
    for a, r in zip(got, torch.autograd.grad(ref, (qk, v), g)):
        torch.testing.assert_close(a, r, **tol)


def test_gpu_hash_kernel_matches_argmax_of_both_signs():
    dtype = torch.float32 if KERNEL_DEVICE == "cuda" else torch.float64
    g = torch.Generator().manual_seed(0)
    x = torch.randn(1, 2, 50, 8, generator=g, dtype=dtype)
    rot = torch.randn(8, 3, 70, generator=g, dtype=dtype)  # 70 projections: two tiles, one partial
    x[0, 0, 0] = 0.0  # every projection 0: a tie, won by the first position
    with running_kernels() as device:
        from longattn.attention._reformer_triton import lsh_hash

        got = lsh_hash(x.to(device), rot.to(device)).cpu()
    assert torch.equal(got, hash_buckets(x, rot))
    with force_path("gpu"):  # the PyTorch GPU path's max / min with indices
        assert torch.equal(reformer._hash_gpu(x, rot), hash_buckets(x, rot))


def test_gpu_path_half_precision_and_size():
    n = 1024
    torch.manual_seed(0)
    layer = reformer.ReformerAttention(dim=32, heads=2, bucket_size=32)
    x = torch.randn(1, n, 32, requires_grad=True)
    with force_path("gpu"), LargestTensorRecorder() as rec:
        layer(x).sum().backward()
    # without triton: the [N, n_buckets / 2] projections per round and head, and every chunk's [m, 2m] scores
    assert rec.max_numel <= 2 * n * 4 * 32 * 2, (rec.max_shape, rec.max_op)
    with force_path("gpu"), torch.autocast("cpu", dtype=torch.bfloat16):
        out = layer(x[:, :300])
    assert out.dtype == torch.bfloat16 and torch.isfinite(out).all()
