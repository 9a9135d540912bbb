"""PoNet: fast path vs the plain loops of eqs. 1-6, segment ids through layer_state, each pooling's role."""

import pytest
import torch

from longattn import attention
from longattn.attention import AttentionError
from longattn.attention.ponet import (
    SEGMENT_IDS_KEY,
    fixed_segment_ids,
    ponet_mixing,
    ponet_mixing_reference,
)
from longattn.testing import scattered_mask

B, H, DH = 2, 3, 5


def branches(n, seed=0):
    g = torch.Generator().manual_seed(seed)
    names = ("query", "key", "value", "segment", "local", "gate")
    return {k: (torch.randn(B, H, n, DH, generator=g, dtype=torch.float64) * 2).requires_grad_() for k in names}


def call(fn, t, mask, segment_ids, kernel_size, **options):
    return fn(t["query"], t["key"], t["value"], mask, segment=t["segment"], local=t["local"], gate=t["gate"],
              segment_ids=segment_ids, kernel_size=kernel_size, **options)


@pytest.mark.parametrize("n", [1, 37, 101])
@pytest.mark.parametrize("kernel_size", [1, 3, 7])
@pytest.mark.parametrize("segments", ["fixed", "sentences"])
def test_fast_path_matches_reference_forward_and_backward(n, kernel_size, segments, path):
    t = branches(n)
    mask = scattered_mask(B, n)
    if segments == "fixed":
        ids = fixed_segment_ids(B, n, 4)
    else:  # irregular, non-contiguous, sparse sentence labels, different per row
        ids = torch.randint(0, 5, (B, n), generator=torch.Generator().manual_seed(1)) * 10**9
    fast, ref = call(ponet_mixing, t, mask, ids, kernel_size), call(ponet_mixing_reference, t, mask, ids, kernel_size)
    torch.testing.assert_close(fast, ref)
    grad = torch.randn_like(fast)
    inputs = list(t.values())
    for a, b in zip(torch.autograd.grad(fast, inputs, grad), torch.autograd.grad(ref, inputs, grad)):
        torch.testing.assert_close(a, b)


def test_without_mask_equals_all_true_mask():
    t = branches(23)
    ids = fixed_segment_ids(B, 23, 3)
    ones = torch.ones(B, 23, dtype=torch.bool)
    torch.testing.assert_close(call(ponet_mixing, t, None, ids, 3), call(ponet_mixing, t, ones, ids, 3))


def test_fixed_segments_follow_the_authors_split():
    # N // segment_num + 1 tokens per segment, the last one shorter
    assert fixed_segment_ids(1, 10, 4).tolist() == [[0, 0, 0, 1, 1, 1, 2, 2, 2, 3]]
    assert fixed_segment_ids(2, 5, 1).tolist() == [[0] * 5] * 2


def test_each_pooling_does_its_part():
    """Hand-made branches: the output is (g' + s) * H_o + l exactly, with the maxima expected."""
    n = 6
    zeros = torch.zeros(1, 1, n, 1, dtype=torch.float64)
    local = torch.tensor([1.0, 5.0, 2.0, 0.0, 3.0, -1.0], dtype=torch.float64).view(1, 1, n, 1)
    segment = torch.tensor([4.0, 1.0, 0.0, 7.0, 2.0, 3.0], dtype=torch.float64).view(1, 1, n, 1)
    value = torch.arange(n, dtype=torch.float64).view(1, 1, n, 1)
    gate = torch.full((1, 1, n, 1), 2.0, dtype=torch.float64)
    ids = torch.tensor([[0, 0, 0, 1, 1, 1]])
    mask = torch.tensor([[True, True, True, False, True, True]])
    out = ponet_mixing(zeros, zeros, value, mask, segment=segment, local=local, gate=gate, segment_ids=ids)
    g_prime = value[0, 0, mask[0], 0].mean()  # zero keys: uniform attention over the real tokens
    seg = torch.tensor([4.0, 4.0, 4.0, 0.0, 3.0, 3.0])  # the padded 7.0 never wins
    loc = torch.tensor([5.0, 5.0, 5.0, 0.0, 3.0, 3.0])  # windows of 3, padding skipped
    expected = ((g_prime + seg) * 2.0 + loc) * mask[0]
    torch.testing.assert_close(out[0, 0, :, 0], expected.double())


def test_module_matches_reference_and_reads_segment_ids_from_layer_state(path):
    torch.manual_seed(0)
    layer = attention.build("ponet", dim=12, heads=2, segment_num=3, kernel_size=5).double().eval()
    x = torch.randn(2, 29, 12, dtype=torch.float64)
    mask = torch.rand(2, 29, generator=torch.Generator().manual_seed(2)) > 0.2
    ids = torch.randint(0, 4, (2, 29), generator=torch.Generator().manual_seed(3))
    f = layer.project(x)
    for given in (None, ids):
        state = None if given is None else {SEGMENT_IDS_KEY: given}
        used = fixed_segment_ids(2, 29, 3) if given is None else given
        ref = ponet_mixing_reference(f["query"], f["key"], f["value"], mask, segment=f["segment"],
                                     local=f["local"], gate=f["gate"], segment_ids=used, kernel_size=5)
        expected = layer.to_out(ref.transpose(1, 2).reshape(2, 29, 12)) * mask[..., None]
        torch.testing.assert_close(layer(x, mask, state), expected)
    assert not torch.allclose(layer(x, mask), layer(x, mask, {SEGMENT_IDS_KEY: ids}))


def test_shared_key_value_has_one_projection_less():
    full = attention.build("ponet", dim=8, heads=2)
    shared = attention.build("ponet", dim=8, heads=2, share_key_value=True)
    count = lambda m: sum(p.numel() for p in m.parameters())  # noqa: E731
    assert count(full) - count(shared) == 8 * 8 + 8
    f = shared.project(torch.randn(1, 4, 8))
    assert f["value"] is f["key"]


def test_bad_segment_ids_and_options_raise():
    layer = attention.build("ponet", dim=8, heads=2)
    x = torch.randn(1, 5, 8)
    with pytest.raises(AttentionError, match="segment_ids must have shape"):
        layer(x, layer_state={SEGMENT_IDS_KEY: torch.zeros(1, 4, dtype=torch.long)})
    with pytest.raises(AttentionError, match="integer"):
        layer(x, layer_state={SEGMENT_IDS_KEY: torch.zeros(1, 5)})
    with pytest.raises(AttentionError, match="non-negative"):
        layer(x, layer_state={SEGMENT_IDS_KEY: -torch.ones(1, 5, dtype=torch.long)})
    with pytest.raises(AttentionError, match="odd"):
        attention.build("ponet", dim=8, heads=2, kernel_size=4)
    with pytest.raises(AttentionError, match="segment_num"):
        attention.build("ponet", dim=8, heads=2, segment_num=0)


@pytest.mark.parametrize("parts", [("segment", "local"), ("global", "local"), ("global", "segment"), ("local",)])
def test_component_ablations_match_the_reference_and_drop_their_projections(parts, path):
    t = branches(19)
    mask = scattered_mask(B, 19)
    ids = fixed_segment_ids(B, 19, 3)
    fast = call(ponet_mixing, t, mask, ids, 3, parts=parts)
    torch.testing.assert_close(fast, call(ponet_mixing_reference, t, mask, ids, 3, parts=parts))
    assert not torch.allclose(fast, call(ponet_mixing, t, mask, ids, 3))
    torch.manual_seed(0)
    layer = attention.build("ponet", dim=8, heads=2, parts=parts)
    expected = {
        ("segment", "local"): ("segment", "local", "gate"),
        ("global", "local"): ("query", "key", "value", "local", "gate"),
        ("global", "segment"): ("query", "key", "value", "segment", "gate"),
        ("local",): ("local",),
    }[parts]
    assert layer.branches == expected and layer.to_branches.out_features == 8 * len(expected)
    layer(torch.randn(1, 7, 8)).sum().backward()
    assert all(p.grad is not None for p in layer.parameters())  # no unused parameters (DDP)
    with pytest.raises(AttentionError, match="parts"):
        attention.build("ponet", dim=8, heads=2, parts=("global", "pooling"))
