"""Seed statistics of the grid tables, on constructed data whose answer is known."""

from __future__ import annotations

import json
import math

import pytest

from longattn.experiment.stats import (
    NOT_SIGNIFICANT,
    PairedDifference,
    format_difference,
    mean_std,
    mean_with_sem,
    paired_difference,
    summarize,
)

# Student t quantile t_{0.975} with 3 degrees of freedom (printed tables), for a hand-computed interval.
T_975_DF3 = 3.182446


def test_summary_is_mean_sample_std_and_standard_error():
    summary = summarize([1.0, 2.0, 3.0, 6.0])
    assert summary.n == 4 and summary.mean == pytest.approx(3.0)
    assert summary.std == pytest.approx(math.sqrt(14 / 3))  # n - 1 in the denominator
    assert summary.sem == pytest.approx(math.sqrt(14 / 3) / 2)
    one = summarize([5.0])
    assert one.mean == 5.0 and math.isnan(one.std) and math.isnan(one.sem)
    assert summarize([]).n == 0
    assert mean_std([1.0, 2.0, 3.0, 6.0]) == "3.00 ± 2.16" and mean_std([5.0]) == "5.00" and mean_std([]) == "-"
    assert mean_with_sem([1.0, 2.0, 3.0, 6.0]) == "3.00 ± 2.16 (1.08)"


def test_paired_interval_is_the_student_t_interval_of_the_differences():
    reference = {0: 30.0, 1: 40.0, 2: 35.0, 3: 45.0}
    shifts = {0: 2.0, 1: 3.0, 2: 1.0, 3: 4.0}
    candidate = {seed: reference[seed] + shifts[seed] for seed in reference}
    difference = paired_difference(candidate, reference)
    sd = summarize(list(shifts.values())).std
    half = T_975_DF3 * sd / 2
    assert difference.mean == pytest.approx(2.5)
    assert (difference.low, difference.high) == pytest.approx((2.5 - half, 2.5 + half), rel=1e-5)
    # the shared part of the noise (reference spread of 15 points) cancels: the shift is significant
    assert difference.significant and NOT_SIGNIFICANT not in format_difference(difference)
    assert difference.p_value < 0.05
    # what results.json holds reads back as the same difference
    saved = json.loads(json.dumps(difference.as_dict()))
    assert PairedDifference.from_dict(saved) == difference


def test_a_difference_within_the_seed_noise_is_marked_not_significant():
    reference = {0: 30.0, 1: 40.0, 2: 35.0}
    candidate = {0: 31.0, 1: 39.0, 2: 35.5}  # differences +1, -1, +0.5
    difference = paired_difference(candidate, reference)
    assert difference.low < 0 < difference.high and not difference.significant
    assert format_difference(difference).endswith(NOT_SIGNIFICANT)


def test_only_shared_seeds_are_paired_and_one_seed_has_no_interval():
    difference = paired_difference({0: 1.0, 1: 2.0, 5: 9.0}, {1: 1.0, 2: 0.0})
    assert difference.seeds == [1] and difference.mean == 1.0 and not difference.significant
    assert "no interval" in format_difference(difference)
    assert paired_difference({0: 1.0}, {1: 1.0}) is None and format_difference(None) == "-"


def test_identical_runs_differ_by_zero_and_a_constant_shift_is_significant():
    same = paired_difference({0: 1.0, 1: 2.0}, {0: 1.0, 1: 2.0})
    assert same.mean == 0 and not same.significant
    shifted = paired_difference({0: 2.0, 1: 3.0}, {0: 1.0, 1: 2.0})
    assert shifted.low == shifted.high == 1.0 and shifted.significant
    # a zero-width interval keeps the digits asked for
    assert format_difference(same) == "+0.00 [+0.00, +0.00] n.s."
    assert format_difference(shifted) == "+1.00 [+1.00, +1.00]"


def test_a_narrow_interval_gets_the_decimals_that_show_it():
    """Two seeds differing by +0.00026 and +0.00028 (significant) print with the decimals that separate the bounds,
    not as '+0.000 [+0.000, +0.000]'; a wide interval keeps the digits asked for."""
    narrow = paired_difference({0: 0.19323, 1: 0.18946}, {0: 0.19297, 1: 0.18918})
    assert narrow.significant
    assert format_difference(narrow, digits=3) == f"{narrow.mean:+.4f} [{narrow.low:+.4f}, {narrow.high:+.4f}]"
    wide = paired_difference({0: 0.5, 1: 0.7, 2: 0.6}, {0: 0.1, 1: 0.2, 2: 0.3})
    assert format_difference(wide, digits=3) == f"{wide.mean:+.3f} [{wide.low:+.3f}, {wide.high:+.3f}]"
