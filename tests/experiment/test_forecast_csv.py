"""A small CSV series in the benchmark layout (date column first, target OT last), for forecasting tests."""

from datetime import datetime, timedelta
from pathlib import Path

import numpy as np


def write_series(path: Path, rows: int = 200, channels: int = 2) -> Path:
    t = np.arange(rows)
    lines = ["date," + ",".join([f"c{i}" for i in range(channels - 1)] + ["OT"])]
    start = datetime(2020, 1, 1)
    for i in range(rows):
        values = [np.sin(2 * np.pi * t[i] / 12 + c) for c in range(channels)]
        lines.append((start + timedelta(hours=i)).strftime("%Y-%m-%d %H:%M:%S") + ","
                     + ",".join(f"{v:.5f}" for v in values))
    path.write_text("\n".join(lines) + "\n")
    return path


def test_written_series_has_the_layout(tmp_path):
    text = write_series(tmp_path / "s.csv", rows=3).read_text().splitlines()
    assert text[0] == "date,c0,OT" and len(text) == 4
