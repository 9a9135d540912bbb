"""The thread policy of the grid commands: workers x threads never more than the cores given (affinity, cgroup
quota) or the budget OMP_NUM_THREADS sets, one thread per run of a grid unless --workers says otherwise."""

from __future__ import annotations

import pytest

from longattn.experiment.threads import cgroup_quota, env_threads, given_cores, plan_threads


@pytest.mark.parametrize("affinity, quota, env, workers, runs, expected", [
    (2, None, {}, None, 21, (2, 1)),  # the README's job on a 2-core machine: two runs at once, one thread each
    (16, None, {}, None, 21, (16, 1)),
    (16, 4.0, {}, None, 21, (4, 1)),  # a container's --cpus 4 on a 16-core host
    (16, 1.5, {}, None, 21, (1, 1)),  # a fractional quota rounds down: never more busy threads than it allows
    (8, None, {}, None, 3, (3, 1)),  # fewer runs than cores: one per run
    (8, None, {}, None, 1, (1, 8)),  # a single run uses every core
    (8, None, {"OMP_NUM_THREADS": "1"}, None, 21, (1, 1)),  # the user's budget wins over the cores
    (2, None, {"OMP_NUM_THREADS": "4"}, None, 21, (4, 1)),
    (2, None, {"OMP_NUM_THREADS": "2"}, 2, 21, (2, 1)),  # the workaround: an even share
    (16, None, {}, 4, 21, (4, 4)),
    (16, 2.0, {}, 1, 21, (1, 2)),  # --workers 1: one run at a time with the cores given
    (4, None, {"OMP_NUM_THREADS": ""}, 3, 2, (2, 2)),  # empty: unset; never more workers than runs
])
def test_workers_and_threads_fit_the_cores_given(affinity, quota, env, workers, runs, expected):
    plan = plan_threads(runs, workers=workers, environ=env, affinity=affinity, quota=quota)
    assert (plan.workers, plan.threads) == expected
    assert plan.workers * plan.threads <= plan.budget
    assert plan.describe().startswith(f"threads: {'1 run at a time' if expected[0] == 1 else f'{expected[0]} runs at once'}")


def test_the_first_line_says_where_the_budget_came_from():
    assert "OMP_NUM_THREADS=3" in plan_threads(5, environ={"OMP_NUM_THREADS": "3"}, affinity=8, quota=None).describe()
    line = plan_threads(5, environ={}, affinity=8, quota=2.5).describe()
    assert "2 cores given: affinity 8, cgroup quota 2.5 cores" in line
    crowded = plan_threads(8, workers=4, environ={}, affinity=2, quota=None).describe()
    assert "4 threads on 2: oversubscribed, as --workers asked" in crowded


@pytest.mark.parametrize("text", ["0", "-2", "two", "1.5"])
def test_a_bad_omp_num_threads_is_named(text):
    with pytest.raises(ValueError, match="OMP_NUM_THREADS must be a whole number"):
        env_threads({"OMP_NUM_THREADS": text})


def test_a_bad_workers_count_is_refused():
    with pytest.raises(ValueError, match="--workers must be at least 1"):
        plan_threads(3, workers=0, environ={}, affinity=2, quota=None)


@pytest.mark.parametrize("files, expected", [
    ({"cpu.max": "max 100000\n"}, None),
    ({"cpu.max": "150000 100000\n"}, 1.5),
    ({"cpu/cpu.cfs_quota_us": "-1\n", "cpu/cpu.cfs_period_us": "100000\n"}, None),
    ({"cpu/cpu.cfs_quota_us": "300000\n", "cpu/cpu.cfs_period_us": "100000\n"}, 3.0),
    ({}, None),
])
def test_cgroup_quota_of_v1_and_v2(tmp_path, files, expected):
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    assert cgroup_quota(tmp_path) == expected


def test_given_cores_never_below_one():
    assert given_cores(4, 0.5) == 1
    assert given_cores(4, None) == 4
    assert given_cores(4, 8.0) == 4


def test_a_single_run_uses_the_whole_budget():
    assert (plan_threads(1, grid=False, environ={}, affinity=8, quota=6.0).threads) == 6
    assert (plan_threads(1, grid=False, environ={"OMP_NUM_THREADS": "3"}, affinity=8, quota=None).threads) == 3
