import importlib.util
from pathlib import Path

import pytest
import torch

from longattn import attention
from longattn.attention import AttentionError, collect_aux_losses
from longattn.attention.dsa import dsa_attention, dsa_attention_reference, dsa_indexer_loss_reference
from longattn.attention.ops import token_select
from longattn.attention.ops.token_select import indexer_kl_loss, select_top_k, selected_kl_loss
from longattn.testing import assert_forward_backward_close

B, H, D, HI, DI = 2, 3, 8, 4, 5


def inputs(n, seed=0, positive_index=False):
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(B, H, n, D, dtype=torch.float64, generator=g).requires_grad_() for _ in range(3))
    draw = torch.rand if positive_index else torch.randn
    index = (draw(B, HI, n, DI, dtype=torch.float64, generator=g), draw(B, n, DI, dtype=torch.float64, generator=g),
             draw(B, HI, n, dtype=torch.float64, generator=g))
    mask = torch.rand(B, n, generator=g) > 0.25
    mask[1, : n // 3] = False  # left padding beside the scattered one
    return q, k, v, index, mask


def index_options(index):
    return dict(index_query=index[0], index_key=index[1], index_weights=index[2])


@pytest.fixture
def small_chunks(monkeypatch):
    """A few hundred elements per chunk: the CPU path then runs many chunks of a few rows each."""
    monkeypatch.setattr(token_select, "CHUNK_ELEMENTS", 300)


@pytest.fixture(params=["gather", "masked"])
def strategy(request, monkeypatch):
    """Either strategy of the CPU path's selected attention, forced by its threshold."""
    monkeypatch.setattr(token_select, "MASKED_UP_TO", 10**9 if request.param == "masked" else 0)
    return request.param


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("n", [1, 37, 101])
def test_fast_matches_reference_forward_and_backward(path, small_chunks, strategy, causal, n):
    q, k, v, index, mask = inputs(n)
    kw = dict(top_k=9, is_causal=causal, **index_options(index))
    assert_forward_backward_close(dsa_attention(q, k, v, mask, **kw), dsa_attention_reference(q, k, v, mask, **kw),
                                  [q, k, v])


def fla_naive_dsa():
    """fla's ops/dsa/naive.py on its own (it needs torch and einops only): importing the fla package would build
    every Triton kernel it ships, seconds of import for two plain functions."""
    fla = importlib.util.find_spec("fla")
    if fla is None or fla.origin is None:
        pytest.skip("peer package fla-core not installed")
    spec = importlib.util.spec_from_file_location("fla_naive_dsa", Path(fla.origin).parent / "ops" / "dsa" / "naive.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_equals_fla_naive_dsa():
    naive = fla_naive_dsa()
    n = 45
    q, k, v, index, _ = inputs(n, positive_index=True)  # positive indexer inputs: no ReLU ties to break
    ours = dsa_attention(q, k, v, top_k=11, is_causal=True, **index_options(index))
    theirs = naive.naive_dsa(*(t.transpose(1, 2) for t in (q, k, v)), index[0].transpose(1, 2), index[1],
                             index[2].transpose(1, 2), topk=11)
    torch.testing.assert_close(ours, theirs.transpose(1, 2).double(), rtol=1e-5, atol=1e-5)  # fla runs in float32
    ids, selected = select_top_k(*index, torch.ones(B, n, dtype=torch.bool), 11, causal=True)
    their_ids = naive.naive_dsa_indexer(index[0].transpose(1, 2), index[1], index[2].transpose(1, 2), topk=11,
                                        activation="relu")
    ours_sets = [set(row[ok].tolist()) for row, ok in zip(ids.flatten(0, 1), selected.flatten(0, 1))]
    assert ours_sets == [set(row[row >= 0].tolist()) for row in their_ids.flatten(0, 1)]


def test_keys_outside_the_selection_have_no_effect_and_no_gradient(small_chunks):
    n = 64
    q, k, v, index, mask = inputs(n)
    mask[:] = True
    kw = dict(top_k=6, is_causal=True, **index_options(index))
    ids, selected = select_top_k(*index, mask, 6, causal=True)
    key_pos = 20
    chosen = ((ids == key_pos) & selected).any(-1)  # [B, N]: the queries that selected key 20
    blind = ~chosen
    blind[:, :key_pos] = False  # earlier queries cannot see it anyway; compare the later ones that skipped it
    assert blind.sum() > 10 and chosen.sum() > 0
    out = dsa_attention(q, k, v, mask, **kw)
    k2, v2 = k.detach().clone(), v.detach().clone()
    k2[:, :, key_pos] += 50.0
    v2[:, :, key_pos] -= 50.0
    moved = dsa_attention(q, k2, v2, mask, **kw)
    rows = blind[:, None, :, None].expand_as(out)
    torch.testing.assert_close(moved[rows], out[rows])
    assert not torch.allclose(moved[chosen[:, None, :, None].expand_as(out)], out[chosen[:, None, :, None].expand_as(out)])
    grad_k, grad_v = torch.autograd.grad(out[rows].square().sum(), (k, v))
    assert torch.all(grad_k[:, :, key_pos] == 0) and torch.all(grad_v[:, :, key_pos] == 0)
    assert grad_k.abs().sum() > 0


def test_top_k_covering_every_key_is_softmax_attention():
    from longattn.attention.softmax import softmax_attention_reference

    q, k, v, index, mask = inputs(30)
    out = dsa_attention(q, k, v, mask, top_k=30, **index_options(index))
    torch.testing.assert_close(out, softmax_attention_reference(q, k, v, mask))


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("selected_only", [False, True])
def test_indexer_losses_match_their_dense_reference(path, small_chunks, causal, selected_only):
    n = 29
    q, k, _, index, mask = inputs(n, seed=2)
    leaves = [t.clone().requires_grad_() for t in index]
    if selected_only:
        ids, selected = select_top_k(*index, mask, 7, causal)
        loss = selected_kl_loss(q, k, mask, *leaves, ids, selected, scale=D**-0.5)
    else:
        loss = indexer_kl_loss(q, k, mask, *leaves, causal, scale=D**-0.5)
    ref = dsa_indexer_loss_reference(q.detach(), k.detach(), mask, *leaves, is_causal=causal,
                                     top_k=7 if selected_only else None)
    torch.testing.assert_close(loss, ref)
    for a, r in zip(torch.autograd.grad(loss, leaves), torch.autograd.grad(ref, leaves)):
        torch.testing.assert_close(a, r)
    assert q.grad is None and k.grad is None  # the target takes no gradient


def test_indexer_loss_trains_the_indexer_only_and_is_switchable():
    torch.manual_seed(0)
    layer = attention.build("dsa", dim=16, heads=2, causal=True, top_k=4).double()
    x = torch.randn(2, 21, 16, dtype=torch.float64)
    out = layer(x)
    aux = collect_aux_losses(layer)
    assert set(aux) == {"dsa_indexer_kl"} and aux["dsa_indexer_kl"] > 0
    main = torch.autograd.grad(out.square().sum(), list(layer.indexer.parameters()), allow_unused=True)
    assert all(g is None for g in main)  # the selection is discrete: the task loss never reaches the indexer
    out = layer(x)
    grads = torch.autograd.grad(collect_aux_losses(layer)["dsa_indexer_kl"], list(layer.parameters()), allow_unused=True)
    named = dict(zip([name for name, _ in layer.named_parameters()], grads))
    assert all(g is None for name, g in named.items() if name.startswith("proj."))  # detached indexer inputs
    assert all(g is not None and g.abs().sum() > 0 for name, g in named.items() if name.startswith("indexer."))
    layer.eval()
    layer(x)
    assert collect_aux_losses(layer) == {}
    off = attention.build("dsa", dim=16, heads=2, causal=True, top_k=4, indexer_loss="off")
    off(x.float())
    assert collect_aux_losses(off) == {}


def test_bf16_autocast_trains_the_selection_and_the_indexer():
    torch.manual_seed(0)
    layer = attention.build("dsa", dim=16, heads=2, causal=True, top_k=4, indexer_loss="selected")
    optimizer = torch.optim.Adam(layer.parameters(), lr=1e-2)
    x = torch.randn(2, 33, 16)
    target = torch.randn(2, 33, 16)
    losses = []
    for _ in range(8):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = layer(x)
            loss = (out.float() - target).square().mean() + sum(collect_aux_losses(layer).values())
        assert out.dtype == torch.bfloat16
        optimizer.zero_grad()
        loss.backward()
        assert all(torch.isfinite(p.grad).all() for p in layer.parameters() if p.grad is not None)
        optimizer.step()
        losses.append(loss.item())
    assert losses[-1] < losses[0]


def test_bad_options_and_index_tensors_raise_clear_errors():
    q, k, v, index, mask = inputs(10)
    with pytest.raises(AttentionError, match="top_k"):
        dsa_attention(q, k, v, mask, top_k=0, **index_options(index))
    with pytest.raises(AttentionError, match="index_key"):
        dsa_attention(q, k, v, mask, top_k=3, index_query=index[0], index_key=index[1][:, :5], index_weights=index[2])
    with pytest.raises(AttentionError, match="index_weights"):
        dsa_attention(q, k, v, mask, top_k=3, index_query=index[0], index_key=index[1], index_weights=index[2][:, :1])
    with pytest.raises(AttentionError, match="index_query"):
        dsa_attention(q, k, v, mask, top_k=3, index_query=index[0][0], index_key=index[1], index_weights=index[2])
    for options, field in (({"top_k": 0}, "top_k"), ({"indexer_heads": 0}, "indexer_heads"),
                           ({"indexer_loss": "kl"}, "indexer_loss"), ({"indexer_loss_weight": -1.0}, "weight")):
        with pytest.raises(AttentionError, match=field):
            attention.build("dsa", dim=16, heads=2, **options)


@pytest.mark.parametrize("indexer_loss", ["dense", "selected"])
def test_no_quadratic_intermediate_with_either_loss_in_a_causal_layer(monkeypatch, strategy, indexer_loss):
    from longattn.testing import LargestTensorRecorder

    monkeypatch.setattr(token_select, "CHUNK_ELEMENTS", 2048)  # at N = 128 an N x N tensor is 8 chunks' worth
    n = 128
    torch.manual_seed(0)
    layer = attention.build("dsa", dim=16, heads=2, causal=True, top_k=8, indexer_heads=2, indexer_dim=4,
                            indexer_loss=indexer_loss)
    x = torch.randn(1, n, 16, requires_grad=True)
    with LargestTensorRecorder() as rec:
        out = layer(x)
        (out.sum() + collect_aux_losses(layer)["dsa_indexer_kl"]).backward()
    assert rec.max_numel <= n * n // 4, (rec.max_shape, rec.max_op)  # the widest linear terms are N x 16


def test_strategy_follows_the_threshold_and_the_path(monkeypatch):
    from longattn.attention.base import force_path

    q = torch.zeros(1, 1, 4, 8)
    limit = token_select.MASKED_UP_TO
    assert token_select.selection_strategy(q, keys=limit * 64, count=64, causal=False) == "masked"
    assert token_select.selection_strategy(q, keys=limit * 64 + 1, count=64, causal=False) == "gather"
    assert token_select.selection_strategy(q, keys=2 * limit * 64, count=64, causal=True) == "masked"  # half reachable
    assert token_select.selection_strategy(q, keys=2 * limit * 64 + 2, count=64, causal=True) == "gather"
    with force_path("gpu"):
        assert token_select.selection_strategy(q, keys=64, count=64, causal=False) == "gather"
    q, k, v, index, mask = inputs(12)
    ids, selected = select_top_k(*index, mask, 3, causal=False)
    with pytest.raises(AttentionError, match="strategy"):
        token_select.selected_attention(q, k, v, ids, selected, 1.0, strategy="dense")
    calls = []
    monkeypatch.setattr(token_select._SelectedAttention, "apply", lambda *args: calls.append(args[-1]))
    token_select.selected_attention(q, k, v, ids, selected, 1.0)  # 12 keys, 3 selected: masked
    token_select.selected_attention(q, k, v, ids, selected, 1.0, strategy="gather")
    assert calls == ["masked", "gather"]


def test_selection_mask_keeps_a_selected_key_that_an_unselected_slot_also_names():
    # row 0 selected keys 0 and 2 and left its last slot unselected (pointing at key 0); row 1 selected nothing
    indices = torch.tensor([[[2, 0, 0], [1, 1, 1]]])
    selected = torch.tensor([[[True, True, False], [False, False, False]]])
    mask = token_select.selection_mask(indices, selected, span=3)
    assert mask.tolist() == [[[True, False, True], [False, False, False]]]
    q = torch.randn(1, 1, 2, 4, dtype=torch.float64)
    k, v = torch.randn(1, 1, 3, 4, dtype=torch.float64), torch.randn(1, 1, 3, 4, dtype=torch.float64)
    gathered, masked = (token_select.selected_attention(q, k, v, indices, selected, 0.5, strategy=s)
                        for s in ("gather", "masked"))
    torch.testing.assert_close(masked, gathered)
    assert torch.all(masked[:, :, 1] == 0)  # nothing selected: zeros, not NaN
