"""Reliability of the attention interface (issue 13): padded positions never leak, whatever they
hold; dtype mismatches, empty batches and non-finite inputs give clear errors or documented results.

Every registered mechanism is covered, module form and functional form, forward and backward.
"""

import sys

import pytest
import torch

from longattn import attention
from longattn.attention import AttentionError, check_finite
from reliability import (ATTENTION_AUTOCAST, ATTENTION_DTYPE, ATTENTION_EMPTY, ATTENTION_FINITE, ATTENTION_FUNCTIONAL,
                         ATTENTION_PADDING, CLEAR_ERROR, CORRECT_RESULT, bad_input)

NAMES = attention.available()
FUNCTIONAL_NAMES = [n for n in NAMES if attention.get_spec(n).functional is not None]
DIM, HEADS, N = 32, 2, 301
POISONS = [float("nan"), float("inf"), 1e30]
# Options that make a module call its registered functional form at N = 301 (bigbird's default
# 64-token blocks fall back to dense softmax below 8 blocks).
CALLS_FUNCTIONAL = {"bigbird": {"block_size": 16}}


def make(name, **options):
    torch.manual_seed(0)
    return attention.build(name, dim=DIM, heads=HEADS, max_len=N, **options).double().eval()


def inputs():
    g = torch.Generator().manual_seed(3)
    x = torch.randn(2, N, DIM, dtype=torch.float64, generator=g)
    mask = torch.rand(2, N, generator=g) > 0.3
    mask[1, 250:] = False  # a padded suffix as well as scattered padding
    return x, mask


def poisoned(t, keep, value):
    """A leaf copy of ``t`` holding ``value`` wherever ``keep`` (broadcast) is False."""
    return torch.where(keep, t, torch.full_like(t, value)).detach().requires_grad_(True)


def forward_backward(layer, x, mask):
    layer.zero_grad()
    x = x.detach().requires_grad_(True)
    torch.manual_seed(1)  # the same draws for stochastic mechanisms
    out = layer(x, mask)
    out.square().sum().backward()
    grads = {k: p.grad.clone() for k, p in layer.named_parameters() if p.grad is not None}
    return out.detach(), x.grad, grads


@bad_input(ATTENTION_PADDING, CORRECT_RESULT)
@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("poison", POISONS, ids=["nan", "inf", "1e30"])
def test_module_padded_values_never_reach_real_outputs_or_gradients(name, poison):
    layer = make(name).train()  # training paths too: dropout, resampling, auxiliary losses
    x, mask = inputs()
    clean_out, clean_xgrad, clean_grads = forward_backward(layer, x, mask)
    out, xgrad, grads = forward_backward(layer, poisoned(x, mask[..., None], poison), mask)
    torch.testing.assert_close(out[mask], clean_out[mask])
    assert torch.all(out[~mask] == 0), "padded outputs must be zeros"
    torch.testing.assert_close(xgrad, clean_xgrad)
    assert torch.all(xgrad[~mask] == 0)
    assert grads.keys() == clean_grads.keys()
    for key in grads:
        torch.testing.assert_close(grads[key], clean_grads[key], msg=key)


def _recorded_call(name):
    """The arguments the module form passes to its registered functional form."""
    spec = attention.get_spec(name)
    module = sys.modules[spec.module_cls.__module__]
    original, calls = getattr(module, spec.functional.__name__), []

    def record(*args, **kwargs):
        calls.append((args, kwargs))
        return original(*args, **kwargs)

    layer = make(name, **CALLS_FUNCTIONAL.get(name, {}))
    x, mask = inputs()
    setattr(module, spec.functional.__name__, record)
    try:
        torch.manual_seed(1)
        layer(x, mask)
    finally:
        setattr(module, spec.functional.__name__, original)
    return calls, layer, x, mask


def _direct_call(name, layer, x, mask):
    """Arguments for the functional forms that the module form does not call as such."""
    q, k, v = (attention.split_heads(torch.randn_like(x), HEADS) for _ in range(3))
    if name == "skeleton":
        layer.resample()
        options = {"row_indices": layer.row_indices, "column_indices": layer.column_indices}
    elif name == "singular":
        options = {"factor_logits": layer.factor_logits(x).detach()}
    elif name == "luna":
        options = {"pack_query": torch.randn(2, HEADS, 16, DIM // HEADS, dtype=x.dtype)}
    elif name == "bigbird":
        options = {"random_idx": layer.random_idx(-(-x.shape[1] // layer.block_size)), "block_size": layer.block_size}
    elif name == "dsa":  # its module form selects once for the attention and the indexer's loss
        index_query, index_key, index_weights = (t.detach() for t in layer.indexer(q, k))
        options = {"index_query": index_query, "index_key": index_key, "index_weights": index_weights, "top_k": 5}
    elif name in ("local", "longformer"):  # their module forms project inside the chunks
        options = {}
    elif name in ("deltanet", "gated_deltanet"):  # called from their shared layer, attention/ops/delta_layer.py
        b, n = x.shape[:2]
        options = {"beta": torch.rand(b, HEADS, n, dtype=x.dtype), "log_decay": -torch.rand(b, HEADS, n, dtype=x.dtype)}
    elif name in ("gla", "mamba2"):  # called from their shared layer, attention/ops/gated_layer.py
        b, n = x.shape[:2]
        decay_width = q.shape[-1] if name == "gla" else 1  # GLA decays per key channel, Mamba-2 per head
        log_decay = -torch.rand(b, HEADS, n, decay_width, dtype=x.dtype)
        return (q, k, v, log_decay, mask), {}
    elif name == "fsat":  # its module form projects K and V inside the edge blocks
        b, n = x.shape[:2]
        options = {"dominant_index": torch.rand(b, HEADS, n, layer.num_dominant, dtype=x.dtype) * n}
    else:
        raise AssertionError(f"{name}: add the arguments of its functional form to this test")
    return (q, k, v, mask), options


def functional_arguments(name):
    calls, layer, x, mask = _recorded_call(name)
    if calls:
        args, options = calls[0]
    else:
        args, options = _direct_call(name, layer, x, mask)
    detach = lambda t: t.detach() if isinstance(t, torch.Tensor) else t  # noqa: E731
    return [detach(a) for a in args], {k: detach(v) for k, v in options.items()}, mask


@bad_input(ATTENTION_FUNCTIONAL, CORRECT_RESULT)
@pytest.mark.parametrize("name", FUNCTIONAL_NAMES)
@pytest.mark.parametrize("poison", POISONS, ids=["nan", "inf", "1e30"])
def test_functional_padded_values_never_reach_real_outputs_or_gradients(name, poison):
    fn = attention.get_spec(name).functional
    args, options, mask = functional_arguments(name)
    keep = mask[:, None, :, None]
    sequences = [i for i, a in enumerate(args) if isinstance(a, torch.Tensor) and a.dim() == 4]

    def run(fill):
        call = list(args)
        for i in sequences:
            call[i] = poisoned(args[i], keep, 0.0) if fill is None else poisoned(args[i], keep, fill)
        torch.manual_seed(1)
        out = fn(*call, **options)
        out = out[0] if isinstance(out, tuple) else out
        out.square().sum().backward()
        return out.detach(), [call[i].grad for i in sequences]

    clean_out, clean_grads = run(None)
    out, grads = run(poison)
    real = keep.expand_as(out)
    torch.testing.assert_close(out[real], clean_out[real])
    assert torch.all(out[~real] == 0), "padded query rows must be zeros"
    for grad, clean in zip(grads, clean_grads):
        if clean is None:  # an argument the mechanism does not use (vmean's queries and keys)
            assert grad is None
            continue
        torch.testing.assert_close(grad, clean)
        assert torch.all(grad[~keep.expand_as(grad)] == 0)


@bad_input(ATTENTION_FUNCTIONAL, CORRECT_RESULT)
def test_functional_leaves_queries_of_another_length_alone():
    """The key mask applies to queries only in self-attention (queries of the keys' length)."""
    q = torch.randn(2, 2, 5, 8, dtype=torch.float64)
    k, v = torch.randn(2, 2, 9, 8, dtype=torch.float64), torch.randn(2, 2, 9, 8, dtype=torch.float64)
    mask = torch.ones(2, 9, dtype=torch.bool)
    mask[0, 4:] = False
    fn = attention.get_spec("softmax").functional
    out = fn(q, k, v, mask)
    assert torch.all(out.abs().sum(-1) > 0)
    torch.testing.assert_close(out, attention.get_spec("softmax").reference(q, k, v, mask))


def _dtype_case(name):
    """A mechanism with parameters refuses bf16 and float64 input (2 errors); one without takes any (1 result)."""
    has_parameters = any(p.is_floating_point() for p in attention.build(name, dim=DIM, heads=HEADS, max_len=64)
                         .parameters())
    mark = bad_input(ATTENTION_DTYPE, CLEAR_ERROR, 2) if has_parameters else bad_input(ATTENTION_DTYPE, CORRECT_RESULT)
    return pytest.param(name, marks=mark)


@pytest.mark.parametrize("name", [_dtype_case(name) for name in NAMES])
def test_input_dtype_differing_from_the_layer_is_a_clear_error(name):
    layer = attention.build(name, dim=DIM, heads=HEADS, max_len=64)
    x = torch.randn(2, 64, DIM, dtype=torch.bfloat16)
    if not any(p.is_floating_point() for p in layer.parameters()):
        assert layer(x).dtype == torch.bfloat16  # parameter-free (fnet): any floating dtype
        return
    with pytest.raises(AttentionError, match="differs from the torch.float32 parameters"):
        layer(x)
    with pytest.raises(AttentionError, match="differs from the torch.float32 parameters"):
        layer(x.double())


@bad_input(ATTENTION_AUTOCAST, CORRECT_RESULT, cases=2)
@pytest.mark.parametrize("name", NAMES)
def test_autocast_keeps_working_with_any_input_dtype(name):
    layer = attention.build(name, dim=DIM, heads=HEADS, max_len=64)
    mask = torch.ones(2, 64, dtype=torch.bool)
    mask[0, 40:] = False
    for dtype in (torch.float32, torch.bfloat16):
        x = torch.randn(2, 64, DIM, dtype=dtype, requires_grad=True)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = layer(x, mask)
        assert out.shape == x.shape and torch.isfinite(out).all()
        out.float().sum().backward()
        assert torch.isfinite(x.grad).all()


@bad_input(ATTENTION_EMPTY, CORRECT_RESULT)
@pytest.mark.parametrize("name", NAMES)
def test_empty_batch_gives_an_empty_result(name):
    layer = attention.build(name, dim=DIM, heads=HEADS, max_len=64)
    x = torch.randn(0, 64, DIM, requires_grad=True)
    out = layer(x, torch.ones(0, 64, dtype=torch.bool))
    assert out.shape == (0, 64, DIM) and out.dtype == x.dtype
    out.sum().backward()
    assert x.grad.shape == x.shape


@bad_input(ATTENTION_FINITE, CORRECT_RESULT)  # NaN at a padded position: the same result
@bad_input(ATTENTION_FINITE, CLEAR_ERROR, cases=2)  # inf at a real position, with a mask and without
@pytest.mark.parametrize("name", NAMES)
def test_check_finite_mode_raises_on_real_positions_only(name):
    layer = make(name)
    x, mask = inputs()
    padded = torch.nonzero(~mask)[0].tolist()
    x[padded[0], padded[1], 0] = float("nan")
    torch.manual_seed(1)
    off = layer(x, mask)  # off by default: padded NaN is masked, nothing raised
    with check_finite():
        torch.manual_seed(1)
        torch.testing.assert_close(layer(x, mask), off)  # padded NaN is not an error
        real = torch.nonzero(mask)[5].tolist()
        x[real[0], real[1], 3] = float("inf")
        with pytest.raises(AttentionError, match=rf"non-finite value \(inf\) .*batch {real[0]}, token {real[1]}"):
            layer(x, mask)
    assert layer(x, mask).shape == x.shape  # off again outside the block: no error
    with pytest.raises(AttentionError, match="non-finite"), check_finite():
        layer(x)


@bad_input(ATTENTION_FINITE, CORRECT_RESULT)
@bad_input(ATTENTION_FINITE, CLEAR_ERROR)
def test_check_finite_mode_covers_the_functional_form():
    q = torch.randn(1, 2, 10, 8)
    mask = torch.ones(1, 10, dtype=torch.bool)
    mask[0, 7:] = False
    q[0, 1, 8, 0] = float("nan")  # padded: fine
    fn = attention.get_spec("softmax").functional
    with check_finite():
        assert torch.isfinite(fn(q, q, q, mask)).all()
        q[0, 0, 2, 5] = float("-inf")
        with pytest.raises(AttentionError, match=r"query holds a non-finite value \(-inf\).*token 2"):
            fn(q, q, q, mask)
    assert not torch.isfinite(fn(q, q, q, mask)).all()  # off again outside the block
