"""Long-term forecasting data: the ETT and "custom" CSV benchmarks with the literature's standard splits.

Conventions (those of Informer / Autoformer / FEDformer, which the SKTformer and S^3 papers build on):

* **ETT** (ETTh1, ETTh2, ETTm1, ETTm2): fixed borders of 12 / 4 / 4 months. For hourly data train is
  rows [0, 8640), validation [8640 - seq_len, 11520), test [11520 - seq_len, 14400); the 15-minute files use
  the same borders times 4. Rows after the test border are not used.
* **custom** (Exchange, ILI, Weather, Electricity, Traffic and any CSV with a date column): train is the first
  ``int(0.7 N)`` rows, test the last ``int(0.2 N)``, validation the rest; validation and test windows start
  ``seq_len`` rows early so that their first forecast begins right at the split border.
* The target column is moved last; features ``M`` use every column, ``S`` only the target, ``MS`` every column
  as input and the target as the one output (the model slices it).
* A standard scaler (mean, population std) is fitted on the **train slice only** and applied to all splits.
* Files as published: a row that repeats the timestamp and the values of the row before is kept (Weather's line
  19,046 repeats 2020-05-12 06:00:00; the papers' splits count it) with one warning; a repeated timestamp with
  other values, or time going back, is an error unless ``strict_time_order=False``. Fill values (``-9999``, a
  sensor that did not record) are counted per column and kept as numbers, as the papers read them, unless
  ``fill_values="interpolate"``.
* A window at index i is ``x = rows[i : i + seq_len]`` and ``y = rows[i + seq_len - label_len :
  i + seq_len + pred_len]`` (the label part overlaps x, the decoder-style convention); the number of windows
  is ``rows - seq_len - pred_len + 1``.
"""

from __future__ import annotations

import csv
import math
import os
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Literal

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset

from longattn.data.common import folder_contents
from longattn.data.download import download_file
from longattn.utils import warn

Features = Literal["M", "S", "MS"]
FillPolicy = Literal["keep", "interpolate"]
FILL_POLICIES = ("keep", "interpolate")
# Values that stand for "not recorded" in the published files (Weather's wv and max. wv columns hold -9999).
FILL_VALUES = (-9999.0,)


class TimeSeriesDataError(ValueError):
    """A time-series file or option is unusable (missing column, NaN, malformed row, too short...)."""


@dataclass(frozen=True)
class SeriesInfo:
    """What the project knows about one benchmark file."""

    filename: str
    kind: Literal["ETTh", "ETTm", "custom"]
    url: str | None  # direct official download location, None where only a manual one exists
    sha256: str | None  # of the file as the literature uses it
    homepage: str
    shape: tuple[int, int] | None = None  # (rows, value columns) of the official file, checked after a download
    target: str = "OT"
    # The file's folder in Time-Series-Library's dataset/ tree (the Autoformer authors' Google Drive folder and
    # Hugging Face copy): a data folder laid out like it (DIR/weather/weather.csv) is read as it is.
    library_folder: str = ""


# SHA-256 of the copies the project was developed with; docs/forecasting.md says which were cross-checked
# against independent records of the official files. None: no copy was available to hash.
_ETT_RAW = "https://raw.githubusercontent.com/zhouhaoyi/ETDataset/main/ETT-small/"
_AUTOFORMER_DRIVE = "https://drive.google.com/drive/folders/1ZOYpTUa82_jCcxIdTmyr0LXQfvaM9vIy"
# The Autoformer authors' (thuml) Hugging Face copy of that folder: the direct links for the custom datasets.
_THUML_HF = "https://huggingface.co/datasets/thuml/Time-Series-Library/resolve/main/"
_ETT_HOME = "https://github.com/zhouhaoyi/ETDataset"
SERIES: dict[str, SeriesInfo] = {
    "ETTh1": SeriesInfo("ETTh1.csv", "ETTh", _ETT_RAW + "ETTh1.csv",
                        "f18de3ad269cef59bb07b5438d79bb3042d3be49bdeecf01c1cd6d29695ee066", _ETT_HOME, (17420, 7),
                        library_folder="ETT-small"),
    "ETTh2": SeriesInfo("ETTh2.csv", "ETTh", _ETT_RAW + "ETTh2.csv",
                        "a3dc2c597b9218c7ce1cd55eb77b283fd459a1d09d753063f944967dd6b9218b", _ETT_HOME, (17420, 7),
                        library_folder="ETT-small"),
    "ETTm1": SeriesInfo("ETTm1.csv", "ETTm", _ETT_RAW + "ETTm1.csv", None, _ETT_HOME, (69680, 7),
                        library_folder="ETT-small"),
    "ETTm2": SeriesInfo("ETTm2.csv", "ETTm", _ETT_RAW + "ETTm2.csv",
                        "db973ca252c6410a30d0469b13d696cf919648d0f3fd588c60f03fdbdbadd1fd", _ETT_HOME, (69680, 7),
                        library_folder="ETT-small"),
    "exchange": SeriesInfo("exchange_rate.csv", "custom", _THUML_HF + "exchange_rate/exchange_rate.csv",
                           "48b4d9d3d508f5104162e85b9a6042e3557fde11aa9f2944eba8c0d0efc89842",
                           _AUTOFORMER_DRIVE, (7588, 8), library_folder="exchange_rate"),
    "ili": SeriesInfo("national_illness.csv", "custom", _THUML_HF + "illness/national_illness.csv",
                      "93601f64d2566dc796ca4305adad8b8560c2db1a1ff04543c3bd813a7263570a", _AUTOFORMER_DRIVE, (966, 7),
                      library_folder="illness"),
    # No copy of these three was available to hash (docs/forecasting.md): a download is checked against the
    # official shape (SKTformer Table 13 / the Autoformer paper: rows, and columns besides the date) instead.
    "weather": SeriesInfo("weather.csv", "custom", _THUML_HF + "weather/weather.csv", None, _AUTOFORMER_DRIVE,
                          (52696, 21), library_folder="weather"),
    "electricity": SeriesInfo("electricity.csv", "custom", _THUML_HF + "electricity/electricity.csv", None,
                              _AUTOFORMER_DRIVE, (26304, 321), library_folder="electricity"),
    "traffic": SeriesInfo("traffic.csv", "custom", _THUML_HF + "traffic/traffic.csv", None, _AUTOFORMER_DRIVE,
                          (17544, 862), library_folder="traffic"),
}
_ALIASES = {"exchange_rate": "exchange", "national_illness": "ili", "illness": "ili", "ecl": "electricity"}

# ETT borders in rows of the hourly files (12 / 4 / 4 months of 30 days).
_ETT_HOURS = (12 * 30 * 24, 16 * 30 * 24, 20 * 30 * 24)


def resolve_series(name: str) -> tuple[str, SeriesInfo]:
    """Canonical benchmark name and its info; case-insensitive, accepts the file stem too."""
    lowered = {k.lower(): k for k in SERIES}
    key = _ALIASES.get(name.lower(), name)
    key = lowered.get(key.lower(), key)
    if key not in SERIES:
        raise TimeSeriesDataError(
            f"unknown dataset {name!r}; known: {', '.join(SERIES)} (or pass a path to any CSV with a date column)"
        )
    return key, SERIES[key]


def download_series(name: str, data_dir: str | os.PathLike, timeout: float = 60.0) -> Path:
    """Fetch benchmark ``name`` into ``data_dir`` from its official location and verify it: its SHA-256 where
    one is recorded, and its shape (rows x value columns) where the official one is known. A file that fails
    the shape check is removed."""
    key, info = resolve_series(name)
    if info.url is None:
        raise TimeSeriesDataError(
            f"{key} has no direct download link; get {info.filename} from {info.homepage} "
            f"(Autoformer's dataset folder) and put it in {data_dir}"
        )
    path = download_file(info.url, Path(data_dir) / info.filename, sha256=info.sha256, timeout=timeout)
    if info.shape is not None:
        try:
            table = read_series_csv(path)
            problem = None if table.values.shape == info.shape else (
                f"{table.values.shape[0]} rows x {table.values.shape[1]} value columns")
        except TimeSeriesDataError as err:
            problem = str(err)
        if problem is not None:
            path.unlink()
            raise TimeSeriesDataError(f"{key}: the file downloaded from {info.url} is not the benchmark "
                                      f"({info.shape[0]} rows x {info.shape[1]} value columns): {problem}; removed")
    return path


# ----------------------------------------------------------------------------- CSV reading

_DATE_FORMATS = ("%Y-%m-%d %H:%M:%S", "%Y-%m-%d %H:%M", "%Y-%m-%d", "%Y/%m/%d %H:%M:%S", "%Y/%m/%d %H:%M",
                 "%Y/%m/%d", "%m/%d/%Y %H:%M", "%m/%d/%Y")


def parse_date(text: str) -> datetime:
    """Parse the date strings used by the benchmark files (``2016-07-01 00:00:00``, ``1990/1/1 0:00``...)."""
    text = text.strip()
    for fmt in _DATE_FORMATS:
        try:
            return datetime.strptime(text, fmt)
        except ValueError:
            continue
    try:
        return datetime.fromisoformat(text)
    except ValueError:
        raise TimeSeriesDataError(f"cannot parse date {text!r}") from None


@dataclass
class SeriesTable:
    """A CSV read into memory: one date per row and a float64 value matrix [rows, columns], with what the reader
    accepted that is not a clean series: the file lines of rows that repeat the row before (date and values),
    of rows out of time order (``strict_time_order=False`` only), and the fill values per column."""

    dates: list[datetime]
    columns: list[str]
    values: np.ndarray
    repeated_lines: list[int] = field(default_factory=list)
    unordered_lines: list[int] = field(default_factory=list)
    fill_counts: dict[str, int] = field(default_factory=dict)


def _lines_text(lines: list[int], shown: int = 5) -> str:
    """``line 19046`` / ``lines 4, 9 and 3 more``."""
    head = ", ".join(str(line) for line in lines[:shown])
    more = f" and {len(lines) - shown} more" if len(lines) > shown else ""
    return f"line{'s' if len(lines) > 1 else ''} {head}{more}"


def read_series_csv(path: str | os.PathLike, date_column: str = "date", *,
                    strict_time_order: bool = True) -> SeriesTable:
    """Read a header + rows CSV (LF or CRLF) with a date column and numeric value columns.

    Raises :class:`TimeSeriesDataError` naming the file and line (the line of the file, counting the header
    and any blank line) for ragged rows, non-numeric or empty cells, NaNs, blank lines and rows of empty
    cells inside the table, and dates that repeat with other values or go back in time, so bad data never
    reaches a model silently (windows cut across a gap or a reordering would be wrong without a word).
    A row identical to the one before (date and values) is kept, as the published splits count it
    (``repeated_lines``); ``strict_time_order=False`` keeps repeated dates with other values and dates going
    back as well, in file order (local-time data repeats an hour at a daylight-saving change;
    ``unordered_lines``). Blank lines after the last row are allowed.
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"time-series file {path} does not exist")
    # errors="replace": the Weather file's header writes the units W/m^2 and umol/m^2/s in a legacy encoding
    # (not UTF-8); only column names can hold such bytes, since dates and values must parse as ASCII numbers.
    with open(path, newline="", encoding="utf-8-sig", errors="replace") as f:
        reader = csv.reader(f)
        try:
            # (line where the row starts, fields): csv.reader's line_num is the line a row ends on
            rows, start = [], 1
            for row in reader:
                rows.append((start, row))
                start = reader.line_num + 1
        except csv.Error as err:
            raise TimeSeriesDataError(f"{path} line {reader.line_num}: malformed CSV ({err})") from None
    while rows and not any(cell.strip() for cell in rows[-1][1]):
        rows.pop()  # blank lines at the end of the file
    if not rows:
        raise TimeSeriesDataError(f"{path} is empty")
    header = [h.strip() for h in rows[0][1]]
    if not any(header):
        raise TimeSeriesDataError(f"{path} line 1: blank line before the header")
    if date_column not in header:
        raise TimeSeriesDataError(f"{path} has no {date_column!r} column; columns: {header}")
    if len(set(header)) != len(header):
        repeated = sorted({h for h in header if header.count(h) > 1})
        raise TimeSeriesDataError(f"{path} line 1: duplicate column name(s) {repeated}; columns: {header}")
    date_idx = header.index(date_column)
    value_idx = [i for i in range(len(header)) if i != date_idx]
    if not value_idx:
        raise TimeSeriesDataError(f"{path} has no value columns besides {date_column!r}")
    dates: list[datetime] = []
    values = np.empty((len(rows) - 1, len(value_idx)), dtype=np.float64)
    repeated_lines: list[int] = []
    unordered_lines: list[int] = []
    for r, (line, row) in enumerate(rows[1:]):
        if not any(cell.strip() for cell in row):
            what = "a blank line" if not row else "a row of empty cells"
            raise TimeSeriesDataError(f"{path} line {line}: {what} inside the table (a gap in the series); "
                                      "remove it, or fill the row")
        if len(row) != len(header):
            raise TimeSeriesDataError(f"{path} line {line}: {len(row)} fields, header has {len(header)}")
        try:
            date = parse_date(row[date_idx])
        except TimeSeriesDataError as err:
            raise TimeSeriesDataError(f"{path} line {line}: {err}") from None
        for c, i in enumerate(value_idx):
            cell = row[i].strip()
            try:
                value = float(cell)
            except ValueError:
                raise TimeSeriesDataError(
                    f"{path} line {line}, column {header[i]!r}: not a number: {cell!r}"
                ) from None
            if not math.isfinite(value):
                raise TimeSeriesDataError(f"{path} line {line}, column {header[i]!r}: {cell!r} (NaN/inf)")
            values[r, c] = value
        if dates and date <= dates[-1]:
            if date == dates[-1] and np.array_equal(values[r], values[r - 1]):
                repeated_lines.append(line)
            elif strict_time_order:
                previous = rows[r][0]  # the line of the row before (rows[0] is the header)
                relation = "repeats" if date == dates[-1] else "goes back in time from"
                detail = " with other values" if date == dates[-1] else ""
                raise TimeSeriesDataError(
                    f"{path} line {line}: date {row[date_idx].strip()!r} {relation} the date on line {previous} "
                    f"({dates[-1]}){detail}; the rows must be in increasing time order (a row identical to the "
                    "one before is kept); data.strict_time_order=false keeps such rows in file order")
            else:
                unordered_lines.append(line)
        dates.append(date)
    columns = [header[i] for i in value_idx]
    fill = np.isin(values, FILL_VALUES).sum(axis=0)
    fill_counts = {column: int(count) for column, count in zip(columns, fill) if count}
    return SeriesTable(dates, columns, values, repeated_lines, unordered_lines, fill_counts)


def interpolate_fill_values(values: np.ndarray) -> np.ndarray:
    """``values`` with every fill value (:data:`FILL_VALUES`) replaced by linear interpolation over the row
    index between the recorded values of its column (the nearest recorded value before the first or after
    the last); a column with no recorded value is an error."""
    filled = values.copy()
    rows = np.arange(len(values))
    for c in range(values.shape[1]):
        missing = np.isin(values[:, c], FILL_VALUES)
        if not missing.any():
            continue
        if missing.all():
            raise TimeSeriesDataError(f"column {c} holds only fill values {FILL_VALUES}: nothing to interpolate")
        filled[missing, c] = np.interp(rows[missing], rows[~missing], values[~missing, c])
    return filled


def describe_series(name: str, table: SeriesTable, freq: str) -> str:
    """The one data line a forecasting run prints: rows, columns, span, inferred frequency, repeated rows
    (and rows out of order) and fill values."""
    span = f"{min(table.dates)} to {max(table.dates)}" if table.dates else "no dates"
    spacing = np.median(np.diff([d.timestamp() for d in table.dates])) if len(table.dates) > 1 else 0.0
    parts = [f"{name}: {len(table.values):,} rows x {len(table.columns)} columns", span,
             f"frequency {freq} (median step {spacing / 60:g} min)",
             f"{len(table.repeated_lines)} repeated row(s)"
             + (f" ({_lines_text(table.repeated_lines)})" if table.repeated_lines else "")]
    if table.unordered_lines:
        parts.append(f"{len(table.unordered_lines)} row(s) out of time order kept "
                     f"({_lines_text(table.unordered_lines)})")
    fills = ", ".join(f"{column} {count}" for column, count in table.fill_counts.items())
    parts.append(f"fill values {'/'.join(f'{v:g}' for v in FILL_VALUES)}: {fills or 'none'}")
    return "; ".join(parts)


# ----------------------------------------------------------------------------- features


def infer_freq(dates: list[datetime]) -> str:
    """'min', 'h', 'd' or 'w' from the median spacing of the dates."""
    if len(dates) < 2:
        return "h"
    seconds = np.median(np.diff(np.array([d.timestamp() for d in dates])))
    if seconds < 3600:
        return "min"
    if seconds < 86400:
        return "h"
    if seconds < 7 * 86400:
        return "d"
    return "w"


def calendar_features(dates: list[datetime], freq: str) -> np.ndarray:
    """Calendar features scaled to [-0.5, 0.5], coarser for coarser data (the Autoformer 'timeF' encoding)."""
    def scaled(values: list[int], top: int) -> list[float]:
        return [v / top - 0.5 for v in values]

    columns: list[list[float]] = []
    if freq == "min":
        columns.append(scaled([d.minute for d in dates], 59))
    if freq in ("min", "h"):
        columns.append(scaled([d.hour for d in dates], 23))
    if freq in ("min", "h", "d"):
        columns.append(scaled([d.weekday() for d in dates], 6))
    columns.append(scaled([d.day - 1 for d in dates], 30))
    if freq == "w":
        columns.append(scaled([d.isocalendar()[1] - 1 for d in dates], 52))
    else:
        columns.append(scaled([d.timetuple().tm_yday - 1 for d in dates], 365))
    return np.asarray(columns, dtype=np.float64).T


@dataclass
class StandardScaler:
    """Per-column mean and population standard deviation (a constant column keeps scale 1)."""

    mean: np.ndarray
    std: np.ndarray

    @classmethod
    def fit(cls, values: np.ndarray) -> "StandardScaler":
        std = values.std(axis=0)
        return cls(values.mean(axis=0), np.where(std > 0, std, 1.0))

    def transform(self, values: np.ndarray) -> np.ndarray:
        return (values - self.mean) / self.std

    def inverse_transform(self, values: np.ndarray | torch.Tensor, columns: slice | list[int] | None = None):
        """Undo :meth:`transform`; ``columns`` selects the scaler columns ``values`` holds (e.g. the target)."""
        sel = slice(None) if columns is None else columns
        mean, std = self.mean[sel], self.std[sel]
        if isinstance(values, torch.Tensor):
            mean = torch.as_tensor(mean, dtype=values.dtype, device=values.device)
            std = torch.as_tensor(std, dtype=values.dtype, device=values.device)
        return values * std + mean


# ----------------------------------------------------------------------------- windows


class ForecastWindows(Dataset):
    """Sliding windows over one split: items are (x, y, x_mark, y_mark) float32 tensors."""

    def __init__(self, data: np.ndarray, marks: np.ndarray, seq_len: int, label_len: int, pred_len: int) -> None:
        self.data = torch.as_tensor(data, dtype=torch.float32)
        self.marks = torch.as_tensor(marks, dtype=torch.float32)
        self.seq_len, self.label_len, self.pred_len = seq_len, label_len, pred_len

    def __len__(self) -> int:
        return len(self.data) - self.seq_len - self.pred_len + 1

    def __getitem__(self, index: int) -> tuple[torch.Tensor, ...]:
        if not 0 <= index < len(self):
            raise IndexError(index)
        x_end = index + self.seq_len
        y_begin, y_end = x_end - self.label_len, x_end + self.pred_len
        return self.data[index:x_end], self.data[y_begin:y_end], self.marks[index:x_end], self.marks[y_begin:y_end]


@dataclass
class ForecastData:
    """Train/val/test windows of one series plus what is needed to interpret model outputs."""

    name: str
    columns: list[str]  # input channels, target last
    target_columns: list[int]  # indices into ``columns`` the loss and metrics use
    scaler: StandardScaler
    train: ForecastWindows
    val: ForecastWindows
    test: ForecastWindows
    freq: str
    borders: dict[str, tuple[int, int]] = field(default_factory=dict)
    description: str = ""  # the data line of describe_series, which a forecasting run prints

    @property
    def channels(self) -> int:
        return len(self.columns)

    @property
    def calendar_dim(self) -> int:
        return self.train.marks.shape[1]

    def loaders(self, batch_size: int, eval_batch_size: int | None = None,
                generator: torch.Generator | None = None) -> dict[str, DataLoader]:
        """Shuffled train loader (drop_last, as the literature trains); val/test in order, nothing dropped."""
        eval_bs = eval_batch_size or batch_size
        return {
            "train": DataLoader(self.train, batch_size=batch_size, shuffle=True, drop_last=len(self.train) > batch_size,
                                generator=generator),
            "val": DataLoader(self.val, batch_size=eval_bs, shuffle=False, drop_last=False),
            "test": DataLoader(self.test, batch_size=eval_bs, shuffle=False, drop_last=False),
        }


def split_borders(kind: str, rows: int, seq_len: int) -> dict[str, tuple[int, int]]:
    """Row ranges [begin, end) of the three splits, val/test beginning ``seq_len`` rows early."""
    if kind in ("ETTh", "ETTm"):
        per_hour = 1 if kind == "ETTh" else 4
        train_end, val_end, test_end = (b * per_hour for b in _ETT_HOURS)
        if rows < test_end:
            raise TimeSeriesDataError(
                f"{kind} data needs at least {test_end} rows for the standard 12/4/4-month borders, got {rows}"
            )
        return {"train": (0, train_end), "val": (train_end - seq_len, val_end), "test": (val_end - seq_len, test_end)}
    if kind != "custom":
        raise TimeSeriesDataError(f"unknown split kind {kind!r}; use ETTh, ETTm or custom")
    num_train, num_test = int(rows * 0.7), int(rows * 0.2)
    num_val = rows - num_train - num_test
    return {
        "train": (0, num_train),
        "val": (num_train - seq_len, num_train + num_val),
        "test": (rows - num_test - seq_len, rows),
    }


def series_candidates(info: SeriesInfo, data_dir: Path) -> list[Path]:
    """Where a benchmark's file may lie, in order: ``DIR/<file>`` (what ``longattn data download`` writes), then
    ``DIR/<folder>/<file>``, Time-Series-Library's ``dataset/`` tree (``dataset/weather/weather.csv``)."""
    return [data_dir / info.filename, data_dir / info.library_folder / info.filename]


def missing_series_message(name: str, info: SeriesInfo, data_dir: Path) -> str:
    """What a run says when a benchmark's file is not in ``data_dir``: what the folder holds, the file name
    and the places it looks for it, and the command that downloads it."""
    first, library = series_candidates(info, data_dir)
    return (f"{first} not found: {name} is read from the file {info.filename} (a CSV with a 'date' column) in the "
            f"data folder, or from {library.relative_to(data_dir)} as in Time-Series-Library's dataset/ folder; "
            f"the data folder {folder_contents(data_dir)}; download it with "
            f"`longattn data download {name} --data-dir {data_dir}` or from {info.homepage}")


def load_forecast_data(
    dataset: str,
    data_dir: str | os.PathLike | None = None,
    *,
    seq_len: int = 96,
    label_len: int = 48,
    pred_len: int = 96,
    features: Features = "M",
    target: str = "OT",
    calendar: bool = False,
    kind: str | None = None,
    date_column: str = "date",
    strict_time_order: bool = True,
    fill_values: FillPolicy = "keep",
) -> ForecastData:
    """Read a benchmark (by name, from ``data_dir``) or any CSV (by path) and cut the standard windows.

    ``kind`` overrides the split family (``ETTh``, ``ETTm``, ``custom``); by default benchmarks use theirs
    and other files the custom 7:1:2 split. With ``calendar=False`` the marks are empty ([T, 0]).
    Rows that repeat the row before are kept with a warning; ``strict_time_order`` and the rows it lets
    through are those of :func:`read_series_csv`. ``fill_values="interpolate"`` replaces the fill values
    (:data:`FILL_VALUES`) by linear interpolation before scaling; ``"keep"`` leaves them as numbers. A
    benchmark read by name from a file of another shape than the published one (rows x value columns) is read
    with a warning: its splits are not the benchmark's.
    """
    if fill_values not in FILL_POLICIES:
        raise TimeSeriesDataError(f"fill_values must be one of {', '.join(FILL_POLICIES)}, got {fill_values!r}")
    if min(seq_len, pred_len) < 1 or label_len < 0 or label_len > seq_len:
        raise TimeSeriesDataError(
            f"need seq_len >= 1, pred_len >= 1 and 0 <= label_len <= seq_len; got {seq_len}, {label_len}, {pred_len}"
        )
    if features not in ("M", "S", "MS"):
        raise TimeSeriesDataError(f"features must be 'M', 'S' or 'MS', got {features!r}")
    published: SeriesInfo | None = None  # the benchmark read by name, whose published shape the file should have
    if dataset.lower().endswith(".csv") or os.sep in dataset:
        path, name, split_kind = Path(dataset), Path(dataset).stem, kind or "custom"
    else:
        name, info = resolve_series(dataset)
        if data_dir is None:
            raise TimeSeriesDataError(f"dataset {name} needs a data directory (--data-dir)")
        found = [candidate for candidate in series_candidates(info, Path(data_dir)) if candidate.is_file()]
        if not found:
            raise FileNotFoundError(missing_series_message(name, info, Path(data_dir)))
        path, split_kind, published = found[0], kind or info.kind, info
    table = read_series_csv(path, date_column=date_column, strict_time_order=strict_time_order)
    if published is not None and published.shape is not None and table.values.shape != published.shape:
        warn(f"{path}: {table.values.shape[0]:,} rows x {table.values.shape[1]} value columns, the published {name} "
             f"file {published.shape[0]:,} x {published.shape[1]}: its splits are not the benchmark's, so its figures "
             f"do not compare with the papers' (a partial, edited or other copy? `longattn data download {name}` "
             "fetches the published one)")
    if table.repeated_lines:
        warn(f"{path}: {len(table.repeated_lines)} row(s) repeat the date and values of the row before "
             f"({_lines_text(table.repeated_lines)}); kept, as the published splits count them")
    if table.unordered_lines:
        warn(f"{path}: {len(table.unordered_lines)} row(s) repeat a date with other values or go back in time "
             f"({_lines_text(table.unordered_lines)}); kept in file order (strict_time_order=False)")
    if fill_values == "interpolate":
        table.values = interpolate_fill_values(table.values)
    if target not in table.columns:
        raise TimeSeriesDataError(f"target column {target!r} not in {path}; columns: {table.columns}")
    order = [c for c in table.columns if c != target] + [target]
    if features == "S":
        order = [target]
    values = table.values[:, [table.columns.index(c) for c in order]]
    rows = len(values)
    borders = split_borders(split_kind, rows, seq_len)
    for split, (begin, end) in borders.items():
        if end - begin < seq_len + pred_len:
            raise TimeSeriesDataError(
                f"{path}: the {split} split has {end - begin} rows (with the seq_len overlap) but one window "
                f"needs seq_len + pred_len = {seq_len + pred_len}; the series ({rows} rows) is too short"
            )
    train_begin, train_end = borders["train"]
    scaler = StandardScaler.fit(values[train_begin:train_end])
    scaled = scaler.transform(values)
    freq = infer_freq(table.dates)
    description = describe_series(path.name, table, freq)
    marks = calendar_features(table.dates, freq) if calendar else np.zeros((rows, 0))
    windows = {
        split: ForecastWindows(scaled[b:e], marks[b:e], seq_len, label_len, pred_len)
        for split, (b, e) in borders.items()
    }
    targets = list(range(len(order))) if features == "M" else [len(order) - 1]
    return ForecastData(name, order, targets, scaler, windows["train"], windows["val"], windows["test"], freq, borders,
                        description)
