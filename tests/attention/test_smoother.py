import math

import pytest
import torch
import torch.nn.functional as F

from longattn.attention import AttentionError
from longattn.attention.smoother import MaskedBatchNorm, Smoother

DIM = 16


def direct_kernel(frequency_weight: torch.Tensor, length: int) -> torch.Tensor:
    """The real circular-convolution kernel [length, dim] whose rFFT is L, by an explicit DFT sum."""
    a, b = frequency_weight[..., 0], frequency_weight[..., 1]  # [F, dim]
    k = torch.arange(a.shape[0], dtype=a.dtype)
    # a real signal's spectrum counts every bin twice except DC and (even length) Nyquist
    multiplicity = torch.full_like(k, 2.0)
    multiplicity[0] = 1.0
    if length % 2 == 0:
        multiplicity[-1] = 1.0
    t = torch.arange(length, dtype=a.dtype)
    angle = 2 * math.pi * t[:, None] * k[None, :] / length  # [T, F]
    return (torch.cos(angle) @ (multiplicity[:, None] * a) - torch.sin(angle) @ (multiplicity[:, None] * b)) / length


def direct_fourier_smooth(smoother: Smoother, x: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    """Eq. (5) as an O(max_len^2) circular convolution of the segment-averaged, zero-padded input."""
    b, n, d = x.shape
    m = smoother.max_len
    if mask is not None:
        x = x * mask[..., None].to(x.dtype)
    s = d // smoother.segments
    averaging = torch.block_diag(*[torch.full((s, s), 1.0 / s, dtype=x.dtype)] * smoother.segments)  # S, eq. (6)
    xs = F.pad(x @ averaging, (0, 0, 0, m - n))  # [B, max_len, d]
    kernel = direct_kernel(smoother.frequency_weight, m)  # [max_len, d]
    t = torch.arange(m)
    circulant = kernel[(t[:, None] - t[None, :]) % m]  # [T, J, d]: kernel[(t - j) mod M]
    return torch.einsum("tjd,bjd->btd", circulant, xs)[:, :n]


@pytest.mark.parametrize("max_len,n,segments", [(37, 37, 4), (37, 29, 2), (40, 33, 16), (40, 40, 1)])
def test_fourier_convolution_matches_direct_circular_convolution(max_len, n, segments):
    torch.manual_seed(0)
    smoother = Smoother(DIM, max_len, segments=segments).double()
    x = torch.randn(2, n, DIM, dtype=torch.float64, requires_grad=True)
    mask = torch.rand(2, n) > 0.25
    fast = smoother.fourier_smooth(x, mask)
    slow = direct_fourier_smooth(smoother, x, mask)
    torch.testing.assert_close(fast, slow)
    g = torch.randn_like(fast)
    params = (x, smoother.frequency_weight)
    grads_fast = torch.autograd.grad(fast, params, g)
    grads_slow = torch.autograd.grad(slow, params, g)
    for a, r in zip(grads_fast, grads_slow):
        torch.testing.assert_close(a, r)


def reference_smoother(smoother: Smoother, x: torch.Tensor) -> torch.Tensor:
    """The authors' pipeline on a full-length unpadded batch, with torch's own BatchNorm1d."""
    smoothed = direct_fourier_smooth(smoother, x, None)
    h = F.conv1d(torch.cat((smoothed, x), -1).transpose(1, 2), smoother.stem_conv.weight,
                 smoother.stem_conv.bias, padding=smoother.kernel_size // 2).transpose(1, 2)
    norm = smoother.stem_norm
    if norm.over == "positions":  # BatchNorm1d(max_len) on [B, max_len, dim], as in Algorithm 2
        h = F.batch_norm(h, None, None, norm.weight, norm.bias, training=True, eps=norm.eps)
    else:
        h = F.batch_norm(h.transpose(1, 2), None, None, norm.weight, norm.bias, training=True,
                         eps=norm.eps).transpose(1, 2)
    return F.elu(h) if smoother.activation == "elu" else F.relu(h)


@pytest.mark.parametrize("over", ["positions", "features"])
@pytest.mark.parametrize("kernel_size,activation", [(3, "relu"), (1, "elu"), (5, "relu")])
def test_full_smoother_matches_reference_forward_and_backward(over, kernel_size, activation):
    torch.manual_seed(1)
    smoother = Smoother(DIM, 23, kernel_size=kernel_size, activation=activation, dropout=0.0,
                        batchnorm_over=over).double()
    with torch.no_grad():
        smoother.stem_norm.weight.uniform_(0.5, 1.5)
        smoother.stem_norm.bias.uniform_(-0.5, 0.5)
    x = torch.randn(3, 23, DIM, dtype=torch.float64, requires_grad=True)
    out = smoother(x)
    ref = reference_smoother(smoother, x)
    torch.testing.assert_close(out, ref)
    g = torch.randn_like(out)
    params = [x] + [p for p in smoother.parameters()]
    for a, r in zip(torch.autograd.grad(out, params, g), torch.autograd.grad(ref, params, g)):
        torch.testing.assert_close(a, r)


def test_running_statistics_match_torch_batchnorm():
    torch.manual_seed(2)
    smoother = Smoother(DIM, 11, dropout=0.0).double()
    torch_bn = torch.nn.BatchNorm1d(11).double()
    x = torch.randn(4, 11, DIM, dtype=torch.float64)
    smoother(x)
    with torch.no_grad():
        smoothed = smoother.fourier_smooth(x)
        torch_bn(smoother.stem_conv(torch.cat((smoothed, x), -1).transpose(1, 2)).transpose(1, 2))
    torch.testing.assert_close(smoother.stem_norm.running_mean, torch_bn.running_mean)
    torch.testing.assert_close(smoother.stem_norm.running_var, torch_bn.running_var)


@pytest.mark.parametrize("training", [True, False])
@pytest.mark.parametrize("over", ["positions", "features"])
def test_padding_never_leaks_even_into_training_batch_statistics(training, over):
    torch.manual_seed(3)
    smoother = Smoother(DIM, 31, dropout=0.0, batchnorm_over=over).double().train(training)
    x = torch.randn(3, 31, DIM, dtype=torch.float64)
    mask = torch.rand(3, 31) > 0.3
    out = smoother(x, mask)
    x_changed = torch.where(mask[..., None], x, 1e3 * torch.randn_like(x))
    torch.testing.assert_close(smoother(x_changed, mask)[mask], out[mask])
    assert torch.all(out[~mask] == 0)


@pytest.mark.parametrize("training", [True, False])
def test_short_input_equals_input_padded_to_max_len(training):
    torch.manual_seed(4)
    smoother = Smoother(DIM, 50, dropout=0.0).double().train(training)
    x = torch.randn(2, 35, DIM, dtype=torch.float64)
    padded = F.pad(x, (0, 0, 0, 15))
    mask = torch.zeros(2, 50, dtype=torch.bool)
    mask[:, :35] = True
    torch.testing.assert_close(smoother(x), smoother(padded, mask)[:, :35])


def test_fft_norm_choices_give_the_same_round_trip():
    torch.manual_seed(5)
    x = torch.randn(2, 19, DIM, dtype=torch.float64)
    outs = []
    for norm in ("backward", "ortho", "forward"):
        torch.manual_seed(6)
        outs.append(Smoother(DIM, 24, fft_norm=norm, dropout=0.0).double().fourier_smooth(x))
    torch.testing.assert_close(outs[0], outs[1])
    torch.testing.assert_close(outs[0], outs[2])


def test_ablations_and_lra_variant():
    torch.manual_seed(7)
    x = torch.randn(2, 9, DIM)
    no_stem = Smoother(DIM, 9, conv_stem=False, dropout=0.0)
    assert not hasattr(no_stem, "stem_conv")
    torch.testing.assert_close(no_stem(x), no_stem.fourier_smooth(x))
    no_fourier = Smoother(DIM, 9, fourier=False)
    assert not hasattr(no_fourier, "frequency_weight") and no_fourier.stem_conv.in_channels == DIM
    assert no_fourier(x).shape == x.shape
    with pytest.raises(AttentionError, match="fourier"):
        Smoother(DIM, 9, fourier=False, conv_stem=False)
    lra = Smoother.lra_variant(DIM, 9, dropout=0.1)
    assert (lra.segments, lra.kernel_size, lra.activation, lra.dropout.p) == (DIM, 1, "elu", 0.1)
    # without segment averaging each feature is its own segment: XS = X
    torch.testing.assert_close(lra.segment_average_of(x), x)
    # the paper's segment average: r groups of dim/r consecutive features (eq. 6)
    paper = Smoother(DIM, 9)
    torch.testing.assert_close(paper.segment_average_of(x), x.reshape(2, 9, 8, 2).mean(-1))
    ts = Smoother(DIM, 9, segments=8, fft_norm="ortho", kernel_size=3, activation="elu")
    assert ts(x).shape == x.shape


def test_eval_is_deterministic_and_training_is_dropped_out():
    torch.manual_seed(8)
    smoother = Smoother(DIM, 20)  # paper default dropout 0.5
    x = torch.randn(2, 20, DIM)
    smoother.train()
    smoother(x)
    smoother.eval()
    torch.testing.assert_close(smoother(x), smoother(x))


def test_training_dropout_drops_a_fraction_p_and_rescales_the_rest():
    torch.manual_seed(11)
    smoother = Smoother(DIM, 64, conv_stem=False, dropout=0.3).double()
    x = torch.randn(2, 64, DIM, dtype=torch.float64)
    mask = torch.rand(2, 64) > 0.2
    kept = smoother.eval()(x, mask)
    dropped = smoother.train()(x, mask)
    zeroed = (dropped == 0) & mask[..., None]
    assert abs(zeroed.double().mean().item() / mask.double().mean().item() - 0.3) < 0.05
    torch.testing.assert_close(dropped[~zeroed], kept[~zeroed] / 0.7)
    assert torch.all(dropped[~mask] == 0)


def test_bad_options_and_inputs_raise():
    with pytest.raises(AttentionError, match="divisor"):
        Smoother(DIM, 8, segments=5)
    with pytest.raises(AttentionError, match="odd"):
        Smoother(DIM, 8, kernel_size=2)
    with pytest.raises(AttentionError, match="activation"):
        Smoother(DIM, 8, activation="tanh")
    with pytest.raises(AttentionError, match="fft_norm"):
        Smoother(DIM, 8, fft_norm="none")
    with pytest.raises(AttentionError, match="batchnorm_over"):
        Smoother(DIM, 8, batchnorm_over="tokens")
    smoother = Smoother(DIM, 8)
    with pytest.raises(AttentionError, match="max_len"):
        smoother(torch.randn(1, 9, DIM))
    with pytest.raises(AttentionError, match="dim"):
        smoother(torch.randn(1, 8, DIM + 1))
    with pytest.raises(AttentionError, match="bool"):
        smoother(torch.randn(1, 8, DIM), torch.ones(1, 8))


@pytest.mark.parametrize("over", ["positions", "features"])
def test_masked_batchnorm_uses_real_tokens_only(over):
    torch.manual_seed(9)
    norm = MaskedBatchNorm(12 if over == "positions" else 5, over).double()
    h = torch.randn(4, 12, 5, dtype=torch.float64)
    mask = torch.rand(4, 12) > 0.4
    mask[1] = True  # every position but 0 has a real token
    mask[:, 0] = False  # a position with no real token keeps its running statistics
    out = norm(h, mask.double())
    if over == "features":
        expected = F.batch_norm(h[mask], None, None, training=True, eps=norm.eps)  # [real tokens, C]
        torch.testing.assert_close(out[mask], expected)
        running = torch.lerp(torch.ones(5, dtype=torch.float64), h[mask].var(0), 0.1)
        torch.testing.assert_close(norm.running_var, running)
    else:
        for p in range(1, 12):
            real = h[mask[:, p], p]  # [real tokens at p, C]
            expected = (real - real.mean()) / torch.sqrt(real.var(unbiased=False) + norm.eps)
            torch.testing.assert_close(out[mask[:, p], p], expected)
            torch.testing.assert_close(norm.running_mean[p], 0.1 * real.mean())
        assert norm.running_mean[0] == 0 and norm.running_var[0] == 1


@pytest.mark.parametrize("over", ["positions", "features"])
@pytest.mark.parametrize("masked", [False, True])
def test_masked_batchnorm_gradients_match_autograd_of_the_plain_formulas(over, masked):
    # the training forward has a hand-written backward: compare it with autograd of the formulas
    torch.manual_seed(10)
    b, n, c = 3, 11, 5
    norm = MaskedBatchNorm(n if over == "positions" else c, over).double()
    with torch.no_grad():
        norm.weight.uniform_(0.5, 1.5)
        norm.bias.uniform_(-0.5, 0.5)
    h = torch.randn(b, n, c, dtype=torch.float64, requires_grad=True)
    valid = torch.ones(b, n, dtype=torch.float64)
    if masked:
        valid = (torch.rand(b, n) > 0.4).double()
        valid[:, 3] = 0  # a position without real tokens
    dims, shape = ((0, 2), (1, n, 1)) if over == "positions" else ((0, 1), (1, 1, c))
    count = (valid.sum(0) * c if over == "positions" else valid.sum().expand(c)).clamp_min(1)
    w = valid.unsqueeze(-1)
    mean = (h * w).sum(dims) / count
    var = ((h - mean.view(shape)).square() * w).sum(dims) / count
    expected = (h - mean.view(shape)) * (norm.weight / torch.sqrt(var + norm.eps)).view(shape) + norm.bias.view(shape)
    out = norm(h, valid)
    torch.testing.assert_close(out, expected)
    g = torch.randn_like(out)
    params = [h, norm.weight, norm.bias]
    for got, want in zip(torch.autograd.grad(out, params, g), torch.autograd.grad(expected, params, g)):
        torch.testing.assert_close(got, want)


def test_bfloat16_input_runs_its_fft_in_float32():
    torch.manual_seed(10)
    smoother = Smoother(DIM, 21, dropout=0.0).eval()
    x = torch.randn(2, 21, DIM)
    out = smoother.to(torch.bfloat16)(x.to(torch.bfloat16))
    assert out.dtype == torch.bfloat16 and torch.isfinite(out).all()


@pytest.mark.parametrize("fourier,max_len,fft_norm,block_bytes", [
    (True, 41, "backward", 1 << 30), (False, 41, "backward", 1 << 30), (True, 41, "ortho", 41 * 8 * 3 * 4),
    (True, 40, "forward", 40 * 3 * 2 * 8), (True, 42, "backward", 1),
])
@pytest.mark.parametrize("kernel_size,n,padded", [(3, 37, True), (5, 29, False), (3, 40, False), (1, 33, True)])
def test_fused_stem_is_the_module_by_module_stem(monkeypatch, fourier, max_len, fft_norm, block_bytes, kernel_size, n,
                                                 padded):
    """The fused tile-by-tile stem (and Fourier convolution by column blocks: whole, spanning
    segments, inside one) against the module path, float64, dropout on, several tiles, odd and even
    FFT lengths: outputs, every gradient and the running statistics."""
    import longattn.attention.smoother as smoother_module

    monkeypatch.setattr(smoother_module, "STEM_TILE", 8)  # several tiles, one of them partial
    monkeypatch.setattr(smoother_module, "FOURIER_BLOCK_BYTES", block_bytes)
    torch.manual_seed(3)
    options = dict(kernel_size=kernel_size, fourier=fourier, dropout=0.3, fft_norm=fft_norm)
    fused = Smoother(DIM, max_len, **options).double().train()
    with torch.no_grad():
        fused.stem_norm.weight.uniform_(0.5, 1.5)
        fused.stem_norm.bias.uniform_(-0.5, 0.5)
    plain = smoother_module.Smoother(DIM, max_len, **options).double().train()
    plain.load_state_dict(fused.state_dict())
    plain.fused = False
    x = torch.randn(3, n, DIM, dtype=torch.float64, requires_grad=True)
    mask = None
    if padded:
        mask = torch.rand(3, n) > 0.3
        mask[0] = True
        mask[2, : n // 2] = False
        x.data[~mask] = float("nan")  # padded contents must not leak, NaN included
    assert fused.uses_fused_stem(x) and not plain.uses_fused_stem(x)
    outputs, grads = [], []
    for module in (fused, plain):
        torch.manual_seed(7)  # the same dropout draws
        out = module(x, mask)
        g = torch.randn(out.shape, dtype=out.dtype, generator=torch.Generator().manual_seed(1))
        params = [x] + list(module.parameters())
        grads.append(torch.autograd.grad(out, params, g))
        outputs.append(out)
    torch.testing.assert_close(outputs[0], outputs[1])
    assert torch.isfinite(outputs[0]).all()
    for name, a, r in zip(["x"] + [k for k, _ in fused.named_parameters()], *grads):
        torch.testing.assert_close(a, r, msg=lambda m: f"{name}: {m}")
    torch.testing.assert_close(fused.stem_norm.running_mean, plain.stem_norm.running_mean)
    torch.testing.assert_close(fused.stem_norm.running_var, plain.stem_norm.running_var)


def test_fused_stem_reduced_precision_stays_close_to_float32():
    torch.manual_seed(4)
    full = Smoother(64, 300, dropout=0.0).train()
    reduced = Smoother(64, 300, dropout=0.0, precision="bf16").train()
    reduced.load_state_dict(full.state_dict())
    x = torch.randn(2, 300, 64, requires_grad=True)
    out_full, out_reduced = full(x), reduced(x)
    relative = (out_reduced - out_full).norm() / out_full.norm()
    assert 0 < relative < 2e-2  # bf16 factors: about 3 significant digits
    g = torch.randn_like(out_full)
    grad_full, grad_reduced = (torch.autograd.grad(o, [x, m.stem_conv.weight], g)
                               for o, m in ((out_full, full), (out_reduced, reduced)))
    for a, r in zip(grad_reduced, grad_full):
        assert (a - r).norm() / r.norm() < 6e-2  # through the BatchNorm over 2 x 64 values per position


def test_tiled_dropout_draws_are_those_of_one_rand_call(monkeypatch):
    import longattn.attention.smoother as smoother_module

    monkeypatch.setattr(smoother_module, "STEM_TILE", 7)  # several tiles, one of them partial
    for shape in [(3, 40, 5), (2, 23, 2, 4)]:
        torch.manual_seed(1)
        keep = smoother_module.draw_keep(shape, 0.3, torch.device("cpu"))
        torch.manual_seed(1)
        assert keep.dtype == torch.bool and torch.equal(keep, torch.rand(shape) >= 0.3)


def test_precision_must_be_known():
    with pytest.raises(AttentionError, match="precision"):
        Smoother(DIM, 10, precision="fp8")


@pytest.mark.parametrize("kernel_size", [1, 3, 5])
def test_im2col_conv_tiles_are_the_tap_by_tap_conv(kernel_size):
    """The reduced-precision stem's conv (one GEMM over an im2col tile, halo rows copied from a
    channel-first and a token-major input) against the tap-by-tap GEMMs and F.conv1d, float64: tiles
    at both ends of the sequence (zero halo), inside it and one shorter than the rest."""
    import longattn.attention.smoother as smoother_module

    torch.manual_seed(12)
    batch, length, dim = 2, 23, 6
    smoothed = torch.randn(batch, dim, length, dtype=torch.float64).transpose(1, 2)  # channel-first, as the stem's
    x = torch.randn(batch, length, dim, dtype=torch.float64)
    weight = torch.randn(dim, 2 * dim, kernel_size, dtype=torch.float64)
    expected = F.conv1d(torch.cat([smoothed, x], -1).transpose(1, 2), weight, padding=kernel_size // 2).transpose(1, 2)
    taps = smoother_module._stem_taps(weight, 2, torch.float64)
    stacked = smoother_module._stacked_taps(weight, 2)
    for start, stop in [(0, 8), (8, 16), (16, 23), (0, 23), (1, 3)]:
        by_taps = torch.full((batch, stop - start, dim), float("nan"), dtype=torch.float64)
        by_im2col = by_taps.clone()
        smoother_module._stem_conv_tile([smoothed, x], taps, start, by_taps)
        smoother_module._stem_conv_tile_im2col([smoothed, x], stacked, kernel_size, start, by_im2col)
        torch.testing.assert_close(by_taps, expected[:, start:stop])
        torch.testing.assert_close(by_im2col, expected[:, start:stop])


@pytest.mark.parametrize("kernel_size", [1, 3, 5])
@pytest.mark.parametrize("windows", [False, True])
def test_conv_backward_tiles_are_the_conv_gradients(kernel_size, windows):
    """The stem's conv backward tile by tile (input gradients tap by tap, or with ``back_stacked`` by one
    GEMM over the windows of the conv gradient as the reduced-precision stem does) against autograd
    of F.conv1d, float64: tiles at both ends (zero halo), inside, one shorter than the rest; the input
    gradients written into a channel-first and a token-major buffer holding NaN, the weight gradient
    accumulated over the tiles."""
    import longattn.attention.smoother as smoother_module

    torch.manual_seed(15)
    batch, length, dim, half = 2, 23, 6, kernel_size // 2
    smoothed = torch.randn(batch, dim, length, dtype=torch.float64).transpose(1, 2).requires_grad_()
    x = torch.randn(batch, length, dim, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(dim, 2 * dim, kernel_size, dtype=torch.float64, requires_grad=True)
    grad_out = torch.randn(batch, length, dim, dtype=torch.float64)
    out = F.conv1d(torch.cat([smoothed, x], -1).transpose(1, 2), weight, padding=half).transpose(1, 2)
    expected = torch.autograd.grad(out, [smoothed, x, weight], grad_out)
    taps = smoother_module._stem_taps(weight.detach(), 2, torch.float64, transpose=False)
    back_stacked = smoother_module._backward_stacked_taps(weight.detach(), torch.float64) if windows else None
    grad_taps = [[torch.zeros(dim, dim, dtype=torch.float64) for _ in row] for row in taps]
    grad_inputs = [torch.full((batch, dim, length), float("nan"), dtype=torch.float64).transpose(1, 2),
                   torch.full((batch, length, dim), float("nan"), dtype=torch.float64)]
    for start, stop in [(0, 8), (8, 19), (19, 23)]:
        lo, hi = max(0, start - half), min(length, stop + half)
        smoother_module._stem_conv_tile_backward(grad_out[:, lo:hi], lo, [smoothed.detach(), x.detach()], taps,
                                                 grad_inputs, grad_taps, start, stop, back_stacked)
    grad_weight = torch.stack([torch.cat([g.t() for g in row], dim=1) for row in grad_taps], dim=-1)
    for actual, wanted in zip([*grad_inputs, grad_weight], expected):
        torch.testing.assert_close(actual, wanted)


@pytest.mark.parametrize("kernel_size,n", [(3, 37), (5, 29)])
def test_reduced_precision_stem_with_dropout_padding_and_tiles_stays_close(monkeypatch, kernel_size, n):
    """bf16 GEMM inputs and conv output kept in bf16: odd lengths, several tiles (halo rows at tile
    edges), padding and dropout; the same entries dropped as in float32, values and gradients close."""
    import longattn.attention.smoother as smoother_module

    monkeypatch.setattr(smoother_module, "STEM_TILE", 8)
    torch.manual_seed(13)
    full = Smoother(64, 48, kernel_size=kernel_size, dropout=0.3).train()
    reduced = Smoother(64, 48, kernel_size=kernel_size, dropout=0.3, precision="bf16").train()
    reduced.load_state_dict(full.state_dict())
    x = torch.randn(2, n, 64, requires_grad=True)
    mask = torch.ones(2, n, dtype=torch.bool)
    mask[1, n - 7:] = False
    outputs, grads = [], []
    for module in (full, reduced):
        torch.manual_seed(14)
        out = module(x, mask)
        outputs.append(out)
        grads.append(torch.autograd.grad(out, [x, module.frequency_weight, module.stem_conv.weight],
                                         torch.ones_like(out)))
    out_full, out_reduced = outputs
    assert out_reduced.dtype == torch.float32
    assert (out_reduced[~mask] == 0).all()
    dropped_or_clipped = out_full == 0
    assert (out_reduced[dropped_or_clipped] == 0).float().mean() > 0.97  # the same dropout draws
    assert 0 < (out_reduced - out_full).norm() / out_full.norm() < 2e-2
    for a, r in zip(grads[1], grads[0]):
        # the BatchNorm over 2 x 64 values per position amplifies the rounding of the incoming
        # gradient (about 8% at this size, the same before the conv output was kept in bf16)
        assert (a - r).norm() / r.norm() < 0.15


def test_frequency_weights_are_stored_channel_first_and_any_layout_works():
    """The parameter keeps its [F, dim, 2] shape with each feature's weights contiguous (the Fourier
    blocks read and write whole rows of it); a copy in the default layout (loaded by the user into a
    new Parameter) gives the same outputs and gradients."""
    torch.manual_seed(16)
    smoother = Smoother(DIM, 30, dropout=0.0).double().train()
    weight = smoother.frequency_weight
    assert weight.shape == (16, DIM, 2) and weight.stride() == (2, 2 * 16, 1)
    other = Smoother(DIM, 30, dropout=0.0).double().train()
    other.load_state_dict(smoother.state_dict())
    assert other.frequency_weight.stride() == weight.stride()
    other.frequency_weight = torch.nn.Parameter(weight.detach().contiguous())
    x = torch.randn(2, 27, DIM, dtype=torch.float64, requires_grad=True)
    results = []
    for module in (smoother, other):
        out = module(x)
        results.append((out, *torch.autograd.grad(out.square().sum(), [x, module.frequency_weight])))
    for a, b in zip(*results):
        torch.testing.assert_close(a, b)
    assert results[0][2].stride() == weight.stride()  # the gradient in the parameter's layout


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gradient_of_x_smooth_in_the_tail_of_the_weights_gradient_buffer(dtype):
    """At batch 1 the gradient of X^smooth is stored in the tail of the frequency weights' gradient
    buffer (in bf16 when the stem's products are): the Fourier backward turns its feature rows into
    weight rows in order without reading anything it already overwrote, so weights' and x's gradients
    equal those from a separate float32 buffer; at batch 2 (no room) the buffers are separate."""
    import longattn.attention.smoother as smoother_module

    torch.manual_seed(24)
    max_len, length, dim, segments = 40, 37, 8, 2
    x = torch.randn(1, length, dim)
    frequency_weight = torch.randn(max_len // 2 + 1, dim, 2)
    _, spectrum, weight = smoother_module._fourier_forward(x, frequency_weight, None, max_len, segments, "backward")
    values = torch.randn(1, dim, length).to(dtype).float()  # representable in dtype
    results = []
    for shared in (True, False):
        if shared:
            grad_weight, store = smoother_module._fourier_gradient_buffers(1, length, weight, dtype)
            assert store.untyped_storage().data_ptr() == grad_weight.untyped_storage().data_ptr()
        else:
            grad_weight, store = torch.empty_like(weight), torch.empty(1, length, dim)
        store.copy_(values.transpose(1, 2))
        grad_x = torch.zeros(1, length, dim)
        grad_frequency_weight = smoother_module._fourier_backward(
            store.transpose(1, 2), grad_x, spectrum, weight, grad_weight, max_len, segments, "backward")
        results.append((grad_frequency_weight.clone(), grad_x))
    for a, b in zip(*results):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    grad_weight, store = smoother_module._fourier_gradient_buffers(2, max_len, weight, torch.float32)
    assert store.untyped_storage().data_ptr() != grad_weight.untyped_storage().data_ptr()
