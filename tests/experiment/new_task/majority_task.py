"""A new classification task in one module (with its preset beside it): nothing else in longattn changes.

Label = whether most bits of a random bit string are ones. Registered on import; the command line
imports it through LONGATTN_PLUGINS (or put the module into longattn/tasks/ to ship it).
"""

from pathlib import Path

import torch
from torch.utils.data import Dataset

from longattn.tasks import register_task
from longattn.tasks.classification import ClassificationTask


class MajorityBits(Dataset):
    def __init__(self, split: str, num_examples: int = 64, length: int = 15, seed: int = 0) -> None:
        g = torch.Generator().manual_seed(seed * 10 + ("train", "val", "test").index(split))
        self.items = []
        for _ in range(num_examples):
            bits = torch.randint(0, 2, (length,), generator=g)
            self.items.append({"tokens": bits, "label": int(bits.sum() * 2 > length)})

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, index: int) -> dict:
        return self.items[index]


@register_task("majority", description="majority of a bit string (a demonstration task)")
class MajorityTask(ClassificationTask):
    vocab_size = 2
    num_classes = 2
    max_len = 32
    preset_dir = Path(__file__).parent / "majority_presets"

    def build_split(self, config, split, **options):
        return MajorityBits(split, seed=config.seed, **options)
