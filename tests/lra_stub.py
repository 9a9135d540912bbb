"""An in-memory stand-in for ``longattn.data.lra`` (same API) so training tests need no data files.

Examples are random tokens of random length; the label is whether most tokens lie in the upper
half of the vocabulary, which a tiny model learns in a few dozen steps.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import SimpleNamespace

import torch


@dataclass(frozen=True)
class StubTask:
    name: str
    vocab_size: int = 16
    num_classes: int = 2
    max_len: int = 24
    dual: bool = False
    pad_id: int = 0


TASKS = {
    "listops": StubTask("listops"),
    "image": StubTask("image"),
    "retrieval": StubTask("retrieval", dual=True),
    # longer, for analyses of token matrices at ranks up to 16 (S^3 Table 14 on Text and Pathfinder)
    "text": StubTask("text", max_len=48),
    "pathfinder": StubTask("pathfinder", max_len=48),
}


class StubDataset(torch.utils.data.Dataset):
    def __init__(self, task: StubTask, split: str, num_examples: int = 64, min_length: int = 8,
                 max_length: int | None = None, seed: int = 0, noise_amplitude: float = 0.0) -> None:
        longest = min(task.max_len, max_length or task.max_len)
        min_length = min(min_length, longest)
        g = torch.Generator().manual_seed(seed * 1000 + ("train", "val", "test").index(split))
        self.dual = task.dual
        self.items = []
        for _ in range(num_examples):
            docs = []
            for _ in range(2 if task.dual else 1):
                length = int(torch.randint(min_length, longest + 1, (1,), generator=g))
                docs.append(torch.randint(0, task.vocab_size, (length,), generator=g))
            votes = [bool((d >= task.vocab_size // 2).float().mean() > 0.5) for d in docs]
            label = int(votes[0] == votes[1]) if task.dual else int(votes[0])
            if task.dual:
                self.items.append({"tokens0": docs[0], "tokens1": docs[1], "label": label})
            else:
                self.items.append({"tokens": docs[0], "label": label})

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, i: int) -> dict:
        return self.items[i]


def get_task(name: str) -> StubTask:
    return TASKS[name]


def build_dataset(name: str, split: str = "train", data_dir=None, **options) -> StubDataset:
    return StubDataset(TASKS[name], split, **options)


def _pad(seqs: list[torch.Tensor], pad_to: int | None) -> tuple[torch.Tensor, torch.Tensor]:
    width = pad_to or max(len(s) for s in seqs)
    tokens = torch.zeros(len(seqs), width, dtype=torch.long)
    mask = torch.zeros(len(seqs), width, dtype=torch.bool)
    for row, seq in enumerate(seqs):
        tokens[row, : len(seq)] = seq
        mask[row, : len(seq)] = True
    return tokens, mask


def collate(items: list[dict], pad_to: int | None = None) -> dict:
    label = torch.tensor([it["label"] for it in items], dtype=torch.long)
    if "tokens0" in items[0]:
        t0, m0 = _pad([it["tokens0"] for it in items], pad_to)
        t1, m1 = _pad([it["tokens1"] for it in items], pad_to)
        return {"tokens0": t0, "attention_mask0": m0, "tokens1": t1, "attention_mask1": m1, "label": label}
    tokens, mask = _pad([it["tokens"] for it in items], pad_to)
    return {"tokens": tokens, "attention_mask": mask, "label": label}


API = SimpleNamespace(get_task=get_task, build_dataset=build_dataset, collate=collate, LRA_TASKS=TASKS)
