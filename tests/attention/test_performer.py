import contextlib

import pytest
import torch
from gpu_path_checks import assert_gpu_result_close, kernel_dtype, running_kernels

from longattn import attention
from longattn.attention import AttentionError, force_path, performer
from longattn.attention.base import budget_slices
from longattn.attention.performer import (
    orthogonal_random_features,
    performer_attention,
    performer_attention_reference,
)
from longattn.attention.softmax import softmax_attention_reference
from longattn.testing import LargestTensorRecorder, random_qkv


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("n", [1, 65, 301])
def test_fast_matches_reference_forward_and_backward(causal, n):
    q, k, v = random_qkv(2, 2, n, 8)
    w = orthogonal_random_features(20, 8, generator=torch.Generator().manual_seed(5), dtype=torch.float64)
    mask = torch.rand(2, n, generator=torch.Generator().manual_seed(1)) > 0.3
    mask[:, 0] = True
    out = performer_attention(q, k, v, mask, projection=w, is_causal=causal)
    ref = performer_attention_reference(q, k, v, mask, projection=w, is_causal=causal)
    torch.testing.assert_close(out, ref)
    g = torch.randn_like(out)
    for a, r in zip(torch.autograd.grad(out, (q, k, v), g), torch.autograd.grad(ref, (q, k, v), g)):
        torch.testing.assert_close(a, r)


def assert_matches_reference(q, k, v, mask, w, causal):
    inputs = (q, k, v) if not w.requires_grad else (q, k, v, w)
    out = performer_attention(q, k, v, mask, projection=w, is_causal=causal)
    ref = performer_attention_reference(q, k, v, mask, projection=w, is_causal=causal)
    torch.testing.assert_close(out, ref)
    g = torch.randn_like(out)
    for a, r in zip(torch.autograd.grad(out, inputs, g), torch.autograd.grad(ref, inputs, g)):
        torch.testing.assert_close(a, r)


@pytest.mark.parametrize("keep_elements", ["below", "at"])
@pytest.mark.parametrize("chunk", [8, 2048])
def test_features_kept_or_recomputed_per_chunk_match_the_reference(monkeypatch, keep_elements, chunk):
    """Both sides of FAVOR_KEEP_ELEMENTS (features kept for the backward pass, or recomputed under
    checkpoint) and of FAVOR_CHUNK (one chunk, or chunks of 8 with a shorter last one), with fewer keys
    than queries, padded keys, and a gradient for the projection too."""
    b, h, n_query, n_key, m = 2, 3, 37, 23, 20
    monkeypatch.setattr(performer, "FAVOR_CHUNK", chunk)
    monkeypatch.setattr(performer, "FAVOR_KEEP_ELEMENTS", b * h * n_query * m - (keep_elements == "below"))
    g = torch.Generator().manual_seed(4)
    q = torch.randn(b, h, n_query, 8, generator=g, dtype=torch.float64, requires_grad=True)
    k, v = (torch.randn(b, h, n_key, 8, generator=g, dtype=torch.float64, requires_grad=True) for _ in range(2))
    w = orthogonal_random_features(m, 8, generator=g, dtype=torch.float64).requires_grad_()
    mask = torch.rand(b, n_key, generator=g) > 0.3
    mask[:, 0] = True
    calls, checkpoint = [], performer.checkpoint
    monkeypatch.setattr(performer, "checkpoint", lambda *a, **kw: calls.append(a[0]) or checkpoint(*a, **kw))
    assert_matches_reference(q, k, v, mask, w, causal=False)
    kept = keep_elements == "at" and chunk == 2048
    assert bool(calls) != kept  # the path this case is meant to take
    if chunk == 8:
        assert len(calls) == -(-n_key // 8) + -(-n_query // 8)


@pytest.mark.parametrize("n", [144, 145, 200])
def test_causal_equal_chunks_with_and_without_padding_match_the_reference(n):
    """The causal sums cut N into equal chunks of at most 64: 144 = 3 x 48 (the Performer forecaster's
    decoder at horizon 96, no padding), 145 = 3 x 49 - 2 and 200 = 4 x 50 (padding), in float64."""
    q, k, v = random_qkv(2, 2, n, 8)
    w = orthogonal_random_features(24, 8, generator=torch.Generator().manual_seed(6), dtype=torch.float64)
    mask = torch.rand(2, n, generator=torch.Generator().manual_seed(7)) > 0.2
    mask[:, 0] = True
    assert_matches_reference(q, k, v, mask, w.requires_grad_(), causal=True)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("rows", [1, 2, 4, 5])
def test_forward_only_slices_of_the_batch_match_the_gradient_path_and_the_reference(monkeypatch, causal, rows):
    """Without gradients the batch is attended FAVOR_SLICE_ELEMENTS' worth of rows at a time: slices of 1 and 2
    rows of 5 (a shorter last slice), one row short of the batch (4) and the whole batch (5), odd lengths,
    padded keys, fewer keys than queries when not causal: the same numbers as the path with gradients (same
    stabilisers, same features) and as the plain Lemma 1, in float64."""
    b, h, n_query, m = 5, 3, 37, 20
    n_key = n_query if causal else 23
    monkeypatch.setattr(performer, "FAVOR_SLICE_ELEMENTS", rows * h * n_query * m + rows - 1)
    g = torch.Generator().manual_seed(8)
    q = torch.randn(b, h, n_query, 8, generator=g, dtype=torch.float64)
    k, v = (torch.randn(b, h, n_key, 8, generator=g, dtype=torch.float64) for _ in range(2))
    w = orthogonal_random_features(m, 8, generator=g, dtype=torch.float64)
    mask = torch.rand(b, n_key, generator=g) > 0.3
    mask[:, 0] = True
    sliced, favor = [], performer._favor
    monkeypatch.setattr(performer, "_favor", lambda *a: sliced.append(a[0].shape[0]) or favor(*a))
    with torch.no_grad():
        out = performer_attention(q, k, v, mask, projection=w, is_causal=causal)
    assert sliced == [rows] * (b // rows) + [b % rows] * (b % rows > 0)
    slices = len(sliced)
    with_gradients = performer_attention(q.requires_grad_(), k, v, mask, projection=w, is_causal=causal)
    assert len(sliced) == slices  # the path with gradients takes the whole batch through the grouped path
    torch.testing.assert_close(out, with_gradients.detach(), rtol=1e-13, atol=1e-15)
    torch.testing.assert_close(out, performer_attention_reference(q.detach(), k, v, mask, projection=w,
                                                                  is_causal=causal))


def plain_favor(query, key, value, attention_mask, projection, is_causal):
    """The path with gradients before the grouped one: autograd of the features and the (chunked) sums."""
    return performer._favor(query, key, value, attention_mask, projection, is_causal)


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("n", [1, 5, 64, 67, 145])
@pytest.mark.parametrize("pairs_per_group", [1, 2, 4, 6])
@pytest.mark.parametrize("padded", [False, True])
def test_grouped_training_path_matches_the_plain_path_forward_and_gradients(monkeypatch, causal, n, pairs_per_group,
                                                                           padded):
    """The grouped path with gradients (_GroupedFavor, its backward written out) against autograd of the plain path,
    float64: groups of 1, 2, 4 of 6 (batch, head) pairs (a shorter last group) and all 6; causal: one chunk,
    chunks with and without padding (64 = 1 x 64, 67 = 2 x 34 - 1, 145 = 3 x 49 - 2); not causal: 3 keys fewer
    than queries; padded keys; gradients of q, k, v and the projection; and the plain Lemma 1."""
    b, h, m = 3, 2, 20
    n_key = n if causal else max(1, n - 3)
    monkeypatch.setattr(performer, "FAVOR_SLICE_ELEMENTS", pairs_per_group * n * m + pairs_per_group - 1)
    g = torch.Generator().manual_seed(n + pairs_per_group)
    q = torch.randn(b, h, n, 8, generator=g, dtype=torch.float64, requires_grad=True)
    k, v = (torch.randn(b, h, n_key, 8, generator=g, dtype=torch.float64, requires_grad=True) for _ in range(2))
    w = orthogonal_random_features(m, 8, generator=g, dtype=torch.float64).requires_grad_()
    mask = None
    if padded:
        mask = torch.rand(b, n_key, generator=g) > 0.3
        mask[:, 0] = True
    groups, grouped = [], performer._grouped_favor
    monkeypatch.setattr(performer, "budget_slices", lambda *a: groups.append(budget_slices(*a)) or groups[-1])
    out = performer_attention(q, k, v, mask, projection=w, is_causal=causal)
    assert [group.stop - group.start for group in groups[0]] == (
        [pairs_per_group] * (b * h // pairs_per_group) + [b * h % pairs_per_group] * (b * h % pairs_per_group > 0))
    monkeypatch.setattr(performer, "_grouped_favor", plain_favor)
    plain = performer_attention(q, k, v, mask, projection=w, is_causal=causal)
    monkeypatch.setattr(performer, "_grouped_favor", grouped)
    torch.testing.assert_close(out, plain, rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(out, performer_attention_reference(q, k, v, mask, projection=w, is_causal=causal))
    grad = torch.randn(out.shape, generator=g, dtype=torch.float64)
    for fast, reference in zip(torch.autograd.grad(out, (q, k, v, w), grad),
                               torch.autograd.grad(plain, (q, k, v, w), grad)):
        torch.testing.assert_close(fast, reference, rtol=1e-11, atol=1e-13)


@pytest.mark.parametrize("causal", [True, False])
def test_grouped_training_path_passes_gradcheck(monkeypatch, causal):
    """Finite differences of _GroupedFavor itself in float64: 2 pairs in groups of 1, padded keys; causal: two
    chunks with padding; not causal: fewer keys than queries."""
    monkeypatch.setattr(performer, "FAVOR_SLICE_ELEMENTS", 67 * 3)
    g = torch.Generator().manual_seed(9)
    n_key = 67 if causal else 40
    q = torch.randn(2, 67, 2, generator=g, dtype=torch.float64, requires_grad=True)
    k, v = (torch.randn(2, n_key, 2, generator=g, dtype=torch.float64, requires_grad=True) for _ in range(2))
    w = orthogonal_random_features(3, 2, generator=g, dtype=torch.float64).requires_grad_()
    real = torch.rand(2, n_key, 1, generator=g) > 0.3
    real[:, 0] = True
    assert torch.autograd.gradcheck(
        lambda *t: performer._GroupedFavor.apply(*t, real, torch.finfo(torch.float64).tiny, causal), (q, k, v, w))


def test_causal_training_path_has_no_quadratic_intermediate():
    """A causal layer's forward and backward in training: nothing of N x N elements (the within-chunk products
    are [pairs * chunks, 64, 64]), and the largest tensor grows linearly with N."""
    def largest(n):
        torch.manual_seed(0)
        layer = attention.build("performer", dim=16, heads=1, max_len=n, causal=True, nb_features=32)
        x = torch.randn(1, n, 16, requires_grad=True)
        mask = torch.ones(1, n, dtype=torch.bool)
        mask[0, -5:] = False
        with LargestTensorRecorder() as rec:
            layer(x, mask).sum().backward()
        return rec

    big, small = largest(4096), largest(2048)
    assert big.max_numel <= 4096 * 4096 // 4, (big.max_shape, big.max_op)
    assert big.max_numel <= 2.5 * small.max_numel, (big.max_shape, small.max_shape)


def test_stabiliser_keeps_large_inputs_finite():
    # |q|, |k| ~ 30: exp(w.x) overflows without the max shift, the reference is inf/nan
    q, k, v = (t.detach() for t in random_qkv(1, 1, 64, 16, scale=8.0))
    w = orthogonal_random_features(32, 16)
    out = performer_attention(q.float(), k.float(), v.float(), projection=w)
    assert torch.isfinite(out).all()


def test_many_features_approximate_softmax_attention():
    q, k, v = (t.detach() for t in random_qkv(1, 1, 40, 8, scale=0.5))
    exact = softmax_attention_reference(q, k, v)
    errors = []
    for m in (8, 8192):
        w = orthogonal_random_features(m, 8, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
        errors.append((performer_attention(q, k, v, projection=w) - exact).abs().max().item())
    assert errors[1] < 0.03 and errors[1] < errors[0] / 3, errors


def test_orthogonal_features_are_orthogonal_within_a_block_and_gaussian_length():
    w = orthogonal_random_features(20, 8, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    assert w.shape == (20, 8)
    block = w[:8] / w[:8].norm(dim=1, keepdim=True)
    torch.testing.assert_close(block @ block.T, torch.eye(8, dtype=torch.float64))
    lengths = w.norm(dim=1)
    assert lengths.std() > 0  # chi-distributed, not all sqrt(d)
    big = orthogonal_random_features(4096, 8, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    assert abs(big.square().sum(1).mean().item() - 8) < 0.5  # E|w|^2 = d
    iid = orthogonal_random_features(8, 8, orthogonal=False, generator=torch.Generator().manual_seed(0))
    gram = iid @ iid.T
    assert (gram - torch.diag(gram.diag())).abs().max() > 1e-3


def test_features_are_redrawn_every_interval_only_in_training():
    layer = attention.build("performer", dim=16, heads=2, redraw_interval=2)
    x = torch.randn(1, 10, 16)
    first = layer.projection.clone()
    layer.eval()
    for _ in range(5):
        layer(x)
    assert torch.equal(layer.projection, first)
    layer.train()
    layer(x)
    layer(x)
    assert torch.equal(layer.projection, first)
    layer(x)  # third training call: interval reached
    assert not torch.equal(layer.projection, first)
    fixed = attention.build("performer", dim=16, heads=2, redraw_interval=None)
    before = fixed.projection.clone()
    for _ in range(3):
        fixed(x)
    assert torch.equal(fixed.projection, before)


def test_bad_options_raise():
    with pytest.raises(AttentionError, match="nb_features"):
        attention.build("performer", dim=16, heads=2, nb_features=0)
    with pytest.raises(AttentionError, match="redraw_interval"):
        attention.build("performer", dim=16, heads=2, redraw_interval=0)
    q, k, v = (t.detach() for t in random_qkv(1, 1, 4, 8))
    with pytest.raises(AttentionError, match="projection"):
        performer_attention(q, k, v, projection=torch.randn(4, 3))


def test_matches_performer_pytorch_with_the_same_projection():
    # performer-pytorch adds eps=1e-4 to every feature after its max shift (not in the paper);
    # its kernel functions with eps=0 are the paper's FAVOR+, which must equal ours exactly.
    peer = pytest.importorskip("performer_pytorch.performer_pytorch", reason="performer-pytorch not installed")
    q, k, v = (t.detach() for t in random_qkv(2, 2, 77, 16))
    w = orthogonal_random_features(32, 16, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    phi_q = peer.softmax_kernel(q, projection_matrix=w, is_query=True, eps=0.0)
    phi_k = peer.softmax_kernel(k, projection_matrix=w, is_query=False, eps=0.0)
    theirs = peer.linear_attention(phi_q, phi_k, v)
    ours = performer_attention(q, k, v, projection=w)
    torch.testing.assert_close(ours, theirs)
    # and their projection matrix (drawn by their code) used in our layer gives the same result
    fast = peer.FastAttention(dim_heads=16, nb_features=32)
    w_peer = fast.projection_matrix.double()
    theirs = peer.linear_attention(
        peer.softmax_kernel(q, projection_matrix=w_peer, is_query=True, eps=0.0),
        peer.softmax_kernel(k, projection_matrix=w_peer, is_query=False, eps=0.0),
        v,
    )
    torch.testing.assert_close(performer_attention(q, k, v, projection=w_peer), theirs)


# ----------------------------------------------------------------------------- GPU path (forced on CPU)


@pytest.mark.parametrize("kernels", [False, True])
@pytest.mark.parametrize("causal", [False, True])
def test_gpu_path_matches_reference_forward_and_backward(causal, kernels):
    """Non-causal: one batched program that recomputes the features in its backward pass; causal: the features
    through the shared scan (PyTorch, or the Triton kernels: compiled on CUDA in float32, else interpreted in
    float64). The projection's gradient too."""
    dtype = kernel_dtype(kernels)
    q, k, v = random_qkv(2, 2, 37, 8, dtype=dtype)
    w = orthogonal_random_features(20, 8, generator=torch.Generator().manual_seed(5), dtype=dtype)
    w.requires_grad_()
    mask = torch.rand(2, 37, generator=torch.Generator().manual_seed(1)) > 0.3
    mask[:, 0] = True
    g = torch.randn(2, 2, 37, 8, dtype=dtype)
    with running_kernels() if kernels else contextlib.nullcontext("cpu") as device, force_path("gpu"):
        out = performer_attention(*(t.to(device) for t in (q, k, v, mask)), projection=w.to(device),
                                  is_causal=causal)
        got = torch.autograd.grad(out, (q, k, v, w), g.to(device))
    ref = performer_attention_reference(q, k, v, mask, projection=w, is_causal=causal)
    assert_gpu_result_close(out.cpu(), got, ref, (q, k, v, w), g, dtype)


def test_gpu_path_with_fewer_keys_than_queries_and_a_padded_sequence():
    g = torch.Generator().manual_seed(4)
    q = torch.randn(2, 3, 37, 8, generator=g, dtype=torch.float64, requires_grad=True)
    k, v = (torch.randn(2, 3, 23, 8, generator=g, dtype=torch.float64, requires_grad=True) for _ in range(2))
    w = orthogonal_random_features(20, 8, generator=g, dtype=torch.float64)
    mask = torch.rand(2, 23, generator=g) > 0.3
    mask[1] = False  # no real key: zeros
    with force_path("gpu"):
        out = performer_attention(q, k, v, mask, projection=w)
    ref = performer_attention_reference(q, k, v, mask, projection=w)
    torch.testing.assert_close(out, ref)
    assert torch.all(out[1] == 0)
    out.square().sum().backward()
    assert all(torch.isfinite(t.grad).all() for t in (q, k, v))


def test_training_calls_count_on_the_host_and_follow_a_loaded_state():
    """The redraw counter is read from the buffer once (no device read-back per call), and again after a
    state dict is loaded."""
    layer = attention.build("performer", dim=16, heads=2, redraw_interval=3).train()
    x = torch.randn(1, 10, 16)
    for _ in range(2):
        layer(x)
    assert int(layer.calls_since_redraw) == 2
    state = {key: value.clone() for key, value in layer.state_dict().items()}
    layer(x)
    layer.load_state_dict(state)  # back to 2 calls: the next call is the third, the one after redraws
    layer(x)
    assert torch.equal(layer.projection, state["projection"])
    layer(x)
    assert not torch.equal(layer.projection, state["projection"]) and int(layer.calls_since_redraw) == 1
