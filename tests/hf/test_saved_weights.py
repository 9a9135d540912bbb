"""Saved weights that load wrong without a word (issue 56): a safetensors file whose tensor bytes were overwritten
(safetensors checks no data) loads NaN weights, refused naming the tensor (``check_finite=False`` loads them
anyway); a converted model loaded with plain transformers is refused, naming longattn."""

from __future__ import annotations

import json
import shutil
import struct

import pytest
import torch
import transformers

import longattn.hf as lhf
from longattn.hf.convert import SAVED_ATTN_IMPLEMENTATION
from longattn.train.checkpoint import CheckpointError, load_weights
from reliability import CLEAR_ERROR, CORRECT_RESULT, FOREIGN_WEIGHTS, bad_input


def tiny_bert():
    config = transformers.BertConfig(vocab_size=61, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                     num_attention_heads=2, max_position_embeddings=32)
    torch.manual_seed(0)
    return transformers.BertModel(config).eval()


def overwrite_tensor(path, name: str) -> None:
    """Overwrite the first bytes of tensor ``name`` of a safetensors file with 0xFF (a NaN in any float dtype)."""
    data = bytearray(path.read_bytes())
    (size,) = struct.unpack("<Q", data[:8])
    start, _ = json.loads(data[8:8 + size])[name]["data_offsets"]
    data[8 + size + start:8 + size + start + 8] = b"\xff" * 8
    path.write_bytes(bytes(data))


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    folder = tmp_path_factory.mktemp("converted")
    lhf.convert(tiny_bert(), "linformer", max_len=32).save_pretrained(folder)
    return folder


NAME = "encoder.layer.0.attention.self.query.weight"


@bad_input(FOREIGN_WEIGHTS, CLEAR_ERROR)
def test_overwritten_bytes_of_a_converted_model_are_refused_naming_the_tensor(tmp_path, saved):
    folder = tmp_path / "saved"
    shutil.copytree(saved, folder)
    overwrite_tensor(folder / "model.safetensors", NAME)
    with pytest.raises(CheckpointError, match=rf"model.safetensors: non-finite weights in {NAME} \(2 of the 256"):
        lhf.from_pretrained(folder)
    model = lhf.from_pretrained(folder, check_finite=False)  # on purpose: the flag skips the pass
    assert model.get_parameter(NAME).isnan().sum() == 2


@bad_input(FOREIGN_WEIGHTS, CLEAR_ERROR)
def test_overwritten_bytes_of_a_bert_checkpoint_are_refused_naming_the_tensor(tmp_path):
    folder = tmp_path / "bert"
    tiny_bert().save_pretrained(folder)
    overwrite_tensor(folder / "model.safetensors", NAME)
    with pytest.raises(CheckpointError, match=f"non-finite weights in {NAME}"):
        lhf.load_bert(folder)
    assert lhf.load_bert(folder, check_finite=False).get_parameter(NAME).isnan().any()


@bad_input(FOREIGN_WEIGHTS, CLEAR_ERROR)
def test_a_state_with_an_infinity_is_refused_by_load_weights():
    model = torch.nn.Linear(3, 2)
    state = {k: v.clone() for k, v in model.state_dict().items()}
    state["bias"][1] = float("inf")
    with pytest.raises(CheckpointError, match=r"run.pt: non-finite weights in bias \(1 of the 2"):
        load_weights(model, state, "run.pt")


@bad_input(FOREIGN_WEIGHTS, CLEAR_ERROR)
def test_a_converted_model_loaded_without_longattn_is_refused_naming_longattn(saved):
    assert json.loads((saved / "config.json").read_text())["attn_implementation"] == SAVED_ATTN_IMPLEMENTATION
    with pytest.raises(ValueError, match="longattn.hf.from_pretrained"):
        transformers.AutoModel.from_pretrained(str(saved))


@bad_input(FOREIGN_WEIGHTS, CORRECT_RESULT)
def test_a_converted_model_saved_again_loads_with_the_same_outputs(tmp_path, saved):
    model = lhf.from_pretrained(saved)
    model.save_pretrained(tmp_path / "again")
    ids = torch.randint(0, 61, (2, 9), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(lhf.from_pretrained(tmp_path / "again")(ids).last_hidden_state,
                                   model(ids).last_hidden_state)
