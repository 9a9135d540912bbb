"""longattn.hf.demo: the MiniLM table and the fine-tuning behind docs/hf.md."""

import pytest

from longattn.hf.demo import embedding_table, finetune, read_sst2, table_markdown

SENTENCES = ["a gripping, beautifully acted film", "dull, lifeless and far too long",
             "one of the best films of the year", "a tedious mess with no redeeming qualities"]


def test_embedding_table_reports_cosine_and_path(minilm_path):
    rows = {r["mechanism"]: r for r in embedding_table(SENTENCES, ["softmax", "linformer", "skeleton", "synthesizer"])}
    assert rows["softmax"]["cosine_mean"] > 0.99999 and rows["softmax"]["path"] == "function (register)"
    assert rows["linformer"]["path"] == "convert: model's q, k, v"
    assert rows["skeleton"]["path"] == "convert: hidden states, pretrained Q/K/V"
    assert rows["synthesizer"]["path"] == "convert, fresh projections"
    assert rows["skeleton"]["cosine_mean"] < 0.99  # random new parameters: not a zero-shot replacement
    assert "| `linformer` | convert: model's q, k, v |" in table_markdown(list(rows.values()))


def test_finetune_reaches_both_parameter_groups(minilm_path):
    run = finetune("skeleton", SENTENCES, [1, 0, 1, 0], steps=3, batch_size=4, s1=4, s2=4, max_len=32,
                   dev=(SENTENCES, [1, 0, 1, 0]))
    assert run["grad_norm_step1"]["pretrained"] > 0 and run["grad_norm_step1"]["new_attention"] > 0
    assert len(run["losses"]) == 3 and 0 <= run["accuracy_after"] <= 1
    run = finetune("nystrom", SENTENCES, [1, 0, 1, 0], steps=2, batch_size=4, num_landmarks=4)
    assert run["path"] == "function (register)" and run["grad_norm_step1"]["new_attention"] == 0


def test_read_sst2(tmp_path):
    file = tmp_path / "train.tsv"
    file.write_text("sentence\tlabel\nit is good \t1\nit is bad \t0\n")
    assert read_sst2(file) == (["it is good", "it is bad"], [1, 0])
    file.write_text("sentence\tlabel\nno label here\n")
    with pytest.raises(ValueError, match="train.tsv:2"):
        read_sst2(file)
    with pytest.raises(FileNotFoundError, match="SST-2"):
        read_sst2(tmp_path / "missing.tsv")
