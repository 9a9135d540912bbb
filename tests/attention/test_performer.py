import pytest
import torch

from longattn import attention
from longattn.attention import AttentionError
from longattn.attention.performer import (
    orthogonal_random_features,
    performer_attention,
    performer_attention_reference,
)
from longattn.attention.softmax import softmax_attention_reference
from longattn.testing import random_qkv


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("n", [1, 65, 301])
def test_fast_matches_reference_forward_and_backward(causal, n):
    q, k, v = random_qkv(2, 2, n, 8)
    w = orthogonal_random_features(20, 8, generator=torch.Generator().manual_seed(5), dtype=torch.float64)
    mask = torch.rand(2, n, generator=torch.Generator().manual_seed(1)) > 0.3
    mask[:, 0] = True
    out = performer_attention(q, k, v, mask, projection=w, is_causal=causal)
    ref = performer_attention_reference(q, k, v, mask, projection=w, is_causal=causal)
    torch.testing.assert_close(out, ref)
    g = torch.randn_like(out)
    for a, r in zip(torch.autograd.grad(out, (q, k, v), g), torch.autograd.grad(ref, (q, k, v), g)):
        torch.testing.assert_close(a, r)


def test_stabiliser_keeps_large_inputs_finite():
    # |q|, |k| ~ 30: exp(w.x) overflows without the max shift, the reference is inf/nan
    q, k, v = (t.detach() for t in random_qkv(1, 1, 64, 16, scale=8.0))
    w = orthogonal_random_features(32, 16)
    out = performer_attention(q.float(), k.float(), v.float(), projection=w)
    assert torch.isfinite(out).all()


def test_many_features_approximate_softmax_attention():
    q, k, v = (t.detach() for t in random_qkv(1, 1, 40, 8, scale=0.5))
    exact = softmax_attention_reference(q, k, v)
    errors = []
    for m in (8, 8192):
        w = orthogonal_random_features(m, 8, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
        errors.append((performer_attention(q, k, v, projection=w) - exact).abs().max().item())
    assert errors[1] < 0.03 and errors[1] < errors[0] / 3, errors


def test_orthogonal_features_are_orthogonal_within_a_block_and_gaussian_length():
    w = orthogonal_random_features(20, 8, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    assert w.shape == (20, 8)
    block = w[:8] / w[:8].norm(dim=1, keepdim=True)
    torch.testing.assert_close(block @ block.T, torch.eye(8, dtype=torch.float64))
    lengths = w.norm(dim=1)
    assert lengths.std() > 0  # chi-distributed, not all sqrt(d)
    big = orthogonal_random_features(4096, 8, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    assert abs(big.square().sum(1).mean().item() - 8) < 0.5  # E|w|^2 = d
    iid = orthogonal_random_features(8, 8, orthogonal=False, generator=torch.Generator().manual_seed(0))
    gram = iid @ iid.T
    assert (gram - torch.diag(gram.diag())).abs().max() > 1e-3


def test_features_are_redrawn_every_interval_only_in_training():
    layer = attention.build("performer", dim=16, heads=2, redraw_interval=2)
    x = torch.randn(1, 10, 16)
    first = layer.projection.clone()
    layer.eval()
    for _ in range(5):
        layer(x)
    assert torch.equal(layer.projection, first)
    layer.train()
    layer(x)
    layer(x)
    assert torch.equal(layer.projection, first)
    layer(x)  # third training call: interval reached
    assert not torch.equal(layer.projection, first)
    fixed = attention.build("performer", dim=16, heads=2, redraw_interval=None)
    before = fixed.projection.clone()
    for _ in range(3):
        fixed(x)
    assert torch.equal(fixed.projection, before)


def test_bad_options_raise():
    with pytest.raises(AttentionError, match="nb_features"):
        attention.build("performer", dim=16, heads=2, nb_features=0)
    with pytest.raises(AttentionError, match="redraw_interval"):
        attention.build("performer", dim=16, heads=2, redraw_interval=0)
    q, k, v = (t.detach() for t in random_qkv(1, 1, 4, 8))
    with pytest.raises(AttentionError, match="projection"):
        performer_attention(q, k, v, projection=torch.randn(4, 3))


def test_matches_performer_pytorch_with_the_same_projection():
    # performer-pytorch adds eps=1e-4 to every feature after its max shift (not in the paper);
    # its kernel functions with eps=0 are the paper's FAVOR+, which must equal ours exactly.
    peer = pytest.importorskip("performer_pytorch.performer_pytorch", reason="performer-pytorch not installed")
    q, k, v = (t.detach() for t in random_qkv(2, 2, 77, 16))
    w = orthogonal_random_features(32, 16, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    phi_q = peer.softmax_kernel(q, projection_matrix=w, is_query=True, eps=0.0)
    phi_k = peer.softmax_kernel(k, projection_matrix=w, is_query=False, eps=0.0)
    theirs = peer.linear_attention(phi_q, phi_k, v)
    ours = performer_attention(q, k, v, projection=w)
    torch.testing.assert_close(ours, theirs)
    # and their projection matrix (drawn by their code) used in our layer gives the same result
    fast = peer.FastAttention(dim_heads=16, nb_features=32)
    w_peer = fast.projection_matrix.double()
    theirs = peer.linear_attention(
        peer.softmax_kernel(q, projection_matrix=w_peer, is_query=True, eps=0.0),
        peer.softmax_kernel(k, projection_matrix=w_peer, is_query=False, eps=0.0),
        v,
    )
    torch.testing.assert_close(performer_attention(q, k, v, projection=w_peer), theirs)
