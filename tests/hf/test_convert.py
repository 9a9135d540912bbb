"""longattn.hf.convert: mechanisms with parameters or state inside pretrained transformers models."""

import pytest
import torch
import transformers

import longattn.hf as lhf
from longattn import attention
from longattn.attention import AttentionError, collect_aux_losses


def real_max_diff(a, b, mask):
    return (a - b)[mask.bool()].abs().max().item()


def test_convert_softmax_equals_the_original_and_keeps_every_key(minilm_path, batch):
    reference = lhf.load_bert()
    model = lhf.convert(lhf.load_bert(), "softmax")
    with torch.no_grad():
        diff = real_max_diff(model(**batch).last_hidden_state, reference(**batch).last_hidden_state,
                             batch["attention_mask"])
    assert diff <= 1e-5
    assert set(reference.state_dict()) == set(model.state_dict())  # softmax adds nothing


def test_convert_softmax_on_gqa_llama_with_left_padding(tiny_llama):
    ids = torch.randint(3, 101, (2, 9), generator=torch.Generator().manual_seed(3))
    mask = torch.ones(2, 9, dtype=torch.long)
    mask[0, :4] = 0
    reference, model = tiny_llama(), lhf.convert(tiny_llama(), "softmax")
    with torch.no_grad():
        assert real_max_diff(model(ids, attention_mask=mask).last_hidden_state,
                             reference(ids, attention_mask=mask).last_hidden_state, mask) <= 1e-5


@pytest.mark.parametrize("name, options", [("skeleton", {"s1": 8, "s2": 8}), ("linformer", {"k": 16}),
                                           ("singular", {}), ("luna", {"pack_length": 8})])
def test_parameterised_conversion_keeps_pretrained_keys_and_adds_one_prefix(minilm_path, name, options):
    original = lhf.load_bert().state_dict()
    model = lhf.convert(lhf.load_bert(), name, **options)
    state = model.state_dict()
    assert set(original) <= set(state)
    for key in original:
        assert torch.equal(state[key], original[key])
    new = set(state) - set(original)
    assert new and all(".longattn." in key for key in new)
    assert model.config.longattn["name"] == name


@pytest.mark.parametrize("name, options", [("skeleton", {"s1": 8, "s2": 8}), ("softmax", {}), ("bigbird", {})])
def test_save_and_reload_is_exact(minilm_path, batch, tmp_path, name, options):
    model = lhf.convert(lhf.load_bert(), name, **options)
    with torch.no_grad():
        for p in model.parameters():  # as after fine-tuning: not the conversion's initial values
            p.add_(torch.randn_like(p) * 1e-3)
    model.save_pretrained(tmp_path)
    loaded = lhf.from_pretrained(tmp_path)
    with torch.no_grad():
        assert torch.equal(loaded(**batch).last_hidden_state, model.eval()(**batch).last_hidden_state)
    assert loaded.config.longattn == model.config.longattn


def test_training_reaches_new_and_pretrained_parameters_and_collects_aux_losses(minilm_path, batch):
    model = lhf.convert(lhf.load_bert(), "singular", rank=8).train()
    out = model(**batch).last_hidden_state
    aux = collect_aux_losses(model)
    assert set(aux) == {"singular_orthogonal", "singular_diagonal"}
    (out.square().mean() + sum(aux.values())).backward()
    layer = model.encoder.layer[0].attention.self
    assert layer.query.weight.grad.abs().sum() > 0  # pretrained
    assert layer.longattn.to_factors.weight.grad.abs().sum() > 0  # new


def test_layer_state_flows_through_the_layers(minilm_path, batch):
    # Singularformer's score residual: layer i reads what layer i-1 left in the one dict of this forward
    model = lhf.convert(lhf.load_bert(), "singular", rank=8).eval()
    seen = []
    for layer in model.encoder.layer:
        layer.attention.self.longattn.register_forward_pre_hook(
            lambda mod, args, kwargs: seen.append((id(kwargs["layer_state"]), sorted(kwargs["layer_state"]))),
            with_kwargs=True)
    with torch.no_grad():
        model(**batch)
    assert len({i for i, _ in seen}) == 1 and seen[0][1] == [] and all(keys for _, keys in seen[1:])
    seen.clear()
    with torch.no_grad():
        model(**batch)
    assert seen[0][1] == []  # a fresh dict per forward


def test_layers_subset_leaves_the_others_exact(minilm_path, batch):
    model = lhf.convert(lhf.load_bert(), "linformer", k=16, layers=[0])
    assert hasattr(model.encoder.layer[0].attention.self, "longattn")
    assert not hasattr(model.encoder.layer[1].attention.self, "longattn")
    with torch.no_grad():
        model(**batch)


def test_refusals(minilm_path, tiny_llama, batch):
    with pytest.raises(AttentionError, match="fresh=True"):
        lhf.convert(lhf.load_bert(), "synthesizer")
    model = lhf.convert(lhf.load_bert(), "synthesizer", fresh=True)
    with torch.no_grad():
        model(**batch)
    with pytest.raises(AttentionError, match="already converted"):
        lhf.convert(model, "softmax")
    with pytest.raises(AttentionError, match="rotary"):
        lhf.convert(tiny_llama(), "luna", pack_length=4)(torch.randint(0, 101, (1, 8)))
    config = transformers.MPNetConfig(vocab_size=50, hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                                      intermediate_size=64)
    with pytest.raises(AttentionError, match="no self-attention module"):
        lhf.convert(transformers.MPNetModel(config), "softmax")
    with pytest.raises(AttentionError, match="out of range"):
        lhf.convert(lhf.load_bert(), "softmax", layers=[6])
    with pytest.raises(AttentionError, match="no longattn conversion"):
        lhf.from_pretrained(minilm_path)


def test_a_converted_model_that_bypasses_the_interface_raises(tiny_bert):
    # Longformer-style models keep query/key/value but not the interface: convert's first forward says so
    model = lhf.convert(tiny_bert(), "softmax")
    model.config._attn_implementation = "eager"  # as a model that ignores the interface would behave
    with pytest.raises(AttentionError, match="never reached"):
        model(torch.randint(0, 101, (1, 8)))


# Deterministic mechanisms that depend on the padded length, and the option that makes them invariant.
PADDED_LENGTH_DEPENDENT = {
    "cosformer": {"max_positions": 128},  # M of eq. 9 defaults to the (padded) sequence length
    "fsat": {"lmax": 128},  # the predicted indices are scaled by lmax, which defaults to the padded length
    "fnet": None,  # the DFT runs over the padded length: inherent to FNet
    "bigbird": None,  # random blocks are drawn per number of blocks and the last block is global
    "sinkhorn": None,  # the learned sorting permutes every block of the padded length
    "ponet": None,  # segment max-pooling splits the padded length into segment_num runs (authors' LRA code)
}
SMALL = {"skeleton": {"s1": 8, "s2": 8}, "nystrom": {"num_landmarks": 4}, "linformer": {"k": 16},
         "luna": {"pack_length": 8}, "bigbird": {"block_size": 4}, "local": {"window_size": 4},
         "longformer": {"attention_window": 4}, "sinkhorn": {"block_size": 4}, "transformer_ls": {"window_size": 4},
         "dsa": {"top_k": 4},
         "sliding_sinks": {"window_size": 4, "sink_tokens": 2}}


def padding_differences(model, tokenizer):
    sentence = "Attention mechanisms let each token look at every other token in the sequence."
    longer = sentence + " And a second clause makes this one longer, so the first is padded in the batch."
    alone = tokenizer([sentence], return_tensors="pt")
    n = alone["input_ids"].shape[1]
    batched = tokenizer([longer, sentence], padding=True, return_tensors="pt")
    padded = tokenizer([sentence], padding="max_length", max_length=64, return_tensors="pt")
    with torch.no_grad():
        a = model(**alone).last_hidden_state[0]
        b = model(**batched).last_hidden_state[1, :n]
        c = model(**padded).last_hidden_state[0, :n]
    return (a - b).abs().max().item(), (a - c).abs().max().item()


@pytest.mark.parametrize("name", [n for n in attention.available() if not attention.capabilities(n).stochastic_eval])
def test_padding_invariance_through_transformers(minilm_path, tokenizer, name):
    options = SMALL.get(name, {})
    convert = lambda **extra: lhf.convert(lhf.load_bert(), name, fresh=name in lhf.NO_QKV_MAPPING,  # noqa: E731
                                          **options, **extra)
    if name in PADDED_LENGTH_DEPENDENT:
        # the declaration holds: with the defaults the padded length changes the outputs ...
        assert max(padding_differences(convert(), tokenizer)) > 1e-3
        fixed = PADDED_LENGTH_DEPENDENT[name]
        if fixed is None:
            return
        model = convert(**fixed)  # ... and the fixed-length option makes them invariant
    else:
        model = convert()
    assert max(padding_differences(model, tokenizer)) <= 1e-4


def test_convert_leaves_the_callers_config_alone(tiny_llama):
    config = tiny_llama().config
    first = lhf.convert(transformers.LlamaModel(config), "linear")
    implementation = config._attn_implementation
    second = lhf.convert(transformers.LlamaModel(config), "softmax")  # the same config object: not "already converted"
    assert not hasattr(config, "longattn") and config._attn_implementation == implementation != lhf.CONVERTED_KEY
    assert (first.config.longattn["name"], second.config.longattn["name"]) == ("linear", "softmax")
    for model in (first, second):  # every module reads the model's own copy
        assert all(m.config is model.config for m in model.modules() if "config" in m.__dict__)
        with torch.no_grad():
            model(torch.randint(0, 101, (1, 6)))
