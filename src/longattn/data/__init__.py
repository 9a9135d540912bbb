"""Datasets: Long Range Arena (ListOps, Text, Retrieval, Image, Pathfinder), GLUE (`data.glue`), document
classification (`data.textcls`) and time series.

See docs/data.md and docs/forecasting.md for formats, official locations and checksums.
"""

from .common import DatasetError
from .lra import LRA_TASKS, LRATask, build_dataset, collate, get_task

__all__ = ["DatasetError", "LRA_TASKS", "LRATask", "build_dataset", "collate", "get_task"]
