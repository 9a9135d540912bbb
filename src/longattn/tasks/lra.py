"""The five Long Range Arena tasks (Tay et al. 2021), on the data of :mod:`longattn.data.lra`.

Presets live in ``configs/lra/<task>/<preset>.yaml`` (``standard``: Nystromformer's LRA settings, which
the papers build on; ``demo``: minutes on a laptop; the papers' own tables). The data module can be
swapped (``task.data_api = module_with(get_task, build_dataset, collate)``), which the tests use.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import longattn.data.lra as lra_data
from longattn.tasks.base import register_task
from longattn.tasks.classification import ClassificationTask

LRA_CONFIGS = Path(__file__).resolve().parents[1] / "configs" / "lra"


class LRATask(ClassificationTask):
    family = "lra"
    data_api: Any = lra_data

    @property
    def _meta(self) -> Any:
        return self.data_api.get_task(self.name)

    vocab_size = property(lambda self: self._meta.vocab_size)  # type: ignore[assignment]
    num_classes = property(lambda self: self._meta.num_classes)  # type: ignore[assignment]
    max_len = property(lambda self: self._meta.max_len)  # type: ignore[assignment]
    dual = property(lambda self: self._meta.dual)  # type: ignore[assignment]

    @property
    def preset_dir(self) -> Path:  # type: ignore[override]
        return LRA_CONFIGS / self.name

    def build_split(self, config: Any, split: str, **options: Any) -> Any:
        return self.data_api.build_dataset(self.name, split=split, data_dir=config.data.data_dir, **options)

    def collate_items(self, items: list[Any], pad_to: int | None = None) -> Any:
        return self.data_api.collate(items, pad_to=pad_to)


for _name, _text in (("listops", "ListOps: nested list operations, 10 classes (up to 2k tokens)"),
                     ("text", "byte-level IMDb sentiment (up to 4k bytes)"),
                     ("retrieval", "byte-level AAN citation matching, two documents (4k bytes each)"),
                     ("image", "CIFAR-10 as 1024 grey-level pixels"),
                     ("pathfinder", "Pathfinder-32: are the two dots connected? (1024 pixels)")):
    register_task(_name, description=_text)(type(f"LRA_{_name}", (LRATask,), {"description": _text}))
