from pathlib import Path

from longattn.tasks.forecasting import FORECAST_CONFIGS
from longattn.tasks.forecasting import find_preset as find_config


def test_forecast_config_comes_from_the_current_folder_first(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert find_config("ETTm2") == FORECAST_CONFIGS / "ETTm2.yaml"
    own = tmp_path / "configs" / "forecast" / "ETTm2.yaml"
    own.parent.mkdir(parents=True)
    own.write_text("train: {}\n")
    assert find_config("ETTm2") == Path("configs/forecast/ETTm2.yaml").resolve()
    assert find_config("no_such_series.csv") is None
