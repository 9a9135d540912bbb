"""The LRA encoder and classifiers: padding never matters, pooling, post-LN, dual tower, layer_state, heads."""

import sys
import types

import pytest
import torch
from torch import nn

from longattn.attention import AttentionBase
from longattn.models import LRAEncoder, build_classifier, count_parameters, pool_features


def tiny(**kw):
    options = dict(vocab_size=11, num_classes=3, max_len=20, dim=8, hidden=16, heads=2, dropout=0.0,
                   embedding_dropout=0.0)
    options.update(kw)
    return build_classifier(**options).eval()


@pytest.mark.parametrize("pooling", ["mean", "cls", "maxmean"])
@pytest.mark.parametrize("norm", ["pre", "post"])
def test_padding_never_changes_the_logits(pooling, norm):
    torch.manual_seed(1)
    model = tiny(pooling=pooling, norm=norm).double()
    tokens = torch.randint(0, 11, (1, 9))
    unpadded = model(tokens, torch.ones(1, 9, dtype=torch.bool))
    # trailing padding: same positions for the real tokens, so the logits must be equal
    suffix = torch.cat([tokens, torch.full((1, 6), 7)], 1)
    suffix_mask = torch.arange(15).unsqueeze(0) < 9
    torch.testing.assert_close(model(suffix, suffix_mask), unpadded)
    # padding scattered between real tokens: whatever the padded ids, the logits do not move
    mask = torch.zeros(1, 15, dtype=torch.bool)
    mask[0, torch.tensor([0, 2, 3, 5, 8, 9, 11, 12, 14])] = True
    scattered = torch.randint(0, 11, (1, 15))
    other = scattered.masked_fill(~mask, 3)
    torch.testing.assert_close(model(scattered, mask), model(other, mask))
    assert not torch.allclose(model(scattered, mask), model(scattered, torch.ones_like(mask)))


def test_token_zero_is_not_padding():
    model = tiny()
    ones = torch.ones(1, 6, dtype=torch.bool)
    a = model(torch.tensor([[0, 0, 0, 4, 5, 6]]), ones)
    b = model(torch.tensor([[4, 5, 6]]), ones[:, :3])
    assert not torch.allclose(a, b)


def test_mean_pooling_ignores_padding_and_maxmean_concatenates():
    features = torch.tensor([[[1.0, 2.0], [3.0, -4.0], [100.0, 100.0]]])
    mask = torch.tensor([[True, True, False]])
    assert torch.equal(pool_features(features, mask, "mean"), torch.tensor([[2.0, -1.0]]))
    assert torch.equal(pool_features(features, mask, "maxmean"), torch.tensor([[3.0, 2.0, 2.0, -1.0]]))
    empty = torch.zeros(1, 3, dtype=torch.bool)
    assert torch.equal(pool_features(features, empty, "maxmean"), torch.zeros(1, 4))


def test_standard_model_size():
    # 2 layers, dim 64, hidden 128, 2 heads, learned positions, Linear-ReLU-Linear classifier.
    model = build_classifier(vocab_size=18, num_classes=10, max_len=2000)
    embeddings = 18 * 64 + 2000 * 64
    block = 4 * (64 * 64 + 64) + (64 * 128 + 128) + (128 * 64 + 64) + 2 * 2 * 64
    classifier = (64 * 128 + 128) + (128 * 10 + 10)
    assert count_parameters(model) == embeddings + 2 * block + 2 * 64 + classifier


def test_dual_tower_uses_the_four_way_combination():
    torch.manual_seed(0)
    model = tiny(dual=True)
    assert model.head[0].in_features == 4 * 8
    t0, t1 = torch.randint(0, 11, (2, 7)), torch.randint(0, 11, (2, 5))
    m0, m1 = torch.ones(2, 7, dtype=torch.bool), torch.ones(2, 5, dtype=torch.bool)
    logits = model(t0, m0, t1, m1)
    assert logits.shape == (2, 3)
    x0, x1 = model.embed(t0, m0), model.embed(t1, m1)
    assert torch.allclose(logits, model.head(torch.cat([x0, x1, x0 * x1, x0 - x1], -1)))


def test_bad_inputs_raise_clear_errors():
    model = tiny()
    with pytest.raises(ValueError, match="exceeds the model's max_len=20"):
        model(torch.zeros(1, 21, dtype=torch.long))
    with pytest.raises(ValueError, match=r"token ids must lie in \[0, 11\)"):
        model(torch.tensor([[3, 11]]))
    with pytest.raises(ValueError, match="attention_mask must be bool"):
        model(torch.tensor([[3, 1]]), torch.ones(1, 2))
    with pytest.raises(ValueError, match="pooling"):
        tiny(pooling="sum")
    with pytest.raises(ValueError, match="head"):
        tiny(head="linear")
    with pytest.raises(ValueError, match="unknown option"):
        tiny(attention_options={"no_such_option": 1})


class RecordingAttention(AttentionBase):
    """Unregistered stand-in that records which layer_state dict it received."""

    def __init__(self, dim, log):
        super().__init__(dim=dim, heads=1)
        self.log = log

    def attend(self, x, attention_mask, layer_state):
        self.log.append(layer_state)
        layer_state["depth"] = layer_state.get("depth", 0) + 1
        return x


def test_one_layer_state_per_forward_shared_by_all_layers():
    model = tiny(layers=3)
    log = []
    for block in model.encoder.blocks:
        block.attention = RecordingAttention(8, log)
    model(torch.randint(0, 11, (2, 5)))
    model(torch.randint(0, 11, (2, 5)))
    assert log[0] is log[1] is log[2] and log[3] is log[4] is log[5] and log[0] is not log[3]
    assert log[0]["depth"] == 3 and log[3]["depth"] == 3


def test_singular_head_is_imported_lazily(monkeypatch):
    class FakeHead(nn.Module):
        def __init__(self, dim, num_classes):
            super().__init__()
            self.out = nn.Linear(2 * dim, num_classes)

        def forward(self, x, attention_mask):
            return self.out(pool_features(x, attention_mask, "maxmean"))

    monkeypatch.setitem(sys.modules, "longattn.models.singular_head", types.SimpleNamespace(SingularHead=FakeHead))
    model = tiny(head="singular")
    assert isinstance(model.head, FakeHead)
    assert model(torch.randint(0, 11, (2, 4))).shape == (2, 3)
    with pytest.raises(ValueError, match="dual-tower"):
        tiny(head="singular", dual=True)


def test_missing_singular_head_is_a_clear_error(monkeypatch):
    monkeypatch.setitem(sys.modules, "longattn.models.singular_head", None)  # import raises ImportError
    with pytest.raises(ValueError, match="SingularHead"):
        tiny(head="singular")


def test_encoder_returns_features_and_mask_with_cls():
    encoder = LRAEncoder(11, 20, dim=8, hidden=16, pooling="cls")
    features, mask = encoder(torch.randint(0, 11, (2, 20)), torch.ones(2, 20, dtype=torch.bool))
    assert features.shape == (2, 21, 8) and mask.all()


def test_real_singular_head_plugs_in():
    pytest.importorskip("longattn.models.singular_head", reason="the Singularformer head has not landed")
    torch.manual_seed(0)
    model = tiny(head="singular", attention="singular")
    mask = torch.ones(2, 6, dtype=torch.bool)
    mask[1, 4:] = False
    tokens = torch.randint(0, 11, (2, 6))
    logits = model(tokens, mask)
    assert logits.shape == (2, 3)
    shorter = model(tokens[1:, :4], mask[1:, :4])
    torch.testing.assert_close(logits[1:], shorter)


@pytest.mark.parametrize("norm", ["pre", "post"])
def test_a_mechanism_that_replaces_the_ffn_gets_no_ffn(norm):
    """FLASH's GAU is attention and FFN in one: the block is its single residual sublayer."""
    torch.manual_seed(0)
    model = tiny(attention="flash", norm=norm, attention_options=dict(chunk_size=4, query_key_dim=8)).double()
    softmax_model = tiny(norm=norm)
    for block in model.encoder.blocks:
        assert block.ffn is None and block.norm_ffn is None
    assert not any(isinstance(m, nn.GELU) for m in model.modules())
    assert any(isinstance(m, nn.GELU) for m in softmax_model.modules())
    tokens = torch.randint(0, 11, (2, 13))
    mask = torch.ones(2, 13, dtype=torch.bool)
    mask[1, 9:] = False
    logits = model(tokens, mask)
    assert logits.shape == (2, 3) and torch.isfinite(logits).all()
    torch.testing.assert_close(model(tokens[1:, :9], mask[1:, :9]), logits[1:])
