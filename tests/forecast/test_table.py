"""The forecast table: the papers' numbers, seed statistics, the 2-std mark, plots, presets and selection."""

from __future__ import annotations

import json
import re
import statistics
from pathlib import Path

import pytest

from longattn.cli import main
from longattn.experiment.config import resolve_config
from longattn.forecast import paper
from longattn.forecast.plots import plot_mse_by_horizon
from longattn.forecast.table import MISPRINT_NOTE, format_table, summarise
from longattn.tasks.forecasting import find_preset

FIXTURES = Path(__file__).resolve().parents[1] / "data" / "fixtures" / "timeseries"
_PAPERS = [Path(__file__).resolve().parents[2].parent / "shared" / "papers",
           Path(__file__).resolve().parents[2].parent.parent / "shared" / "papers"]
_PAPER_NAMES = {"ETTm2": "ETTm2", "Electricity": "electricity", "Exchange": "exchange", "Traffic": "traffic",
                "Weather": "weather", "ILI": "ili"}


def _rows(model, dataset, horizon, values, seq_len=96):
    return [{"dataset": dataset, "horizon": horizon, "model": model, "seed": seed, "mse": mse, "mae": mse + 0.1,
             "seq_len": seq_len, "seconds": 900.0} for seed, mse in enumerate(values)]


def test_table16_is_read_from_the_paper_text():
    """Every number of Table 16 against the paper's own text (skipped where the papers folder is absent)."""
    folder = next((p for p in _PAPERS if (p / "000_36820dbc2b939f95.txt").is_file()), None)
    if folder is None:
        pytest.skip("the papers folder (../shared/papers) is not on this machine")
    text = (folder / "000_36820dbc2b939f95.txt").read_text()
    dataset, checked = None, 0
    for line in text[text.index("Table 16:"):].splitlines()[:40]:
        fields = [f for f in re.sub(r"</?b>", "", line).split("\t") if f.strip()]
        if fields and fields[0] in _PAPER_NAMES:
            dataset, fields = _PAPER_NAMES[fields[0]], fields[1:]
        if dataset is None or len(fields) != 1 + 2 * len(paper.TABLE16_MODELS):
            continue
        horizon, numbers = int(fields[0]), [float(v) for v in fields[1:]]
        for i, model in enumerate(paper.TABLE16_MODELS):
            assert paper.paper_result(dataset, horizon, model) == (numbers[2 * i], numbers[2 * i + 1])
            checked += 1
    assert checked == 24 * len(paper.TABLE16_MODELS)


def test_paper_numbers_per_registered_model():
    assert paper.paper_for_model("skt", "ETTm2", 96) == (0.192, 0.283)
    assert paper.paper_for_model("skt:skeleton", "ETTm2", 96) == (0.192, 0.283)
    assert paper.paper_for_model("skt:softmax", "ETTm2", 96) is None  # not the published model
    assert paper.paper_for_model("skt", "ili", 24, seq_len=36) == (2.431, 0.997)  # the journal's input-36 row
    assert paper.paper_for_model("skt", "ili", 24, seq_len=60) == (2.185, 0.926)
    assert paper.paper_for_model("fedformer", "ETTm2", 96) == (0.203, 0.287)
    assert paper.paper_for_model("nystromformer", "traffic", 192) == (1.127, 0.611)
    assert paper.paper_for_model("patchtst", "ETTm2", 96) == paper.OWN_PAPER_INPUT96[("PatchTST", "ETTm2", 96)]
    assert paper.paper_for_model("dlinear", "exchange", 96) is None
    assert paper.paper_for_model("itransformer", "ETTm2", 96) is None
    for column in paper.PAPER_COLUMN.values():
        assert column in paper.PAPER_MODELS


def test_summary_mean_std_and_the_two_std_mark():
    rows = (_rows("skt", "ETTm2", 96, [0.30, 0.31, 0.29])          # far above 0.192, small spread: marked
            + _rows("fedformer", "ETTm2", 96, [0.15, 0.35])       # above 0.203 on average, large spread: not
            + _rows("autoformer", "ETTm2", 96, [0.40])            # one seed: undecided
            + _rows("itransformer", "ETTm2", 96, [0.2, 0.3]))     # no published number
    rows.append({"dataset": "ETTm2", "horizon": 96, "model": "s4", "seed": 0, "error": "RuntimeError: boom"})
    summary = {e["model"]: e for e in summarise(rows)}
    skt = summary["skt"]
    assert skt["seeds"] == 3 and skt["mse_mean"] == pytest.approx(0.30)
    assert skt["mse_std"] == pytest.approx(statistics.stdev([0.30, 0.31, 0.29]))
    assert skt["paper_mse"] == 0.192 and skt["worse_beyond_2std"] is True and skt["train_seconds"] == 2700.0
    assert summary["fedformer"]["worse_beyond_2std"] is False
    assert summary["autoformer"]["mse_std"] is None and summary["autoformer"]["worse_beyond_2std"] is None
    assert summary["itransformer"]["paper_mse"] is None and summary["itransformer"]["worse_beyond_2std"] is None
    assert summary["s4"]["failed"] and summary["s4"]["mse_mean"] is None
    table = format_table(rows, ["skt", "fedformer", "autoformer", "itransformer", "s4"])
    line = next(l for l in table.splitlines() if l.startswith("| ETTm2 | 96 |"))
    cells = [c.strip() for c in line.strip("|").split("|")]
    assert cells[2] == f"0.300 ± {statistics.stdev([0.30, 0.31, 0.29]):.3f} (0.192) **!**"
    assert cells[3] == f"0.400 ± {statistics.stdev([0.40, 0.41, 0.39]):.3f} (0.283)"
    assert "**!**" not in cells[4] and "(0.203)" in cells[4]
    assert cells[6] == "0.400 (0.255)" and cells[8].startswith("0.250 ± ") and "(" not in cells[8]
    assert cells[10:] == ["failed", "-"]
    assert table.endswith("Training time of these runs: 2.00 h.")  # 8 finished runs of 900 s
    rows += [{"dataset": "ETTm2", "horizon": 192, "model": "skt", "seed": seed, "missing": True} for seed in (3, 4)]
    table = format_table(rows, ["skt"])
    assert "| ETTm2 | 192 | - | - |" in table
    assert table.endswith("Not run yet (dataset H model: missing seeds): ETTm2 192 skt: 3 4.")


def test_a_misprinted_published_number_is_shown_and_compared_with_nothing():
    """Table 16's S4 on ETTm2-720 prints MSE 0.877 with MAE 1.074: below MAE^2, which no errors can give."""
    misprints = [(dataset, horizon, model) for (dataset, horizon), models in paper.PAPER_RESULTS.items()
                 for model, pair in models.items() if paper.is_misprint(pair)]
    assert misprints == [("ETTm2", 720, "S4")]
    assert paper.is_misprint((0.99, 1.0)) and not paper.is_misprint((1.0, 1.0))
    rows = _rows("s4", "ETTm2", 720, [2.2, 2.3, 2.1]) + _rows("s4", "ETTm2", 336, [2.2, 2.3, 2.1])
    summary = {e["horizon"]: e for e in summarise(rows)}
    assert summary[720]["paper_misprint"] and summary[720]["worse_beyond_2std"] is None
    assert not summary[336]["paper_misprint"] and summary[336]["worse_beyond_2std"] is True  # 1.364 published
    table = format_table(rows, ["s4"])
    assert "(0.877 †)" in table and "(1.364) **!**" in table and table.count(") **!**") == 1
    assert table.endswith(MISPRINT_NOTE)
    assert not format_table(_rows("s4", "ETTm2", 336, [1.0, 1.1]), ["s4"]).endswith(MISPRINT_NOTE)


def test_plot_per_dataset(tmp_path):
    rows = _rows("skt", "ETTm2", 96, [0.2, 0.21]) + _rows("skt", "ETTm2", 192, [0.26, 0.27])
    rows += _rows("dlinear", "exchange", 96, [0.1])
    paths = plot_mse_by_horizon(summarise(rows), tmp_path)
    assert sorted(p.name for p in paths) == ["ETTm2_mse.png", "exchange_mse.png"]
    assert all(p.stat().st_size > 1000 for p in paths)


@pytest.mark.parametrize("dataset", ["ETTm2", "electricity", "exchange", "traffic", "weather", "ili", "ETTh1", "ETTh2",
                                     "ETTm1"])
def test_every_table_dataset_has_a_preset_with_the_papers_lengths(dataset):
    preset = find_preset(dataset)
    assert preset is not None and preset.stem == dataset
    config = resolve_config("forecasting", preset, data={"dataset": dataset})
    if dataset == "ili":
        assert (config.data.seq_len, config.data.horizons) == (60, [24, 36, 48, 60])  # conference Table 2
    else:
        assert (config.data.seq_len, config.data.horizons) == (96, [96, 192, 336, 720])
    for model in ("skt", "dlinear", "patchtst", "fedformer"):  # every per-model section resolves
        resolve_config("forecasting", preset, model_name=model, data={"dataset": dataset})


@pytest.mark.parametrize("workers", ["1", "2"])
def test_forecast_select_never_scores_the_test_split(tmp_path, workers):
    out = tmp_path / "select"
    argv = ["forecast-select", "--dataset", "weather", "--data-dir", str(FIXTURES), "--model", "dlinear",
            "--pred-len", "8", "--grid", "optim.lr=1e-6,1e-2", "--set", "data.seq_len=24", "--set", "data.label_len=12", "--set", "train.epochs=2",
            "--out", str(out), "--workers", workers]
    assert main(argv) == 0
    selection = json.loads((out / "selection.json").read_text())
    means = {c["candidate"]: c["mean"] for c in selection["candidates"]}
    assert selection["best"]["candidate"] == min(means, key=means.get)
    results = [json.loads(p.read_text()) for p in out.rglob("results.json")]
    assert len(results) == 2 and all(r["test"] is None and r["val"]["mse"] > 0 for r in results)
    assert not list(out.rglob("forecast.png"))  # the forecast plot draws test windows: not made
