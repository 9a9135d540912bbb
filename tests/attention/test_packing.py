"""Packed sequences (several per row, as transformers' DataCollatorWithFlattening makes them): each mechanism that
can keep them apart gives the padded batch's outputs and gradients; the others refuse with the reason."""

import pytest
import torch

from longattn import attention
from longattn.attention import AttentionError
from longattn.attention.packing import PADDED_LENGTH_DEPENDENT, packed_call, packing_plan, segment_ids

DIM, HEADS = 32, 2
LENGTHS = [5, 11, 3, 8]
SMALL = {"skeleton": {"s1": 4, "s2": 4}, "nystrom": {"num_landmarks": 4}, "linformer": {"k": 8},
         "luna": {"pack_length": 4}, "bigbird": {"block_size": 4}, "local": {"window_size": 4},
         "longformer": {"attention_window": 4}, "sinkhorn": {"block_size": 4}, "transformer_ls": {"window_size": 4},
         "performer": {"nb_features": 16}, "reformer": {"bucket_size": 4}, "flash": {"chunk_size": 4, "query_key_dim": 8},
         "fsat": {"lmax": 16}, "cosformer": {"max_positions": 16},
         "dsa": {"top_k": 3},
         "sliding_sinks": {"window_size": 3, "sink_tokens": 2}}
PACKABLE = [n for n in attention.available() if n not in PADDED_LENGTH_DEPENDENT or PADDED_LENGTH_DEPENDENT[n][1]]


def packed_and_padded(seed=0):
    sequences = [torch.randn(n, DIM, dtype=torch.float64, generator=torch.Generator().manual_seed(seed + i))
                 for i, n in enumerate(LENGTHS)]
    packed = torch.cat(sequences)[None].requires_grad_()
    padded = torch.zeros(len(LENGTHS), max(LENGTHS), DIM, dtype=torch.float64)
    mask = torch.zeros(len(LENGTHS), max(LENGTHS), dtype=torch.bool)
    for i, s in enumerate(sequences):
        padded[i, :len(s)], mask[i, :len(s)] = s, True
    positions = torch.cat([torch.arange(n) for n in LENGTHS])[None]
    return packed, padded.requires_grad_(), mask, positions


def unpadded(t, mask):
    return t[mask]  # the real tokens in order, as the packed row holds them


CASES = [(n, False) for n in PACKABLE] + [(n, True) for n in PACKABLE if attention.capabilities(n).causal]


@pytest.mark.parametrize("name, causal", CASES)
def test_packed_equals_padded_outputs_and_gradients(name, causal):
    torch.manual_seed(0)
    layer = attention.build(name, dim=DIM, heads=HEADS, max_len=16, causal=causal, **SMALL.get(name, {})).double()
    packed, padded, mask, positions = packed_and_padded()
    torch.manual_seed(1)  # stochastic mechanisms draw the same for the same padded batch
    out_packed = layer.forward_packed(packed, position_ids=positions)
    grads_packed = torch.autograd.grad(out_packed.square().sum(), [packed, *layer.parameters()], allow_unused=True)
    torch.manual_seed(1)
    out_padded = layer(padded, mask)
    grads_padded = torch.autograd.grad(out_padded.square().sum(), [padded, *layer.parameters()], allow_unused=True)
    torch.testing.assert_close(out_packed[0], unpadded(out_padded, mask), atol=1e-10, rtol=1e-10)
    torch.testing.assert_close(grads_packed[0][0], unpadded(grads_padded[0], mask), atol=1e-10, rtol=1e-10)
    for a, b in zip(grads_packed[1:], grads_padded[1:]):
        assert (a is None) == (b is None)
        if a is not None:
            torch.testing.assert_close(a, b, atol=1e-10, rtol=1e-10)


@pytest.mark.parametrize("name", ["softmax", "linear", "local", "nystrom"])
def test_packed_sequences_equal_each_sequence_alone(name):
    # padding-invariant mechanisms: a packed sequence is computed as if it were alone
    torch.manual_seed(0)
    layer = attention.build(name, dim=DIM, heads=HEADS, **SMALL.get(name, {})).double()
    packed, _, _, positions = packed_and_padded()
    cu_seqlens = torch.tensor([0, *torch.tensor(LENGTHS).cumsum(0).tolist()])
    out = layer.forward_packed(packed.detach(), cu_seqlens=cu_seqlens)
    torch.testing.assert_close(out, layer.forward_packed(packed.detach(), position_ids=positions))
    alone = torch.cat([layer(s[None])[0] for s in packed.detach()[0].split(LENGTHS)])
    torch.testing.assert_close(out[0], alone, atol=1e-10, rtol=1e-10)


def test_functional_forms_take_packed_sequences():
    q, k, v = (torch.randn(1, HEADS, sum(LENGTHS), 8, dtype=torch.float64) for _ in range(3))
    cu = torch.tensor([0, *torch.tensor(LENGTHS).cumsum(0).tolist()])
    spans = list(zip(cu[:-1].tolist(), cu[1:].tolist()))
    performer = attention.build("performer", dim=16, heads=HEADS, nb_features=8).double()
    for name, options in [("softmax", {"is_causal": True}), ("linear", {}), ("local", {"window_size": 2}),
                          ("performer", {"projection": performer.projection}),
                          ("cosformer", {"max_positions": 16, "is_causal": True})]:
        fn = attention.get_spec(name).functional
        out = packed_call(fn, q, k, v, cu_seqlens=cu, **options)
        alone = torch.cat([fn(q[:, :, a:b], k[:, :, a:b], v[:, :, a:b], **options) for a, b in spans], dim=2)
        torch.testing.assert_close(out, alone, atol=1e-10, rtol=1e-10)


@pytest.mark.parametrize("name", sorted(PADDED_LENGTH_DEPENDENT))
def test_mechanisms_that_depend_on_the_padded_length_refuse_packing(name):
    options = {k: v for k, v in SMALL.get(name, {}).items() if k != PADDED_LENGTH_DEPENDENT[name][1]}
    torch.manual_seed(0)
    layer = attention.build(name, dim=DIM, heads=HEADS, max_len=16, **options).double()
    packed, _, _, positions = packed_and_padded()
    with pytest.raises(AttentionError, match="cannot take packed sequences"):
        layer.forward_packed(packed, position_ids=positions)


def test_segment_ids_and_bad_packing_inputs():
    positions = torch.tensor([[0, 1, 2, 0, 1, 0, 0, 1]])
    assert segment_ids(position_ids=positions, shape=(1, 8)).tolist() == [[0, 0, 0, 1, 1, 2, 3, 3]]
    cu = torch.tensor([0, 3, 5, 6, 8])
    assert torch.equal(segment_ids(cu_seqlens=cu, shape=(1, 8)), segment_ids(position_ids=positions, shape=(1, 8)))
    plan = packing_plan(segment_ids(cu_seqlens=cu, shape=(1, 8)))
    assert plan.valid.sum(1).tolist() == [3, 2, 1, 2]
    x = torch.arange(8.0).view(1, 8, 1)
    assert torch.equal(plan.repack(plan.unpack(x)), x)
    with pytest.raises(AttentionError, match="exactly one"):
        segment_ids(shape=(1, 8))
    with pytest.raises(AttentionError, match="cu_seqlens"):
        segment_ids(cu_seqlens=torch.tensor([0, 3, 7]), shape=(1, 8))
    with pytest.raises(AttentionError, match="position_ids"):
        segment_ids(position_ids=torch.zeros(2, 5), shape=(1, 8))
