"""FSAT / FAT: FFT cross vs eq. 2, merge vs eq. 4, sparse path vs an explicit L x L reference,
gradient truncation, eval/train index sets."""

import pytest
import torch
import torch.nn.functional as F

from longattn import attention
from longattn.attention import AttentionError, merge_heads, split_heads
from longattn.attention.fsat import (
    central_token_symmetry_merge,
    central_token_symmetry_merge_reference,
    fsat_sparse_attention,
    fsat_sparse_attention_reference,
    pooled_hidden_state_cross,
    pooled_hidden_state_cross_reference,
)
from longattn.attention.softmax import softmax_attention_reference

DIM, HEADS = 16, 2


def assert_same_forward_and_backward(fast_fn, ref_fn, inputs):
    out, ref = fast_fn(*inputs), ref_fn(*inputs)
    torch.testing.assert_close(out, ref)
    g = torch.randn_like(out)
    grads = torch.autograd.grad(out, inputs, g, allow_unused=True)
    grads_ref = torch.autograd.grad(ref, inputs, g, allow_unused=True)
    for a, r in zip(grads, grads_ref):
        torch.testing.assert_close(a, r)


# ----------------------------------------------------------------------------- pooled cross


@pytest.mark.parametrize("n", [1, 2, 7, 33, 100])
def test_fft_cross_is_the_linear_convolution_of_eq2(n):
    f1, f2 = (torch.randn(2, n, 5, dtype=torch.float64, requires_grad=True) for _ in range(2))
    assert_same_forward_and_backward(pooled_hidden_state_cross, pooled_hidden_state_cross_reference, (f1, f2))
    assert pooled_hidden_state_cross(f1, f2).shape == (2, 2 * n - 1, 5)


@pytest.mark.parametrize("n", [1, 2, 7, 33])
def test_merge_of_eq4_groups_crosses_by_central_token(n):
    f1, f2 = (torch.randn(2, n, 5, dtype=torch.float64, requires_grad=True) for _ in range(2))

    def fast(a, b):
        return central_token_symmetry_merge(pooled_hidden_state_cross(a, b), a, b)

    assert_same_forward_and_backward(fast, central_token_symmetry_merge_reference, (f1, f2))


def test_merge_worked_example_by_hand():
    x = torch.tensor([1.0, 2.0, 3.0, 4.0], dtype=torch.float64).view(1, 4, 1)
    # antidiagonal sums c_0..c_6 of x x^T: 1, 4, 10, 20, 25, 24, 16
    torch.testing.assert_close(
        pooled_hidden_state_cross(x, x).flatten(),
        torch.tensor([1.0, 4.0, 10.0, 20.0, 25.0, 24.0, 16.0], dtype=torch.float64),
    )
    # t: c_2t + c_2t+1 - x_t^2  ->  1+4-1, 10+20-4, 25+24-9, 16+0-16
    merged = central_token_symmetry_merge(pooled_hidden_state_cross(x, x), x, x)
    torch.testing.assert_close(merged.flatten(), torch.tensor([4.0, 26.0, 40.0, 0.0], dtype=torch.float64))


def test_cross_in_float32_and_bfloat16_is_close_to_float64(path):
    f1, f2 = torch.randn(2, 1, 300, 8, dtype=torch.float64)
    ref = pooled_hidden_state_cross_reference(f1, f2)
    torch.testing.assert_close(pooled_hidden_state_cross(f1.float(), f2.float()).double(), ref, rtol=1e-4, atol=1e-3)
    low = pooled_hidden_state_cross(f1.bfloat16(), f2.bfloat16())
    assert low.dtype == torch.bfloat16
    torch.testing.assert_close(low.double(), ref, rtol=0.05, atol=0.5)


# ----------------------------------------------------------------------------- sparse attention


def sparse_inputs(n, m=4, r=4, b=2, h=3, dh=8, seed=0, lmax=None, masked=True):
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(b, h, n, dh, generator=g, dtype=torch.float64, requires_grad=True) for _ in range(3))
    lmax = n if lmax is None else lmax
    dominant = (torch.rand(b, h, n, m, generator=g, dtype=torch.float64) * lmax).requires_grad_()
    random_index = torch.randint(0, n, (b, h, n, r), generator=g) if r else None
    mask = torch.rand(b, n, generator=g) > 0.25 if masked else None
    return q, k, v, dominant, random_index, mask


@pytest.mark.parametrize("n", [1, 7, 37, 101])
@pytest.mark.parametrize("truncate", [True, False])
@pytest.mark.parametrize("use_predicted,r", [(True, 4), (True, 0), (False, 4), (True, 6)])
def test_sparse_path_matches_explicit_matrix_reference(n, truncate, use_predicted, r, path):
    q, k, v, dominant, random_index, mask = sparse_inputs(n, r=r, seed=n)
    options = dict(random_index=random_index, use_predicted=use_predicted, truncate_gradient=truncate)

    def fast(q, k, v, dominant):
        return fsat_sparse_attention(q, k, v, mask, dominant_index=dominant, **options)

    def ref(q, k, v, dominant):
        return fsat_sparse_attention_reference(q, k, v, mask, dominant_index=dominant, **options)

    assert_same_forward_and_backward(fast, ref, (q, k, v, dominant))


def test_sparse_path_with_fixed_lmax_unnormalised_confidence_and_no_mask():
    n = 41
    q, k, v, dominant, random_index, _ = sparse_inputs(n, lmax=64, seed=5, masked=False)
    options = dict(random_index=random_index, lmax=64, sigma2=9.0, normalize_confidence=False, scale=0.3)

    def fast(q, k, v, dominant):
        return fsat_sparse_attention(q, k, v, dominant_index=dominant, **options)

    def ref(q, k, v, dominant):
        return fsat_sparse_attention_reference(q, k, v, dominant_index=dominant, **options)

    assert_same_forward_and_backward(fast, ref, (q, k, v, dominant))


def test_duplicate_edges_count_once():
    n = 5
    q, k, v = (torch.randn(1, 1, n, 4, dtype=torch.float64) for _ in range(3))
    dominant = torch.full((1, 1, n, 2), 2.5, dtype=torch.float64)  # both columns predict query 2
    once = fsat_sparse_attention(q, k, v, dominant_index=dominant[..., :1])
    twice = fsat_sparse_attention(q, k, v, dominant_index=dominant)
    again = fsat_sparse_attention(q, k, v, dominant_index=dominant[..., :1], random_index=torch.full((1, 1, n, 1), 2))
    torch.testing.assert_close(twice, once)
    torch.testing.assert_close(again, once)
    # every key chose query 2, so the other queries have no neighbours and output zero
    assert torch.all(once[0, 0, [0, 1, 3, 4]] == 0) and torch.all(once[0, 0, 2] != 0)


def test_gradient_truncation_drops_positive_confidence_gradients():
    n = 23
    q, k, _, dominant, random_index, mask = sparse_inputs(n, seed=1)
    value = torch.rand(2, 3, n, 8, dtype=torch.float64) + 0.1  # positive values: d(sum out)/d(confidence) > 0

    def dominant_grad(sign, truncate):
        out = fsat_sparse_attention(
            q, k, value, mask, dominant_index=dominant, random_index=random_index, truncate_gradient=truncate
        )
        return torch.autograd.grad(sign * out.sum(), dominant)[0]

    untruncated = dominant_grad(1.0, truncate=False)
    assert untruncated.abs().max() > 1e-6  # without truncation the confidence pushes I_bar around
    torch.testing.assert_close(dominant_grad(1.0, truncate=True), torch.zeros_like(dominant))
    # all-negative gradients pass unchanged
    torch.testing.assert_close(dominant_grad(-1.0, truncate=True), dominant_grad(-1.0, truncate=False))


def test_sparse_inputs_are_validated():
    q, k, v, dominant, random_index, mask = sparse_inputs(9)
    with pytest.raises(AttentionError, match="dominant_index"):
        fsat_sparse_attention(q, k, v, mask, dominant_index=dominant[:, :, :4])
    with pytest.raises(AttentionError, match="floating"):
        fsat_sparse_attention(q, k, v, mask, dominant_index=dominant.long())
    with pytest.raises(AttentionError, match="random_index"):
        fsat_sparse_attention(q, k, v, mask, dominant_index=dominant, random_index=random_index.double())
    with pytest.raises(AttentionError, match="sigma2"):
        fsat_sparse_attention(q, k, v, mask, dominant_index=dominant, sigma2=-1.0)
    with pytest.raises(AttentionError, match="no edges"):
        fsat_sparse_attention(q, k, v, mask, dominant_index=dominant, use_predicted=False)


# ----------------------------------------------------------------------------- module


def build(name="fsat", **options):
    torch.manual_seed(0)
    return attention.build(name, dim=DIM, heads=HEADS, **options).double()


def module_parts(layer, x, mask):
    """Recompute the module's C, Q, K, V and I_bar from its own parameters (eqs. 1-4, 6, 9)."""
    c = layer.cross(x, mask)
    q = split_heads(layer.to_q(x), HEADS)
    k, v = split_heads(layer.to_k(c), HEADS), split_heads(layer.to_v(c), HEADS)
    n = x.shape[1]
    logits = layer.to_index(c).view(x.shape[0], n, HEADS, layer.num_dominant).transpose(1, 2)
    return q, k, v, torch.sigmoid(logits) * n


def module_reference(layer, x, mask, random_index):
    """The module from the plain references: eqs. 1-4 with all L^2 crosses, eq. 6's projections,
    eq. 9, and the sparse attention with explicit N x N matrices."""
    keep = torch.ones_like(x[..., :1]) if mask is None else mask[..., None].to(x.dtype)
    xm = x * keep
    f1x, f2x = layer.cross.f1(xm) * keep, layer.cross.f2(xm) * keep
    norm = layer.cross.norm
    c = F.layer_norm(central_token_symmetry_merge_reference(f1x, f2x), norm.normalized_shape, norm.weight, norm.bias)
    b, n, _ = x.shape
    q = split_heads(layer.to_q(xm), HEADS)
    k, v = split_heads(layer.to_k(c), HEADS), split_heads(layer.to_v(c), HEADS)
    logits = layer.to_index(c).view(b, n, HEADS, layer.num_dominant).transpose(1, 2)
    out = fsat_sparse_attention_reference(
        q, k, v, mask, dominant_index=torch.sigmoid(logits) * n, random_index=random_index,
        use_predicted=not (layer.training and layer.train_indices == "random"),
        truncate_gradient=layer.truncate_gradient,
    )
    return layer.to_out(merge_heads(out)) * keep


@pytest.mark.parametrize("n", [1, 7, 37, 100])
@pytest.mark.parametrize("feature_map", ["dense", "conv"])
@pytest.mark.parametrize("training,masked,truncate", [(True, True, True), (False, True, True), (True, False, False)])
def test_module_matches_the_plain_references_with_every_gradient(n, feature_map, training, masked, truncate, path):
    """The fast module (the cross's own backward, K and V projected inside the edge blocks, the
    softmax over in-edges in one function) against autograd through the plain references: output,
    input gradient and every parameter's gradient, float64."""
    layer = build(feature_map=feature_map, truncate_gradient=truncate).train(training)
    g = torch.Generator().manual_seed(n)
    x = torch.randn(2, n, DIM, dtype=torch.float64, generator=g, requires_grad=True)
    mask = torch.rand(2, n, generator=g) > 0.3 if masked else None
    torch.manual_seed(7)
    out = layer(x, mask)
    torch.manual_seed(7)
    random_index = torch.randint(0, n, (2, HEADS, n, layer.num_random)) if training else None  # the module's draw
    expected = module_reference(layer, x, mask, random_index)
    torch.testing.assert_close(out, expected)
    weights = torch.randn(out.shape, dtype=torch.float64, generator=g)
    inputs = [x, *layer.parameters()]
    for got, want in zip(torch.autograd.grad(out, inputs, weights), torch.autograd.grad(expected, inputs, weights)):
        torch.testing.assert_close(got, want)


def test_eval_uses_only_predicted_indices_and_is_deterministic():
    layer = build().eval()
    x = torch.randn(2, 57, DIM, dtype=torch.float64)
    mask = torch.rand(2, 57) > 0.2
    torch.manual_seed(1)
    out = layer(x, mask)
    torch.manual_seed(2)
    torch.testing.assert_close(layer(x, mask), out)
    q, k, v, dominant = module_parts(layer, x, mask)
    expected = layer.to_out(merge_heads(fsat_sparse_attention_reference(q, k, v, mask, dominant_index=dominant)))
    torch.testing.assert_close(out, expected * mask[..., None])


@pytest.mark.parametrize("train_indices", ["union", "random"])
def test_training_adds_random_indices(train_indices):
    layer = build(num_random=3, train_indices=train_indices).train()
    n = 57
    x = torch.randn(2, n, DIM, dtype=torch.float64)
    torch.manual_seed(11)
    out = layer(x)
    torch.manual_seed(11)
    random_index = torch.randint(0, n, (2, HEADS, n, 3))  # the module's only random draw
    q, k, v, dominant = module_parts(layer, x, None)
    expected = fsat_sparse_attention_reference(
        q, k, v, dominant_index=dominant, random_index=random_index, use_predicted=train_indices == "union"
    )
    torch.testing.assert_close(out, layer.to_out(merge_heads(expected)))
    torch.manual_seed(12)
    assert not torch.allclose(layer(x), out)  # fresh random edges each training step
    assert not torch.allclose(layer.eval()(x), out)


def test_training_with_predicted_only_equals_eval():
    layer = build(train_indices="predicted")
    x = torch.randn(1, 40, DIM, dtype=torch.float64)
    torch.testing.assert_close(layer.train()(x), layer.eval()(x))


def test_truncate_gradient_option_reaches_the_index_predictor():
    x = torch.randn(2, 50, DIM, dtype=torch.float64)
    grads = []
    for truncate in (True, False):
        layer = build(truncate_gradient=truncate).eval()
        layer(x).square().sum().backward()
        grads.append(layer.to_index.weight.grad)
    assert not torch.allclose(grads[0], grads[1])


@pytest.mark.parametrize("name", ["fsat", "fat"])
def test_conv_feature_map_ignores_padding(name):
    layer = build(name, feature_map="conv").eval()
    x = torch.randn(2, 61, DIM, dtype=torch.float64)
    mask = torch.rand(2, 61, generator=torch.Generator().manual_seed(4)) > 0.3
    out = layer(x, mask)
    changed = layer(torch.where(mask[..., None], x, 100 * torch.randn_like(x)), mask)
    torch.testing.assert_close(changed[mask], out[mask])
    assert isinstance(layer.cross.f1.depthwise, torch.nn.Conv1d) and layer.cross.f1.depthwise.kernel_size == (5,)


def test_fixed_lmax_accepts_shorter_sequences():
    layer = build(lmax=128).eval()
    out = layer(torch.randn(1, 30, DIM, dtype=torch.float64))
    assert out.shape == (1, 30, DIM) and torch.isfinite(out).all()


def test_fat_is_dense_softmax_with_keys_and_values_from_the_cross(path):
    layer = build("fat").eval()
    x = torch.randn(2, 29, DIM, dtype=torch.float64, requires_grad=True)
    mask = torch.rand(2, 29) > 0.2
    out = layer(x, mask)
    keep = mask[..., None].double()
    xm = x * keep
    f1x, f2x = layer.cross.f1(xm) * keep, layer.cross.f2(xm) * keep
    c = F.layer_norm(
        central_token_symmetry_merge_reference(f1x, f2x), (DIM,), layer.cross.norm.weight, layer.cross.norm.bias
    )
    q = split_heads(layer.to_q(x), HEADS)
    k, v = split_heads(layer.to_k(c), HEADS), split_heads(layer.to_v(c), HEADS)
    expected = layer.to_out(merge_heads(softmax_attention_reference(q, k, v, mask))) * keep
    torch.testing.assert_close(out, expected)
    g = torch.randn_like(out)
    torch.testing.assert_close(torch.autograd.grad(out, x, g)[0], torch.autograd.grad(expected, x, g)[0])


@pytest.mark.parametrize(
    "options,match",
    [
        (dict(feature_map="fourier"), "feature_map"),
        (dict(conv_kernel_size=4), "conv_kernel_size"),
        (dict(feature_activation="swish"), "feature_activation"),
        (dict(num_dominant=0), "num_dominant"),
        (dict(num_random=-1), "num_random"),
        (dict(train_indices="all"), "train_indices"),
        (dict(num_random=0), "num_random > 0"),
        (dict(lmax=0), "lmax"),
        (dict(sigma2=0.0), "sigma2"),
    ],
)
def test_bad_options_raise(options, match):
    with pytest.raises(AttentionError, match=match):
        attention.build("fsat", dim=DIM, heads=HEADS, **options)


def test_registry_capabilities():
    fsat, fat = attention.capabilities("fsat"), attention.capabilities("fat")
    assert fsat.subquadratic and not fsat.stochastic_eval and not fsat.needs_max_len
    assert not fat.subquadratic


def test_dropped_edges_with_huge_scores_leave_gradients_finite():
    n = 6
    q, k, v = (torch.randn(1, 1, n, 4, dtype=torch.float64) for _ in range(3))
    dominant = torch.full((1, 1, n, 1), 3.5, dtype=torch.float64, requires_grad=True)  # every key -> query 3
    k[0, 0, 0] = 1e4 * q[0, 0, 3]  # key 0 is padding and would out-score every kept edge by far
    k.requires_grad_()
    mask = torch.ones(1, n, dtype=torch.bool)
    mask[0, 0] = False
    out = fsat_sparse_attention(q, k, v, mask, dominant_index=dominant)
    grads = torch.autograd.grad(out.square().sum(), (k, dominant))
    assert torch.isfinite(out).all() and all(torch.isfinite(g).all() for g in grads)
    assert torch.all(grads[0][0, 0, 0] == 0)
