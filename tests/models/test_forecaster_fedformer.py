"""FEDformer: frequency blocks against a plainly written DFT, Legendre multiwavelet filters, MOE decomposition,
both versions' shapes, gradients and a short overfit."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from forecaster_checks import SMALL_OPTIONS, check_forward_and_gradients, check_rejects_bad_input, overfit_ratio, tiny
from longattn.models.fedformer import (
    FourierBlock,
    FourierCrossAttention,
    MultiwaveletBlock,
    MultiwaveletFilters,
    SparseKernelFT,
    frequency_modes,
    legendre_filters,
    legendre_scaling,
)
from longattn.models.forecast_blocks import MixtureDecomposition
from longattn.models.forecasters import moving_average


def plain_dft(x: torch.Tensor) -> torch.Tensor:
    """X_f = sum_t x_t exp(-2 pi i f t / L) for f = 0 .. L // 2, along the last axis."""
    n = x.shape[-1]
    f = torch.arange(n // 2 + 1, dtype=torch.float64)[:, None]
    t = torch.arange(n, dtype=torch.float64)[None, :]
    basis = torch.exp(-2j * math.pi * f * t / n)  # [F, L]
    return torch.einsum("...t,ft->...f", x.to(torch.complex128), basis)


def plain_inverse(spectrum: torch.Tensor, n: int) -> torch.Tensor:
    """x_t = (1/n) sum_f c_f Re(X_f exp(2 pi i f t / n)), c_0 = c_{n/2} = 1, else 2 (a real signal's inverse)."""
    f = torch.arange(spectrum.shape[-1], dtype=torch.float64)
    weight = torch.full_like(f, 2.0)
    weight[0] = 1.0
    if n % 2 == 0 and spectrum.shape[-1] == n // 2 + 1:
        weight[-1] = 1.0
    t = torch.arange(n, dtype=torch.float64)
    basis = torch.exp(2j * math.pi * f[:, None] * t[None, :] / n)  # [F, L]
    return torch.einsum("...f,ft->...t", spectrum * weight, basis).real / n


def test_frequency_modes():
    torch.manual_seed(3)
    index = frequency_modes(144, 64, "random")
    assert len(index) == 64 and index.unique().numel() == 64 and index.max() < 72
    assert torch.equal(index, index.sort().values)
    assert frequency_modes(96, 64, "random").tolist() == list(range(48))  # min(64, 48) of 48: all of them
    assert frequency_modes(23, 5, "lowest").tolist() == [0, 1, 2, 3, 4]
    with pytest.raises(ValueError, match="mode selection"):
        frequency_modes(10, 2, "best")


def as_heads(time_domain: torch.Tensor, layout: str) -> torch.Tensor:
    """[B, H, E, L] -> [B, L, H, E]: transposed (paper) or the authors' layer's view of the memory (code)."""
    b, h, e, n = time_domain.shape
    if layout == "paper":
        return time_domain.permute(0, 3, 1, 2)
    flat = time_domain.flatten(1)  # row-major [H, E, L] of each sample, re-read as [L, H, E]
    return torch.stack([flat[:, i * h * e:(i + 1) * h * e] for i in range(n)], dim=1).reshape(b, n, h, e)


@pytest.mark.parametrize("output_modes, layout", [("first", "paper"), ("selected", "paper"), ("first", "code")])
def test_fourier_block_matches_plain_dft(output_modes, layout):
    torch.manual_seed(0)
    n, heads, e = 23, 2, 3
    block = FourierBlock(heads, e, n, modes=5, output_modes=output_modes, output_layout=layout)
    q = torch.randn(2, n, heads, e, dtype=torch.float64)
    out = block(q, None, None)
    spectrum = plain_dft(q.permute(0, 2, 3, 1))[..., block.index]  # [B, H, E, M]
    weights = block.weights.to(torch.complex128)  # [H, E_in, E_out, M]
    mixed = torch.stack([torch.stack([spectrum[:, h, :, m] @ weights[h, :, :, m] for m in range(len(block.index))],
                                     dim=-1) for h in range(heads)], dim=1)  # [B, H, E_out, M]
    full = torch.zeros(2, heads, e, n // 2 + 1, dtype=torch.complex128)
    for slot, bin_ in enumerate(block.index.tolist()):
        full[..., slot if output_modes == "first" else bin_] = mixed[..., slot]
    torch.testing.assert_close(out, as_heads(plain_inverse(full, n), layout))


@pytest.mark.parametrize("activation, output_modes, layout", [("tanh", "selected", "paper"),
                                                             ("softmax", "selected", "paper"),
                                                             ("tanh", "first", "paper"), ("tanh", "selected", "code")])
def test_fourier_cross_attention_matches_plain_dft(activation, output_modes, layout):
    torch.manual_seed(1)
    heads, e, nq, nk = 2, 3, 17, 12
    block = FourierCrossAttention(heads, e, nq, nk, modes=4, activation=activation, output_modes=output_modes,
                                  output_layout=layout)
    assert block.index_q.tolist() != list(range(4))  # random modes: "first" and "selected" differ
    q, k = torch.randn(2, nq, heads, e, dtype=torch.float64), torch.randn(2, nk, heads, e, dtype=torch.float64)
    out = block(q, k, None)
    q_ft = plain_dft(q.permute(0, 2, 3, 1))[..., block.index_q]
    k_ft = plain_dft(k.permute(0, 2, 3, 1))[..., block.index_kv]
    expected = torch.zeros(2, heads, e, nq // 2 + 1, dtype=torch.complex128)
    weights = block.weights.to(torch.complex128)
    for b in range(2):
        for h in range(heads):
            scores = q_ft[b, h].T @ k_ft[b, h]  # [Mq, Mkv]: sum over channels
            scores = scores.tanh() if activation == "tanh" else torch.softmax(scores.abs(), -1).to(torch.complex128)
            attended = k_ft[b, h] @ scores.T  # [E, Mq]
            for m, bin_ in enumerate(block.index_q.tolist()):
                expected[b, h, :, m if output_modes == "first" else bin_] = attended[:, m] @ weights[h, :, :, m]
    torch.testing.assert_close(out, as_heads(plain_inverse(expected / (heads * e) ** 2, nq), layout))


def test_sparse_kernel_matches_plain_dft():
    torch.manual_seed(2)
    kernel = SparseKernelFT(k=2, c=3, modes=4)
    x = torch.randn(2, 11, 3, 2, dtype=torch.float64)
    spectrum = plain_dft(x.reshape(2, 11, 6).transpose(1, 2))  # [B, 6, 6]
    out = torch.zeros_like(spectrum)
    weights = kernel.weights.to(torch.complex128)
    for m in range(4):
        out[..., m] = spectrum[..., m] @ weights[:, :, m]
    torch.testing.assert_close(kernel(x), plain_inverse(out, 11).transpose(1, 2).reshape(2, 11, 3, 2))


@pytest.mark.parametrize("k", [1, 3, 8])
def test_legendre_filters_two_scale_relation_and_orthogonality(k):
    h0, h1, g0, g1 = (t.numpy() for t in legendre_filters(k))
    bank = np.block([[h0, h1], [g0, g1]])
    np.testing.assert_allclose(bank @ bank.T, np.eye(2 * k), atol=1e-10)
    x = np.random.default_rng(0).uniform(0, 0.5, 7)
    # phi_i(x) = sqrt(2) sum_j H0_ij phi_j(2x) on [0, 1/2), and with H1 and phi_j(2x - 1) on [1/2, 1)
    np.testing.assert_allclose(legendre_scaling(k, x), math.sqrt(2) * h0 @ legendre_scaling(k, 2 * x), atol=1e-10)
    np.testing.assert_allclose(legendre_scaling(k, x + 0.5), math.sqrt(2) * h1 @ legendre_scaling(k, 2 * x),
                               atol=1e-10)
    # wavelets have k vanishing moments: integral psi_i(x) x^m dx = 0, m < k (by Gauss quadrature on both halves)
    nodes, weights = np.polynomial.legendre.leggauss(2 * k)
    u = (nodes + 1) / 2
    for m in range(k):
        left = (legendre_scaling(k, u) * weights / 2) @ (u / 2) ** m / 2
        right = (legendre_scaling(k, u) * weights / 2) @ ((u + 1) / 2) ** m / 2
        np.testing.assert_allclose(math.sqrt(2) * (g0 @ left + g1 @ right), np.zeros(k), atol=1e-10)


class _Zero(torch.nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.zeros_like(x)


def test_multiwavelet_cascade_reconstructs_with_identity_operators():
    """With A = identity, B = C = 0 and T0 = identity, the cascade of FEB-w passes the details through and must
    reconstruct its input exactly (decomposition and reconstruction are each other's inverse at every level,
    including the power-of-two padding and the cut back)."""
    filters = MultiwaveletFilters(4)
    x = torch.randn(2, 16, 3, 4, dtype=torch.float64)
    torch.testing.assert_close(filters.reconstruct(*reversed(filters.decompose(x))), x)
    block = MultiwaveletBlock(d_model=8, k=4, c=3, modes=3, skipped_levels=1).double()
    block.a, block.b, block.c_kernel, block.coarsest = torch.nn.Identity(), _Zero(), _Zero(), torch.nn.Identity()
    y = torch.randn(2, 23, 3, 4, dtype=torch.float64)  # odd length: padded to 32, 4 levels, cut back to 23
    torch.testing.assert_close(block.transform(y), y)
    block.c_kernel = torch.nn.Identity()  # Us = d is added to the smooth part: no longer the identity
    assert not torch.allclose(block.transform(y), y)


@pytest.mark.parametrize("kernels, length", [([3, 4], 13), ([24], 31), ([5, 2, 8], 8)])
def test_mixture_decomposition_is_a_softmax_weighted_sum_of_moving_averages(kernels, length):
    """Forward and gradients (input and gate) against the plain form: Linear(1 -> K) gate per value, softmax
    over the kernels on the last axis, weighted sum; one kernel (FEDformer's [24]) included."""
    torch.manual_seed(length)
    decomposition = MixtureDecomposition(kernels).double()
    torch.nn.init.normal_(decomposition.gate.weight)  # a gate that weights the kernels unevenly
    x = torch.randn(2, length, 3, dtype=torch.float64, requires_grad=True)
    seasonal, trend = decomposition(x)
    gate = torch.softmax(decomposition.gate(x[..., None]), dim=-1)
    expected = sum(gate[..., i] * moving_average(x, k) for i, k in enumerate(kernels))
    torch.testing.assert_close(trend, expected)
    torch.testing.assert_close(seasonal + trend, x)
    g = torch.randn_like(trend)
    params = [x, *decomposition.parameters()]
    for a, r in zip(torch.autograd.grad(trend, params, g), torch.autograd.grad(expected, params, g)):
        torch.testing.assert_close(a, r)


SMALL = SMALL_OPTIONS["fedformer"]


@pytest.mark.parametrize("version", ["fourier", "wavelet"])
@pytest.mark.parametrize("seq_len, pred_len, label_len", [(23, 5, None), (24, 7, 9)])
def test_shapes_and_gradients(version, seq_len, pred_len, label_len):
    model = tiny("fedformer", 3, seq_len, pred_len, version=version, label_len=label_len, **SMALL)
    check_forward_and_gradients(model, seq_len, pred_len, 3)
    check_rejects_bad_input(model, seq_len, 3)


def test_calendar_marks():
    model = tiny("fedformer", 3, 24, 7, calendar_dim=4, **SMALL)
    check_forward_and_gradients(model, 24, 7, 3, calendar_dim=4)


@pytest.mark.parametrize("version", ["fourier", "wavelet"])
def test_overfits_a_synthetic_series(version):
    assert overfit_ratio(tiny("fedformer", 2, 24, 6, version=version, **SMALL), 24, 6, 2) < 0.5


@pytest.mark.parametrize("version", ["fourier", "wavelet"])
def test_shared_blocks_tie_every_layer_to_one_frequency_block(version):
    """shared_blocks=True (the authors' code): one frequency block per role, used by every layer; the model then
    equals an unshared one whose per-layer blocks hold copies of the shared block's weights and modes."""
    torch.manual_seed(4)
    options = dict(SMALL, version=version, encoder_layers=3, decoder_layers=2, dropout=0.0)
    shared = tiny("fedformer", 3, 24, 7, shared_blocks=True, **options).double().eval()
    inners = [layer.attention.inner for layer in shared.encoder]
    assert all(inner is inners[0] for inner in inners)
    assert shared.decoder[0].self_attention.inner is shared.decoder[1].self_attention.inner
    assert shared.decoder[0].cross_attention.inner is shared.decoder[1].cross_attention.inner
    unshared = tiny("fedformer", 3, 24, 7, **options).double().eval()
    assert sum(p.numel() for p in unshared.parameters()) > sum(p.numel() for p in shared.parameters())
    # state_dict lists the shared block under every layer's name, so it loads into the unshared model as copies
    unshared.load_state_dict(shared.state_dict())
    x = torch.randn(2, 24, 3, dtype=torch.float64)
    torch.testing.assert_close(unshared(x), shared(x))


def test_code_layout_changes_the_model_and_is_fourier_only():
    torch.manual_seed(5)
    paper = tiny("fedformer", 3, 24, 7, dropout=0.0, **SMALL).double().eval()
    code = tiny("fedformer", 3, 24, 7, dropout=0.0, output_layout="code", **SMALL).double().eval()
    code.load_state_dict(paper.state_dict())
    x = torch.randn(2, 24, 3, dtype=torch.float64)
    assert not torch.allclose(paper(x), code(x))
    with pytest.raises(ValueError, match="Fourier version only"):
        tiny("fedformer", 3, 24, 7, version="wavelet", output_layout="code", **SMALL)
    with pytest.raises(ValueError, match="output_layout"):
        FourierBlock(2, 3, 23, modes=5, output_layout="transposed")
