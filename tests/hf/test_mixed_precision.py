"""Training under torch.autocast through transformers: rotary embeddings hand back float32 queries and keys next to
bfloat16 values; the adapter brings them to one dtype for every mechanism the bridge accepts."""

import pytest
import torch
import transformers

import longattn.hf as lhf
from longattn import attention
from longattn.attention import AttentionError, collect_aux_losses

SMALL = {"skeleton": {"s1": 4, "s2": 4}, "nystrom": {"num_landmarks": 4}, "linformer": {"k": 8},
         "luna": {"pack_length": 4}, "bigbird": {"block_size": 4}, "local": {"window_size": 4},
         "longformer": {"attention_window": 4}, "sinkhorn": {"block_size": 4}, "transformer_ls": {"window_size": 4},
         "performer": {"nb_features": 16}, "reformer": {"bucket_size": 4}, "flash": {"chunk_size": 8, "query_key_dim": 8}}
# causal mechanisms that take Llama's own (rotated) q, k, v; the others would skip its rotary embedding
LLAMA = ["cosformer", "deltanet", "dsa", "gated_deltanet", "gla", "linear", "local", "longformer", "mamba2", "moba",
         "nsa", "performer", "realformer", "sliding_sinks", "softmax", "transformer_ls"]


def tiny(family: str):
    torch.manual_seed(0)
    if family == "llama":
        config = transformers.LlamaConfig(vocab_size=101, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                          num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32)
        return transformers.LlamaForCausalLM(config)
    config = transformers.BertConfig(vocab_size=101, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                     num_attention_heads=4, max_position_embeddings=32, attention_probs_dropout_prob=0.0)
    return transformers.BertForMaskedLM(config)


def through_longattn(model, name):
    options = SMALL.get(name, {})
    if name in lhf.function_path_names():
        return lhf.enable(model, name, **options)
    return lhf.convert(model, name, fresh=name in lhf.NO_QKV_MAPPING, **options)


@pytest.mark.parametrize("family, name", [("llama", n) for n in LLAMA] + [("bert", n) for n in attention.available()])
def test_ten_training_steps_under_bf16_autocast(family, name):
    model = through_longattn(tiny(family), name).train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    ids = torch.randint(3, 101, (2, 16), generator=torch.Generator().manual_seed(0))
    mask = torch.ones(2, 16, dtype=torch.long)
    mask[1, 12:] = 0
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    for _ in range(10):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = model(ids, attention_mask=mask, labels=ids).loss + sum(collect_aux_losses(model).values())
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        assert torch.isfinite(loss)
    # the attention trained: the model's q/k/v projections or the mechanism's own parameters moved (FNet's
    # Fourier mixing has neither)
    if name == "fnet":
        return
    after = dict(model.named_parameters())
    parts = ("q_proj", "k_proj", "v_proj", ".query.", ".key.", ".value.", ".longattn.")
    assert any(not torch.equal(before[n], after[n]) for n in before if any(part in n for part in parts))


def test_the_other_mechanisms_are_refused_in_a_llama_with_a_reason():
    for name in sorted(set(attention.available()) - set(LLAMA)):
        with pytest.raises(AttentionError, match="causal|rotary"):
            through_longattn(tiny("llama"), name)(torch.randint(3, 101, (1, 8)))
