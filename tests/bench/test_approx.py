import json

import pytest
import torch

from longattn.bench.approx import APPROX_METHODS, approx_table, evaluate, qkv_per_layer, relative_spectral_error, wikitext_sequences
from longattn.cli import main


@pytest.fixture
def tiny_checkpoint(tmp_path):
    """A tiny BERT checkpoint in Hugging Face layout (config.json + model.safetensors)."""
    transformers = pytest.importorskip("transformers", reason="transformers is in the hf extra")
    config = transformers.BertConfig(vocab_size=50, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                                     intermediate_size=64, max_position_embeddings=64)
    torch.manual_seed(0)
    original = transformers.BertModel(config).eval()
    original.save_pretrained(tmp_path)
    return tmp_path, original


def test_checkpoint_loads_with_the_same_outputs_and_per_layer_qkv(tiny_checkpoint):
    from longattn.hf import load_bert

    folder, original = tiny_checkpoint
    loaded = load_bert(folder)
    ids = torch.randint(0, 50, (2, 40))
    with torch.no_grad():
        torch.testing.assert_close(loaded(input_ids=ids).last_hidden_state, original(input_ids=ids).last_hidden_state)
    layers = list(qkv_per_layer(loaded, ids))
    assert [i for i, *_ in layers] == [0, 1] and layers[0][1].shape == (2, 2, 40, 16)
    # the captured q of layer 0 is that layer's query projection of the embeddings, split into heads
    with torch.no_grad():
        hidden = loaded.embeddings(input_ids=ids)
        q = loaded.encoder.layer[0].attention.self.query(hidden).view(2, 40, 2, 16).transpose(1, 2)
    torch.testing.assert_close(layers[0][1], q)


def test_random_weights_differ_from_pretrained_and_are_seeded(tiny_checkpoint):
    from longattn.hf import load_bert

    folder, _ = tiny_checkpoint
    a, b = load_bert(folder), load_bert(folder, pretrained=False, seed=1)  # the checkpoint was drawn from seed 0
    assert not torch.equal(a.encoder.layer[0].attention.self.query.weight, b.encoder.layer[0].attention.self.query.weight)
    c = load_bert(folder, pretrained=False, seed=1)
    assert torch.equal(b.encoder.layer[0].attention.self.query.weight, c.encoder.layer[0].attention.self.query.weight)


def test_missing_checkpoint_is_a_clear_error(tmp_path):
    pytest.importorskip("transformers", reason="transformers is in the hf extra")
    from longattn.hf import load_bert

    with pytest.raises(FileNotFoundError, match="config.json"):
        load_bert(tmp_path)


def test_spectral_error_is_zero_for_exact_and_one_for_zero():
    m = torch.randn(3, 20, 8)
    assert torch.allclose(relative_spectral_error(m, m), torch.zeros(3, dtype=torch.float64))
    assert torch.allclose(relative_spectral_error(m, torch.zeros_like(m)), torch.ones(3, dtype=torch.float64))


def test_vmean_is_exact_for_uniform_attention_and_not_otherwise():
    q = torch.zeros(1, 2, 30, 8)  # all scores equal: attention is exactly the mean of V
    k, v = torch.randn(1, 2, 30, 8), torch.randn(1, 2, 30, 8)
    res = evaluate(iter([(0, q, k, v)]), ["vmean"], [8], trials=1)
    assert res[0].mean < 1e-12
    res = evaluate(iter([(0, 3 * torch.randn(1, 2, 30, 8), k, v)]), ["vmean"], [8], trials=1)
    assert res[0].mean > 0.05
    assert "| vmean |" in approx_table(res)


def test_unknown_method_is_rejected():
    with pytest.raises(ValueError, match="unknown approximation method"):
        evaluate(iter([]), ["nope"], [8])


def test_wikitext_sequences_frame_and_cut(tmp_path):
    tokenizers = pytest.importorskip("tokenizers", reason="tokenizers is in the hf extra")
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import Whitespace

    vocab = {"[UNK]": 0, "[CLS]": 1, "[SEP]": 2, "a": 3, "b": 4}
    tok = tokenizers.Tokenizer(WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = Whitespace()
    (tmp_path / "wiki.valid.tokens").write_text("a b " * 50)
    ids = wikitext_sequences(tmp_path, tok, length=10, count=3)
    assert ids.shape == (3, 10)
    assert (ids[:, 0] == 1).all() and (ids[:, -1] == 2).all()
    assert ids[0, 1:-1].tolist() == [3, 4] * 4
    with pytest.raises(ValueError, match="fewer than"):
        wikitext_sequences(tmp_path, tok, length=10, count=100)
    with pytest.raises(FileNotFoundError, match="wiki.test.tokens"):
        wikitext_sequences(tmp_path, tok, split="test")


def test_every_registered_method_runs_and_is_finite():
    q, k, v = (torch.randn(2, 70, 16, dtype=torch.float64) for _ in range(3))
    g = torch.Generator().manual_seed(0)
    for name, fn in APPROX_METHODS.items():
        out = fn(q, k, v, 16, g)
        assert out.shape == v.shape and torch.isfinite(out).all(), name
