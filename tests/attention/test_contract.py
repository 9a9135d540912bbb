"""The contract every registered mechanism must honour; new mechanisms are picked up automatically.

Mechanism-specific tests (fast path vs reference, paper limits) live in test_<mechanism>.py.
"""

import pytest
import torch

from longattn import attention
from longattn.attention import AttentionError
from longattn.testing import LargestTensorRecorder

NAMES = attention.available()
DIM, HEADS = 32, 2


def make(name, n, **options):
    torch.manual_seed(0)
    layer = attention.build(name, dim=DIM, heads=HEADS, max_len=n, **options)
    return layer.double()


def run(layer, x, mask=None, seed=1):
    torch.manual_seed(seed)  # same draws for stochastic mechanisms
    return layer(x, mask)


def test_registry_lists_softmax_and_is_sorted():
    assert "softmax" in NAMES
    assert NAMES == sorted(NAMES)


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("n", [1, 7, 1000, 1023])
def test_shapes_finite_and_gradients(name, n):
    layer = make(name, n)
    x = torch.randn(2, n, DIM, dtype=torch.float64, requires_grad=True)
    out = run(layer, x)
    assert out.shape == (2, n, DIM)
    assert torch.isfinite(out).all()
    out.square().sum().backward()
    assert torch.isfinite(x.grad).all()
    grads = [p.grad for p in layer.parameters() if p.requires_grad]
    assert all(g is None or torch.isfinite(g).all() for g in grads)


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision_training_step_with_padding_stays_finite(name, dtype):
    """Padded (all-zero) rows and near-constant channels are where half precision overflows or
    divides 0 by 0 (a norm's eps, 1 / variance); a training step must stay finite."""
    n = 300
    torch.manual_seed(0)
    layer = attention.build(name, dim=DIM, heads=HEADS, max_len=n).to(dtype).train()
    x = torch.randn(2, n, DIM, dtype=dtype, requires_grad=True)
    mask = torch.rand(2, n, generator=torch.Generator().manual_seed(3)) > 0.3
    mask[:, 250:] = False  # whole padded positions across the batch as well as scattered ones
    out = run(layer, x, mask)
    assert torch.isfinite(out).all()
    out.float().square().sum().backward()
    assert torch.isfinite(x.grad).all()
    assert all(p.grad is None or torch.isfinite(p.grad).all() for p in layer.parameters())


@pytest.mark.parametrize("name", NAMES)
def test_batch_independence(name):
    n = 257
    layer = make(name, n).eval()
    x = torch.randn(3, n, DIM, dtype=torch.float64)
    full = run(layer, x)
    if attention.capabilities(name).stochastic_eval:
        # Draws may depend on the batch size; compare a permuted batch under the same seed only
        # for shape/finiteness, the seed-equal check below covers determinism.
        assert torch.isfinite(full).all()
        torch.testing.assert_close(run(layer, x), full)
        return
    torch.testing.assert_close(run(layer, x[1:2]), full[1:2])
    x2 = x.clone()
    x2[0] += 1.0
    torch.testing.assert_close(run(layer, x2)[1:], full[1:])


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("where", ["suffix", "scattered"])
def test_padding_invariance(name, where):
    n = 301
    layer = make(name, n).eval()
    x = torch.randn(2, n, DIM, dtype=torch.float64)
    mask = torch.ones(2, n, dtype=torch.bool)
    if where == "suffix":
        mask[0, 200:] = False
        mask[1, 120:] = False
    else:
        g = torch.Generator().manual_seed(3)
        mask = torch.rand(2, n, generator=g) > 0.3
    out = run(layer, x, mask)
    x_changed = torch.where(mask[..., None], x, torch.randn_like(x) * 100)
    out_changed = run(layer, x_changed, mask)
    torch.testing.assert_close(out_changed[mask], out[mask])
    assert torch.all(out[~mask] == 0), "padded positions must be zero in the module form"
    assert torch.isfinite(out).all()


@pytest.mark.parametrize("name", NAMES)
def test_bad_inputs_raise_clear_errors(name):
    layer = make(name, 64)
    x = torch.randn(2, 64, DIM, dtype=torch.float64)
    with pytest.raises(AttentionError, match="B, N, dim"):
        layer(x[0])
    with pytest.raises(AttentionError, match="dim"):
        layer(torch.randn(2, 64, DIM + 1, dtype=torch.float64))
    with pytest.raises(AttentionError, match="floating"):
        layer(torch.ones(2, 64, DIM, dtype=torch.long))
    with pytest.raises(AttentionError, match="bool"):
        layer(x, torch.ones(2, 64))
    with pytest.raises(AttentionError, match="shape"):
        layer(x, torch.ones(2, 63, dtype=torch.bool))
    with pytest.raises(AttentionError, match="unknown option"):
        attention.build(name, dim=DIM, heads=HEADS, max_len=64, no_such_option=1)
    with pytest.raises(AttentionError, match="divisible"):
        attention.build(name, dim=DIM, heads=3, max_len=64)
    if not attention.capabilities(name).causal:
        with pytest.raises(AttentionError, match="causal"):
            attention.build(name, dim=DIM, heads=HEADS, max_len=64, causal=True)
    if attention.capabilities(name).needs_max_len:
        with pytest.raises(AttentionError, match="max_len"):
            layer(torch.randn(1, 65, DIM, dtype=torch.float64))
        with pytest.raises(AttentionError, match="max_len"):
            attention.build(name, dim=DIM, heads=HEADS)


def test_unknown_mechanism_lists_the_valid_names():
    with pytest.raises(AttentionError, match="available: .*softmax"):
        attention.build("no-such-attention", dim=DIM, heads=HEADS)


SUBQUADRATIC = [n for n in NAMES if attention.capabilities(n).subquadratic]


def largest_intermediate(name, n):
    torch.manual_seed(0)
    layer = attention.build(name, dim=DIM, heads=1, max_len=n)
    x = torch.randn(1, n, DIM, requires_grad=True)
    mask = torch.ones(1, n, dtype=torch.bool)
    mask[0, -5:] = False
    with LargestTensorRecorder() as rec:
        layer(x, mask).sum().backward()
    return rec


@pytest.mark.parametrize("name", SUBQUADRATIC)
def test_no_quadratic_intermediate_forward_or_backward(name):
    n = 4096
    rec = largest_intermediate(name, n)
    # N^2/4 leaves room for legitimately wide linear terms (a 3 x 256 local window, BigBird's
    # 8 blocks of 64) while any N x N tensor fails; the growth check below is the sharper test.
    assert rec.max_numel <= n * n // 4, (
        f"{name} created a {rec.max_shape} tensor in {rec.max_op} at N={n}"
    )
    # and the largest tensor grows linearly, not quadratically, with N
    smaller = largest_intermediate(name, n // 2)
    assert rec.max_numel <= 2.5 * smaller.max_numel, (rec.max_shape, smaller.max_shape)


def test_recorder_sees_a_quadratic_intermediate_in_backward():
    from longattn.attention.softmax import softmax_attention_reference

    q, k, v = (torch.randn(1, 1, 512, 8, requires_grad=True) for _ in range(3))
    with LargestTensorRecorder() as rec:
        softmax_attention_reference(q, k, v).sum().backward()
    # the plain reference materialises the 512 x 512 score matrix: the recorder must see it
    assert rec.max_numel >= 512 * 512


def test_collect_aux_losses_sums_and_clears():
    layer = make("softmax", 8)
    layer.add_aux_loss("ortho", torch.tensor(1.0))
    model = torch.nn.Sequential(layer)
    assert attention.collect_aux_losses(model) == {"ortho": torch.tensor(1.0)}
    assert attention.collect_aux_losses(model) == {}
