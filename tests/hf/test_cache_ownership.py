"""A transformers cache filled by one converted model and passed to another (issue 56): the decoding states in
its LongattnCacheLayers know their layers, so the other model's first step raises AttentionError naming the
field (layer, mechanism, batch) instead of a trace from inside torch or another model's continuation."""

import pytest
import torch
import transformers

from longattn.attention import AttentionError
from reliability import CLEAR_ERROR, DECODING, cases
from test_generate import left_padded_prompts, routed

# (the model that fills the cache, the one it is passed to, the batch of the second call, the field named)
PASSED = {
    "same-mechanism-other-model": ("linear", ("linear", 1), 3, "layer expected"),
    "other-mechanism": ("linear", ("softmax", 0), 3, "mechanism expected 'softmax'.*'linear'"),
    "other-family-and-mechanism": ("softmax", ("luna", 0), 3, "mechanism expected 'luna'.*'softmax'"),
    "other-batch": ("linear", ("linear", 0), 2, "batch expected 3 .* batch 2"),
}


@pytest.mark.parametrize("filler, receiver, batch, field", cases(DECODING, CLEAR_ERROR, PASSED))
def test_a_cache_passed_to_another_converted_model_is_refused(filler, receiver, batch, field):
    ids, mask = left_padded_prompts()
    first = routed(filler)
    second = first if receiver == (filler, 0) else routed(*receiver)
    cache = transformers.DynamicCache()
    with torch.no_grad():
        first(ids, attention_mask=mask, cache=cache, use_cache=True)
        with pytest.raises(AttentionError, match=field):
            second(ids[:batch, :1], attention_mask=torch.cat([mask, mask[:, :1]], dim=1)[:batch], cache=cache,
                   use_cache=True)
