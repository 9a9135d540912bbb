import io
import math

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from longattn import attention
from longattn.analysis import mu_incoherence
from longattn.attention import AttentionError
from longattn.attention.skeleton import (
    SkeletonAttention,
    draw_skeleton_indices,
    skeleton_attention,
    skeleton_attention_reference,
)
from longattn.attention.softmax import softmax_attention_reference

B, H, DH = 2, 3, 8


def qkv(n, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(B, H, n, DH, dtype=torch.float64, generator=g).requires_grad_() for _ in range(3)]


def norms(seed=1):
    g = torch.Generator().manual_seed(seed)
    return [
        (1 + 0.3 * torch.randn(H * DH, dtype=torch.float64, generator=g),
         0.3 * torch.randn(H * DH, dtype=torch.float64, generator=g))
        for _ in range(2)
    ]


def compare(n, mask, options):
    q, k, v = qkv(n)
    row_norm, column_norm = norms()
    rows = torch.tensor([0, 3, 5, n - 1, n + 4])  # n + 4: beyond N, i.e. padding
    columns = torch.tensor([1, 2, 6])
    common = dict(row_indices=rows, column_indices=columns, row_norm=row_norm, column_norm=column_norm, **options)
    out = skeleton_attention(q, k, v, mask, **common)
    ref = skeleton_attention_reference(q, k, v, mask, **common)
    torch.testing.assert_close(out, ref)
    g = torch.randn_like(out)
    inputs = (q, k, v, *row_norm, *column_norm)
    for p in inputs[3:]:
        p.requires_grad_()
    out = skeleton_attention(q, k, v, mask, **common)
    ref = skeleton_attention_reference(q, k, v, mask, **common)
    # a disabled branch leaves its LayerNorm parameters unused (gradient None in both)
    grads = torch.autograd.grad(out, inputs, g, allow_unused=True)
    grads_ref = torch.autograd.grad(ref, inputs, g, allow_unused=True)
    for a, r in zip(grads, grads_ref):
        assert (a is None) == (r is None)
        if a is not None:
            torch.testing.assert_close(a, r)


@pytest.mark.parametrize("n", [7, 33, 257])
@pytest.mark.parametrize("mask_padded_samples", [True, False])
@pytest.mark.parametrize("branches", ["both", "row", "column"])
def test_functional_matches_dense_formulas_with_the_same_indices(n, mask_padded_samples, branches):
    mask = torch.rand(B, n, generator=torch.Generator().manual_seed(n)) > 0.3
    mask[0, 3] = False  # a sampled position is padding in sequence 0
    options = dict(
        mask_padded_samples=mask_padded_samples,
        row_attention=branches != "column",
        column_attention=branches != "row",
    )
    compare(n, mask, options)
    compare(n, None, options)


def test_temperatures_and_per_sequence_column_scale():
    n = 19
    mask = torch.ones(B, n, dtype=torch.bool)
    mask[1, 11:] = False
    per_sequence = mask.sum(-1).double().rsqrt()
    compare(n, mask, dict(row_scale=0.7, column_scale=per_sequence))
    compare(n, mask, dict(column_scale=2.5))


def test_row_branch_with_every_token_sampled_is_softmax_attention():
    n = 41
    q, k, v = qkv(n, seed=3)
    mask = torch.rand(B, n, generator=torch.Generator().manual_seed(5)) > 0.2
    out = skeleton_attention(q, k, v, mask, row_indices=torch.arange(n), column_indices=torch.arange(DH),
                             column_attention=False)
    dense = softmax_attention_reference(q, k, v, mask)
    merged = dense.transpose(1, 2).reshape(B, n, H * DH)
    expected = F.layer_norm(merged, (H * DH,)).reshape(B, n, H, DH).transpose(1, 2) / 2
    torch.testing.assert_close(out, expected)


def test_column_branch_is_the_papers_formula_for_one_head():
    n = 13
    q, k, v = (t[0, 0] for t in qkv(n, seed=4))  # [n, Dh]
    columns = torch.tensor([0, 4, 7])
    p2 = torch.zeros(DH, 3, dtype=torch.float64)
    p2[columns, torch.arange(3)] = 1
    # V P2 softmax(P2^T K^T Q / sqrt(n)), softmax normalising each of the Dh columns over s2
    paper = v @ p2 @ torch.softmax(p2.T @ k.T @ q / math.sqrt(n), dim=0)
    out = skeleton_attention(q[None, None], k[None, None], v[None, None], row_indices=torch.tensor([0]),
                             column_indices=columns, row_attention=False)
    torch.testing.assert_close(out[0, 0], F.layer_norm(paper, (DH,)) / 2)


def test_all_sampled_tokens_padded_gives_finite_outputs_and_gradients():
    n = 10
    q, k, v = qkv(n)
    mask = torch.ones(B, n, dtype=torch.bool)
    mask[0, :5] = False
    indices = dict(row_indices=torch.tensor([1, 2, 4, n + 1]), column_indices=torch.tensor([0]))
    out = skeleton_attention(q, k, v, mask, **indices)
    out.sum().backward()
    assert all(torch.isfinite(t).all() for t in (out, q.grad, k.grad, v.grad))
    # sequence 0 has no real sampled token: its row branch is LayerNorm(0) = 0
    torch.testing.assert_close(out, skeleton_attention_reference(q, k, v, mask, **indices))
    column_only = skeleton_attention(q, k, v, mask, **indices, row_attention=False)
    torch.testing.assert_close(out[0], column_only[0])


def test_functional_rejects_bad_indices():
    q, k, v = qkv(5)
    with pytest.raises(AttentionError, match="column_indices"):
        skeleton_attention(q, k, v, row_indices=torch.tensor([0]), column_indices=torch.tensor([DH]))
    with pytest.raises(AttentionError, match="row_indices"):
        skeleton_attention(q, k, v, row_indices=torch.tensor([-1]), column_indices=torch.tensor([0]))
    with pytest.raises(AttentionError, match="row_indices"):
        skeleton_attention(q, k, v, row_indices=torch.tensor([0.0]), column_indices=torch.tensor([0]))
    with pytest.raises(AttentionError, match="row_attention or column_attention"):
        skeleton_attention(q, k, v, row_indices=torch.tensor([0]), column_indices=torch.tensor([0]),
                           row_attention=False, column_attention=False)


# ----------------------------------------------------------------------------- module form


def build(max_len, **options):
    torch.manual_seed(0)
    return attention.build("skeleton", dim=32, heads=2, max_len=max_len, **options).double()


def test_module_is_smoother_then_functional_core():
    layer = build(40, dropout=0.0, smoother_dropout=0.0).eval()
    x = torch.randn(2, 40, 32, dtype=torch.float64)
    mask = torch.rand(2, 40) > 0.3
    smoothed = layer.smoother(x, mask)
    q, k, v = layer.proj.qkv(smoothed)
    core = skeleton_attention_reference(
        q, k, v, mask, row_indices=layer.row_indices, column_indices=layer.column_indices,
        column_scale=1 / math.sqrt(40),
        row_norm=(layer.row_norm.weight, layer.row_norm.bias),
        column_norm=(layer.column_norm.weight, layer.column_norm.bias),
    )
    expected = layer.proj.out(core) * mask[..., None]
    torch.testing.assert_close(layer(x, mask), expected)


def test_indices_are_drawn_once_clipped_and_saved_with_the_model():
    layer = build(50, s1=1000, s2=1000)
    assert layer.row_indices.tolist() == list(range(50))  # s1 > max_len: every position
    assert layer.column_indices.tolist() == list(range(16))  # s2 > head dim: every coordinate
    layer = build(300).eval()
    assert layer.row_indices.numel() == 8 and layer.column_indices.numel() == 8
    assert torch.all(layer.row_indices.diff() > 0)
    x = torch.randn(1, 300, 32, dtype=torch.float64)
    buffer = io.BytesIO()
    torch.save(layer.state_dict(), buffer)
    torch.manual_seed(123)  # a fresh layer draws different indices...
    other = attention.build("skeleton", dim=32, heads=2, max_len=300).double().eval()
    assert not torch.equal(other.row_indices, layer.row_indices)
    buffer.seek(0)
    other.load_state_dict(torch.load(buffer))  # ...until it loads the saved ones
    torch.testing.assert_close(other(x), layer(x))


def test_resample_each_step_redraws_in_training_only():
    layer = build(500, resample_each_step=True)
    x = torch.randn(1, 500, 32, dtype=torch.float64)
    before = layer.row_indices.clone()
    layer(x)
    assert not torch.equal(layer.row_indices, before)
    layer.eval()
    drawn = layer.row_indices.clone()
    first = layer(x)
    assert torch.equal(layer.row_indices, drawn)
    torch.testing.assert_close(layer(x), first)  # eval is deterministic despite dropout options
    fixed = build(500)
    before = fixed.row_indices.clone()
    fixed(x)
    assert torch.equal(fixed.row_indices, before)


@pytest.mark.parametrize("mask_padded_samples", [True, False])
def test_short_sequence_equals_the_same_sequence_padded_to_max_len(mask_padded_samples):
    layer = build(64, s1=32, mask_padded_samples=mask_padded_samples).eval()
    x = torch.randn(2, 45, 32, dtype=torch.float64)
    mask = torch.zeros(2, 64, dtype=torch.bool)
    mask[:, :45] = True
    padded = layer(F.pad(x, (0, 0, 0, 19)), mask)
    torch.testing.assert_close(layer(x), padded[:, :45])


def test_masking_padded_samples_differs_from_only_zeroing_them():
    x = torch.randn(2, 64, 32, dtype=torch.float64)
    mask = torch.ones(2, 64, dtype=torch.bool)
    mask[0, 20:] = False
    masked = build(64, s1=32, mask_padded_samples=True).eval()
    zeroed = build(64, s1=32, mask_padded_samples=False).eval()
    assert (masked.row_indices >= 20).any()
    torch.testing.assert_close(masked(x, mask)[1], zeroed(x, mask)[1])  # no padding in sequence 1
    assert not torch.allclose(masked(x, mask)[0, :20], zeroed(x, mask)[0, :20])


def test_valid_column_scale_uses_the_number_of_real_tokens():
    layer = build(30, column_scale="valid", smoother=False).eval()
    x = torch.randn(2, 30, 32, dtype=torch.float64)
    mask = torch.ones(2, 30, dtype=torch.bool)
    mask[1, 17:] = False
    q, k, v = layer.proj.qkv(x)
    core = skeleton_attention(
        q, k, v, mask, row_indices=layer.row_indices, column_indices=layer.column_indices,
        column_scale=torch.tensor([30.0, 17.0], dtype=torch.float64).rsqrt(),
        row_norm=(layer.row_norm.weight, layer.row_norm.bias),
        column_norm=(layer.column_norm.weight, layer.column_norm.bias),
    )
    torch.testing.assert_close(layer(x, mask), layer.proj.out(core) * mask[..., None])


def test_table6_ablation_switches():
    full = build(16)
    assert full.smoother.fourier and full.smoother.conv_stem
    assert not build(16, fourier_conv=False).smoother.fourier
    assert not build(16, conv_stem=False).smoother.conv_stem
    assert build(16, fourier_conv=False, conv_stem=False).smoother is None
    assert build(16, smoother=False).smoother is None
    assert build(16, column_attention=False).column_norm is None
    assert build(16, row_attention=False).row_norm is None
    lra = build(16, smoother_segment_average=False, smoother_kernel_size=1, smoother_activation="elu")
    assert (lra.smoother.segments, lra.smoother.kernel_size, lra.smoother.activation) == (32, 1, "elu")
    x = torch.randn(2, 16, 32, dtype=torch.float64)
    for options in ({"fourier_conv": False}, {"conv_stem": False}, {"row_attention": False},
                    {"column_attention": False}, {"smoother": False}):
        assert build(16, **options)(x).shape == x.shape
    with pytest.raises(AttentionError, match="row_attention or column_attention"):
        build(16, row_attention=False, column_attention=False)


def test_bad_options_raise():
    for options, message in (({"s1": 0}, "s1"), ({"s2": 2.5}, "s2"), ({"column_scale": "n"}, "column_scale"),
                             ({"column_scale": -1.0}, "column_scale"), ({"row_scale": 0.0}, "row_scale"),
                             ({"dropout": 1.0}, "dropout"), ({"smoother_segments": 5}, "divisor")):
        with pytest.raises(AttentionError, match=message):
            build(16, **options)
    with pytest.raises(AttentionError, match="max_len"):
        SkeletonAttention(dim=32, heads=2)


def test_draw_skeleton_indices_is_seeded_and_without_replacement():
    torch.manual_seed(9)
    rows, columns = draw_skeleton_indices(100, 16, 30, 5)
    torch.manual_seed(9)
    again = draw_skeleton_indices(100, 16, 30, 5)
    assert torch.equal(rows, again[0]) and torch.equal(columns, again[1])
    assert rows.unique().numel() == 30 and columns.unique().numel() == 5


# ----------------------------------------------------------------------------- mu-incoherence


def test_mu_incoherence_extremes_and_invariances():
    n, d = 64, 16
    # a spike e_1 e_1^T has all its energy in one row and column: mu = max(n, d) / rank
    spike = torch.zeros(n, d)
    spike[0, 0] = 3.0
    assert mu_incoherence(spike, 1) == pytest.approx(n)
    # cosine-sampled (DFT-like) singular vectors spread the energy evenly: mu close to 1
    t = torch.arange(n, dtype=torch.float64)[:, None]
    f = torch.arange(d, dtype=torch.float64)[None, :]
    flat = torch.cos(2 * math.pi * t * 4 / n) * torch.cos(2 * math.pi * f * 2 / d)
    assert mu_incoherence(flat, 1) == pytest.approx(2.0)  # cos^2 peaks at twice its mean
    g = torch.Generator().manual_seed(0)
    x = torch.randn(n, d, generator=g)
    mu = mu_incoherence(x, 4)
    assert 1.0 <= mu <= n / 4
    assert mu_incoherence(5.0 * x, 4) == pytest.approx(mu)
    perm = torch.randperm(n, generator=g)
    assert mu_incoherence(x[perm], 4) == pytest.approx(mu)
    with pytest.raises(ValueError, match="rank"):
        mu_incoherence(x, 17)
    with pytest.raises(ValueError, match="2-D"):
        mu_incoherence(x[None], 4)


@pytest.mark.parametrize("length,padded,extra,batch", [
    (45, True, {}, 2), (64, False, {}, 2), (37, False, {"bias": False}, 2), (45, True, {"row_attention": False}, 2),
    (45, True, {"column_attention": False}, 2), (45, True, {"mask_padded_samples": False}, 2),
    (50, True, {"column_scale": "valid"}, 2), (33, False, {"smoother": False}, 2),
    (45, True, {}, 1), (46, False, {"smoother_kernel_size": 5}, 1),
])
def test_fused_smoother_path_is_exact_in_the_full_layer(length, padded, extra, batch, monkeypatch):
    """The layer with the fused stem and the tiled core against the module-by-module one: float64,
    every dropout on, several stem and core tiles, padding holding NaN; output and the gradient of
    x and of every parameter. At batch 1 the gradient of X^smooth lives in the frequency weights'
    gradient buffer; the stem writes the gradient of x over the core's gradient in both."""
    import longattn.attention.skeleton as skeleton_module
    import longattn.attention.smoother as smoother_module

    monkeypatch.setattr(smoother_module, "STEM_TILE", 16)
    monkeypatch.setattr(skeleton_module, "CORE_TILE", 16)
    torch.manual_seed(5)
    options = dict(dim=32, heads=2, max_len=64, dropout=0.2, smoother_dropout=0.3, **extra)
    fused = attention.build("skeleton", **options).double().train()
    plain = attention.build("skeleton", **options).double().train()
    plain.load_state_dict(fused.state_dict())
    plain.fused = False
    if plain.smoother is not None:
        plain.smoother.fused = False
    x = torch.randn(batch, length, 32, dtype=torch.float64, requires_grad=True)
    mask = None
    if padded:
        mask = torch.ones(batch, length, dtype=torch.bool)
        mask[-1, length - 9:] = False
        mask[0, 3] = False
        x.data[~mask] = float("nan")
    results = []
    for layer in (fused, plain):
        torch.manual_seed(11)
        out = layer(x, mask)
        g = torch.randn(out.shape, dtype=out.dtype, generator=torch.Generator().manual_seed(2))
        results.append((out, torch.autograd.grad(out, [x, *layer.parameters()], g)))
    (out_fused, grads_fused), (out_plain, grads_plain) = results
    assert torch.isfinite(out_fused).all()
    torch.testing.assert_close(out_fused, out_plain)
    for name, a, r in zip(["x"] + [n for n, _ in fused.named_parameters()], grads_fused, grads_plain):
        torch.testing.assert_close(a, r, msg=lambda m: f"{name}: {m}")


class _NewWholeSequenceBuffers(TorchDispatchMode):
    """Counts the fresh empty tensors of one shape and dtype made under it."""

    def __init__(self, shape: torch.Size, dtype: torch.dtype) -> None:
        super().__init__()
        self.shape, self.dtype, self.count = shape, dtype, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if (func in (torch.ops.aten.empty.memory_format, torch.ops.aten.empty_like.default)
                and out.shape == self.shape and out.dtype == self.dtype):
            self.count += 1
        return out


@pytest.mark.parametrize("kernel_size,batch,padded", [(3, 1, False), (5, 2, True), (1, 2, False)])
def test_stem_writing_the_gradient_of_x_over_the_incoming_one_changes_nothing(kernel_size, batch, padded,
                                                                              monkeypatch):
    """When only the layer's own core sees the gradient of the Smoother's output, the fused stem writes
    the gradient of x over it (keeping the k//2 rows each next tile reads): one whole-sequence buffer
    fewer in backward, and bitwise the same output and gradients as with a fresh buffer."""
    import longattn.attention.smoother as smoother_module

    monkeypatch.setattr(smoother_module, "STEM_TILE", 8)  # several tiles, one of them partial
    torch.manual_seed(21)
    layer = attention.build("skeleton", dim=16, heads=2, max_len=40, smoother_kernel_size=kernel_size,
                            dropout=0.2, smoother_dropout=0.3).double().train()
    x = torch.randn(batch, 37, 16, dtype=torch.float64, requires_grad=True)
    mask = None
    if padded:
        mask = torch.ones(batch, 37, dtype=torch.bool)
        mask[-1, 30:] = False
    results, fresh_buffers = [], []
    for observed in (False, True):
        monkeypatch.setattr(layer, "_smoother_observed", lambda observed=observed: observed)
        torch.manual_seed(22)
        out = layer(x, mask)
        with _NewWholeSequenceBuffers(x.shape, x.dtype) as recorder:
            grads = torch.autograd.grad(out, [x, *layer.parameters()], torch.ones_like(out))
        results.append((out, *grads))
        fresh_buffers.append(recorder.count)
    assert fresh_buffers[0] == fresh_buffers[1] - 1
    for private, observed in zip(*results):
        assert torch.equal(private, observed)


def test_a_hook_on_the_smoother_keeps_its_output_gradient_intact():
    """A module hook on the Smoother can hold the gradient of its output: the stem then leaves it alone
    (it equals the module path's), and a global module hook counts as well."""
    torch.manual_seed(23)
    fused = attention.build("skeleton", dim=16, heads=2, max_len=30, dropout=0.0, smoother_dropout=0.0).double().train()
    plain = attention.build("skeleton", dim=16, heads=2, max_len=30, dropout=0.0, smoother_dropout=0.0).double().train()
    plain.load_state_dict(fused.state_dict())
    plain.fused = plain.smoother.fused = False
    x = torch.randn(1, 30, 16, dtype=torch.float64, requires_grad=True)
    seen = []
    for layer in (fused, plain):
        handle = layer.smoother.register_full_backward_hook(lambda module, grad_in, grad_out: seen.append(grad_out[0]))
        assert layer._smoother_observed()
        layer(x).square().sum().backward()
        handle.remove()
    torch.testing.assert_close(seen[0], seen[1])
    assert not fused._smoother_observed()
    handle = torch.nn.modules.module.register_module_forward_hook(lambda module, args, out: None)
    try:
        assert fused._smoother_observed()
    finally:
        handle.remove()


def test_fused_core_in_eval_mode_and_float32_matches_the_module_path():
    torch.manual_seed(9)
    fused = attention.build("skeleton", dim=32, heads=2, max_len=300).eval()
    plain = attention.build("skeleton", dim=32, heads=2, max_len=300).eval()
    plain.load_state_dict(fused.state_dict())
    plain.fused = False
    x = torch.randn(3, 300, 32)
    torch.testing.assert_close(fused(x), plain(x), rtol=1e-4, atol=1e-5)


def test_reduced_precision_layer_stays_close_to_float32():
    torch.manual_seed(6)
    full = attention.build("skeleton", dim=64, heads=2, max_len=512, dropout=0.0, smoother_dropout=0.0).train()
    reduced = attention.build("skeleton", dim=64, heads=2, max_len=512, dropout=0.0, smoother_dropout=0.0,
                              precision="bf16").train()
    reduced.load_state_dict(full.state_dict())
    x = torch.randn(2, 512, 64, requires_grad=True)
    out_full, out_reduced = full(x), reduced(x)
    assert out_reduced.dtype == torch.float32
    assert 0 < ((out_reduced - out_full).norm() / out_full.norm()) < 2e-2
    with pytest.raises(AttentionError, match="precision"):
        attention.build("skeleton", dim=64, heads=2, max_len=8, precision="half")


@pytest.mark.parametrize("branches", [{}, {"row_attention": False}, {"column_attention": False}, {"bias": False}])
def test_module_gradients_match_smoother_projections_and_reference_core(branches):
    """The module (fused stem, sampled projections with their hand-written backward) against the
    plain Smoother, full Q/K/V projections and the dense reference core: every gradient, float64."""
    torch.manual_seed(8)
    layer = attention.build("skeleton", dim=32, heads=2, max_len=41, dropout=0.0, smoother_dropout=0.0,
                            **branches).double().train()
    x = torch.randn(2, 41, 32, dtype=torch.float64, requires_grad=True)
    mask = torch.rand(2, 41) > 0.3
    out = layer(x, mask)
    g = torch.randn_like(out)
    params = [x, *layer.parameters()]
    fast = torch.autograd.grad(out, params, g)
    layer.smoother.fused = False
    q, k, v = layer.proj.qkv(layer.smoother(x, mask))
    norms = {name: None if getattr(layer, name) is None else (getattr(layer, name).weight, getattr(layer, name).bias)
             for name in ("row_norm", "column_norm")}
    core = skeleton_attention_reference(
        q, k, v, mask, row_indices=layer.row_indices, column_indices=layer.column_indices,
        column_scale=1 / math.sqrt(41), row_attention=layer.row_attention, column_attention=layer.column_attention,
        **norms,
    )
    expected = layer.proj.out(core) * mask[..., None]
    torch.testing.assert_close(out, expected)
    slow = torch.autograd.grad(expected, params, g, allow_unused=True)
    for name, a, r in zip(["x"] + [n for n, _ in layer.named_parameters()], fast, slow):
        torch.testing.assert_close(a, torch.zeros_like(a) if r is None else r, msg=lambda m: f"{name}: {m}")


@pytest.mark.parametrize("masked", [False, True])
def test_gram_and_rows_alone_give_their_own_gradient(masked):
    """_GramAndRows without the core's gradient buffer (it then writes the whole gradient of s):
    G = s^T diag(m) s, sigma = s^T m and the sampled rows, against autograd of the plain formulas."""
    import longattn.attention.skeleton as skeleton_module

    torch.manual_seed(15)
    s = torch.randn(2, 37, 5, dtype=torch.float64, requires_grad=True)
    mask = (torch.rand(2, 37) > 0.3) if masked else None
    rows = torch.tensor([0, 4, 36])
    outputs = skeleton_module._GramAndRows.apply(s, mask, rows, skeleton_module._InputGradient())
    m = torch.ones(2, 37, dtype=torch.float64) if mask is None else mask.to(torch.float64)
    expected = (s.transpose(1, 2) @ (s * m[..., None]), (s * m[..., None]).sum(1), s[:, rows])
    grads = [torch.randn_like(t) for t in expected]
    for out, ref in zip(outputs, expected):
        torch.testing.assert_close(out, ref)
    (fast,) = torch.autograd.grad(outputs, [s], grads)
    (slow,) = torch.autograd.grad(expected, [s], grads)
    torch.testing.assert_close(fast, slow)


def test_fused_core_under_autocast_runs_its_own_dtypes_forward_and_backward():
    """Autocast active in forward and in backward: the tiled core keeps its products in float32 (its
    inputs from the Gram matrix and the sampled rows come through autocast's bf16), so its output and
    gradients stay close to the same layer without autocast."""
    torch.manual_seed(17)
    layer = attention.build("skeleton", dim=32, heads=2, max_len=40, dropout=0.0, smoother=False).train()
    s = torch.randn(2, 40, 32, requires_grad=True)
    plain = layer(s)
    (plain_grad,) = torch.autograd.grad(plain.sum(), [s])
    with torch.autocast("cpu", dtype=torch.bfloat16):
        cast = layer(s)
        (cast_grad,) = torch.autograd.grad(cast.sum(), [s])
    assert cast.dtype == torch.float32
    torch.testing.assert_close(cast, plain, rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(cast_grad, plain_grad, rtol=5e-2, atol=5e-2)
