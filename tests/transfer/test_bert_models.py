"""BERT encoders with longattn mechanisms (hf/bert.py): the mechanism is really in use, gradients reach
it, the mixers replace the self-attention, and fine-tuning starts from the pretrained weights."""

import pytest
import torch

from longattn.attention import AttentionBase
from longattn.config import write_yaml
from longattn.hf.bert import BertGlue, BertMLM, MixerSelfAttention
from longattn.train.checkpoint import save_atomic

TINY = dict(hidden_size=32, layers=2, heads=2, intermediate_size=64)
VOCAB = 120


def _inputs(batch=2, length=20):
    torch.manual_seed(1)
    ids = torch.randint(5, VOCAB, (batch, length))
    mask = torch.ones(batch, length, dtype=torch.bool)
    mask[1, 13:] = False
    return ids, mask


@pytest.mark.parametrize("name,options", [("softmax", {}), ("skeleton", {"s1": 4, "s2": 4}), ("fnet", {}),
                                          ("ponet", {"segment_num": 4}), ("nystrom", {"num_landmarks": 4})])
def test_mlm_model_runs_the_mechanism_and_learns(name, options):
    torch.manual_seed(0)
    model = BertMLM(VOCAB, max_len=32, attention=name, attention_options=options, **TINY).train()
    ids, mask = _inputs()
    predict = torch.zeros_like(mask)
    predict[:, 3:6] = True
    logits = model(ids, mask, predict)
    assert logits.shape == (6, VOCAB)
    logits.logsumexp(-1).sum().backward()
    layers = model.mlm.bert.encoder.layer
    if name in ("fnet", "ponet"):
        assert all(isinstance(layer.attention.self, MixerSelfAttention) for layer in layers)
        assert all(isinstance(layer.attention.output.dense, torch.nn.Identity) for layer in layers)
        assert not any(n.endswith("query.weight") for n, _ in model.named_parameters())
    elif name != "softmax":
        assert all(isinstance(layer.attention.self.longattn, AttentionBase) for layer in layers)
    # every parameter gets a gradient (FNet's mixing has none of its own; nothing is left unused)
    unused = [n for n, p in model.named_parameters() if p.grad is None]
    assert unused == []
    # the decoder is tied to the word embeddings, as BERT's
    assert model.mlm.cls.predictions.decoder.weight is model.mlm.bert.embeddings.word_embeddings.weight


def test_mixer_sees_the_padding_mask():
    torch.manual_seed(0)
    model = BertMLM(VOCAB, max_len=32, attention="ponet", **TINY).eval()
    ids, mask = _inputs()
    seen = []
    mixer = model.mlm.bert.encoder.layer[0].attention.self.mixer
    handle = mixer.register_forward_pre_hook(lambda m, a, k: seen.append(k["attention_mask"]), with_kwargs=True)
    model(ids, mask, mask)
    handle.remove()
    assert torch.equal(seen[0], mask)  # the bridge's bool [B, N] key padding mask, True = real token


def _pretrain_folder(tmp_path, attention="skeleton", options=None):
    """A run folder as `longattn pretrain` leaves it: config.yaml and checkpoints/best.pt."""
    torch.manual_seed(0)
    options = options or {"s1": 4, "s2": 4}
    model = BertMLM(VOCAB, max_len=32, attention=attention, attention_options=options, mechanism_seed=3, **TINY)
    folder = tmp_path / "pretrain"
    (folder / "checkpoints").mkdir(parents=True)
    write_yaml({"task": "mlm", "model_name": "bert_mlm", "attention": attention,
                "attention_options": {attention: options}, "data": {"max_len": 32},
                "model": {**TINY, "dropout": 0.1, "mechanism_seed": 3}}, folder / "config.yaml")
    save_atomic({"model": model.state_dict(), "step": 1, "val": {}}, folder / "checkpoints" / "best.pt")
    return folder, model


def test_glue_model_starts_from_the_pretrained_encoder(tmp_path):
    folder, pretrained = _pretrain_folder(tmp_path)
    model = BertGlue(VOCAB, num_labels=3, max_len=16, attention="skeleton", attention_options={"s1": 4, "s2": 4},
                     pretrained=str(folder))
    source = pretrained.mlm.bert.state_dict()
    for key, value in model.bert.state_dict().items():
        if not key.startswith("pooler."):
            assert torch.equal(value, source[key]), key
    ids, mask = _inputs()
    model.eval()
    assert model(ids, torch.zeros_like(ids), mask).shape == (2, 3)
    # the same encoder output as the pretrained model's (same mechanism, same weights)
    with torch.no_grad():
        ours = model.bert(input_ids=ids, attention_mask=mask).last_hidden_state
        theirs = pretrained.eval().mlm.bert(input_ids=ids, attention_mask=mask).last_hidden_state
    torch.testing.assert_close(ours[mask], theirs[mask])


def test_glue_model_refuses_another_mechanism_or_a_non_run(tmp_path):
    folder, _ = _pretrain_folder(tmp_path)
    with pytest.raises(ValueError, match="pretrained with attention 'skeleton'"):
        BertGlue(VOCAB, num_labels=2, max_len=16, attention="softmax", pretrained=str(folder))
    with pytest.raises(FileNotFoundError, match="config.yaml does not exist"):
        BertGlue(VOCAB, num_labels=2, max_len=16, pretrained=str(tmp_path))
    with pytest.raises(ValueError, match="vocabulary of 120 words"):
        BertGlue(VOCAB + 1, num_labels=2, max_len=16, attention="skeleton", attention_options={"s1": 4, "s2": 4},
                 pretrained=str(folder))


def test_mean_pooling_ignores_padding():
    torch.manual_seed(0)
    model = BertGlue(VOCAB, num_labels=1, max_len=32, attention="softmax", pooling="mean").eval()
    ids, mask = _inputs()
    short = model(ids[1:, :13], torch.zeros_like(ids[1:, :13]), mask[1:, :13])
    padded = model(ids[1:], torch.zeros_like(ids[1:]), mask[1:])
    torch.testing.assert_close(short, padded)


def test_minilm_rewarm_then_finetune(tmp_path):
    """The optional step of the MiniLM route: MLM re-warm of the converted MiniLM, then fine-tuning from it."""
    from longattn.hf import load_bert

    options = {"s1": 4, "s2": 4}
    original = load_bert().state_dict()
    model = BertMLM(30522, max_len=32, attention="skeleton", attention_options=options, pretrained="minilm")
    encoder = model.mlm.bert.state_dict()
    assert all(torch.equal(encoder[k], v) for k, v in original.items() if k in encoder)  # pretrained weights kept
    assert any(".longattn." in k for k in encoder)  # and the mechanism's new ones
    # optim.new_lr reaches exactly what the conversion added (the MLM head trains at lr, as BERT's heads do)
    new = {id(t) for t in model.new_parameters()}
    added = {n for n, t in model.named_parameters() if id(t) in new}
    assert added and added == {n for n, _ in model.named_parameters() if ".longattn." in n}
    assert not {n.removeprefix("mlm.bert.") for n in added} & set(original)
    assert BertMLM(VOCAB, max_len=32, attention="skeleton", attention_options=options, **TINY).new_parameters() == []
    with pytest.raises(ValueError, match="from scratch"):
        BertMLM(30522, max_len=32, pretrained="bert-base-uncased")
    folder = tmp_path / "rewarm"
    (folder / "checkpoints").mkdir(parents=True)
    write_yaml({"task": "mlm", "model_name": "bert_mlm", "attention": "skeleton",
                "attention_options": {"skeleton": options}, "data": {"max_len": 32},
                "model": {**TINY, "dropout": 0.1, "mechanism_seed": 0, "pretrained": "minilm"}},
               folder / "config.yaml")
    save_atomic({"model": model.state_dict(), "step": 1, "val": {}}, folder / "checkpoints" / "last.pt")
    glue = BertGlue(30522, num_labels=2, max_len=32, attention="skeleton", attention_options=options,
                    pretrained=str(folder), pooling="mean")
    assert glue.bert.config.hidden_size == 384
    assert all(torch.equal(v, encoder[k]) for k, v in glue.bert.state_dict().items())
    assert glue.new_parameters() == []  # the re-warm trained them: nothing starts from random any more
