"""longattn.hf.demo: the MiniLM table and the fine-tuning behind docs/hf.md."""

import pytest

from longattn.config import ConfigError
from longattn.hf import demo
from longattn.hf.demo import embedding_table, finetune, main, parse_variant, read_sst2, table_markdown

SENTENCES = ["a gripping, beautifully acted film", "dull, lifeless and far too long",
             "one of the best films of the year", "a tedious mess with no redeeming qualities"]


ROWS_ONLY = "skeleton:smoother=false,column_attention=false,s1=128"


def test_embedding_table_reports_cosine_and_path(minilm_path):
    names = ["softmax", "linformer", "skeleton", ROWS_ONLY, "synthesizer"]
    rows = {r["mechanism"]: r for r in embedding_table(SENTENCES, names)}
    assert rows["softmax"]["cosine_mean"] > 0.99999 and rows["softmax"]["path"] == "function (register)"
    assert rows["linformer"]["path"] == "convert: model's q, k, v"
    assert rows["skeleton"]["path"] == "convert: hidden states, pretrained Q/K/V"
    assert rows["synthesizer"]["path"] == "convert, fresh projections"
    assert rows["skeleton"]["cosine_mean"] < 0.99  # random new parameters: not a zero-shot replacement
    assert "| `linformer` | convert: model's q, k, v |" in table_markdown(list(rows.values()))
    # the options reach the mechanism: rows over every position and no Smoother keep far more of MiniLM
    assert rows[ROWS_ONLY]["cosine_mean"] > rows["skeleton"]["cosine_mean"] + 0.2


def test_mechanisms_with_options_are_parsed_and_bad_ones_named(minilm_path, tmp_path, capsys):
    assert parse_variant("skeleton:smoother=false,s1=128") == ("skeleton", {"smoother": False, "s1": 128})
    assert parse_variant("nystrom") == ("nystrom", {})
    with pytest.raises(ConfigError, match="'s1' must look like option=value"):
        parse_variant("skeleton:s1")
    (tmp_path / "dev.tsv").write_text("sentence\tlabel\nit is good\t1\n")
    with pytest.raises(SystemExit):
        main(["table", "--data", str(tmp_path), "--mechanisms", "skeleton:smoothr=false"])
    assert "unknown option(s) ['smoothr'] for attention 'skeleton'" in capsys.readouterr().err


def test_bad_names_and_options_fail_before_minilm_loads(tmp_path, capsys, monkeypatch):
    def no_loading(*args, **kwargs):
        raise AssertionError("MiniLM loaded before the mechanisms were checked")

    monkeypatch.setattr(demo, "load_bert", no_loading)
    monkeypatch.setattr(demo, "_tokenizer", no_loading)
    (tmp_path / "dev.tsv").write_text("sentence\tlabel\nit is good\t1\n")
    for mechanisms, message in ((["softmax", "skeletn"], "unknown attention mechanism 'skeletn'; available:"),
                                (["nystrom:num_landmark=8"], "unknown option(s) ['num_landmark'] for attention "
                                                             "'nystrom' in 'nystrom:num_landmark=8'")):
        with pytest.raises(SystemExit):
            main(["table", "--data", str(tmp_path), "--mechanisms", *mechanisms])
        assert message in capsys.readouterr().err


def test_a_variants_seed_and_max_len_are_its_own_not_an_option_clash():
    checked = demo._checked_variants(["bigbird:seed=3,block_size=4", "bigbird", "skeleton:max_len=64"], seed=1)
    assert checked == [("bigbird:seed=3,block_size=4", "bigbird", {"seed": 3, "block_size": 4}),
                       ("bigbird", "bigbird", {"seed": 1}),
                       ("skeleton:max_len=64", "skeleton", {"seed": 1, "max_len": 64})]


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
