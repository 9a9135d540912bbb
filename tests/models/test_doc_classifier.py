"""The seven Table 4 models of Singularformer (models/doc_classifier.py): registered, Table 2 defaults,
the paper's initialisation, padding never matters, token and patch inputs."""

from __future__ import annotations

import pytest
import torch

from longattn.attention import capabilities
from longattn.models.doc_classifier import TABLE4_MODELS, truncated_normal_init
from longattn.models.registry import build_model, model_defaults, model_names

SMALL = {"layers": 2, "dim": 16, "hidden": 32, "heads": 2}


def test_seven_registered_models_with_table2_defaults():
    assert set(TABLE4_MODELS) <= set(model_names("classifier"))
    expected = {"post_ln": ("softmax", "post"), "pre_ln": ("softmax", "pre"), "realformer": ("realformer", "post"),
                "bigbird": ("bigbird", "post"), "linformer": ("linformer", "post"), "flash": ("flash", "pre"),
                "singularformer": ("singular", "post")}
    for name, (attention, norm) in expected.items():
        defaults = model_defaults(name)
        assert (defaults["attention"], defaults["norm"]) == (attention, norm)
        assert {k: defaults[k] for k in ("layers", "dim", "hidden", "heads", "dropout", "embedding_dropout",
                                         "init_std")} == {"layers": 6, "dim": 384, "hidden": 384, "heads": 6,
                                                          "dropout": 0.1, "embedding_dropout": 0.2, "init_std": 0.02}
    # the paper's k = 256 and g = 256 are the mechanisms' own defaults
    linformer = build_model("linformer", vocab_size=10, num_classes=2, max_len=8, **SMALL)
    flash = build_model("flash", vocab_size=10, num_classes=2, max_len=8, **SMALL)
    assert linformer.encoder.blocks[0].attention.k == 256 and flash.encoder.blocks[0].attention.chunk_size == 256


def test_block_layout_and_ffn_follow_the_model():
    post = build_model("post_ln", vocab_size=50, num_classes=3, max_len=20, **SMALL)
    pre = build_model("pre_ln", vocab_size=50, num_classes=3, max_len=20, **SMALL)
    flash = build_model("flash", vocab_size=50, num_classes=3, max_len=20, **SMALL)
    assert not post.encoder.blocks[0].pre_norm and pre.encoder.blocks[0].pre_norm
    assert isinstance(post.encoder.final_norm, torch.nn.Identity) and isinstance(pre.encoder.final_norm, torch.nn.LayerNorm)
    assert capabilities("flash").replaces_ffn and flash.encoder.blocks[0].ffn is None
    assert post.head_kind == "singular" and post.encoder.pooling == "maxmean"


def test_truncated_normal_init_and_zero_biases():
    torch.manual_seed(0)
    model = build_model("singularformer", vocab_size=2000, num_classes=4, max_len=32, dim=64, heads=2, layers=1)
    linears = [m for m in model.modules() if isinstance(m, (torch.nn.Linear, torch.nn.Embedding))]
    assert linears
    for module in linears:
        assert float(module.weight.detach().abs().max()) <= 0.04 + 1e-7
        if getattr(module, "bias", None) is not None:
            assert not module.bias.any()
    table = model.encoder.token_embedding.weight
    # N(0, 0.02^2) cut at 2 std has std 0.02 * 0.8796
    assert abs(float(table.detach().std()) - 0.02 * 0.8796) < 5e-4
    torch.manual_seed(0)
    plain = build_model("singularformer", vocab_size=2000, num_classes=4, max_len=32, dim=64, heads=2, layers=1,
                        init_std=None)
    assert any(m.bias.any() for m in plain.modules() if isinstance(m, torch.nn.Linear) and m.bias is not None)
    with pytest.raises(ValueError, match="init_std must be positive"):
        build_model("post_ln", vocab_size=10, num_classes=2, max_len=8, init_std=-1.0, **SMALL)
    assert truncated_normal_init(torch.nn.LayerNorm(4)).weight.eq(1).all()


@pytest.mark.parametrize("name", list(TABLE4_MODELS))
def test_padding_never_changes_the_logits(name):
    torch.manual_seed(1)
    model = build_model(name, vocab_size=40, num_classes=3, max_len=37, **SMALL).eval()
    tokens = torch.randint(0, 40, (3, 37))
    mask = torch.ones(3, 37, dtype=torch.bool)
    mask[0, 20:] = False
    mask[2, :5] = False  # padding need not sit at the end
    logits = model(tokens, mask)
    changed = tokens.masked_fill(~mask, 7)
    torch.testing.assert_close(model(changed, mask), logits)
    alone = model(tokens[:1, :20], mask[:1, :20])
    torch.testing.assert_close(alone, logits[:1], atol=1e-5, rtol=1e-4)
    model.train()
    model(tokens, mask).sum().backward()
    assert all(p.grad is None or torch.isfinite(p.grad).all() for p in model.parameters())


def test_patch_inputs_through_a_linear_embedding():
    model = build_model("pre_ln", vocab_size=0, input_dim=12, num_classes=5, max_len=16, **SMALL)
    assert isinstance(model.encoder.token_embedding, torch.nn.Linear)
    logits = model(torch.rand(2, 16, 12), torch.ones(2, 16, dtype=torch.bool))
    assert logits.shape == (2, 5)
    with pytest.raises(ValueError, match=r"float tensor \[B, N, 12\]"):
        model(torch.randint(0, 5, (2, 16)))
    with pytest.raises(ValueError, match="input_dim must be positive"):
        build_model("pre_ln", vocab_size=0, input_dim=0, num_classes=5, max_len=16, **SMALL)
    with pytest.raises(ValueError, match="vocab_size and max_len must be positive"):
        build_model("pre_ln", vocab_size=0, num_classes=5, max_len=16, **SMALL)
