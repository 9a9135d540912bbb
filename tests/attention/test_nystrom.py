import pytest
import torch
import torch.nn.functional as F

from longattn import attention
from longattn.attention import AttentionError
from longattn.attention.nystrom import (
    CONV_BLOCK,
    depthwise_value_conv,
    iterative_pinv,
    nystrom_attention,
    nystrom_attention_reference,
)
from longattn.attention.softmax import softmax_attention_reference
from longattn.testing import LargestTensorRecorder, random_qkv


@pytest.mark.parametrize("use_conv", [True, False])
@pytest.mark.parametrize("n, landmarks", [(1, 4), (7, 16), (333, 16), (160, 8)])
def test_fast_matches_reference_forward_and_backward(use_conv, n, landmarks, path):
    heads = 2
    q, k, v = random_qkv(2, heads, n, 8)
    g = torch.Generator().manual_seed(7)
    conv = torch.randn(heads, 1, 5, 1, generator=g, dtype=torch.float64, requires_grad=True) if use_conv else None
    mask = torch.rand(2, n, generator=g) > 0.4
    mask[:, 0] = True
    if n > 60:
        mask[1, 20:60] = False  # whole segments without a real token
    opts = dict(num_landmarks=landmarks, pinv_iterations=6, conv_weight=conv)
    out = nystrom_attention(q, k, v, mask, **opts)
    ref = nystrom_attention_reference(q, k, v, mask, **opts)
    torch.testing.assert_close(out, ref)
    grad = torch.randn_like(out)
    inputs = (q, k, v) + ((conv,) if use_conv else ())
    for a, r in zip(torch.autograd.grad(out, inputs, grad), torch.autograd.grad(ref, inputs, grad)):
        torch.testing.assert_close(a, r)


def test_iterative_pinv_converges_to_the_moore_penrose_inverse():
    g = torch.Generator().manual_seed(0)
    a = torch.softmax(torch.randn(3, 12, 12, generator=g, dtype=torch.float64), dim=-1)
    torch.testing.assert_close(iterative_pinv(a, 40), torch.linalg.pinv(a), rtol=1e-6, atol=1e-8)
    # each step brings A Z A closer to A
    errors = [(a @ iterative_pinv(a, it) @ a - a).abs().max() for it in (2, 6, 12)]
    assert errors[0] > errors[1] > errors[2]


def test_one_token_per_landmark_recovers_exact_softmax_attention():
    # with m = n every token is a landmark: A A^+ A = A, so eq. 15 is exact softmax attention
    q, k, v = (t.detach() * 0.3 for t in random_qkv(1, 2, 24, 8))
    out = nystrom_attention(q, k, v, num_landmarks=24, pinv_iterations=60)
    torch.testing.assert_close(out, softmax_attention_reference(q, k, v), rtol=1e-5, atol=1e-6)


def test_conv_skip_is_a_depthwise_convolution_of_v_along_the_sequence():
    q, k, v = (t.detach() for t in random_qkv(1, 2, 30, 4))
    weight = torch.randn(2, 1, 3, 1, dtype=torch.float64)
    with_conv = nystrom_attention(q, k, v, num_landmarks=5, conv_weight=weight)
    without = nystrom_attention(q, k, v, num_landmarks=5)
    # per head h: sum_t w[h, t] * v[h, i + t - 1], zero beyond the ends
    padded = F.pad(v, (0, 0, 1, 1))
    expected = sum(weight[None, :, 0, t, 0, None, None] * padded[:, :, t : t + 30] for t in range(3))
    torch.testing.assert_close(with_conv - without, expected)


def grouped_conv_of_values(value, weight, mask=None):
    """The value convolution as a grouped Conv1d, one channel per (head, feature), each head's filter repeated
    over its features (the form the banded products replaced)."""
    b, h, n, d = value.shape
    if mask is not None:
        value = value.masked_fill(~mask[:, None, :, None], 0.0)
    channels = value.transpose(-1, -2).reshape(b, h * d, n)
    filters = weight[..., 0].repeat_interleave(d, dim=0)
    out = F.conv1d(channels, filters, padding=weight.shape[-2] // 2, groups=h * d)
    return out.reshape(b, h, d, n).transpose(-1, -2)


@pytest.mark.parametrize("n", [1, 7, CONV_BLOCK, CONV_BLOCK + 1, 3 * CONV_BLOCK + 5])
@pytest.mark.parametrize("kernel", [1, 5, 33])
@pytest.mark.parametrize("masked", [False, True])
def test_value_convolution_matches_grouped_conv1d(n, kernel, masked):
    """The banded-block products against the grouped convolution and the sum of shifted copies: forward and
    gradients (values and filter), float64, lengths within, at and across block edges, kernels longer than
    the sequence, padded positions read as zero."""
    g = torch.Generator().manual_seed(n * kernel)
    value = torch.randn(2, 3, n, 4, generator=g, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(3, 1, kernel, 1, generator=g, dtype=torch.float64, requires_grad=True)
    mask = None
    if masked:
        mask = torch.rand(2, n, generator=g) > 0.3
        mask[1, n // 2:] = False
    out = depthwise_value_conv(value, weight, mask)
    plain = grouped_conv_of_values(value, weight, mask)
    torch.testing.assert_close(out, plain)
    read = value if mask is None else value * mask[:, None, :, None]
    padded = F.pad(read, (0, 0, kernel // 2, kernel // 2))
    shifted = sum(weight[None, :, 0, t, 0, None, None] * padded[:, :, t:t + n] for t in range(kernel))
    torch.testing.assert_close(out, shifted)
    cotangent = torch.randn(out.shape, generator=g, dtype=torch.float64)
    torch.testing.assert_close(torch.autograd.grad(out, (value, weight), cotangent),
                               torch.autograd.grad(plain, (value, weight), cotangent))


def test_value_convolution_buffers_grow_with_the_sequence_not_its_square():
    """The banded products' largest buffer (the input windows) is a bounded multiple of V, forward and backward."""
    value = torch.randn(1, 2, 4096, 8, requires_grad=True)
    weight = torch.randn(2, 1, 33, 1, requires_grad=True)
    with LargestTensorRecorder() as recorder:
        depthwise_value_conv(value, weight).sum().backward()
    assert recorder.max_numel <= 3 * value.numel(), (recorder.max_shape, recorder.max_op)


def test_module_options_and_errors():
    layer = attention.build("nystrom", dim=16, heads=2, num_landmarks=8, conv_kernel=None)
    assert layer.conv_weight is None
    assert layer(torch.randn(1, 19, 16)).shape == (1, 19, 16)
    assert attention.build("nystrom", dim=16, heads=2).conv_weight.shape == (2, 1, 33, 1)
    with pytest.raises(AttentionError, match="odd"):
        attention.build("nystrom", dim=16, heads=2, conv_kernel=4)
    with pytest.raises(AttentionError, match="num_landmarks"):
        attention.build("nystrom", dim=16, heads=2, num_landmarks=0)


def _copy_peer_weights(ours, theirs, dim):
    with torch.no_grad():
        wq, wk, wv = theirs.to_qkv.weight.chunk(3, dim=0)
        for lin, w in zip((ours.proj.to_q, ours.proj.to_k, ours.proj.to_v), (wq, wk, wv)):
            lin.weight.copy_(w)
            lin.bias.zero_()  # their to_qkv has no bias
        ours.proj.to_out.weight.copy_(theirs.to_out[0].weight)
        ours.proj.to_out.bias.copy_(theirs.to_out[0].bias)
        ours.conv_weight.copy_(theirs.res_conv.weight)  # same [H, 1, kernel, 1] layout


def test_matches_nystrom_attention_package_with_the_same_weights():
    # nystrom-attention normalises Z_0 by the max norms over the whole batch and all heads (the
    # paper: per matrix); with one sequence and one head the computations coincide.
    peer = pytest.importorskip("nystrom_attention", reason="nystrom-attention not installed")
    dim, landmarks = 16, 8
    torch.manual_seed(0)
    theirs = peer.NystromAttention(
        dim=dim, dim_head=dim, heads=1, num_landmarks=landmarks, pinv_iterations=6, residual_conv_kernel=5
    ).double()
    ours = attention.build("nystrom", dim=dim, heads=1, num_landmarks=landmarks, conv_kernel=5).double()
    _copy_peer_weights(ours, theirs, dim)

    x = torch.randn(1, 64, dim, dtype=torch.float64)  # a multiple of the landmarks: no padding
    torch.testing.assert_close(ours(x), theirs(x))

    # Padding: ours takes the segments over the real tokens, so a sequence padded to any length
    # matches theirs on the sequence alone (they would take segments over the padded length).
    theirs_out = theirs(x)
    mask = torch.ones(1, 75, dtype=torch.bool)
    mask[0, 64:] = False
    ours_out = ours(F.pad(x, (0, 0, 0, 11), value=7.0), mask)[:, :64]
    torch.testing.assert_close(ours_out, theirs_out, rtol=1e-6, atol=1e-8)  # their mean adds eps=1e-8


@pytest.mark.parametrize("front", [0, 5])
def test_padding_to_any_length_keeps_the_landmarks(front, path):
    # Fewer landmarks than tokens: the segments are taken over the real tokens, so the same sequence
    # alone and padded (at the end, or also in front) to 64 or 200 gives the same outputs.
    q, k, v = (torch.randn(1, 2, 37, 8, dtype=torch.float64) for _ in range(3))
    alone = nystrom_attention(q, k, v, num_landmarks=8)
    for length in (64, 200):
        mask = torch.zeros(1, length, dtype=torch.bool)
        mask[0, front:front + 37] = True
        padded = [torch.randn(1, 2, length, 8, dtype=torch.float64) * 50 for _ in range(3)]
        for full, real in zip(padded, (q, k, v)):
            full[:, :, front:front + 37] = real
        out = nystrom_attention(*padded, mask, num_landmarks=8)
        torch.testing.assert_close(out[:, :, front:front + 37], alone)
        ref = nystrom_attention_reference(*padded, mask, num_landmarks=8)
        torch.testing.assert_close(ref[:, :, front:front + 37], alone)


@pytest.mark.parametrize("padded", [False, True])
def test_fewer_tokens_than_landmarks_builds_no_landmark_sized_matrix(padded):
    # A 20-token sentence with the default 256 landmarks: every token is its own landmark and the
    # other 236 are empty, so nothing of m x m = 256 x 256 may be built (forward or backward) and
    # the output is that of 20 landmarks. (MiniLM converted to nystrom once spent seconds per
    # sentence on 256 x 256 pseudo-inverses.)
    n, m = 20, 256
    q, k, v = random_qkv(2, 2, n, 8)
    mask = None
    if padded:
        mask = torch.ones(2, n, dtype=torch.bool)
        mask[1, 13:] = False
    conv = torch.randn(2, 1, 33, 1, dtype=torch.float64, requires_grad=True)
    with LargestTensorRecorder() as recorder:
        out = nystrom_attention(q, k, v, mask, num_landmarks=m, conv_weight=conv)
        out.sum().backward()
    assert recorder.max_numel < m * m, (recorder.max_shape, recorder.max_op)
    few = nystrom_attention(q, k, v, mask, num_landmarks=n, conv_weight=conv)
    torch.testing.assert_close(out, few)
    ref = nystrom_attention_reference(q, k, v, mask, num_landmarks=m, conv_weight=conv)
    torch.testing.assert_close(out, ref)
