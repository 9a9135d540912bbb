"""record_attention_maps: each mechanism's own n x n map, checked against its own output (map @ V)."""

import pytest
import torch

from longattn import attention
from longattn.attention import AttentionError, merge_heads, record_attention_maps
from longattn.models.encoder import LRAEncoder
from longattn.testing import scattered_mask

N = 37  # odd length
MAPPED = ["softmax", "realformer", "singular"]


def _output_projection(layer):
    # the projection each mechanism applies after weights @ V (Singularformer's commutes with alpha_U,
    # whose rows sum to 1)
    return layer.to_out if layer.name == "singular" else layer.proj.to_out


def _encoder(name, options=None, norm="pre"):
    torch.manual_seed(0)
    return LRAEncoder(50, N, attention=name, attention_options=options, layers=2, dim=12, hidden=16, heads=3,
                      norm=norm).double().eval()


@pytest.mark.parametrize("name,options", [("softmax", None), ("realformer", None), ("singular", None),
                                          ("singular", {"shared_factors": False, "rank": 5})])
def test_map_times_value_is_the_layers_output(name, options):
    encoder = _encoder(name, options)
    tokens = torch.randint(0, 50, (2, N))
    mask = scattered_mask(2, N)
    outputs = []
    hooks = [block.attention.register_forward_hook(lambda m, args, out: outputs.append(out))
             for block in encoder.blocks]
    with torch.no_grad(), record_attention_maps(encoder) as maps:
        encoder(tokens, mask)
    for hook in hooks:
        hook.remove()
    assert [record.layer for record in maps] == [block.attention for block in encoder.blocks]
    real = mask[..., None]
    for record, out in zip(maps, outputs):
        assert record.weights.shape == (2, 3, N, N)
        rebuilt = _output_projection(record.layer)(merge_heads(record.weights @ record.value))
        torch.testing.assert_close(rebuilt * real, out * real)
        # rows of real queries are distributions over the real keys; padded rows and columns are zeros
        rows = record.weights.sum(-1)
        torch.testing.assert_close(rows, mask[:, None, :].expand_as(rows).double())
        assert (record.weights.masked_select(~mask[:, None, None, :].expand_as(record.weights)) == 0).all()


@pytest.mark.parametrize("name", MAPPED)
def test_recording_changes_nothing_and_stops_after_the_block(name):
    encoder = _encoder(name)
    tokens = torch.randint(0, 50, (3, N))
    mask = scattered_mask(3, N)
    with torch.no_grad():
        plain, _ = encoder(tokens, mask)
        with record_attention_maps(encoder) as maps:
            recorded, _ = encoder(tokens, mask)
            encoder(tokens, mask)
        encoder(tokens, mask)
    torch.testing.assert_close(recorded, plain, rtol=0, atol=0)
    assert len(maps) == 4  # one record per layer per forward call, only inside the block


def test_causal_softmax_map_is_lower_triangular():
    layer = attention.build("softmax", dim=8, heads=2, causal=True).double().eval()
    x = torch.randn(1, N, 8, dtype=torch.float64)
    with record_attention_maps(layer) as maps:
        out = layer(x)
    assert torch.equal(maps[0].weights.triu(1), torch.zeros_like(maps[0].weights))
    torch.testing.assert_close(layer.proj.out(maps[0].weights @ maps[0].value), out)


def test_maps_are_never_built_in_training():
    encoder = _encoder("softmax").train()
    with pytest.raises(AttentionError, match="eval"):
        with record_attention_maps(encoder):
            pass
    encoder.eval()
    with pytest.raises(AttentionError, match="eval"):
        with record_attention_maps(encoder):
            encoder.train()
            encoder(torch.randint(0, 50, (1, N)))


def test_mechanism_without_a_map_is_refused_by_name():
    encoder = _encoder("linformer", {"k": 8})
    with pytest.raises(AttentionError, match=r"\['linformer'\] cannot hand out attention maps.*realformer"):
        with record_attention_maps(encoder):
            pass
    assert sorted(n for n in attention.available() if attention.capabilities(n).attention_map) == sorted(MAPPED)
