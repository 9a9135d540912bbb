"""Time-series loaders: CSV parsing, standard splits, scaling, windows, errors, download helper."""

from __future__ import annotations

import functools
import hashlib
import http.server
import os
import re
import threading
from datetime import datetime, timedelta
from pathlib import Path

import numpy as np
import pytest
import torch

from longattn.data import timeseries as ts
from longattn.data.download import DownloadError, check_digests, download_file


def write_csv(path: Path, rows: int, columns=("a", "b", "OT"), start=datetime(2016, 7, 1), step=timedelta(hours=1),
              crlf: bool = False, date_fmt: str = "%Y-%m-%d %H:%M:%S", seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    values = rng.normal(size=(rows, len(columns))) + np.arange(rows)[:, None] * 0.01
    newline = "\r\n" if crlf else "\n"
    lines = ["date," + ",".join(columns)]
    for i in range(rows):
        date = (start + i * step).strftime(date_fmt)
        lines.append(date + "," + ",".join(repr(float(v)) for v in values[i]))
    path.write_bytes((newline.join(lines) + newline).encode())
    return values


def test_crlf_and_unpadded_dates(tmp_path):
    path = tmp_path / "exchange_rate.csv"
    path.write_bytes(b"date,0,1,OT\r\n1990/1/1 0:00,0.7855,1.611,0.593\r\n1990/1/2 0:00,0.7818,1.61,0.594\r\n")
    table = ts.read_series_csv(path)
    assert table.columns == ["0", "1", "OT"]
    assert table.dates == [datetime(1990, 1, 1), datetime(1990, 1, 2)]
    np.testing.assert_array_equal(table.values, [[0.7855, 1.611, 0.593], [0.7818, 1.61, 0.594]])
    assert ts.infer_freq(table.dates) == "d"


@pytest.mark.parametrize(
    "content, message",
    [
        (b"time,a,OT\n2020-01-01,1,2\n", "no 'date' column"),
        (b"date,a,OT\n2020-01-01,1\n", "line 2: 2 fields"),
        (b"date,a,OT\n2020-01-01,1,2\n2020-01-02,x,3\n", "line 3, column 'a': not a number"),
        (b"date,a,OT\n2020-01-01,nan,2\n", "NaN"),
        (b"date,a,OT\n2020-01-01,,2\n", "not a number: ''"),
        (b"date,a,OT\nyesterday,1,2\n", "cannot parse date 'yesterday'"),
        (b"", "is empty"),
    ],
)
def test_malformed_csv_errors(tmp_path, content, message):
    path = tmp_path / "bad.csv"
    path.write_bytes(content)
    with pytest.raises(ts.TimeSeriesDataError, match=message):
        ts.read_series_csv(path)


def test_custom_split_windows_and_scaler(tmp_path):
    path = tmp_path / "series.csv"
    raw = write_csv(path, 200, crlf=True, date_fmt="%Y/%m/%d %H:%M", step=timedelta(days=1))
    data = ts.load_forecast_data(str(path), seq_len=12, label_len=6, pred_len=5)
    # 7:1:2 -> 140 / 20 / 40 rows; val and test begin seq_len rows early.
    assert data.borders == {"train": (0, 140), "val": (128, 160), "test": (148, 200)}
    assert (len(data.train), len(data.val), len(data.test)) == (140 - 16, 32 - 16, 52 - 16)
    # The scaler is fitted on the train slice only (population std), and applied to every split.
    np.testing.assert_allclose(data.scaler.mean, raw[:140].mean(0))
    np.testing.assert_allclose(data.scaler.std, raw[:140].std(0))
    x, y, x_mark, y_mark = data.test[3]
    scaled = (raw - raw[:140].mean(0)) / raw[:140].std(0)
    np.testing.assert_allclose(x.numpy(), scaled[151:163], rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(y.numpy(), scaled[163 - 6 : 168], rtol=1e-5, atol=1e-6)
    assert x_mark.shape == (12, 0)
    # First test forecast starts right at the test border; the last one ends on the last row.
    assert data.borders["test"][0] + 12 == 200 - 40
    assert torch.equal(data.test[len(data.test) - 1][1][-1], torch.tensor(scaled[-1], dtype=torch.float32))


def test_no_drop_last_on_eval_loaders(tmp_path):
    path = tmp_path / "series.csv"
    write_csv(path, 200)
    data = ts.load_forecast_data(str(path), seq_len=12, label_len=6, pred_len=5)
    loaders = data.loaders(batch_size=7)
    assert sum(len(b[0]) for b in loaders["val"]) == len(data.val)
    assert sum(len(b[0]) for b in loaders["test"]) == len(data.test)


def test_feature_modes_and_target_last(tmp_path):
    path = tmp_path / "series.csv"
    write_csv(path, 120, columns=("OT", "a", "b"))
    m = ts.load_forecast_data(str(path), seq_len=8, label_len=4, pred_len=4, features="M")
    assert m.columns == ["a", "b", "OT"] and m.target_columns == [0, 1, 2]
    ms = ts.load_forecast_data(str(path), seq_len=8, label_len=4, pred_len=4, features="MS")
    assert ms.channels == 3 and ms.target_columns == [2]
    s = ts.load_forecast_data(str(path), seq_len=8, label_len=4, pred_len=4, features="S", target="a")
    assert s.columns == ["a"] and s.target_columns == [0]
    torch.testing.assert_close(s.train[0][0][:, 0], m.train[0][0][:, 0])


def test_calendar_features(tmp_path):
    path = tmp_path / "series.csv"
    write_csv(path, 120, step=timedelta(minutes=15))
    data = ts.load_forecast_data(str(path), seq_len=8, label_len=4, pred_len=4, calendar=True)
    assert data.freq == "min" and data.calendar_dim == 5
    marks = data.train.marks
    assert marks.min() >= -0.5 and marks.max() <= 0.5
    assert marks[4, 0] == pytest.approx(0 / 59 - 0.5) and marks[5, 0] == pytest.approx(15 / 59 - 0.5)


def test_data_errors(tmp_path):
    path = tmp_path / "series.csv"
    write_csv(path, 60)
    with pytest.raises(ts.TimeSeriesDataError, match="target column 'price'"):
        ts.load_forecast_data(str(path), seq_len=8, label_len=4, pred_len=4, target="price")
    with pytest.raises(ts.TimeSeriesDataError, match="too short"):
        ts.load_forecast_data(str(path), seq_len=24, label_len=4, pred_len=12)
    with pytest.raises(ts.TimeSeriesDataError, match="features"):
        ts.load_forecast_data(str(path), seq_len=8, label_len=4, pred_len=4, features="X")
    with pytest.raises(ts.TimeSeriesDataError, match="label_len"):
        ts.load_forecast_data(str(path), seq_len=8, label_len=9, pred_len=4)
    with pytest.raises(ts.TimeSeriesDataError, match="at least 14400 rows"):
        ts.load_forecast_data(str(path), seq_len=8, label_len=4, pred_len=4, kind="ETTh")
    with pytest.raises(FileNotFoundError, match="ETTh1.csv not found"):
        ts.load_forecast_data("ETTh1", tmp_path)
    with pytest.raises(ts.TimeSeriesDataError, match="unknown dataset"):
        ts.load_forecast_data("sunspots", tmp_path)


def test_ett_borders(tmp_path):
    assert ts.split_borders("ETTh", 17420, 96) == {"train": (0, 8640), "val": (8544, 11520), "test": (11424, 14400)}
    assert ts.split_borders("ETTm", 69680, 96) == {
        "train": (0, 34560), "val": (34464, 46080), "test": (45984, 57600)}
    write_csv(tmp_path / "ETTh2.csv", 14500)
    data = ts.load_forecast_data("etth2", tmp_path, seq_len=96, label_len=48, pred_len=96)
    assert data.name == "ETTh2" and data.freq == "h"
    assert (len(data.train), len(data.val), len(data.test)) == (8449, 2785, 2785)


# ----------------------------------------------------------------------------- download


@pytest.fixture
def local_server(tmp_path):
    root = tmp_path / "served"
    root.mkdir()
    handler = functools.partial(_QuietHandler, directory=str(root))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield root, f"http://127.0.0.1:{server.server_address[1]}/"
    server.shutdown()
    server.server_close()


class _QuietHandler(http.server.SimpleHTTPRequestHandler):
    def log_message(self, *args):  # keep test output clean
        pass


def test_fetch_verifies_checksum(local_server, tmp_path):
    root, url = local_server
    payload = b"date,OT\r\n2020-01-01 00:00:00,1.0\r\n"
    (root / "tiny.csv").write_bytes(payload)
    good = hashlib.sha256(payload).hexdigest()
    dest = download_file(url + "tiny.csv", tmp_path / "data" / "tiny.csv", sha256=good, progress=False)
    assert dest.read_bytes() == payload
    with pytest.raises(DownloadError, match="does not match"):
        download_file(url + "tiny.csv", tmp_path / "data" / "other.csv", sha256="0" * 64, progress=False)
    assert sorted(p.name for p in (tmp_path / "data").iterdir()) == ["tiny.csv"]  # no partial file left
    # An existing file with a wrong checksum is replaced only by verified bytes.
    (tmp_path / "data" / "tiny.csv").write_bytes(b"corrupt")
    assert download_file(url + "tiny.csv", tmp_path / "data" / "tiny.csv", sha256=good,
                         progress=False).read_bytes() == payload


def test_download_series_uses_table(local_server, tmp_path, monkeypatch):
    root, url = local_server
    payload = b"date,a,OT\n2020-01-01 00:00:00,1,2\n"
    (root / "ETTh1.csv").write_bytes(payload)
    info = ts.SERIES["ETTh1"]
    monkeypatch.setitem(ts.SERIES, "ETTh1", ts.SeriesInfo(info.filename, info.kind, url + "ETTh1.csv",
                                                           hashlib.sha256(payload).hexdigest(), info.homepage))
    assert ts.download_series("etth1", tmp_path).read_bytes() == payload
    ili = ts.SERIES["ili"]
    monkeypatch.setitem(ts.SERIES, "ili", ts.SeriesInfo(ili.filename, ili.kind, None, None, ili.homepage))
    with pytest.raises(ts.TimeSeriesDataError, match="no direct download link"):
        ts.download_series("ili", tmp_path)


def test_checksum_table_is_well_formed():
    for name, info in ts.SERIES.items():
        assert info.sha256 is None or (len(info.sha256) == 64 and int(info.sha256, 16) >= 0), name
        assert info.url is None or info.url.startswith("https://"), name


# ----------------------------------------------------------------------------- real data (optional)


def _shared_timeseries() -> Path | None:
    candidates = [os.environ.get("LONGATTN_DATA_DIR"), Path(__file__).resolve().parents[2] / "../shared/data"]
    for base in filter(None, candidates):
        folder = Path(base) / "timeseries" if (Path(base) / "timeseries").is_dir() else Path(base)
        if (folder / "ETTh1.csv").is_file():
            return folder
    return None


@pytest.mark.skipif(_shared_timeseries() is None, reason="real ETTh1.csv not found (set LONGATTN_DATA_DIR)")
def test_real_etth1_standard_windows():
    folder = _shared_timeseries()
    data = ts.load_forecast_data("ETTh1", folder, seq_len=96, label_len=48, pred_len=96)
    assert data.columns == ["HUFL", "HULL", "MUFL", "MULL", "LUFL", "LULL", "OT"]
    assert (len(data.train), len(data.val), len(data.test)) == (8449, 2785, 2785)
    assert check_digests(folder / "ETTh1.csv", sha256=ts.SERIES["ETTh1"].sha256)


# ----------------------------------------------------------------------------- Weather / Electricity / Traffic

FIXTURES = Path(__file__).resolve().parent / "fixtures" / "timeseries"


@pytest.mark.parametrize("name, columns", [("weather", 21), ("electricity", 6), ("traffic", 8)])
def test_standard_layout_fixtures_load_by_name(name, columns):
    """Small files in the published layout (date first, OT last, 7:1:2 split) load through the benchmark names."""
    data = ts.load_forecast_data(name, FIXTURES, seq_len=24, label_len=12, pred_len=12)
    rows = len(ts.read_series_csv(FIXTURES / ts.SERIES[name].filename).values)
    assert data.channels == columns and data.columns[-1] == "OT" and data.target_columns == list(range(columns))
    train, test = int(0.7 * rows), int(0.2 * rows)
    assert data.borders == {"train": (0, train), "val": (train - 24, rows - test), "test": (rows - test - 24, rows)}
    assert len(data.train) == train - 24 - 12 + 1
    assert data.freq == ("min" if name == "weather" else "h")


def test_weather_header_in_a_legacy_encoding_is_read():
    raw = (FIXTURES / "weather.csv").read_bytes().split(b"\n", 1)[0]
    with pytest.raises(UnicodeDecodeError):
        raw.decode("utf-8")  # the fixture keeps the published file's non-UTF-8 unit symbols
    table = ts.read_series_csv(FIXTURES / "weather.csv")
    assert table.columns[0] == "p (mbar)" and table.columns[-1] == "OT" and len(table.columns) == 21
    assert table.columns[16].startswith("SWDR (W/m")


def test_download_knows_every_table_dataset_and_checks_the_shape(local_server, tmp_path, monkeypatch):
    for name in ("ETTh1", "ETTh2", "ETTm1", "ETTm2", "exchange", "ili", "weather", "electricity", "traffic"):
        info = ts.SERIES[name]
        assert info.url and info.url.endswith("/" + info.filename) and info.shape, name
        assert info.sha256 or info.shape, name
    root, url = local_server
    payload = (FIXTURES / "traffic.csv").read_bytes()
    (root / "traffic.csv").write_bytes(payload)
    info = ts.SERIES["traffic"]
    rows = len(ts.read_series_csv(FIXTURES / "traffic.csv").values)
    monkeypatch.setitem(ts.SERIES, "traffic", ts.SeriesInfo(info.filename, info.kind, url + "traffic.csv", None,
                                                            info.homepage, (rows, 8)))
    assert ts.download_series("traffic", tmp_path / "ok").read_bytes() == payload
    # The published traffic file has 17544 rows x 862 sensors: anything else is refused and removed.
    monkeypatch.setitem(ts.SERIES, "traffic", ts.SeriesInfo(info.filename, info.kind, url + "traffic.csv", None,
                                                            info.homepage, info.shape))
    with pytest.raises(ts.TimeSeriesDataError, match=r"not the benchmark \(17544 rows x 862 value columns\)"):
        ts.download_series("traffic", tmp_path / "bad")
    assert not (tmp_path / "bad" / "traffic.csv").exists()
    (root / "traffic.csv").write_bytes(b"<html>not found</html>\n")
    with pytest.raises(ts.TimeSeriesDataError, match="no 'date' column"):
        ts.download_series("traffic", tmp_path / "html")
    assert not (tmp_path / "html" / "traffic.csv").exists()


# ----------------------------------------------------------------------------- order, gaps and line numbers

from reliability import CLEAR_ERROR, CORRECT_RESULT, TIME_SERIES, bad_input, cases  # noqa: E402

ORDER_AND_GAPS = {
    # the reproduction: dates out of order, a repeated date, a row of empty cells
    "out of order": (b"date,OT\n2020-01-01 02:00,1\n2020-01-01 00:00,2\n2020-01-01 00:00,3\n,\n2020-01-01 03:00,4\n",
                     r"line 3: date '2020-01-01 00:00' goes back in time from the date on line 2"),
    "repeated date": (b"date,OT\n2020-01-01 00:00,1\n2020-01-01 01:00,2\n2020-01-01 01:00,3\n",
                      r"line 4: date '2020-01-01 01:00' repeats the date on line 3"),
    "row of empty cells": (b"date,a,OT\n2020-01-01,1,2\n,,\n2020-01-03,1,2\n", r"line 3: a row of empty cells inside"),
    "blank line": (b"date,a,OT\n2020-01-01,1,2\n\n2020-01-03,1,2\n", r"line 3: a blank line inside the table"),
    "blank line (CRLF)": (b"date,a,OT\r\n2020-01-01,1,2\r\n\r\n2020-01-03,1,2\r\n", r"line 3: a blank line"),
    "spaces only": (b"date,a,OT\n2020-01-01,1,2\n  ,  , \n2020-01-03,1,2\n", r"line 3: a row of empty cells"),
    "blank line before the header": (b"\ndate,a,OT\n2020-01-01,1,2\n", r"line 1: blank line before the header"),
    "duplicate column": (b"date,a,a,OT\n2020-01-01,1,2,3\n", r"line 1: duplicate column name\(s\) \['a'\]"),
    # a quoted cell over two lines: the error after it names the line of the file, not the row's index
    "line after a two-line cell": (b'date,a,OT\n2020-01-01,"1\n",2\n2020-01-02,x,3\n',
                                   r"line 4, column 'a': not a number: 'x'"),
    "unterminated quote": (b'date,a,OT\n2020-01-01,"1,2\n', r"line \d+: malformed CSV|fields"),
}


@pytest.mark.parametrize("content, message", cases(TIME_SERIES, CLEAR_ERROR, ORDER_AND_GAPS))
def test_order_gaps_and_line_numbers_are_clear_errors(tmp_path, content, message):
    path = tmp_path / "series.csv"
    path.write_bytes(content)
    with pytest.raises(ts.TimeSeriesDataError, match=rf"{path}.* {message}"):
        ts.read_series_csv(path)


@bad_input(TIME_SERIES, CORRECT_RESULT, cases=2)
def test_blank_lines_after_the_last_row_are_allowed(tmp_path):
    for newline in (b"\n", b"\r\n"):
        path = tmp_path / "series.csv"
        path.write_bytes(newline.join([b"date,a,OT", b"2020-01-01,1,2", b"2020-01-02,3,4", b"", b"", b""]))
        table = ts.read_series_csv(path)
        assert table.dates == [datetime(2020, 1, 1), datetime(2020, 1, 2)]
        np.testing.assert_array_equal(table.values, [[1, 2], [3, 4]])


# ----------------------------------------------------------------------------- files as published (issue 59)

WEATHER_ROWS, WEATHER_REPEATED_LINE = 52696, 19046  # the published file: 52,696 rows, line 19,046 repeats 19,045


def write_weather_layout(path: Path) -> None:
    """The published Weather file's shape: 52,696 rows x 21 value columns every 10 minutes from 2020-01-01
    00:10, the row on line 19,046 an exact repeat of line 19,045, and two -9999 fill values in `wv (m/s)`."""
    header = (FIXTURES / "weather.csv").read_bytes().split(b"\n", 1)[0]
    unique = WEATHER_ROWS - 1
    start = datetime(2020, 1, 1, 0, 10)
    values = (np.arange(unique)[:, None] % 97 + np.arange(21)[None, :]).astype(np.int64)
    values[[100, 40000], 11] = -9999  # column 11 is `wv (m/s)`
    lines = [(start + timedelta(minutes=10 * i)).strftime("%Y-%m-%d %H:%M:%S") + "," + ",".join(map(str, row))
             for i, row in enumerate(values.tolist())]
    repeated = WEATHER_REPEATED_LINE - 2  # index of the line's row among the data lines (the header is line 1)
    lines.insert(repeated, lines[repeated - 1])
    path.write_bytes(header + b"\n" + "\n".join(lines).encode() + b"\n")


def test_weather_as_published_keeps_its_repeated_row_with_one_warning(tmp_path, capsys):
    write_weather_layout(tmp_path / "weather.csv")
    data = ts.load_forecast_data("weather", tmp_path, seq_len=96, label_len=48, pred_len=96)
    warnings = [line for line in capsys.readouterr().err.splitlines() if line.startswith("warning:")]
    assert len(warnings) == 1 and f"1 row(s) repeat the date and values of the row before (line {WEATHER_REPEATED_LINE})" \
        in warnings[0]
    sizes = {split: end - begin for split, (begin, end) in data.borders.items()}
    # the published 7:1:2 split counts the repeated row: 36,887 / 5,270 / 10,539 rows (val and test without the
    # seq_len overlap)
    assert (sizes["train"], sizes["val"] - 96, sizes["test"] - 96) == (36887, 5270, 10539)
    assert len(data.train) == 36696  # 36,887 - 96 - 96 + 1; 36,695 without the repeated row
    assert data.description.startswith("weather.csv: 52,696 rows x 21 columns; 2020-01-01 00:10:00 to ")
    assert "frequency min (median step 10 min)" in data.description
    assert f"1 repeated row(s) (line {WEATHER_REPEATED_LINE})" in data.description
    assert "fill values -9999: wv (m/s) 2" in data.description
    assert (data.scaler.inverse_transform(data.train.data.double().numpy())[100, 11] == pytest.approx(-9999))


@pytest.mark.parametrize("content, line, relation", [
    (b"date,a,OT\n2020-01-01 00:00,1,2\n2020-01-01 01:00,1,2\n2020-01-01 01:00,1,3\n2020-01-01 02:00,1,2\n", 4,
     "repeats the date on line 3 (2020-01-01 01:00:00) with other values"),
    (b"date,a,OT\n2020-01-01 00:00,1,2\n2020-01-01 02:00,1,2\n2020-01-01 01:00,1,2\n2020-01-01 03:00,1,2\n", 4,
     "goes back in time from the date on line 3"),
])
def test_a_repeated_date_with_other_values_or_time_going_back_is_refused_unless_allowed(tmp_path, content, line,
                                                                                       relation):
    path = tmp_path / "series.csv"
    path.write_bytes(content)
    with pytest.raises(ts.TimeSeriesDataError, match=rf"line {line}: .* {re.escape(relation)}.*"
                                                     r"data.strict_time_order=false"):
        ts.read_series_csv(path)
    table = ts.read_series_csv(path, strict_time_order=False)
    assert table.unordered_lines == [line] and table.repeated_lines == [] and len(table.values) == 4
    np.testing.assert_array_equal(table.values[:, 1], [int(r.split(b",")[2]) for r in content.split(b"\n")[1:-1]])


def test_an_identical_repeated_row_is_kept_and_other_problems_still_refused(tmp_path):
    path = tmp_path / "series.csv"
    path.write_bytes(b"date,a,OT\n2020-01-01 00:00,1,2\n2020-01-01 00:00,1,2\n2020-01-01 01:00,3,4\n")
    table = ts.read_series_csv(path)
    assert table.repeated_lines == [3] and table.unordered_lines == [] and len(table.values) == 3


def test_fill_values_are_counted_kept_or_interpolated(tmp_path):
    path = tmp_path / "series.csv"
    write_csv(path, 60)
    lines = path.read_text().splitlines()
    for number in (2, 3):  # rows 1 and 2 of column a (line 1 is the header): between the recorded rows 0 and 3
        date, _, rest = lines[number].split(",", 2)
        lines[number] = f"{date},-9999,{rest}"
    path.write_text("\n".join(lines) + "\n")
    table = ts.read_series_csv(path)
    assert table.fill_counts == {"a": 2}
    kept = ts.load_forecast_data(str(path), seq_len=8, label_len=4, pred_len=4)
    filled = ts.load_forecast_data(str(path), seq_len=8, label_len=4, pred_len=4, fill_values="interpolate")
    raw_kept = kept.scaler.inverse_transform(kept.train.data.double().numpy())
    raw_filled = filled.scaler.inverse_transform(filled.train.data.double().numpy())
    assert raw_kept[1:3, 0] == pytest.approx([-9999, -9999])
    a0, a3 = table.values[0, 0], table.values[3, 0]
    assert raw_filled[1:3, 0] == pytest.approx([a0 + (a3 - a0) / 3, a0 + 2 * (a3 - a0) / 3], abs=1e-4)
    with pytest.raises(ts.TimeSeriesDataError, match="fill_values must be one of keep, interpolate"):
        ts.load_forecast_data(str(path), seq_len=8, label_len=4, pred_len=4, fill_values="drop")


def test_a_missing_benchmark_file_names_the_folder_the_file_and_the_download_command(tmp_path):
    (tmp_path / "notes.txt").write_text("x")
    with pytest.raises(FileNotFoundError) as error:
        ts.load_forecast_data("weather", tmp_path)
    message = str(error.value)
    assert "holds notes.txt" in message and "the file weather.csv" in message
    assert "or from weather/weather.csv as in Time-Series-Library's dataset/ folder" in message
    assert f"longattn data download weather --data-dir {tmp_path}" in message
    assert "forecast-download" not in message


@pytest.mark.parametrize("name, folder", [("ETTh2", "ETT-small"), ("exchange", "exchange_rate"), ("ili", "illness")])
def test_time_series_librarys_dataset_folder_is_read_as_it_is(tmp_path, capsys, name, folder):
    """--data-dir pointed at Time-Series-Library's dataset/ (DIR/ETT-small/ETTh2.csv, DIR/illness/...) reads the
    same file as one in DIR itself."""
    filename = ts.SERIES[name].filename
    (tmp_path / "library" / folder).mkdir(parents=True)
    (tmp_path / "flat").mkdir()
    for where in (tmp_path / "library" / folder, tmp_path / "flat"):
        write_csv(where / filename, 14500)
    library = ts.load_forecast_data(name, tmp_path / "library", seq_len=24, label_len=12, pred_len=12)
    flat = ts.load_forecast_data(name, tmp_path / "flat", seq_len=24, label_len=12, pred_len=12)
    assert library.borders == flat.borders and library.description.startswith(f"{filename}: 14,500 rows")
    last = len(flat.test) - 1
    rows, columns = ts.SERIES[name].shape
    warnings = [line for line in capsys.readouterr().err.splitlines() if line.startswith("warning:")]
    assert len(warnings) == 2 and f"{filename}: 14,500 rows x 3 value columns, the published {name} file " \
        f"{rows:,} x {columns}: its splits are not the benchmark's" in warnings[0]  # the Weather-layout test: none at the published shape
    assert torch.equal(library.train[0][0], flat.train[0][0]) and torch.equal(library.test[last][1], flat.test[last][1])
