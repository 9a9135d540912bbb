"""End to end on the real data module: `longattn train` and `compare` on tiny generated ListOps."""

import json

import pytest

pytest.importorskip("longattn.data.lra", reason="the LRA data module is not available")

from longattn.cli import main  # noqa: E402

TINY = ["--set", "train.max_steps=3", "--set", "train.eval_every=3", "--set", "model.dim=16", "--set",
        "model.hidden=16", "--set", "data.options.min_length=16", "--set", "data.options.max_length=32",
        "--set", "data.train.num_examples=24", "--set", "data.val.num_examples=10",
        "--set", "data.test.num_examples=10", "--set", "train.batch_size=8", "--set", "optim.warmup_steps=0",
        "--no-progress"]


def test_train_and_compare_on_generated_listops(tmp_path):
    out = tmp_path / "train"
    assert main(["train", "--task", "listops", "--attention", "softmax", "--preset", "demo", "--out", str(out),
                 *TINY]) == 0
    results = json.loads((out / "results.json").read_text())
    assert results["val"]["examples"] == 10 and results["test"]["examples"] == 10
    # the cost columns at small lengths (the README's job measures 4k and 16k): one layer, CPU time at one thread
    assert main(["compare", "--task", "listops", "--attentions", "softmax,singular", "--seeds", "0",
                 "--out", str(tmp_path / "c"), *TINY, "--cost-lengths", "64", "--cost-repeats", "1"]) == 0
    table = (tmp_path / "c" / "table.md").read_text()
    header = next(line for line in table.splitlines() if line.startswith("| attention"))
    assert header.rstrip(" |").endswith("fwd+bwd 64 (s) | mem 64 (MB)")
    singular = next(line for line in table.splitlines() if line.startswith("| singular"))
    seconds, megabytes = (cell.strip() for cell in singular.strip(" |").split("|")[-2:])
    assert float(seconds) > 0 and float(megabytes) >= 0
    assert "process CPU time at one thread" in table and "![accuracy against cost at N=64](frontier.png)" in table
    assert (tmp_path / "c" / "frontier.png").is_file()
    measured = json.loads((tmp_path / "c" / "results.json").read_text())["cost"]["measured"]
    assert set(measured) == {"softmax", "singular"} and measured["softmax"]["64"]["status"] == "ok"
