"""Decoding states that know whose they are (issue 56): a state handed to a layer, a batch, a dtype or a device
other than its own gives an AttentionError naming the field; the documented ways (``copy_for``, ``to``) give the
documented result. Every causal mechanism is covered through the generic checks of prefill / step."""

import copy
import traceback
from dataclasses import dataclass

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from longattn import attention
from longattn.attention import AttentionError, decoding
from longattn.attention.decoding import DecodingState, KVState, decoding_names
from reliability import CLEAR_ERROR, CORRECT_RESULT, DECODING, bad_input

DIM, HEADS, MAX_LEN = 16, 2, 32
NAMES = decoding_names()
# small windows, chunks and features; reformer's one bucket and round make it exact (see test_decoding.py)
OPTIONS = {
    "cosformer": {"max_positions": MAX_LEN},
    "flash": {"chunk_size": 4, "query_key_dim": 8},
    "local": {"window_size": 4},
    "longformer": {"attention_window": 4, "global_positions": (0, 5)},
    "luna": {"pack_length": 4},
    "performer": {"nb_features": 8},
    "reformer": {"bucket_size": 16, "n_hashes": 1, "attend_across_buckets": True},
    "transformer_ls": {"window_size": 4, "chunk_size": 3, "chunk_rank": 2},
}


def make(name, seed=0, heads=HEADS):
    torch.manual_seed(seed)
    return attention.build(name, dim=DIM, heads=heads, max_len=MAX_LEN, causal=True,
                           **OPTIONS.get(name, {})).double().eval()


def tokens(batch=3, n=7, dtype=torch.float64):
    return torch.randn(batch, n, DIM, dtype=dtype, generator=torch.Generator().manual_seed(2))


def prefilled(name, batch=3, seed=0):
    layer = make(name, seed)
    x = tokens(batch)
    with torch.no_grad():
        _, state = layer.prefill(x[:, :5])
    return layer, x, state


@bad_input(DECODING, CLEAR_ERROR)
@pytest.mark.parametrize("name", NAMES)
def test_a_state_stepped_by_another_layer_of_the_same_shapes_is_refused(name):
    _, x, state = prefilled(name)
    with pytest.raises(AttentionError, match="layer expected .* another layer.*copy_for"):
        make(name, seed=1).step(x[:, 5:6], state)


@bad_input(DECODING, CORRECT_RESULT)
@pytest.mark.parametrize("name", NAMES)
def test_copy_for_hands_a_state_to_a_layer_of_the_same_settings(name):
    layer, x, state = prefilled(name)
    twin = copy.deepcopy(layer)
    handed = state.copy_for(twin)
    with torch.no_grad():
        torch.manual_seed(4)
        expected, _ = layer.step(x[:, 5:6], state)
        torch.manual_seed(4)
        got, handed = twin.step(x[:, 5:6], handed)
    torch.testing.assert_close(got, expected)
    assert handed.length == 6


@bad_input(DECODING, CLEAR_ERROR)
@pytest.mark.parametrize("name", NAMES)
def test_a_state_of_another_mechanism_is_refused(name):
    other = "linear" if name != "linear" else "softmax"
    _, x, state = prefilled(other)
    with pytest.raises(AttentionError, match=f"mechanism expected '{name}'.* '{other}'"):
        make(name).step(x[:, 5:6], state)


@bad_input(DECODING, CLEAR_ERROR, cases=2)
@pytest.mark.parametrize("name", NAMES)
def test_a_token_batch_other_than_the_states_is_refused(name):
    layer, x, state = prefilled(name)
    for batch in (2, 1):  # 1 vs 3 used to broadcast silently (linear attention)
        with pytest.raises(AttentionError, match=f"batch expected 3 .* given a token with batch {batch}"):
            layer.step(x[:batch, 5:6], state)


@bad_input(DECODING, CLEAR_ERROR)
@pytest.mark.parametrize("name", NAMES)
def test_a_state_of_another_head_count_is_refused(name):
    _, x, state = prefilled(name)
    layer = make(name, heads=4)
    with pytest.raises(AttentionError, match="heads expected 4 .* heads=2"):
        layer.step(x[:, 5:6], state)
    with pytest.raises(AttentionError, match="heads expected 4"):
        state.copy_for(layer)


@bad_input(DECODING, CLEAR_ERROR, cases=2)
@pytest.mark.parametrize("name", NAMES)
def test_a_state_of_another_dtype_is_refused_and_moved_on_purpose_with_to(name):
    layer, x, state = prefilled(name)
    layer.float()  # float64 state, float32 layer
    with pytest.raises(AttentionError, match="dtype expected torch.float64 .* torch.float32.*state.to"):
        layer.step(x[:, 5:6].float(), state)
    state.to(dtype=torch.float32)
    with torch.no_grad():
        out, state = layer.step(x[:, 5:6].float(), state)
    assert out.dtype == torch.float32 and torch.isfinite(out).all()
    layer.bfloat16()  # float32 state, bf16 layer
    with pytest.raises(AttentionError, match="dtype expected torch.float32 .* torch.bfloat16"):
        layer.step(x[:, 6:7].bfloat16(), state)


@bad_input(DECODING, CLEAR_ERROR)
@pytest.mark.parametrize("name", NAMES)
def test_a_token_on_another_device_is_refused(name):
    layer, x, state = prefilled(name)
    with pytest.raises(AttentionError, match="device expected cpu .* device meta"):
        layer.step(x[:, 5:6].to("meta"), state)


@bad_input(DECODING, CLEAR_ERROR, cases=6)
def test_bad_select_and_repeat_arguments_are_refused():
    _, _, state = prefilled("softmax")
    for index, field in (([0, 3], "outside the state's batch of 3"), (torch.tensor([-1]), "outside"),
                         (torch.tensor([0.0, 1.0]), "integer"), (torch.tensor([[0, 1]]), "1-D"),
                         ("0", "integer")):
        with pytest.raises(AttentionError, match=field):
            state.select(index)
    with pytest.raises(AttentionError, match="repeats must be a positive int"):
        state.repeat_interleave(0)


@bad_input(DECODING, CORRECT_RESULT)
def test_select_and_repeat_follow_the_batch_in_the_owner():
    layer, x, state = prefilled("linear")
    state.select([2, 0]).repeat_interleave(2)
    assert state.owner.batch == 4
    with torch.no_grad():
        out, _ = layer.step(x[[2, 2, 0, 0], 5:6], state)
        _, alone = layer.prefill(x[2:3, :5])
        ref, _ = layer.step(x[2:3, 5:6], alone)
    torch.testing.assert_close(out[:2], ref.expand(2, -1, -1))
    with pytest.raises(AttentionError, match="batch expected 4"):
        layer.step(x[:, 6:7], state)


@bad_input(DECODING, CLEAR_ERROR)
def test_a_state_built_by_hand_has_no_owner():
    layer, x, _ = prefilled("softmax")
    with pytest.raises(AttentionError, match="no owner.*prefill"):
        layer.step(x[:, 5:6], KVState())


def test_a_mechanism_that_builds_its_state_the_old_way_is_stamped_and_checked():
    """A hook written against the API before owners existed (it builds a plain state, sets no owner) gets the
    checks from prefill / step, as every new causal mechanism does."""

    @dataclass
    class CountState(DecodingState):
        total: torch.Tensor | None = None

    class Counting(attention.get_spec("softmax").module_cls):
        def prefill_attend(self, x, attention_mask, layer_state):
            return x, CountState(length=x.shape[1], total=x.sum(1, keepdim=True))

        def step_attend(self, x, state, real, layer_state):
            return state.total + x, CountState(total=state.total + x)  # a new object, as some hooks return

    layer = Counting(DIM, HEADS, causal=True).double()
    x = tokens()
    _, state = layer.prefill(x[:, :5])
    assert state.owner.layer() is layer and state.owner.batch == 3
    out, state = layer.step(x[:, 5:6], state)
    torch.testing.assert_close(out, x[:, :6].sum(1, keepdim=True))
    assert state.owner.layer() is layer and state.length == 1  # the hook's fresh state carries the owner on
    with pytest.raises(AttentionError, match="batch expected 3"):
        layer.step(x[:1, 6:7], state)


class LibraryScalarReads(TorchDispatchMode):
    """Counts the scalar reads (``.item()``, ``bool(t)``, ``int(t)``: host synchronisations on a GPU) made while
    a function of longattn of each of ``functions`` is on the stack."""

    def __init__(self, *functions: str):
        super().__init__()
        self.counts = dict.fromkeys(functions, 0)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten._local_scalar_dense.default:
            frames = {frame.name for frame in traceback.extract_stack() if "longattn" in frame.filename}
            for function in self.counts:
                self.counts[function] += function in frames
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("name", NAMES)
def test_the_ownership_checks_add_no_host_synchronisation_to_a_step(name):
    layer, x, state = prefilled(name)
    with LibraryScalarReads("check_owner", "step") as reads, torch.no_grad():
        layer.step(x[:, 5:6], state)
        layer.step(x[:, 6:7], state, torch.tensor([[True], [False], [True]]))
    # the step's own read of its token mask (bool(mask.all())) shows that the count sees reads
    assert reads.counts["check_owner"] == 0 and reads.counts["step"] >= 1
