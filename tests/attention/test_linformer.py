import pytest
import torch

from longattn import attention
from longattn.attention import AttentionError
from longattn.attention.linformer import (
    gaussian_sketch,
    linformer_attention,
    linformer_attention_reference,
    linformer_jl_attention,
    linformer_jl_attention_reference,
)
from longattn.attention.softmax import softmax_attention_reference
from longattn.testing import random_qkv, scattered_mask


@pytest.mark.parametrize("headwise", [True, False])
@pytest.mark.parametrize("n", [1, 37, 101])
def test_fast_matches_reference_forward_and_backward(headwise, n, path):
    max_len, k_dim, heads = 120, 16, 2  # n < max_len: the first n rows of E, F are used
    q, k, v = random_qkv(2, heads, n, 8)
    g = torch.Generator().manual_seed(4)
    shape = (max_len, k_dim) if headwise else (heads, max_len, k_dim)
    e = torch.randn(shape, generator=g, dtype=torch.float64, requires_grad=True)
    f = torch.randn(shape, generator=g, dtype=torch.float64, requires_grad=True)
    mask = scattered_mask(2, n, seed=1)
    out = linformer_attention(q, k, v, mask, proj_k=e, proj_v=f)
    ref = linformer_attention_reference(q, k, v, mask, proj_k=e, proj_v=f)
    torch.testing.assert_close(out, ref)
    grad = torch.randn_like(out)
    inputs = (q, k, v, e, f)
    for a, r in zip(torch.autograd.grad(out, inputs, grad), torch.autograd.grad(ref, inputs, grad)):
        torch.testing.assert_close(a, r)


def test_module_options_share_kv_and_per_head_projections():
    shared = attention.build("linformer", dim=16, heads=2, max_len=50, k=8, share_kv=True)
    assert shared.proj_v is None and shared.proj_k.shape == (50, 8)
    per_head = attention.build("linformer", dim=16, heads=2, max_len=50, k=8, headwise=False)
    assert per_head.proj_k.shape == (2, 50, 8) and per_head.proj_v.shape == (2, 50, 8)
    x = torch.randn(2, 31, 16)
    for layer in (shared, per_head):
        assert layer(x).shape == (2, 31, 16)


def test_shorter_input_uses_the_leading_rows_of_e_and_f():
    torch.manual_seed(0)
    long_layer = attention.build("linformer", dim=16, heads=2, max_len=64, k=8).double()
    short_layer = attention.build("linformer", dim=16, heads=2, max_len=20, k=8).double()
    short_layer.load_state_dict(
        {name: (t[:20] if name.startswith("proj_") else t) for name, t in long_layer.state_dict().items()}
    )
    x = torch.randn(2, 20, 16, dtype=torch.float64)
    torch.testing.assert_close(long_layer(x), short_layer(x))
    with pytest.raises(AttentionError, match="max_len"):
        short_layer(torch.randn(1, 21, 16, dtype=torch.float64))


def test_bad_options_raise():
    with pytest.raises(AttentionError, match="k must"):
        attention.build("linformer", dim=16, heads=2, max_len=10, k=0)
    q, k, v = (t.detach() for t in random_qkv(1, 2, 10, 4))
    with pytest.raises(AttentionError, match="proj_k"):
        linformer_attention(q, k, v, proj_k=torch.randn(5, 3), proj_v=torch.randn(10, 3))


def test_matches_the_linformer_package_with_the_same_weights():
    peer = pytest.importorskip("linformer", reason="linformer package not installed")
    dim, heads, max_len, k_dim = 32, 4, 96, 24
    for share_kv in (False, True):
        torch.manual_seed(0)
        theirs = peer.LinformerSelfAttention(dim, max_len, k=k_dim, heads=heads, share_kv=share_kv).double()
        ours = attention.build(
            "linformer", dim=dim, heads=heads, max_len=max_len, k=k_dim, share_kv=share_kv
        ).double()
        with torch.no_grad():
            for lin in (ours.proj.to_q, ours.proj.to_k, ours.proj.to_v):
                lin.bias.zero_()  # their q, k, v maps have no bias
            ours.proj.to_q.weight.copy_(theirs.to_q.weight)
            ours.proj.to_k.weight.copy_(theirs.to_k.weight)
            # their share_kv also reuses the key map for values (V = K); the paper shares only E = F
            ours.proj.to_v.weight.copy_((theirs.to_k if share_kv else theirs.to_v).weight)
            ours.proj.to_out.weight.copy_(theirs.to_out.weight)
            ours.proj.to_out.bias.copy_(theirs.to_out.bias)  # their output layer has a bias
            ours.proj_k.copy_(theirs.proj_k)  # both store E^T as [seq_len, k]
            if not share_kv:
                ours.proj_v.copy_(theirs.proj_v)
        for n in (max_len, 41):  # full length and a shorter input (both slice E, F to n rows)
            x = torch.randn(2, n, dim, dtype=torch.float64)
            torch.testing.assert_close(ours(x), theirs(x))


# ------------------------------------------------------------------ linformer_jl


@pytest.mark.parametrize("n", [1, 57, 203])
def test_jl_fast_matches_reference_forward_and_backward(n, path):
    q, k, v = random_qkv(2, 2, n, 8)
    sketch = gaussian_sketch(n, 12, dtype=torch.float64, device=torch.device("cpu"))
    mask = scattered_mask(2, n, seed=1)
    out = linformer_jl_attention(q, k, v, mask, sketch=sketch)
    ref = linformer_jl_attention_reference(q, k, v, mask, sketch=sketch)
    torch.testing.assert_close(out, ref)
    grad = torch.randn_like(out)
    for a, r in zip(torch.autograd.grad(out, (q, k, v), grad), torch.autograd.grad(ref, (q, k, v), grad)):
        torch.testing.assert_close(a, r)


def test_jl_sketch_is_unbiased_and_large_sketches_recover_softmax_attention():
    torch.manual_seed(0)
    s = gaussian_sketch(30, 40000, dtype=torch.float64, device=torch.device("cpu"))
    torch.testing.assert_close(s @ s.T, torch.eye(30, dtype=torch.float64), atol=0.03, rtol=0)
    q, k, v = (t.detach() for t in random_qkv(1, 1, 30, 8))
    errors = []
    for d in (4, 40000):
        torch.manual_seed(1)
        sketch = gaussian_sketch(30, d, dtype=torch.float64, device=torch.device("cpu"))
        errors.append((linformer_jl_attention(q, k, v, sketch=sketch) - softmax_attention_reference(q, k, v)).abs().max())
    assert errors[1] < 0.05 and errors[1] < errors[0] / 5, errors


def test_jl_module_is_reproducible_under_a_seed_and_marked_quadratic():
    assert attention.capabilities("linformer_jl").subquadratic is False
    assert attention.capabilities("linformer_jl").stochastic_eval is True
    layer = attention.build("linformer_jl", dim=16, heads=2, sketch_dim=8).eval()
    x = torch.randn(2, 20, 16)
    torch.manual_seed(3)
    a = layer(x)
    torch.manual_seed(3)
    torch.testing.assert_close(layer(x), a)
    with pytest.raises(AttentionError, match="sketch_dim"):
        attention.build("linformer_jl", dim=16, heads=2, sketch_dim=0)
