import pytest
import torch
import torch.nn.functional as F

from longattn.attention.softmax import softmax_attention, softmax_attention_reference


@pytest.mark.parametrize("causal", [False, True])
def test_sdpa_matches_reference_forward_and_backward(causal, path):
    b, h, n, d = 2, 3, 1023, 16
    q, k, v = (torch.randn(b, h, n, d, dtype=torch.float64, requires_grad=True) for _ in range(3))
    mask = torch.rand(b, n) > 0.2
    out = softmax_attention(q, k, v, mask, is_causal=causal)
    ref = softmax_attention_reference(q, k, v, mask, is_causal=causal)
    # causal + padding can leave a query with no visible key: both define it as 0
    torch.testing.assert_close(out, ref)
    g = torch.randn_like(out)
    grads = torch.autograd.grad(out, (q, k, v), g)
    grads_ref = torch.autograd.grad(ref, (q, k, v), g)
    for a, r in zip(grads, grads_ref):
        torch.testing.assert_close(a, r)


def test_causal_with_a_mask_that_hides_nothing_equals_the_reference(path):
    """The CPU path drops a key mask without padding and runs SDPA's own causal form (no N x N mask)."""
    q, k, v = (torch.randn(2, 2, 37, 8, dtype=torch.float64, generator=torch.Generator().manual_seed(i))
               for i in range(3))
    mask = torch.ones(2, 37, dtype=torch.bool)
    torch.testing.assert_close(softmax_attention(q, k, v, mask, is_causal=True),
                               softmax_attention_reference(q, k, v, is_causal=True))


def test_all_padded_sequence_gives_zeros_not_nan():
    q = k = v = torch.randn(1, 1, 5, 4)
    out = softmax_attention(q, k, v, torch.zeros(1, 5, dtype=torch.bool))
    assert torch.all(out == 0)


@pytest.mark.parametrize("dropout_p", [0.0, 0.05, 0.5])
@pytest.mark.parametrize("scale", [None, 0.3])
@pytest.mark.parametrize("n_q, n_k, e", [(7, 5, 4), (13, 1, 3), (1, 9, 16)])
def test_dropout_on_cpu_is_sdpa_with_the_same_draw(dropout_p, scale, n_q, n_k, e):
    """With dropout on CPU and no mask, softmax_attention writes out SDPA's math path: the same output and
    gradients as the SDPA call for the same seed (float64, odd lengths, one key, one query, a given scale), and
    the generator left in the same state (without dropout: untouched, as SDPA); another seed gives another
    output."""
    g = torch.Generator().manual_seed(n_q * n_k)
    q, k, v = (torch.randn(3, 2, n, e, generator=g, dtype=torch.float64, requires_grad=True)
               for n in (n_q, n_k, n_k))
    grad = torch.randn(3, 2, n_q, e, generator=g, dtype=torch.float64)
    results = []
    for attend in (lambda: F.scaled_dot_product_attention(q, k, v, dropout_p=dropout_p, scale=scale),
                   lambda: softmax_attention(q, k, v, dropout_p=dropout_p, scale=scale)):
        torch.manual_seed(11)
        out = attend()
        after = torch.rand(4, dtype=torch.float64)
        results.append((out, *torch.autograd.grad(out, (q, k, v), grad), after))
    for old, new in zip(*results):
        torch.testing.assert_close(new, old)
    if dropout_p == 0.5 and n_k > 1:
        torch.manual_seed(12)
        assert not torch.allclose(softmax_attention(q, k, v, dropout_p=dropout_p, scale=scale), results[0][0])


def test_dropout_on_cpu_is_sdpa_bit_for_bit_in_float32():
    """At a forecaster's shape in float32 (the grid's dtype): equal bit for bit to the SDPA call."""
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(4, 8, n, 16, generator=g) for n in (144, 96, 96))
    torch.manual_seed(5)
    expected = F.scaled_dot_product_attention(q, k, v, dropout_p=0.05)
    torch.manual_seed(5)
    assert torch.equal(softmax_attention(q, k, v, dropout_p=0.05), expected)
