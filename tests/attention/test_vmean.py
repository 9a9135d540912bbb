"""V-Mean (`vmean`): the rank-one baseline (1/m) 1 1^T V over the real tokens."""

import pytest
import torch

from longattn import attention
from longattn.attention.vmean import vmean_attention, vmean_attention_reference


@pytest.mark.parametrize("n", [1, 7, 301])
@pytest.mark.parametrize("padded", [False, True])
def test_fast_path_matches_dense_reference_forward_and_backward(n, padded, path):
    g = torch.Generator().manual_seed(n)
    q, k, v = (torch.randn(2, 3, n, 5, generator=g, dtype=torch.float64, requires_grad=True) for _ in range(3))
    mask = None
    if padded:
        mask = torch.rand(2, n, generator=g) > 0.4
        mask[:, 0] = True
    out = vmean_attention(q, k, v, mask)
    ref = vmean_attention_reference(q, k, v, mask)
    torch.testing.assert_close(out, ref)
    weight = torch.randn(out.shape, generator=g, dtype=out.dtype)
    (grad_out,) = torch.autograd.grad(out, v, weight)
    (grad_ref,) = torch.autograd.grad(ref, v, weight)
    torch.testing.assert_close(grad_out, grad_ref)


def test_output_is_the_mean_of_the_real_values_and_ignores_padding():
    v = torch.arange(12, dtype=torch.float64).reshape(1, 1, 6, 2)
    mask = torch.tensor([[True, False, True, False, False, True]])
    poisoned = v.clone()
    poisoned[0, 0, ~mask[0]] = float("nan")
    out = vmean_attention(poisoned, poisoned, poisoned, mask)
    expected = v[0, 0, mask[0]].mean(0)  # rows 0, 2, 5
    torch.testing.assert_close(out[0, 0, mask[0]], expected.expand(3, 2))
    assert torch.all(out[0, 0, ~mask[0]] == 0)  # padded query rows are zeros


def test_all_padded_sequence_gives_zeros():
    v = torch.randn(1, 2, 4, 3)
    out = vmean_attention(v, v, v, torch.zeros(1, 4, dtype=torch.bool))
    assert torch.all(out == 0)


def test_module_output_does_not_depend_on_queries_or_keys():
    torch.manual_seed(0)
    layer = attention.build("vmean", dim=8, heads=2)
    assert not hasattr(layer, "to_q") and not hasattr(layer, "to_k")
    x = torch.randn(2, 9, 8)
    mask = torch.ones(2, 9, dtype=torch.bool)
    mask[1, 4:] = False
    out = layer(x, mask)
    # every real position of a sequence gets the same vector
    torch.testing.assert_close(out[0], out[0, :1].expand(9, 8))
    torch.testing.assert_close(out[1, :4], out[1, :1].expand(4, 8))
    assert torch.all(out[1, 4:] == 0)
