"""A new classification task is a task module, a preset and this test; no existing file changes.

The module (new_task/majority_task.py) and its preset (new_task/majority_presets/demo.yaml) live outside
the package and reach the command line through LONGATTN_PLUGINS, which proves that nothing in longattn
had to be edited: `train --help` lists the task, `train` and `compare` run it.
"""

import json
import sys
from pathlib import Path

import pytest

from longattn.cli import main
from longattn.tasks.base import TASKS

HERE = Path(__file__).parent / "new_task"


@pytest.fixture
def plugin(monkeypatch):
    monkeypatch.syspath_prepend(str(HERE))
    monkeypatch.setenv("LONGATTN_PLUGINS", "majority_task")
    # registrations made by the plugin are undone after the test
    monkeypatch.setattr(TASKS, "_entries", dict(TASKS._entries))
    monkeypatch.setattr(TASKS, "_metadata", dict(TASKS._metadata))
    monkeypatch.delitem(sys.modules, "majority_task", raising=False)


def test_new_task_is_listed_trained_and_compared(plugin, tmp_path, capsys):
    with pytest.raises(SystemExit):
        main(["train", "--help"])
    assert "majority" in capsys.readouterr().out
    assert main(["train", "--task", "majority", "--preset", "demo", "--attention", "linear",
                 "--out", str(tmp_path / "one")]) == 0
    results = json.loads((tmp_path / "one" / "results.json").read_text())
    assert results["task"] == "majority" and results["test"]["examples"] == 32
    assert main(["compare", "--task", "majority", "--attentions", "softmax,skein", "--out", str(tmp_path / "cmp"),
                 "--no-cost"]) == 0
    table = (tmp_path / "cmp" / "table.md").read_text()
    assert "| softmax" in table and "| skein" in table


def test_unknown_plugin_is_a_clear_error(monkeypatch, capsys):
    monkeypatch.setenv("LONGATTN_PLUGINS", "no_such_plugin_module")
    assert main(["train", "--help"]) == 2
    assert "LONGATTN_PLUGINS" in capsys.readouterr().err


def test_new_forecaster_needs_no_config_edit(monkeypatch, tmp_path, capsys):
    from longattn.models.registry import MODELS
    from forecast_csv import write_series

    monkeypatch.syspath_prepend(str(HERE))
    monkeypatch.setenv("LONGATTN_PLUGINS", "naive_forecaster")
    monkeypatch.setattr(MODELS, "_entries", dict(MODELS._entries))
    monkeypatch.setattr(MODELS, "_metadata", dict(MODELS._metadata))
    monkeypatch.delitem(sys.modules, "naive_forecaster", raising=False)
    csv = write_series(tmp_path / "toy.csv")
    out = tmp_path / "f"
    assert main(["forecast", "--dataset", str(csv), "--model", "repeat_last", "--pred-len", "4", "--no-plot",
                 "--set", "data.seq_len=16", "--set", "data.label_len=8", "--set", "train.epochs=1",
                 "--set", "model.scale=0.5", "--out", str(out)]) == 0
    results = json.loads((out / "results.json").read_text())
    assert results["model"] == "repeat_last" and results["config"]["model"] == {"scale": 0.5}
