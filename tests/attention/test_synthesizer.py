"""Synthesizer: the four variants, the dot-product mixture, causal masking, padding."""

import pytest
import torch

from longattn import attention
from longattn.attention import AttentionError, merge_heads, split_heads
from longattn.attention.synthesizer import (
    VARIANTS,
    synthesizer_attention,
    synthesizer_attention_reference,
)
from longattn.testing import scattered_mask

DIM, HEADS = 24, 3


@pytest.mark.parametrize("n", [1, 7, 131])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("mix", [False, True])
def test_functional_matches_reference_forward_and_backward(n, causal, mix, path):
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 3, n, 5, generator=g, dtype=torch.float64).requires_grad_() for _ in range(3))
    logits = (2 * torch.randn(2, 3, n, n, generator=g, dtype=torch.float64)).requires_grad_()
    weights = torch.tensor([0.7, 0.4], dtype=torch.float64, requires_grad=True)
    mask = scattered_mask(2, n)
    kwargs = dict(synthetic_logits=logits, is_causal=causal)
    if mix:
        kwargs.update(synthetic_weight=weights[0], dot_product_weight=weights[1])
    out = synthesizer_attention(q, k, v, mask, **kwargs)
    ref = synthesizer_attention_reference(q, k, v, mask, **kwargs)
    torch.testing.assert_close(out, ref)
    wrt = [q, k, v, logits, weights] if mix else [v, logits]
    grad_out = torch.randn_like(out)
    for got, want in zip(
        torch.autograd.grad(out, wrt, grad_out), torch.autograd.grad(ref, wrt, grad_out)
    ):
        torch.testing.assert_close(got, want)


def build(variant, max_len=12, **options):
    torch.manual_seed(0)
    return attention.build("synthesizer", dim=DIM, heads=HEADS, max_len=max_len, variant=variant, **options).double()


@pytest.mark.parametrize("variant", [*VARIANTS, "dense+random", "factorized_dense+factorized_random"])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("mix", [False, True])
def test_module_matches_reference_for_every_variant(variant, causal, mix, path):
    layer = build(variant, max_len=15, causal=causal, mix_dot_product=mix)
    n = 11  # shorter than max_len: the leading rows/columns are used
    x = torch.randn(2, n, DIM, dtype=torch.float64, requires_grad=True)
    mask = scattered_mask(2, n)
    out = layer(x, mask)
    value = split_heads(layer.to_v(x), HEADS)
    kwargs = dict(synthetic_logits=layer.synthetic_logits(x), is_causal=causal)
    q = k = None
    if mix:
        q, k = split_heads(layer.to_q(x), HEADS), split_heads(layer.to_k(x), HEADS)
        kwargs.update(dot_product_weight=layer.mix_weights[-1])
    ref = layer.to_out(merge_heads(synthesizer_attention_reference(q, k, value, mask, **kwargs)))
    ref = ref * mask[..., None]
    torch.testing.assert_close(out, ref)
    params = [x, *[p for p in layer.parameters() if p.requires_grad]]
    g = torch.randn_like(out)
    for got, want in zip(torch.autograd.grad(out, params, g), torch.autograd.grad(ref, params, g)):
        torch.testing.assert_close(got, want)


def test_dense_rows_depend_only_on_their_own_token():
    layer = build("dense")
    x = torch.randn(1, 9, DIM, dtype=torch.float64, requires_grad=True)
    logits = layer.synthetic_logits(x)
    assert logits.shape == (1, HEADS, 9, 9)
    (grad,) = torch.autograd.grad(logits[0, :, 4].sum(), x)
    touched = grad[0].abs().sum(-1) > 0
    assert touched.tolist() == [i == 4 for i in range(9)]


def test_random_variant_ignores_the_input_and_uses_the_leading_block():
    layer = build("random")
    x = torch.randn(1, 5, DIM, dtype=torch.float64)
    torch.testing.assert_close(layer.synthetic_logits(x), layer.random_logits[:, :5, :5].unsqueeze(0))
    weights = torch.softmax(layer.random_logits[:, :5, :5], -1)
    expected = layer.to_out(merge_heads(weights @ split_heads(layer.to_v(x), HEADS)))
    torch.testing.assert_close(layer(x), expected)


def test_mixtures_weight_each_variant_and_the_dot_product():
    layer = build("dense+random", mix_dot_product=True)
    assert layer.mix_weights.shape == (3,)
    with torch.no_grad():
        layer.mix_weights.copy_(torch.tensor([0.3, 2.0, 0.7]))
    x = torch.randn(1, 9, DIM, dtype=torch.float64)
    expected = 0.3 * layer.part_logits(x, "dense") + 2.0 * layer.part_logits(x, "random")
    torch.testing.assert_close(layer.synthetic_logits(x), expected)
    single = build("dense")
    assert single.mix_weights is None and not hasattr(single, "random_logits")


def test_fixed_random_is_not_trained():
    assert not build("random", trainable_random=False).random_logits.requires_grad
    fixed = build("factorized_random", trainable_random=False)
    assert not fixed.random_left.requires_grad and not fixed.random_right.requires_grad
    assert build("random").random_logits.requires_grad


def test_factorized_dense_pairs_every_a_with_every_b():
    layer = build("factorized_dense", max_len=6, factor_a=2)
    assert (layer.factor_a, layer.factor_b) == (2, 3)
    with torch.no_grad():
        layer.factorized_hidden.weight.zero_()
        layer.factorized_hidden.bias.fill_(1.0)
        layer.to_a.weight.zero_()
        layer.to_b.weight.zero_()
        layer.to_a.bias.copy_(torch.tensor([2.0, 3.0] * HEADS))
        layer.to_b.bias.copy_(torch.tensor([5.0, 7.0, 11.0] * HEADS))
    row = layer.synthetic_logits(torch.zeros(1, 6, DIM, dtype=torch.float64))[0, 0, 0]
    assert row.tolist() == [10.0, 15.0, 14.0, 21.0, 22.0, 33.0]


def test_factorized_random_is_low_rank():
    layer = build("factorized_random", random_rank=2)
    logits = layer.synthetic_logits(torch.zeros(1, 12, DIM, dtype=torch.float64))
    assert torch.linalg.matrix_rank(logits[0, 0]) == 2


def test_default_factor_and_bad_options():
    assert build("factorized_dense", max_len=12).factor_a == 3
    assert build("dense").variant == "dense"
    with pytest.raises(AttentionError, match="variant"):
        build("sparse")
    with pytest.raises(AttentionError, match="variant"):
        build("dense+dense")
    with pytest.raises(AttentionError, match="factor_a"):
        build("factorized_dense", max_len=12, factor_a=5)
    with pytest.raises(AttentionError, match="random_rank"):
        build("factorized_random", random_rank=0)
    v = torch.randn(1, 2, 4, 3)
    with pytest.raises(AttentionError, match="synthetic_logits"):
        synthesizer_attention(None, None, v, synthetic_logits=torch.randn(1, 2, 4, 5))
    with pytest.raises(AttentionError, match="query and key"):
        synthesizer_attention(None, None, v, synthetic_logits=torch.randn(1, 2, 4, 4), dot_product_weight=0.5)


@pytest.mark.parametrize("causal", [False, True])
def test_no_mask_path_matches_all_true_mask(causal):
    g = torch.Generator().manual_seed(1)
    v = torch.randn(2, 3, 9, 4, generator=g, dtype=torch.float64)
    logits = torch.randn(1, 3, 9, 9, generator=g, dtype=torch.float64)
    mask = torch.ones(2, 9, dtype=torch.bool)
    torch.testing.assert_close(
        synthesizer_attention(None, None, v, synthetic_logits=logits, is_causal=causal),
        synthesizer_attention(None, None, v, mask, synthetic_logits=logits, is_causal=causal),
    )
    torch.testing.assert_close(
        synthesizer_attention(None, None, v, synthetic_logits=logits, is_causal=causal),
        synthesizer_attention_reference(None, None, v, synthetic_logits=logits, is_causal=causal),
    )


def test_query_without_visible_keys_gets_zeros():
    g = torch.Generator().manual_seed(2)
    v = torch.randn(2, 1, 6, 3, generator=g, dtype=torch.float64)
    logits = torch.randn(1, 1, 6, 6, generator=g, dtype=torch.float64)
    mask = torch.ones(2, 6, dtype=torch.bool)
    mask[0] = False  # nothing to attend to at all
    mask[1, :3] = False  # causal: queries 0..2 see only padded keys
    out = synthesizer_attention(None, None, v, mask, synthetic_logits=logits, is_causal=True)
    assert torch.all(out[0] == 0) and torch.all(out[1, :, :3] == 0)
    torch.testing.assert_close(
        out, synthesizer_attention_reference(None, None, v, mask, synthetic_logits=logits, is_causal=True)
    )
