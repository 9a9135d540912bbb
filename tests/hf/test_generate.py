"""Cached generation through transformers: every causal mechanism decodes with its own state inside the model's
cache, and greedy decoding gives what recomputing the whole prefix at every token gives."""

import pytest
import torch
import transformers

import longattn.hf as lhf
from longattn.attention import AttentionError
from longattn.attention.decoding import decoding_names
from longattn.hf.cache import LongattnCacheLayer

# How each causal mechanism gets into a decoder: Llama (rotary, GQA) through register or convert; the
# mechanisms that project the hidden states themselves (luna) or have no Q/K/V mapping (fresh projections)
# would skip Llama's rotary embedding, so they decode in a BERT decoder (absolute positions).
ROUTES = {
    "softmax": ("llama", "enable", {}),
    "linear": ("llama", "enable", {}),
    "performer": ("llama", "enable", {"nb_features": 16}),
    "cosformer": ("llama", "enable", {}),  # M = max_position_embeddings in a causal model
    "deltanet": ("llama", "convert", {"chunk_size": 8}),
    "gated_deltanet": ("llama", "convert", {"chunk_size": 8}),
    "local": ("llama", "enable", {"window_size": 4}),
    "longformer": ("llama", "enable", {"attention_window": 4, "global_positions": (0, 12, 20)}),
    "realformer": ("llama", "convert", {}),
    "gla": ("llama", "convert", {}),
    "mamba2": ("llama", "convert", {}),
    "moba": ("llama", "enable", {"block_size": 4, "top_k": 2}),
    "nsa": ("llama", "convert", {"compress_block": 4, "compress_stride": 2, "select_block": 4, "local_blocks": 1,
                                 "select_count": 3, "window": 4}),
    "dsa": ("llama", "convert", {"top_k": 4}),
    "sliding_sinks": ("llama", "convert", {"window_size": 4, "sink_tokens": 2}),
    "transformer_ls": ("llama", "convert", {"window_size": 4, "chunk_size": 3}),
    "luna": ("bert", "convert", {"pack_length": 4}),
    "synthesizer": ("bert", "convert", {}),
    "flash": ("bert", "convert", {"chunk_size": 8, "query_key_dim": 8}),
    # one bucket, one round: LSH attention is exact causal attention whatever its fresh random rotations, so
    # the recomputing decoding state can be compared token for token
    "reformer": ("bert", "convert", {"bucket_size": 64, "n_hashes": 1, "attend_across_buckets": True}),
}
PAD = 0


def decoder(family: str, seed: int = 0):
    # initializer_range 0.2: attention weighs enough in the logits that a wrong state shows
    if family == "llama":
        config = transformers.LlamaConfig(vocab_size=101, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                          num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                                          pad_token_id=PAD, initializer_range=0.2)
        model_class = transformers.LlamaForCausalLM
    else:
        config = transformers.BertConfig(vocab_size=101, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                         num_attention_heads=4, max_position_embeddings=128, is_decoder=True,
                                         attention_probs_dropout_prob=0.0, pad_token_id=PAD, initializer_range=0.2)
        model_class = transformers.BertLMHeadModel
    torch.manual_seed(seed)
    return model_class(config).eval()


def routed(name: str, seed: int = 0):
    family, how, options = ROUTES[name]
    model = decoder(family, seed)
    if how == "enable":
        return lhf.enable(model, name, **options)
    return lhf.convert(model, name, fresh=name in lhf.NO_QKV_MAPPING, **options)


def left_padded_prompts():
    ids = torch.randint(3, 101, (3, 10), generator=torch.Generator().manual_seed(1))
    mask = torch.ones(3, 10, dtype=torch.long)
    mask[1, :3] = 0
    mask[2, :6] = 0
    return ids.masked_fill(mask == 0, PAD), mask


def generate(model, use_cache: bool, **options):
    ids, mask = left_padded_prompts()
    settings = dict(max_new_tokens=32, do_sample=False, output_logits=True, return_dict_in_generate=True,
                    pad_token_id=PAD, use_cache=use_cache)
    with torch.no_grad():
        return model.generate(ids, attention_mask=mask, **{**settings, **options})


def test_every_causal_mechanism_has_a_route():
    assert set(ROUTES) == set(decoding_names())


@pytest.mark.parametrize("name", sorted(ROUTES))
def test_cached_generation_equals_recomputation(name):
    model = routed(name)
    cached, recomputed = generate(model, True), generate(model, False)
    assert torch.equal(cached.sequences, recomputed.sequences)
    assert len(cached.logits) == 32
    for a, b in zip(cached.logits, recomputed.logits):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=0)
    cache = cached.cache if hasattr(cached, "cache") else cached.past_key_values
    layers = cache.layers
    assert all(isinstance(layer, LongattnCacheLayer) and layer.state is not None for layer in layers)
    assert {layer.get_seq_length() for layer in layers} == {10 + 31}  # the last token is never fed back
    if name != "softmax":  # the attention weighs in the logits: a wrong state could not pass unseen
        softmax = generate(routed("softmax") if ROUTES[name][0] == "llama" else
                           lhf.convert(decoder("bert"), "softmax"), False)
        assert max((a - b).abs().max().item() for a, b in zip(cached.logits, softmax.logits)) > 1e-2


def test_beam_search_and_several_samples_per_prompt_follow_the_states():
    model = routed("linear")
    beams = [generate(model, use_cache, num_beams=3, max_new_tokens=8).sequences for use_cache in (True, False)]
    assert torch.equal(*beams)
    samples = []
    for use_cache in (True, False):
        torch.manual_seed(5)
        samples.append(generate(model, use_cache, do_sample=True, num_return_sequences=2, max_new_tokens=8).sequences)
    assert torch.equal(*samples)


def test_a_forward_with_use_cache_continues_several_tokens_at_once():
    model = routed("local")
    ids = torch.randint(3, 101, (2, 14), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        full = model(ids).logits
        first = model(ids[:, :9], use_cache=True)
        cache = first.cache if hasattr(first, "cache") else first.past_key_values
        rest = model(ids[:, 9:], cache=cache, use_cache=True).logits
    torch.testing.assert_close(torch.cat([first.logits, rest], 1), full, atol=1e-5, rtol=0)


def test_decoding_without_the_hooks_or_with_a_foreign_cache_raises():
    model = decoder("llama")
    model.set_attn_implementation(lhf.register("linear"))  # registered, but not through enable: no decoding state
    with pytest.raises(AttentionError, match="decoding state"):
        generate(model, True, max_new_tokens=2)
    assert generate(model, False, max_new_tokens=2).sequences.shape == (3, 12)
    model = decoder("llama")
    model.set_attn_implementation(lhf.register("softmax"))  # softmax decodes with transformers' own KV cache
    cached, recomputed = (generate(model, use_cache, max_new_tokens=4).sequences for use_cache in (True, False))
    assert torch.equal(cached, recomputed)
    model = routed("linear")  # a recurrent state is not croppable: transformers refuses assisted decoding
    with pytest.raises(ValueError, match="cropped"):
        model.generate(torch.tensor([[5, 6, 7, 5, 6, 7, 5, 6]]), max_new_tokens=6, do_sample=False, pad_token_id=PAD,
                       prompt_lookup_num_tokens=2)
