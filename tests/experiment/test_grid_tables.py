"""Grid tables and learning curves built from constructed results (no training): the answer is known."""

from __future__ import annotations

import json

import pytest

from longattn.commands.compare import compare_table
from longattn.experiment.curves import CurveGroup, learning_curves, write_learning_curves
from longattn.experiment.grid import Cell, default_seeds, paired_against, write_sweep_table
from longattn.experiment.stats import NOT_SIGNIFICANT
from longattn.forecast.table import difference_table

SEEDS = [0, 1, 2]
REFERENCE = [30.0, 40.0, 35.0]  # test accuracy (%) per seed: a spread of 10 points between seeds


def _result(seed: int, accuracy: float, order: str = "same") -> dict:
    history = [{"split": "val", "step": step, "loss": 2.0 - step / 100 - seed / 10, "accuracy": accuracy / 100,
                "train_time_s": step * (1 + seed)} for step in (10, 20)]
    return {"seed": seed, "test": {"accuracy": accuracy / 100}, "val": {"accuracy": accuracy / 100},
            "parameters": 10, "steps": 20, "train_time_s": 20.0 * (1 + seed), "peak_memory_mb": 1.0,
            "history": history, "data_order": order}


def _cell(row: str, accuracies: list[float], column: str = "listops") -> Cell:
    cell = Cell(row, column, "listops", explicit={"attention": row})
    cell.results = [_result(seed, value) for seed, value in zip(SEEDS, accuracies)]
    return cell


def _cells() -> list[Cell]:
    return [_cell("softmax", REFERENCE),
            _cell("better", [a + 5 + d for a, d in zip(REFERENCE, (0.1, -0.1, 0.0))]),  # +5 in every seed
            _cell("noisy", [a + d for a, d in zip(REFERENCE, (1.0, -1.0, 0.5))])]  # within the seed noise


def _line(table: str, row: str) -> str:
    return next(line for line in table.splitlines() if line.startswith(f"| {row} "))


def test_compare_table_marks_only_the_differences_that_are_not_significant():
    cells = _cells()
    table = compare_table("listops", cells, cells[0], SEEDS)
    assert "reference" in _line(table, "softmax")
    assert "+5.00 [" in _line(table, "better") and NOT_SIGNIFICANT not in _line(table, "better")
    assert _line(table, "noisy").count(NOT_SIGNIFICANT) == 1
    assert "35.00 ± 5.00" in _line(table, "softmax") and "2.89" in _line(table, "softmax")  # mean ± std, s.e.
    assert "Student t interval" in table


def test_sweep_table_has_standard_errors_and_paired_differences(tmp_path):
    cells = _cells()
    summary = write_sweep_table({"title": "toy", "average": False}, cells, tmp_path, SEEDS)
    table = (tmp_path / "table.md").read_text()
    assert "35.00 ± 5.00 (2.89)" in _line(table, "softmax")
    differences = table.split("Paired difference from softmax")[1]
    assert NOT_SIGNIFICANT in _line(differences, "noisy") and NOT_SIGNIFICANT not in _line(differences, "better")
    by_row = {c["row"]: c for c in json.loads((tmp_path / "results.json").read_text())["cells"]}
    assert by_row["better"]["difference"]["significant"] and not by_row["noisy"]["difference"]["significant"]
    assert by_row["softmax"]["difference"] is None and by_row["softmax"]["test_summary"]["n"] == 3
    assert summary["reference"] == "softmax"
    write_sweep_table({"title": "toy", "reference": "noisy"}, _cells(), tmp_path, SEEDS)
    assert "Paired difference from noisy" in (tmp_path / "table.md").read_text()
    with pytest.raises(ValueError, match="reference row"):
        write_sweep_table({"title": "toy"}, _cells(), tmp_path, SEEDS, reference="absent")


def test_seeds_with_another_data_order_are_not_paired(capsys):
    reference, other = _cells()[:2]
    other.results[2]["data_order"] = "different"
    difference = paired_against(other, reference)
    assert difference.seeds == [0, 1]
    assert "different data orders for seed(s) [2]" in capsys.readouterr().out


def test_default_seeds_three_for_the_demo_five_for_the_papers_presets():
    assert default_seeds("demo") == default_seeds(None) == [0, 1, 2]
    assert default_seeds("standard") == default_seeds("skt_table9") == [0, 1, 2, 3, 4]


def test_forecast_difference_table_pairs_seeds_against_the_reference_model():
    rows = [{"dataset": "ili", "horizon": 24, "model": model, "seed": seed, "mse": mse, "mae": 0.0}
            for model, values in (("skt", (1.0, 2.0, 3.0)), ("dlinear", (1.5, 2.5, 3.6)), ("encoder", (1.1, 1.9, 3.05)))
            for seed, mse in enumerate(values)]
    table = difference_table(rows, ["skt", "dlinear", "encoder"])
    line = _line(table, "ili")
    dlinear, encoder = line.split("|")[3:5]
    assert dlinear.strip().startswith("+0.533 [") and NOT_SIGNIFICANT not in dlinear
    assert NOT_SIGNIFICANT in encoder
    assert difference_table(rows, ["skt"]) == ""


def test_learning_curves_average_seeds_step_by_step():
    curves = learning_curves(CurveGroup("listops", "softmax", _cells()[0].results))
    first = curves["points"][0]
    assert first["step"] == 10 and first["seeds"] == 3
    assert first["time"] == pytest.approx(20.0)  # mean of 10, 20, 30 s
    assert first["loss"] == pytest.approx(1.8) and first["loss_std"] == pytest.approx(0.1)
    assert first["metric"] == pytest.approx(35.0) and first["metric_std"] == pytest.approx(5.0)
    assert curves["best_metric"] == pytest.approx(REFERENCE) and not curves["time_estimated"]


def test_history_without_training_time_is_estimated_from_the_mean_step_time(tmp_path):
    results = _cells()[0].results
    for run in results:
        for record in run["history"]:
            del record["train_time_s"]
    curves = learning_curves(CurveGroup("listops", "softmax", results))
    assert curves["time_estimated"]
    assert curves["points"][1]["time"] == pytest.approx(40.0)  # step 20 x mean step time (1, 2, 3 s)
    written = write_learning_curves([CurveGroup("listops", "softmax", results)], tmp_path)
    assert {p.name for p in written} == {"curves.json", "curves.md", "curves_listops.png"}
    assert (tmp_path / "curves_listops.png").stat().st_size > 1000
