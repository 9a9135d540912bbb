"""The causal-LM benchmark and its task, on a small generated corpus (no shared data needed)."""

import json
import math
import random

import pytest
import torch

pytest.importorskip("transformers", reason="the LM benchmark's model comes from transformers (the hf extra)")

from longattn.bench import lm as bench  # noqa: E402
from longattn.data import lm as data  # noqa: E402
from longattn.tasks.lm import lm_step, perplexity  # noqa: E402
from longattn.train.outputs import OutputFolderError  # noqa: E402

WORDS = ["the", "a", "season", "club", "played", "league", "first", "<unk>", "in", "of", "and", "York", "=", ","]


@pytest.fixture
def corpus(tmp_path, monkeypatch):
    monkeypatch.setenv("LONGATTN_CACHE_DIR", str(tmp_path / "cache"))
    rng = random.Random(0)
    folder = tmp_path / "wikitext"
    folder.mkdir()
    for name, lines in (("wiki.train.tokens.reordered", 400), ("wiki.valid.tokens", 60), ("wiki.test.tokens", 60)):
        text = "\n".join(" ".join(rng.choice(WORDS) for _ in range(rng.randint(3, 15))) if i % 7 else ""
                         for i in range(lines))
        (folder / name).write_text(text + "\n")
    return folder


TINY = ["model.hidden_size=16", "model.heads=2", "model.intermediate_size=32", "data.vocab_size=96",
        "data.context=16", "train.batch_size=4", "train.max_steps=2", "train.eval_every=2", "optim.warmup_steps=1",
        "train.progress=false"]


def test_blocks_overlap_by_one_token_and_every_token_is_predicted_once():
    stream = torch.arange(23).numpy()
    blocks = data.lm_blocks(stream, 5)
    assert blocks.shape == (4, 6)
    assert torch.equal(blocks[:, 1:].flatten(), torch.arange(1, 21))  # predicted tokens: each once, in order
    assert torch.equal(blocks[1:, 0], blocks[:-1, -1])


def test_the_tokenizer_is_cached_by_content_and_the_reordered_train_file_stands_in(corpus):
    path = data.train_file_path(corpus, "wiki.train.tokens")
    assert path.name == "wiki.train.tokens.reordered"
    tokenizer, key = data.bpe_tokenizer(path, 96)
    assert tokenizer.get_vocab_size() <= 96 and tokenizer.token_to_id(data.UNK) is not None  # (a small corpus: fewer merges)
    assert tokenizer.encode("<unk> season").tokens[0] == data.UNK  # WikiText's <unk> stays one token
    again, same_key = data.bpe_tokenizer(path, 96)
    assert same_key == key and (data.cache_dir() / f"{key}.json").is_file()
    stream = data.encode_lines(corpus / "wiki.valid.tokens", tokenizer, key)
    assert stream[-1] == tokenizer.token_to_id(data.EOS)
    assert (stream == tokenizer.token_to_id(data.EOS)).sum() == len(data.read_lines(corpus / "wiki.valid.tokens"))


def test_lm_step_and_perplexity_are_the_mean_token_loss():
    class Uniform(torch.nn.Module):
        def forward(self, ids):
            return torch.zeros(*ids.shape, 50)

    batch = {"input_ids": torch.randint(0, 50, (3, 9))}
    out = lm_step(Uniform(), batch)
    assert math.isclose(float(out.loss), math.log(50), rel_tol=1e-6)
    assert math.isclose(perplexity(out.predictions, out.targets), 50.0, rel_tol=1e-5)
    assert out.predictions[:, 1].tolist() == [8.0, 8.0, 8.0]


def test_the_benchmark_writes_tables_and_plots_and_resumes(corpus, tmp_path):
    config = bench.LMBenchConfig(attentions=["softmax", "linear"], seeds=[0, 1], data_dir=str(corpus),
                                 overrides=TINY, prefixes=[16, 32], decode_tokens=1, throughput_steps=1)
    out = tmp_path / "bench"
    summary = bench.run_lm_bench(config, out)
    text = (out / "lm.md").read_text()
    for part in ("`softmax`", "`linear`", "Δ vs softmax", "N = 32", "tokens/s"):
        assert part in text
    assert {"lm.json", "decode.png", "curves_lm.png"} <= {p.name for p in out.iterdir()}
    rows = {row["attention"]: row for row in summary["rows"]}
    assert len(rows["linear"]["val_perplexity"]) == 2 and rows["linear"]["difference_from_softmax"]["n"] == 2
    assert summary["decode"]["linear"]["bounded"] and not summary["decode"]["softmax"]["bounded"]
    results = json.loads((out / "runs" / "linear" / "seed1" / "results.json").read_text())
    word = math.exp(math.log(results["val"]["perplexity"]) * results["tokens_per_word"]["val"])
    assert math.isclose(results["word_perplexity"]["val"], word)  # the same log-likelihood per word
    # --resume: finished runs and measurements are read back, not run again
    again = bench.run_lm_bench(config, out, resume=True)
    assert again["decode"] == summary["decode"] and again["throughput"] == summary["throughput"]
    assert [r["val_perplexity"] for r in again["rows"]] == [r["val_perplexity"] for r in summary["rows"]]
    with pytest.raises(OutputFolderError, match="--resume"):  # neither: finished runs are not trained over
        bench.run_lm_bench(config, out)


def test_the_benchmark_refuses_mechanisms_a_decoder_cannot_use(corpus, tmp_path):
    config = bench.LMBenchConfig(attentions=["softmax", "nystrom"], data_dir=str(corpus), overrides=TINY)
    with pytest.raises(ValueError, match="causal"):
        bench.run_lm_bench(config, tmp_path / "bench")
    with pytest.raises(ValueError, match="measurement"):
        bench.run_lm_bench(bench.LMBenchConfig(measure=["speed"], data_dir=str(corpus)), tmp_path / "bench")
