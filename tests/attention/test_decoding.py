"""Decoding one token at a time: prefill + steps equal the full causal forward, for every causal mechanism.

As flash-linear-attention checks its recurrent form against its chunked one: float64, left padding, random
(non-initial) parameters, rows compared one by one.
"""

import pytest
import torch

from longattn import attention
from longattn.attention import AttentionError
from longattn.attention.decoding import DECODE_KINDS, DecodingState, decoding_names

DIM, HEADS = 32, 2
# options that make each mechanism's windows, chunks and features small next to the sequence
OPTIONS = {
    "cosformer": {"max_positions": 64},
    "deltanet": {"chunk_size": 8},
    "dsa": {"top_k": 5},
    "flash": {"chunk_size": 4, "query_key_dim": 8},
    "gated_deltanet": {"chunk_size": 8},
    "local": {"window_size": 4},
    "longformer": {"attention_window": 4, "dilation": 2, "global_positions": (0, 5, 13)},
    "luna": {"pack_length": 4},
    "moba": {"block_size": 4, "top_k": 2},
    "nsa": {"compress_block": 4, "compress_stride": 2, "select_block": 4, "select_count": 4, "local_blocks": 1, "window": 3},
    "performer": {"nb_features": 16},
    # one bucket over the whole sequence and one round: LSH attention is then exact causal attention whatever the
    # random rotations (which are drawn afresh at every call), so the recomputing step can be compared
    "reformer": {"bucket_size": 32, "n_hashes": 1, "attend_across_buckets": True},
    "sliding_sinks": {"window_size": 4, "sink_tokens": 2},
    "transformer_ls": {"window_size": 4, "chunk_size": 3, "chunk_rank": 2},
    "synthesizer": {"variant": "dense+factorized_random", "mix_dot_product": True},
}
# more option sets that take other branches of a decoding form
VARIANTS = [
    ("cosformer", {"max_positions": 64, "feature_map": "elu"}),
    ("cosformer", {"reweight": False}),
    ("deltanet", {"short_conv": False, "sigmoid_beta": False, "output_norm": False, "output_gate": True}),
    ("flash", {"chunk_size": 5, "query_key_dim": 8, "scaling": "none"}),
    ("gated_deltanet", {"conv_size": 2, "l2_norm": False, "output_gate": False, "chunk_size": 5}),
    ("local", {"window_size": 3, "exact_window": False, "look_backward": 2}),
    ("longformer", {"attention_window": 6, "global_positions": (3, 20), "separate_global_projections": False}),
    ("longformer", {"attention_window": 2, "global_positions": ()}),
    ("luna", {"pack_length": 4, "tie_kv": False}),
    ("realformer", {"residual_scores": False}),
    ("sliding_sinks", {"window_size": 1, "sink_tokens": 30, "learned_sink": False}),
    ("synthesizer", {"variant": "random+factorized_dense", "factor_a": 4}),
    ("transformer_ls", {"window_size": 1, "chunk_size": 5, "dual_ln": False}),
]
CASES = [(name, OPTIONS.get(name, {})) for name in decoding_names()] + VARIANTS
MAX_LEN = 64


def make(name, options, seed=0):
    torch.manual_seed(seed)
    layer = attention.build(name, dim=DIM, heads=HEADS, max_len=MAX_LEN, causal=True, **options).double().eval()
    with torch.no_grad():  # trained-looking parameters: zero-initialised biases and offsets take part too
        for p in layer.parameters():
            p.add_(torch.randn_like(p) * 0.3)
    return layer


def left_padded(batch=3, n=23, seed=1):
    x = torch.randn(batch, n, DIM, dtype=torch.float64, generator=torch.Generator().manual_seed(seed))
    mask = torch.ones(batch, n, dtype=torch.bool)
    mask[1, :4] = False
    mask[2, :11] = False  # the whole prompt of this row is padding
    return x, mask


def decode(layers, x, mask, prompt, layer_state=False):
    """Prefill ``prompt`` tokens, then step one token at a time through a stack of layers."""
    def run(method, inputs, masks, states):
        state_dict = {} if layer_state else None
        out, new = inputs, []
        for i, layer in enumerate(layers):
            if method == "prefill":
                out, state = layer.prefill(out, masks, state_dict)
            else:
                out, state = layer.step(out, states[i], masks, state_dict)
            new.append(state)
        return out, new

    out, states = run("prefill", x[:, :prompt], mask[:, :prompt], None)
    rows = [out]
    for t in range(prompt, x.shape[1]):
        out, states = run("step", x[:, t:t + 1], mask[:, t:t + 1], states)
        rows.append(out)
    return torch.cat(rows, dim=1), states


def full(layers, x, mask, layer_state=False):
    state_dict = {} if layer_state else None
    for layer in layers:
        x = layer(x, mask, state_dict)
    return x


def test_every_causal_mechanism_declares_its_decoding_state():
    for name in attention.available():
        kind = attention.capabilities(name).decode_state
        assert (kind in DECODE_KINDS) if attention.capabilities(name).causal else kind == "", name
    assert len(decoding_names()) >= 12


@pytest.mark.parametrize("name, options", CASES, ids=[f"{n}-{i}" for i, (n, _) in enumerate(CASES)])
def test_prefill_and_steps_equal_the_full_causal_forward(name, options):
    layers = [make(name, options, seed) for seed in range(2)]  # two layers: layer_state flows as in a model
    x, mask = left_padded()
    uses_state = attention.capabilities(name).uses_layer_state
    expected = full(layers, x, mask, uses_state)
    got, states = decode(layers, x, mask, prompt=9, layer_state=uses_state)
    assert all(isinstance(s, DecodingState) and s.length == x.shape[1] for s in states)
    torch.testing.assert_close(got, expected, atol=1e-10, rtol=1e-10)
    assert torch.all(got[~mask] == 0)  # padded positions (steps included) come out as zeros


def state_elements(state) -> int:
    total = 0
    for value in vars(state).values():
        if isinstance(value, torch.Tensor):
            total += value.numel()
        elif isinstance(value, DecodingState):
            total += state_elements(value)
        elif isinstance(value, dict):
            total += sum(t.numel() for t in value.values())
    return total


@pytest.mark.parametrize("name", [n for n in decoding_names() if attention.capabilities(n).decode_state in
                                  ("recurrent", "window")])
def test_recurrent_and_window_states_do_not_grow(name):
    # O(1) / O(window) per token: the state after 40 tokens is as large as after 20 (longformer's global
    # projections go once the last global position has passed)
    layer = make(name, OPTIONS.get(name, {}))
    x = torch.randn(1, 41, DIM, dtype=torch.float64)
    _, state = layer.prefill(x[:, :20])
    size = state_elements(state)
    for t in range(20, 41):
        _, state = layer.step(x[:, t:t + 1], state)
    assert state_elements(state) == size


def test_batch_reordering_and_repeating_follow_the_rows():
    layer = make("longformer", OPTIONS["longformer"])
    x, mask = left_padded()
    _, state = layer.prefill(x[:, :9], mask[:, :9])
    _, alone = layer.prefill(x[2:3, :9], mask[2:3, :9])
    state.select(torch.tensor([2, 2])).repeat_interleave(2)  # row 2, four times
    for t in range(9, 15):
        out, state = layer.step(x[[2, 2, 2, 2], t:t + 1], state, mask[[2, 2, 2, 2], t:t + 1])
        ref, alone = layer.step(x[2:3, t:t + 1], alone, mask[2:3, t:t + 1])
        torch.testing.assert_close(out, ref.expand(4, -1, -1))


def test_decoding_refusals():
    x = torch.randn(1, 6, DIM, dtype=torch.float64)
    with pytest.raises(AttentionError, match="max_positions"):
        make("cosformer", {}).prefill(x)
    with pytest.raises(AttentionError, match="chunk_size"):
        make("flash", {"chunk_size": 8, "query_key_dim": 8}).prefill(x)
    with pytest.raises(AttentionError, match="causal=True"):
        attention.build("softmax", dim=DIM, heads=HEADS).double().prefill(x)
    with pytest.raises(AttentionError, match="not causal"):
        attention.build("nystrom", dim=DIM, heads=HEADS).double().prefill(x)
    layer = make("linear", {})
    _, state = layer.prefill(x)
    with pytest.raises(AttentionError, match="one new token"):
        layer.step(x[:, :2], state)
    with pytest.raises(AttentionError, match="state"):
        layer.step(x[:, :1], {"sums": None})
    synthesizer = make("synthesizer", {})
    _, state = synthesizer.prefill(torch.randn(1, MAX_LEN, DIM, dtype=torch.float64))
    with pytest.raises(AttentionError, match="max_len"):
        synthesizer.step(x[:, :1], state)
