"""Multi-query associative recall (MQAR), generated as Zoology defines it (Arora et al. 2023, "Zoology:
Measuring and Improving Recall in Efficient Language Models", the ``multiquery_ar`` generator of
HazyResearch/zoology, re-implemented here).

One sequence of ``seq_len`` tokens over a vocabulary of ``vocab_size`` (8,192 in the paper):

* the context: ``num_kv_pairs`` pairs ``k_1 v_1 k_2 v_2 ...``; the keys are distinct and drawn from the
  first half of the vocabulary without token 0, ``[1, vocab_size // 2)``, the values are distinct and drawn
  from the second half, ``[vocab_size // 2, vocab_size)``;
* the query region (the rest): key ``k_j`` appears once more at position ``2 K + 2 g_j``, where the query
  slots ``g_1, g_2, ...`` are drawn without replacement from ``0 .. S - 1`` (``S = (seq_len - 2 K) // 2``)
  with probability proportional to ``(g + 1) ** (power_a - 1)``: a power law that puts most queries close
  to the context, as repeated bigrams are close in real text (``power_a = 0.01``: nearly ``1 / (g + 1)``).
  Zoology draws the slots one after another (``numpy.random.choice(replace=False, p=...)``), so the first
  key's slot follows the power law exactly and later ones follow it among the slots left; here the same
  successive sampling is drawn in one vectorised step (exponential clocks ``E_g / p_g``, smallest first:
  Efraimidis & Spirakis 2006, the same distribution, draw order included);
* every other position of the query region holds token 0, or (``random_non_queries``) a token drawn
  uniformly from the whole vocabulary, as Zoology's option of that name. Zoology's Figure 2 configs use 0.

The target of the query at position ``q`` is the value paired with the key there. A causal model reads
position ``q`` and predicts it as the next token (Zoology's labels are the inputs shifted by one, with the
value in place of the token after the query); the answer is never written into the input outside its pair
in the context, so a bidirectional model that reads the whole sequence cannot see it either.

The generator is deterministic per seed (numpy's ``default_rng``), vectorised, and needs
``4 * num_kv_pairs <= seq_len`` (Zoology's condition: a context of ``2 K`` tokens and room for ``K`` queries
at even offsets).

A dataset may hold several such segments of different ``(seq_len, num_kv_pairs)`` (Zoology's training
mixtures: its ``DataConfig.train_configs`` is a list). :func:`collate` pads a batch that mixes them: tokens to
the batch's longest sequence with the filler, queries to a common width with :data:`IGNORE` answers (not
scored); a batch of one segment is not padded.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np
import torch
from torch import Tensor
from torch.utils.data import Dataset

__all__ = ["FILLER", "IGNORE", "MQARDataset", "MQARExamples", "collate", "gap_probabilities", "multiquery_ar"]

FILLER = 0  # the token of the query region's empty positions (never a key: keys start at 1)
IGNORE = -100  # the answer of a padded query slot (cross-entropy's ignore_index): not scored
_ROWS_PER_CHUNK = 1024  # rows drawn at once by the without-replacement samplers (bounds their memory)


def gap_probabilities(space: int, power_a: float) -> np.ndarray:
    """Zoology's query-slot distribution: ``p_g`` proportional to ``(g + 1) ** (power_a - 1)``, g = 0..space-1."""
    if space < 1:
        raise ValueError(f"the query region needs at least one slot, got {space}")
    if not power_a > 0:
        raise ValueError(f"power_a must be positive, got {power_a}")
    weights = np.arange(1, space + 1, dtype=np.float64) ** (power_a - 1.0)
    return weights / weights.sum()


def _sample_without_replacement(rng: np.random.Generator, rows: int, size: int, count: int,
                                probabilities: np.ndarray | None = None) -> np.ndarray:
    """``rows`` independent ordered samples of ``count`` distinct items of ``0 .. size - 1`` [rows, count].

    Successive sampling in proportion to ``probabilities``: each item gets an exponential clock of rate ``p``
    and the ``count`` first to ring are taken in the order they ring, which is the law of drawing one item at a
    time in proportion to the weights of those left (numpy's ``choice(replace=False, p=...)``). Uniform
    (``probabilities`` None): a uniformly random ordered subset, drawn as ``count`` independent items with the
    rows that repeat one drawn again while repeats are rare (cheaper than ``size`` clocks a row).
    """
    if probabilities is None and count * count <= size:  # a row repeats an item with probability < 1/2
        out = rng.integers(0, size, size=(rows, count))
        repeats = np.arange(rows)
        while len(repeats := repeats[_has_repeat(out[repeats])]):
            out[repeats] = rng.integers(0, size, size=(len(repeats), count))
        return out
    out = np.empty((rows, count), dtype=np.int64)
    for start in range(0, rows, _ROWS_PER_CHUNK):
        stop = min(rows, start + _ROWS_PER_CHUNK)
        clocks = rng.standard_exponential((stop - start, size))
        if probabilities is not None:
            clocks /= probabilities
        first = np.argpartition(clocks, count - 1, axis=1)[:, :count]
        order = np.argsort(np.take_along_axis(clocks, first, axis=1), axis=1, kind="stable")
        out[start:stop] = np.take_along_axis(first, order, axis=1)
    return out


def _has_repeat(rows: np.ndarray) -> np.ndarray:
    ordered = np.sort(rows, axis=1)
    return (ordered[:, 1:] == ordered[:, :-1]).any(axis=1)


@dataclass(frozen=True)
class MQARExamples:
    """Generated examples: ``inputs`` [n, seq_len] (int16), the query positions and their answers [n, K]."""

    inputs: Tensor
    query_positions: Tensor
    answers: Tensor
    vocab_size: int
    num_kv_pairs: int

    def __len__(self) -> int:
        return int(self.inputs.shape[0])


def check_settings(seq_len: int, num_kv_pairs: int, vocab_size: int) -> None:
    """The generator's conditions, each refused with the setting to change."""
    if num_kv_pairs < 1:
        raise ValueError(f"num_kv_pairs must be at least 1, got {num_kv_pairs}")
    if seq_len % 2:
        raise ValueError(f"seq_len must be even (queries sit at even offsets of the query region), got {seq_len}")
    if 4 * num_kv_pairs > seq_len:
        raise ValueError(f"seq_len={seq_len} is too short for num_kv_pairs={num_kv_pairs}: the context takes "
                         f"2 * {num_kv_pairs} tokens and the queries need as many again (seq_len >= {4 * num_kv_pairs})")
    keys, values = vocab_size // 2 - 1, vocab_size - vocab_size // 2
    if num_kv_pairs > min(keys, values):
        raise ValueError(f"vocab_size={vocab_size} has {keys} keys and {values} values, fewer than "
                         f"num_kv_pairs={num_kv_pairs} distinct ones")
    if vocab_size > np.iinfo(np.int16).max + 1:
        raise ValueError(f"vocab_size={vocab_size} exceeds the 32,768 token ids the examples are stored in")


def multiquery_ar(num_examples: int, seq_len: int, num_kv_pairs: int, *, vocab_size: int = 8192,
                  power_a: float = 0.01, random_non_queries: bool = False, seed: int | np.random.SeedSequence = 0
                  ) -> MQARExamples:
    """``num_examples`` MQAR sequences (see the module docstring), the same for the same arguments."""
    check_settings(seq_len, num_kv_pairs, vocab_size)
    if num_examples < 0:
        raise ValueError(f"num_examples must be non-negative, got {num_examples}")
    rng = np.random.default_rng(seed)
    half, context = vocab_size // 2, 2 * num_kv_pairs
    keys = 1 + _sample_without_replacement(rng, num_examples, half - 1, num_kv_pairs)
    values = half + _sample_without_replacement(rng, num_examples, vocab_size - half, num_kv_pairs)
    space = (seq_len - context) // 2
    slots = _sample_without_replacement(rng, num_examples, space, num_kv_pairs, gap_probabilities(space, power_a))
    inputs = np.full((num_examples, seq_len), FILLER, dtype=np.int16)
    inputs[:, 0:context:2] = keys
    inputs[:, 1:context:2] = values
    positions = context + 2 * slots
    np.put_along_axis(inputs, positions, keys, axis=1)
    if random_non_queries:
        empty = inputs == FILLER
        inputs[empty] = rng.integers(0, vocab_size, size=int(empty.sum()), dtype=np.int16)
    return MQARExamples(torch.from_numpy(inputs), torch.from_numpy(positions), torch.from_numpy(values),
                        vocab_size, num_kv_pairs)


class MQARDataset(Dataset):
    """Items ``{"tokens", "query_positions", "answers"}`` of one or more generated :class:`MQARExamples`
    segments, in order (the segments may differ in ``seq_len`` and ``num_kv_pairs``)."""

    def __init__(self, examples: MQARExamples | Sequence[MQARExamples]) -> None:
        self.segments = [examples] if isinstance(examples, MQARExamples) else list(examples)
        if not self.segments:
            raise ValueError("an MQAR dataset needs at least one segment of examples")
        self._ends = np.cumsum([len(segment) for segment in self.segments]).tolist()

    def __len__(self) -> int:
        return self._ends[-1]

    def __getitem__(self, index: int) -> dict[str, Tensor]:
        if not -len(self) <= index < len(self):
            raise IndexError(f"index {index} out of range for {len(self)} examples")
        index %= len(self)
        part = bisect.bisect_right(self._ends, index)
        e = self.segments[part]
        index -= self._ends[part - 1] if part else 0
        return {"tokens": e.inputs[index], "query_positions": e.query_positions[index], "answers": e.answers[index]}

    def lengths(self) -> list[int]:
        """Every example's sequence length (``train.group_by_length`` batches equal lengths together)."""
        return [int(e.inputs.shape[1]) for e in self.segments for _ in range(len(e))]


def collate(items: list[dict[str, Any]]) -> dict[str, Tensor]:
    """Stack items into a batch; token ids as int64 (the embedding's index type).

    Items of different lengths are padded: tokens at the end with :data:`FILLER` (after the query region, so a
    causal model's answers do not change), queries to the batch's most with position 0 and answer
    :data:`IGNORE`.
    """
    length = max(len(item["tokens"]) for item in items)
    width = max(len(item["answers"]) for item in items)
    if all(len(item["tokens"]) == length and len(item["answers"]) == width for item in items):
        return {"tokens": torch.stack([item["tokens"] for item in items]).long(),
                "query_positions": torch.stack([item["query_positions"] for item in items]).long(),
                "answers": torch.stack([item["answers"] for item in items]).long()}
    tokens = torch.full((len(items), length), FILLER, dtype=torch.long)
    positions = torch.zeros((len(items), width), dtype=torch.long)
    answers = torch.full((len(items), width), IGNORE, dtype=torch.long)
    for row, item in enumerate(items):
        tokens[row, : len(item["tokens"])] = item["tokens"]
        positions[row, : len(item["answers"])] = item["query_positions"]
        answers[row, : len(item["answers"])] = item["answers"]
    return {"tokens": tokens, "query_positions": positions, "answers": answers}
