import pytest
import torch
from module_checks import largest_intermediate

from longattn import attention
from longattn.attention import AttentionError
from longattn.attention.sliding_sinks import sliding_sinks_attention, sliding_sinks_attention_reference
from longattn.testing import assert_forward_backward_close


def inputs(n, heads=3, seed=0):
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(2, heads, n, 8, dtype=torch.float64, generator=g).requires_grad_() for _ in range(3))
    sinks = torch.randn(heads, dtype=torch.float64, generator=g).requires_grad_()
    mask = torch.rand(2, n, generator=g) > 0.25
    mask[1, : n // 3] = False
    return q, k, v, sinks, mask


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("sink_tokens,learned", [(0, True), (3, False), (3, True), (0, False)])
@pytest.mark.parametrize("n", [1, 37, 101])
def test_fast_matches_reference_forward_and_backward(path, causal, sink_tokens, learned, n):
    q, k, v, sinks, mask = inputs(n)
    kw = dict(window_size=7, sink_tokens=sink_tokens, sink_logits=sinks if learned else None, is_causal=causal)
    assert_forward_backward_close(sliding_sinks_attention(q, k, v, mask, **kw),
                                  sliding_sinks_attention_reference(q, k, v, mask, **kw),
                                  [q, k, v, sinks] if learned else [q, k, v])


def test_keys_outside_the_window_and_sinks_have_no_effect_and_no_gradient():
    q, k, v, sinks, _ = inputs(80)
    kw = dict(window_size=5, sink_tokens=2, sink_logits=sinks, is_causal=True)
    out = sliding_sinks_attention(q, k, v, **kw)
    k2, v2 = k.detach().clone(), v.detach().clone()
    k2[:, :, 30] += 50.0
    v2[:, :, 30] -= 50.0
    moved = sliding_sinks_attention(q, k2, v2, **kw)
    torch.testing.assert_close(moved[:, :, 35:], out[:, :, 35:])  # key 30 lies outside their windows
    torch.testing.assert_close(moved[:, :, :30], out[:, :, :30])  # and after these causal queries
    assert not torch.allclose(moved[:, :, 30:35], out[:, :, 30:35])
    grad_k, grad_v = torch.autograd.grad(out[:, :, 35:].square().sum(), (k, v))
    assert torch.all(grad_k[:, :, 2:30] == 0) and torch.all(grad_v[:, :, 2:30] == 0)
    assert grad_k[:, :, :2].abs().sum() > 0  # the sink tokens stay in every window


def test_learned_sink_lowers_the_weight_on_the_keys_as_gpt_oss():
    q, k, v, _, _ = inputs(20)
    plain = sliding_sinks_attention(q, k, v, window_size=4, is_causal=True)
    huge = sliding_sinks_attention(q, k, v, window_size=4, sink_logits=torch.full((3,), 60.0, dtype=torch.float64),
                                   is_causal=True)
    torch.testing.assert_close(huge, torch.zeros_like(huge))  # all the weight on the sink, whose value is zero
    tiny = sliding_sinks_attention(q, k, v, window_size=4, sink_logits=torch.full((3,), -60.0, dtype=torch.float64),
                                   is_causal=True)
    torch.testing.assert_close(tiny, plain)


def test_window_covering_everything_is_softmax_attention():
    from longattn.attention.softmax import softmax_attention_reference

    q, k, v, _, mask = inputs(30)
    torch.testing.assert_close(sliding_sinks_attention(q, k, v, mask, window_size=30),
                               softmax_attention_reference(q, k, v, mask))


def test_bad_options_raise_clear_errors():
    q, k, v, sinks, mask = inputs(10)
    with pytest.raises(AttentionError, match="window_size"):
        sliding_sinks_attention(q, k, v, mask, window_size=0)
    with pytest.raises(AttentionError, match="sink_tokens"):
        sliding_sinks_attention(q, k, v, mask, sink_tokens=-1)
    with pytest.raises(AttentionError, match="sink_logits"):
        sliding_sinks_attention(q, k, v, mask, sink_logits=sinks[:2])
    with pytest.raises(AttentionError, match="window_size"):
        attention.build("sliding_sinks", dim=16, heads=2, window_size=0)
    assert attention.build("sliding_sinks", dim=16, heads=2, learned_sink=False).sink_logits is None


def test_no_quadratic_intermediate_with_both_sinks():
    n = 4096  # the windows of all chunks at once: N x (w + one chunk + sinks) scores per head
    assert largest_intermediate("sliding_sinks", n, window_size=16, sink_tokens=4) <= n * n // 16
