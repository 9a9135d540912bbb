"""Padding-free batches through transformers: DataCollatorWithFlattening's packed rows give the padded batch's
logits and gradients, in a Llama (causal, rotary) and a BERT (bidirectional), and train a converted model."""

import pytest
import torch
import transformers

import longattn.hf as lhf
from longattn.attention import AttentionError

LENGTHS = [5, 9, 3]
LLAMA = {"softmax": {}, "linear": {}, "performer": {"nb_features": 16}, "cosformer": {},
         "local": {"window_size": 4}, "longformer": {"attention_window": 4}, "realformer": {},
         "transformer_ls": {"window_size": 4, "chunk_size": 3},
         "deltanet": {"chunk_size": 4}, "gated_deltanet": {"chunk_size": 4}, "gla": {}, "mamba2": {},
         "dsa": {"top_k": 3},
         "sliding_sinks": {"window_size": 3, "sink_tokens": 2}}


def llama():
    config = transformers.LlamaConfig(vocab_size=101, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                      initializer_range=0.2)
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(config).double()


def bert():
    config = transformers.BertConfig(vocab_size=101, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                     num_attention_heads=4, max_position_embeddings=64, initializer_range=0.2,
                                     attention_probs_dropout_prob=0.0, hidden_dropout_prob=0.0)
    torch.manual_seed(0)
    return transformers.BertForMaskedLM(config).double()


def through_longattn(model, name, options):
    if name in lhf.function_path_names():
        return lhf.enable(model, name, **options)
    return lhf.convert(model, name, fresh=name in lhf.NO_QKV_MAPPING, **options)


def examples(seed=0):
    generator = torch.Generator().manual_seed(seed)
    return [{"input_ids": torch.randint(1, 101, (n,), generator=generator).tolist()} for n in LENGTHS]


def padded(features):
    longest = max(len(f["input_ids"]) for f in features)
    ids = torch.zeros(len(features), longest, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, f in enumerate(features):
        ids[i, :len(f["input_ids"])] = torch.tensor(f["input_ids"])
        mask[i, :len(f["input_ids"])] = 1
    return ids, mask


def packed_vs_padded(model, **collator_options):
    features = examples()
    batch = transformers.DataCollatorWithFlattening(**collator_options)(features)
    batch.pop("labels")
    packed = model(**batch).logits[0]
    packed_grads = torch.autograd.grad(packed.square().sum(), list(model.parameters()), allow_unused=True)
    ids, mask = padded(features)
    reference = model(input_ids=ids, attention_mask=mask).logits[mask.bool()]
    reference_grads = torch.autograd.grad(reference.square().sum(), list(model.parameters()), allow_unused=True)
    torch.testing.assert_close(packed, reference, atol=1e-9, rtol=1e-9)
    for a, b in zip(packed_grads, reference_grads):
        if a is not None or b is not None:
            torch.testing.assert_close(a, b, atol=1e-9, rtol=1e-9)


@pytest.mark.parametrize("name", sorted(LLAMA))
def test_a_packed_llama_batch_equals_the_padded_one(name):
    model = through_longattn(llama(), name, LLAMA[name]).eval()  # eval: no dropout draws; gradients all the same
    packed_vs_padded(model)  # position_ids that restart (rotary needs them); the model's default use_cache=True
    packed_vs_padded(model, return_flash_attn_kwargs=True)  # and flash-attention's cu_seq_lens


@pytest.mark.parametrize("name, options", [("softmax", {}), ("skeleton", {"s1": 4, "s2": 4}),
                                           ("luna", {"pack_length": 4}), ("nystrom", {"num_landmarks": 4})])
def test_a_packed_bert_batch_equals_the_padded_one(name, options):
    packed_vs_padded(through_longattn(bert(), name, options).eval(), return_flash_attn_kwargs=True)


def test_packing_refusals():
    model = through_longattn(bert(), "bigbird", {"block_size": 4})
    batch = transformers.DataCollatorWithFlattening()(examples())
    with pytest.raises(AttentionError, match="cannot take packed sequences"):
        model(input_ids=batch["input_ids"], position_ids=batch["position_ids"])
    model = through_longattn(llama(), "linear", {}).eval()
    out = model(input_ids=batch["input_ids"], position_ids=batch["position_ids"], use_cache=True)
    cache = out.cache if hasattr(out, "cache") else out.past_key_values
    with pytest.raises(AttentionError, match="packed batch"):
        model(input_ids=torch.tensor([[5]]), cache=cache, use_cache=True)


def test_a_flattened_batch_trains_a_converted_model():
    model = lhf.convert(llama().float(), "transformer_ls", window_size=4, chunk_size=3).train()
    collator = transformers.DataCollatorWithFlattening()
    batch = collator(examples(1) + examples(2))
    assert batch["input_ids"].shape[0] == 1 and (batch["labels"] == -100).sum() == 2 * len(LENGTHS)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    losses = []
    for _ in range(8):
        loss = model(**batch).loss
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    assert losses[-1] < losses[0]
    assert model.model.layers[0].self_attn.longattn.to_projection.weight.grad.abs().sum() > 0  # its own parameters
