"""Damaged or mismatched Hugging Face files: one clear error naming the file, never transformers' random
initialisation of missing weights with a warning, nor a raw safetensors or torch error."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

import longattn.hf as lhf
from longattn.cli import main
from longattn.train.checkpoint import CheckpointError
from reliability import CLEAR_ERROR, FOREIGN_WEIGHTS, cases


def _truncate(path):
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])


def _garble_header(path):
    data = bytearray(path.read_bytes())
    data[10:40] = b"x" * 30
    path.write_bytes(bytes(data))


def _edit_config(**changes):
    def edit(path):
        config = json.loads(path.read_text())
        for key, value in changes.items():
            if key == "longattn_options":
                config["longattn"]["options"].update(value)
            else:
                config[key] = value
        path.write_text(json.dumps(config))
    return edit


DAMAGE = {
    # (file changed, how, the error)
    "truncated safetensors": ("model.safetensors", _truncate, r"model.safetensors is damaged or truncated"),
    "garbled safetensors header": ("model.safetensors", _garble_header, r"model.safetensors is damaged or truncated"),
    "config with another FFN size": ("config.json", _edit_config(intermediate_size=512),
                                     r"config.json no longer matches .*model.safetensors"),
    "config with one layer more": ("config.json", _edit_config(num_hidden_layers=7),
                                   r"config.json no longer matches .*model.safetensors: missing"),
}


@pytest.fixture(scope="module")
def saved_skeleton(tmp_path_factory, minilm_path):
    folder = tmp_path_factory.mktemp("skeleton")
    lhf.convert(lhf.load_bert(), "skeleton", s1=8, s2=8).save_pretrained(folder)
    return folder


@pytest.mark.parametrize("name, damage, message", cases(FOREIGN_WEIGHTS, CLEAR_ERROR, DAMAGE))
def test_load_bert_on_a_damaged_or_mismatched_folder(tmp_path, minilm_path, name, damage, message):
    folder = tmp_path / "bert"
    shutil.copytree(minilm_path, folder)
    damage(folder / name)
    with pytest.raises(CheckpointError, match=message):
        lhf.load_bert(folder)


CONVERTED = {
    "truncated safetensors": ("model.safetensors", _truncate, r"model.safetensors is damaged or truncated"),
    "garbled safetensors header": ("model.safetensors", _garble_header, r"model.safetensors is damaged or truncated"),
    "mechanism options changed": ("config.json", _edit_config(longattn_options={"s1": 16}),
                                  r"model.safetensors holds the weights of another model .*row_indices.*config.json no longer"),
    "config with another FFN size": ("config.json", _edit_config(intermediate_size=512),
                                     r"model.safetensors holds the weights of another model .*intermediate.dense"),
    "damaged tokenizer": ("tokenizer.json", _truncate, r"tokenizer.json is damaged"),
}


@pytest.mark.parametrize("name, damage, message", cases(FOREIGN_WEIGHTS, CLEAR_ERROR, CONVERTED))
def test_from_pretrained_on_a_damaged_or_mismatched_folder(tmp_path, saved_skeleton, minilm_path, name, damage,
                                                           message):
    folder = tmp_path / "saved"
    shutil.copytree(saved_skeleton, folder)
    shutil.copy(minilm_path / "tokenizer.json", folder / "tokenizer.json")
    damage(folder / name)
    with pytest.raises(CheckpointError, match=message):
        lhf.load_tokenizer(folder) if name == "tokenizer.json" else lhf.from_pretrained(folder)


@pytest.mark.parametrize("damage", cases(FOREIGN_WEIGHTS, CLEAR_ERROR, {"truncated": _truncate,
                                                                        "another FFN size": _edit_config(
                                                                            intermediate_size=512)}))
def test_bench_approx_with_a_damaged_model_is_one_line(tmp_path, minilm_path, capsys, damage):
    folder = tmp_path / "bert"
    shutil.copytree(minilm_path, folder)
    damage(folder / ("config.json" if damage.__name__ == "edit" else "model.safetensors"))
    code = main(["bench", "approx", "--model", str(folder), "--weights", "pretrained", "--sequences", "1",
                 "--length", "8", "--samples", "4", "--trials", "1", "--out", str(tmp_path / "out")])
    err = capsys.readouterr().err
    assert code == 2 and str(folder) in err and "Traceback" not in err, err
    assert len(err.strip().splitlines()) == 1, err


def test_the_undamaged_copies_load(tmp_path, saved_skeleton, minilm_path):
    """The checks above fail only on damage: the same copies, undamaged, load as before."""
    folder = tmp_path / "bert"
    shutil.copytree(minilm_path, folder)
    assert isinstance(lhf.load_bert(folder), torch.nn.Module)
    assert lhf.from_pretrained(saved_skeleton).config.longattn["name"] == "skeleton"
