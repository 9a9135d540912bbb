"""longattn mechanisms through transformers' AttentionInterface / AttentionMaskInterface."""

import pytest
import torch
import transformers
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

import longattn.hf as lhf
from longattn.attention import AttentionError, capabilities
from longattn.hf.bridge import _function_mechanism


def mean_pool(hidden, mask):
    mask = mask[..., None].to(hidden.dtype)
    return (hidden * mask).sum(1) / mask.sum(1)


def assert_same_real_tokens(ours, ref, mask, atol=1e-5):
    real = mask.bool()
    assert (ours[real] - ref[real]).abs().max().item() <= atol
    cosine = torch.cosine_similarity(mean_pool(ours, mask), mean_pool(ref, mask))
    assert cosine.min().item() >= 0.99999


def test_softmax_through_the_interface_equals_sdpa_on_minilm(minilm_path, batch):
    reference = lhf.load_bert()
    model = lhf.enable(lhf.load_bert(), "softmax")
    assert model.config._attn_implementation == "longattn_softmax"
    with torch.no_grad():
        ref = reference(**batch).last_hidden_state
        ours = model(**batch).last_hidden_state
    assert not batch["attention_mask"].bool().all()  # the batch is padded
    assert_same_real_tokens(ours, ref, batch["attention_mask"])


def test_from_pretrained_with_attn_implementation(minilm_path, batch):
    key = lhf.register("softmax")
    model = transformers.AutoModel.from_pretrained(str(minilm_path), attn_implementation=key, local_files_only=True)
    lhf.check_dispatch(model)
    with torch.no_grad():
        ours = model(**batch).last_hidden_state
        ref = lhf.load_bert()(**batch).last_hidden_state
    assert_same_real_tokens(ours, ref, batch["attention_mask"])


def left_padded_ids():
    ids = torch.randint(3, 101, (3, 12), generator=torch.Generator().manual_seed(1))
    mask = torch.ones(3, 12, dtype=torch.long)
    mask[0, :5] = 0  # left padding, as for generation
    mask[1, :2] = 0
    return ids, mask


def test_softmax_through_the_interface_equals_sdpa_on_gqa_llama_with_left_padding(tiny_llama):
    ids, mask = left_padded_ids()
    reference = tiny_llama()
    model = lhf.enable(tiny_llama(), "softmax")
    assert model.layers[0].self_attn.num_key_value_groups == 2
    with torch.no_grad():
        assert_same_real_tokens(model(ids, attention_mask=mask).last_hidden_state,
                                reference(ids, attention_mask=mask).last_hidden_state, mask)


def test_softmax_decodes_with_a_kv_cache(tiny_llama):
    ids = torch.randint(3, 101, (1, 8), generator=torch.Generator().manual_seed(2))
    config = transformers.GenerationConfig(max_new_tokens=4, do_sample=False)
    reference = transformers.LlamaForCausalLM(tiny_llama().config).eval()
    model = transformers.LlamaForCausalLM(tiny_llama().config).eval()
    model.load_state_dict(reference.state_dict())
    lhf.enable(model, "softmax")
    assert torch.equal(model.generate(ids, generation_config=config), reference.generate(ids, generation_config=config))


class ShapeRecorder(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.shapes = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self.shapes += [tuple(t.shape) for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor)]
        return out


def test_mask_function_hands_a_bool_key_padding_mask_and_builds_no_square_mask(minilm_path, tokenizer, monkeypatch):
    from transformers import AttentionInterface

    key = lhf.register("linear")
    seen = []
    real_attention = AttentionInterface._global_mapping[key]

    def spy(module, query, key_, value, attention_mask, **kwargs):
        seen.append(attention_mask)
        return real_attention(module, query, key_, value, attention_mask, **kwargs)

    monkeypatch.setitem(AttentionInterface._global_mapping, key, spy)
    model = lhf.enable(lhf.load_bert(), "linear")
    n = 200  # a length that is no dimension of the model: any [.., N, N] tensor shows
    enc = tokenizer(["word " * 300, "a short sentence"], padding="max_length", truncation=True, max_length=n,
                    return_tensors="pt")
    with ShapeRecorder() as recorder, torch.no_grad():
        model(**enc)
    assert len(seen) == 6
    for mask in seen:
        assert mask.dtype == torch.bool and mask.shape == (2, n)
        assert torch.equal(mask, enc["attention_mask"].bool())
    assert all(shape.count(n) <= 1 for shape in recorder.shapes), "an N x N tensor was built"
    seen.clear()
    with torch.no_grad():
        model(**tokenizer(["no padding here"], return_tensors="pt"))
    assert seen == [None] * 6  # nothing to mask: no mask at all


def test_a_model_that_ignores_the_interface_raises():
    config = transformers.MPNetConfig(vocab_size=50, hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                                      intermediate_size=64)
    with pytest.raises(AttentionError, match="AttentionInterface"):
        lhf.enable(transformers.MPNetModel(config), "softmax")
    # forced into the config, the model still runs its own attention: the first forward raises
    model = transformers.MPNetModel(config)
    model.config._attn_implementation = lhf.register("softmax")
    lhf.check_dispatch(model)
    with pytest.raises(AttentionError, match="did not route its attention"):
        model(torch.randint(0, 50, (1, 6)))


def test_register_is_idempotent_and_refuses_conflicting_options():
    assert lhf.register("local", window_size=4) == lhf.register("local", window_size=4) == "longattn_local"
    with pytest.raises(AttentionError, match="already registered"):
        lhf.register("local", window_size=8)


def test_register_all_covers_the_parameter_free_mechanisms():
    keys = lhf.register_all()
    assert {"longattn_softmax", "longattn_nystrom", "longattn_performer", "longattn_vmean"} <= set(keys)
    for name in ("skeleton", "singular", "linformer", "luna", "synthesizer", "fnet", "reformer"):
        assert lhf.implementation_key(name) not in keys
    with pytest.raises(AttentionError, match="convert"):
        lhf.register("skeleton")


@pytest.mark.parametrize("name", ["nystrom", "performer", "bigbird", "local", "linear", "longformer", "cosformer"])
def test_function_path_matches_the_module_form_with_the_same_projections(name, tiny_bert):
    # through transformers, the mechanism sees exactly what its own module form computes from the same
    # projections: compare one attention layer's context
    model = tiny_bert(attention_probs_dropout_prob=0.0)
    layer = model.encoder.layer[0].attention.self
    x = torch.randn(2, 40, 32)
    mask = torch.ones(2, 40, dtype=torch.bool)
    mask[1, 25:] = False
    options = {**lhf.FUNCTION_FORM_OPTIONS.get(name, {}), **({"num_landmarks": 8} if name == "nystrom" else {}),
               **({"window_size": 8} if name == "local" else {}), **({"block_size": 4} if name == "bigbird" else {}),
               **({"attention_window": 8} if name == "longformer" else {})}
    model.set_attn_implementation(lhf.register(name, **options))
    from longattn.attention import build

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)  # the seed register() builds layer 0's mechanism from
        module = build(name, dim=32, heads=4, **options).eval()
    for ours, theirs in ((module.proj.to_q, layer.query), (module.proj.to_k, layer.key), (module.proj.to_v, layer.value)):
        ours.load_state_dict(theirs.state_dict())
    torch.nn.init.eye_(module.proj.to_out.weight)
    torch.nn.init.zeros_(module.proj.to_out.bias)
    with torch.no_grad():
        context = layer(x, attention_mask=lhf.key_padding_mask(2, 40, 40, attention_mask=mask))[0]
        expected = module(x, attention_mask=mask)
    torch.testing.assert_close(context[mask], expected[mask], atol=1e-5, rtol=1e-5)


def test_clear_errors(tiny_bert, tiny_llama):
    ids = torch.randint(0, 101, (1, 10))
    decoder = tiny_bert(is_decoder=True, attention_probs_dropout_prob=0.0)
    with pytest.raises(AttentionError, match="causal"):
        lhf.enable(decoder, "nystrom")(ids)  # bidirectional only, the decoder is causal
    training = lhf.enable(tiny_bert(), "linear").train()
    with pytest.raises(AttentionError, match="dropout"):
        training(ids)
    lhf.enable(tiny_bert(), "softmax").train()(ids)  # softmax has attention dropout
    config = tiny_llama().config
    config.sliding_window = 4
    mistral = transformers.MistralModel(transformers.MistralConfig(**config.to_dict()))
    with pytest.raises(AttentionError, match="mask pattern"):
        lhf.enable(mistral, "softmax")(torch.randint(0, 101, (1, 10)), attention_mask=torch.ones(1, 10, dtype=torch.long))
    cross = lhf.enable(tiny_bert(is_decoder=True, add_cross_attention=True, attention_probs_dropout_prob=0.0), "softmax")
    with pytest.raises(AttentionError, match="self-attention only"):
        cross(ids, encoder_hidden_states=torch.randn(1, 7, 32))
    with pytest.raises(AttentionError, match="4-D mask"):
        lhf.bridge._check_mask(torch.zeros(1, 1, 10, 10, dtype=torch.bool), 1, 10)


def test_non_default_scaling_is_honoured_or_refused():
    class Module(torch.nn.Module):
        is_causal = False

    q, k, v = (torch.randn(1, 2, 16, 8, dtype=torch.float64) for _ in range(3))
    from longattn.attention.softmax import softmax_attention

    for name in ("softmax", "local"):  # softmax passes scale on, local rescales its queries
        mechanism, projections = _function_mechanism(name, {}, causal=False)
        mechanism.double()
        out = lhf.bridge.run_mechanism(mechanism, projections, Module(), q, k, v, None, dropout=0.0, scaling=0.5)
        torch.testing.assert_close(out, softmax_attention(q, k, v, scale=0.5).transpose(1, 2))
    mechanism, projections = _function_mechanism("linear", {}, causal=False)
    with pytest.raises(AttentionError, match="scaling"):
        lhf.bridge.run_mechanism(mechanism, projections, Module(), q, k, v, None, dropout=0.0, scaling=0.5)


def test_deterministic_function_mechanisms_are_reproducible_across_models(minilm_path, batch):
    # random features and blocks are drawn from fixed seeds: two loads give identical outputs
    for name in ("performer",):
        assert not capabilities(name).stochastic_eval
        a = lhf.enable(lhf.load_bert(), name)
        b = lhf.enable(lhf.load_bert(), name)
        with torch.no_grad():
            assert torch.equal(a(**batch).last_hidden_state, b(**batch).last_hidden_state)
