"""Statistics over seeds for every grid table (compare, sweep, noise, forecast-table).

Per cell: the mean, the sample standard deviation (n - 1) and the standard error (std / sqrt(n)) over seeds.
Between two rows: the paired difference over the seeds both have, with a Student t confidence interval
(``scipy.stats.ttest_rel``).

Why the paired t interval: two runs of a grid with the same seed train on the same data in the same order
(the loader's order depends only on the seed, the dataset size and the batch size; every run records it as
``data_order``) and are tested on the same examples, so taking the difference seed by seed removes the
part of the run-to-run variation the two runs share. The papers report 3 to 5 seeds, too few for a rank
test: with n pairs the two-sided Wilcoxon signed-rank test cannot give p below 2 / 2**n (0.25 at 3 seeds,
0.0625 at 5), so it could never call a difference significant at 5%. The t interval assumes the per-seed
differences are roughly normal, which differences of accuracies averaged over hundreds of test examples
are. No correction for multiple comparisons: each row is its own question against the reference.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import asdict, dataclass, fields
from typing import Any, Mapping, Sequence

from longattn.utils import optional_import

__all__ = ["CONFIDENCE", "NOT_SIGNIFICANT", "PairedDifference", "Summary", "format_difference", "format_sem", "legend",
           "mean_std", "mean_with_sem", "paired_difference", "summarize"]

CONFIDENCE = 0.95  # of every interval in the tables
NOT_SIGNIFICANT = "n.s."  # the table's mark for an interval that contains 0


@dataclass(frozen=True)
class Summary:
    """Mean, sample standard deviation and standard error of one cell over its seeds (NaN where undefined)."""

    n: int
    mean: float
    std: float
    sem: float

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def summarize(values: Sequence[float]) -> Summary:
    """``Summary`` of ``values``; the standard deviation and error need at least 2 values (else NaN)."""
    n = len(values)
    if n == 0:
        return Summary(0, math.nan, math.nan, math.nan)
    mean = statistics.fmean(values)
    if n == 1:
        return Summary(1, mean, math.nan, math.nan)
    std = statistics.stdev(values)
    return Summary(n, mean, std, std / math.sqrt(n))


@dataclass(frozen=True)
class PairedDifference:
    """Mean of (candidate - reference) over shared seeds, its ``confidence`` t interval and p-value."""

    seeds: list[int]
    mean: float
    low: float
    high: float
    p_value: float
    confidence: float = CONFIDENCE

    @property
    def n(self) -> int:
        return len(self.seeds)

    @property
    def significant(self) -> bool:
        """The interval excludes 0 (a single seed has no interval, so nothing is significant)."""
        return self.n >= 2 and not (self.low <= 0.0 <= self.high)

    def as_dict(self) -> dict[str, Any]:
        return {**asdict(self), "n": self.n, "significant": self.significant}

    @classmethod
    def from_dict(cls, saved: Mapping[str, Any]) -> "PairedDifference":
        """The difference :meth:`as_dict` wrote (results.json), without its derived ``n`` and ``significant``."""
        return cls(**{f.name: saved[f.name] for f in fields(cls)})


def paired_difference(candidate: Mapping[int, float], reference: Mapping[int, float],
                      confidence: float = CONFIDENCE) -> PairedDifference | None:
    """Paired difference candidate - reference over the seeds both have (``None`` when they share none)."""
    seeds = sorted(set(candidate) & set(reference))
    if not seeds:
        return None
    ours = [candidate[s] for s in seeds]
    theirs = [reference[s] for s in seeds]
    differences = [a - b for a, b in zip(ours, theirs)]
    mean = statistics.fmean(differences)
    if len(seeds) == 1:
        return PairedDifference(seeds, mean, math.nan, math.nan, math.nan, confidence)
    if max(differences) == min(differences):
        # No spread (e.g. identical runs): t is undefined; the interval is the point itself.
        return PairedDifference(seeds, mean, mean, mean, 1.0 if mean == 0 else 0.0, confidence)
    result = optional_import("scipy.stats").ttest_rel(ours, theirs)
    interval = result.confidence_interval(confidence_level=confidence)
    return PairedDifference(seeds, mean, float(interval.low), float(interval.high), float(result.pvalue),
                            confidence)


def mean_std(values: Sequence[float], digits: int = 2) -> str:
    """'mean ± std' of a cell (just the value for one seed, '-' for none)."""
    summary = summarize(values)
    if summary.n == 0:
        return "-"
    if summary.n == 1:
        return f"{summary.mean:.{digits}f}"
    return f"{summary.mean:.{digits}f} ± {summary.std:.{digits}f}"


def format_sem(values: Sequence[float], digits: int = 2) -> str:
    """The standard error of a cell ('-' with fewer than 2 seeds)."""
    summary = summarize(values)
    return "-" if math.isnan(summary.sem) else f"{summary.sem:.{digits}f}"


def mean_with_sem(values: Sequence[float], digits: int = 2) -> str:
    """'mean ± std (standard error)' of a cell, for tables with one column per task."""
    text = mean_std(values, digits)
    return text if len(values) < 2 else f"{text} ({format_sem(values, digits)})"


def format_difference(difference: PairedDifference | None, digits: int = 2) -> str:
    """'+1.20 [-0.50, +2.90] n.s.': the paired difference, its interval, and the mark when it contains 0.

    At least ``digits`` decimals, more (up to ``digits`` + 4) while a non-empty interval is narrower than the last
    one, so that a small but significant difference does not print as '+0.000 [+0.000, +0.000]'."""
    if difference is None:
        return "-"
    if difference.n < 2:
        return f"{difference.mean:+.{digits}f} (1 seed: no interval)"
    width, most = difference.high - difference.low, digits + 4
    while digits < most and 0 < width < 10.0 ** -digits:  # a zero-width interval is exact as it is
        digits += 1
    mean = f"{difference.mean:+.{digits}f}"
    mark = "" if difference.significant else f" {NOT_SIGNIFICANT}"
    return f"{mean} [{difference.low:+.{digits}f}, {difference.high:+.{digits}f}]{mark}"


def legend(reference: str, confidence: float = CONFIDENCE) -> str:
    """One line under a table saying what the difference column means."""
    level = f"{100 * confidence:g}%"
    return (f"Δ: paired difference from {reference} over the same seeds (same data order), with its {level} "
            f"Student t interval; {NOT_SIGNIFICANT} = the interval contains 0 (not significant at "
            f"{100 - 100 * confidence:g}%).")
