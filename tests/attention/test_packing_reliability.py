"""Packed inputs validated once, at the boundary (issue 56): each fault of ``cu_seqlens`` (floats, a list of
non-ints, 2-D, not from 0, not rising, short, a sequence crossing a row) and a padding mask of another shape give
an AttentionError naming it, in the module form, the functional form and the bridge (one validator,
``segment_ids``); a list of ints is taken as its tensor (the documented rule)."""

import re

import pytest
import torch

from longattn import attention
from longattn.attention import AttentionError
from longattn.attention.packing import packed_call
from reliability import CLEAR_ERROR, CORRECT_RESULT, PACKING, bad_input, cases

DIM, HEADS, B, N = 16, 2, 2, 6
# [B, N] = [2, 6]: sequences 0-4, 4-6 | 6-9, 9-12 (one row boundary, at 6)
GOOD = [0, 4, 6, 9, 12]
FAULTS = {
    "floats": (torch.tensor([0.0, 4.5, 6.0, 9.0, 12.0]), "integer tensor, got torch.float32"),
    "list-of-floats": ([0, 4.5, 6, 9, 12], "list must hold Python ints"),
    "a-string": ("0,4,6,9,12", "integer tensor .* got str"),
    "two-dimensional": (torch.tensor([GOOD]), "1-D"),
    "not-from-zero": (torch.tensor([1, 4, 6, 9, 12]), "from 0"),
    "not-rising": (torch.tensor([0, 4, 4, 6, 9, 12]), "rise strictly"),
    "short": (torch.tensor([0, 4, 6, 9]), "to the 12 tokens"),
    "crossing-a-row": (torch.tensor([0, 4, 7, 9, 12]), "crosses from row 0 .* token 6"),
}
SURFACES = ["module", "functional"]


def layer():
    torch.manual_seed(0)
    return attention.build("softmax", dim=DIM, heads=HEADS).double()


def run(surface, cu_seqlens, attention_mask=None):
    g = torch.Generator().manual_seed(1)
    if surface == "module":
        return layer().forward_packed(torch.randn(B, N, DIM, dtype=torch.float64, generator=g),
                                      cu_seqlens=cu_seqlens, attention_mask=attention_mask)
    q, k, v = (torch.randn(B, HEADS, N, 8, dtype=torch.float64, generator=g) for _ in range(3))
    return packed_call(attention.get_spec("softmax").functional, q, k, v, attention_mask,
                       cu_seqlens=cu_seqlens)


@pytest.mark.parametrize("surface", SURFACES)
@pytest.mark.parametrize("cu_seqlens, field", cases(PACKING, CLEAR_ERROR, FAULTS))
def test_each_cu_seqlens_fault_is_refused_naming_it(surface, cu_seqlens, field):
    with pytest.raises(AttentionError, match=f"cu_seqlens.*{field}"):
        run(surface, cu_seqlens)


@bad_input(PACKING, CORRECT_RESULT)
@pytest.mark.parametrize("surface", SURFACES)
def test_a_list_of_ints_is_taken_as_its_tensor(surface):
    torch.testing.assert_close(run(surface, GOOD), run(surface, torch.tensor(GOOD, dtype=torch.int32)))


@bad_input(PACKING, CLEAR_ERROR, cases=2)
@pytest.mark.parametrize("surface", SURFACES)
def test_a_mask_of_another_shape_is_refused(surface):
    for shape in ((B, N + 1), (B + 1, N)):
        with pytest.raises(AttentionError, match="attention_mask must have shape.*" + re.escape(f"got {list(shape)}")):
            run(surface, torch.tensor(GOOD), torch.ones(shape, dtype=torch.bool))


@bad_input(PACKING, CLEAR_ERROR, cases=2)
def test_position_ids_that_are_not_integers_are_refused():
    x = torch.randn(1, N, DIM, dtype=torch.float64)
    with pytest.raises(AttentionError, match="position_ids must be an integer tensor, got torch.float32"):
        layer().forward_packed(x, position_ids=torch.tensor([[0.0, 1, 2, 0, 1, 2]]))
    with pytest.raises(AttentionError, match="position_ids must be an integer tensor, got list"):
        layer().forward_packed(x, position_ids=[[0, 1, 2, 0, 1, 2]])


@bad_input(PACKING, CLEAR_ERROR, cases=2)
def test_the_bridge_refuses_flash_attention_cu_seqlens_through_the_same_validator():
    transformers = pytest.importorskip("transformers")
    import longattn.hf as lhf

    config = transformers.LlamaConfig(vocab_size=31, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                      num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=32)
    torch.manual_seed(0)
    model = lhf.enable(transformers.LlamaForCausalLM(config), "linear")
    ids = torch.randint(1, 31, (1, 12))
    positions = torch.tensor([[0, 1, 2, 3, 0, 1, 0, 1, 2, 0, 1, 2]])
    for cu, field in ((torch.tensor([0.0, 4, 6, 9, 12]), "integer tensor"), (torch.tensor([0, 4, 6, 9]), "12 tokens")):
        with pytest.raises(AttentionError, match=f"cu_seqlens.*{field}"):
            model(ids, position_ids=positions, cu_seq_lens_q=cu, cu_seq_lens_k=cu, max_length_q=4, max_length_k=4,
                  use_cache=False)
