"""MoBA: the chunked and GPU paths against the float64 reference, the selection as data (keys outside it have no
effect and no gradient), decoding, packing, bf16 autocast training, and fla's kernel where CUDA runs it."""

import pytest
import torch
from module_checks import assert_decoding_equals_forward, assert_no_quadratic_intermediate, bf16_autocast_losses
from selection_checks import DIM, HEADS, assert_packed_equals_padded

from longattn import attention
from longattn.attention import AttentionError
from longattn.attention.moba import MobaOptions, moba_attention, moba_attention_reference, moba_select
from longattn.attention.ops import block_select
from longattn.attention.ops.block_select import block_key_means
from longattn.testing import assert_forward_backward_close, random_qkv


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("n, masked", [(1, True), (37, False), (37, True), (101, True)])
def test_fast_paths_equal_the_float64_reference(path, causal, n, masked, monkeypatch):
    monkeypatch.setattr(block_select, "CHUNK_SCORES", 16 * 24)  # chunks of 16 queries, recomputed in backward
    q, k, v = random_qkv(2, 2, n, 8)
    mask = (torch.rand(2, n, generator=torch.Generator().manual_seed(1)) > 0.3) if masked else None
    options = dict(block_size=8, top_k=3, is_causal=causal)
    assert_forward_backward_close(moba_attention(q, k, v, mask, **options),
                                  moba_attention_reference(q, k, v, mask, **options), [q, k, v])


def test_top_k_covering_every_block_is_causal_softmax():
    from longattn.attention.softmax import softmax_attention_reference

    q, k, v = random_qkv(2, 2, 40, 8)
    torch.testing.assert_close(moba_attention(q, k, v, block_size=8, top_k=5, is_causal=True),
                               softmax_attention_reference(q, k, v, is_causal=True))


@pytest.mark.parametrize("causal", [False, True])
def test_keys_outside_the_selection_have_no_effect_and_no_gradient(causal):
    n, block, top_k, t = 64, 8, 3, 50
    q, k, v = random_qkv(1, 1, n, 8)
    options = MobaOptions(block, top_k, causal, 8 ** -0.5)
    means, ok = block_key_means(k.detach(), block, None)
    blocks, valid = moba_select(q.detach()[:, :, t:t + 1], means, ok, torch.tensor([t]), options)
    chosen = set(blocks[valid].tolist())
    assert len(chosen) == top_k
    outside = torch.tensor([i // block not in chosen for i in range(n)])
    out = moba_attention(q, k, v, block_size=block, top_k=top_k, is_causal=causal)
    grads = torch.autograd.grad(out[0, 0, t].sum(), (k, v))
    assert torch.all(grads[0][0, 0, outside] == 0) and torch.all(grads[1][0, 0, outside] == 0)
    assert grads[1][0, 0, ~outside].abs().sum() > 0
    # new values outside the selection leave the query's output alone (the values do not enter the gate)
    changed = v.detach().clone()
    changed[0, 0, outside] = torch.randn(int(outside.sum()), 8, dtype=torch.float64) * 100
    again = moba_attention(q, k, changed, block_size=block, top_k=top_k, is_causal=causal)
    torch.testing.assert_close(again[0, 0, t], out[0, 0, t])


def test_no_quadratic_intermediate_in_the_causal_form():
    assert_no_quadratic_intermediate("moba")


@pytest.mark.parametrize("causal", [False, True])
def test_packed_sequences_equal_the_padded_batch(causal):
    torch.manual_seed(0)
    layer = attention.build("moba", dim=DIM, heads=HEADS, causal=causal, block_size=4, top_k=2).double()
    assert_packed_equals_padded(layer, [13, 5, 9])


@pytest.mark.parametrize("options", [{"block_size": 3, "top_k": 1}, {"block_size": 5, "top_k": 3}])
def test_decoding_equals_the_causal_forward(options):
    torch.manual_seed(0)
    layer = attention.build("moba", dim=DIM, heads=HEADS, causal=True, **options).double().eval()
    state = assert_decoding_equals_forward(layer, n=26, prompt=7)
    assert state.summaries[0].shape[2] == 26 // options["block_size"]  # the completed blocks' means


def test_bf16_autocast_trains():
    torch.manual_seed(0)
    losses = bf16_autocast_losses(attention.build("moba", dim=DIM, heads=HEADS, causal=True, block_size=8, top_k=2))
    assert losses[-1] < losses[0]


def test_bad_options_raise_clear_errors():
    with pytest.raises(AttentionError, match="block_size"):
        attention.build("moba", dim=DIM, heads=HEADS, block_size=0)
    with pytest.raises(AttentionError, match="top_k"):
        attention.build("moba", dim=DIM, heads=HEADS, top_k=0)
    q, k, v = random_qkv(2, 2, 8, 8)
    with pytest.raises(AttentionError, match="top_k"):
        moba_attention(q, k, v, top_k=-1)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="fla's parallel_moba runs flash-attn on CUDA only")
def test_equals_fla_parallel_moba_on_cuda():
    pytest.importorskip("flash_attn", reason="fla's parallel_moba needs flash-attn")
    from fla.ops.moba import parallel_moba

    n, block, top_k = 512, 64, 3
    q, k, v = (torch.randn(1, 2, n, 64, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    ours = moba_attention(q, k, v, block_size=block, top_k=top_k, is_causal=True)
    cu_seqlens = torch.tensor([0, n], device="cuda", dtype=torch.int32)
    theirs = parallel_moba(*(t.transpose(1, 2) for t in (q, k, v)), cu_seqlens, n, block, top_k).transpose(1, 2)
    torch.testing.assert_close(ours.float(), theirs.float(), atol=2e-2, rtol=2e-2)
