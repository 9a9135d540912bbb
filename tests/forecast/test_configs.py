from pathlib import Path

from longattn.forecast.experiment import find_config
from longattn.train.config import packaged_configs


def test_forecast_config_comes_from_the_current_folder_first(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert find_config("ETTm2") == packaged_configs() / "forecast" / "ETTm2.yaml"
    own = tmp_path / "configs" / "forecast" / "ETTm2.yaml"
    own.parent.mkdir(parents=True)
    own.write_text("train: {}\n")
    assert find_config("ETTm2") == Path("configs/forecast/ETTm2.yaml").resolve()
    assert find_config("no_such_series.csv") is None
