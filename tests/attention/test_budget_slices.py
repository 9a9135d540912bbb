import pytest

from longattn.attention.base import budget_slices


@pytest.mark.parametrize("count, item, budget", [(5, 3, 6), (5, 3, 7), (6, 3, 6), (5, 3, 100), (5, 3, 2), (1, 0, 4),
                                                 (0, 3, 6)])
def test_slices_cover_every_item_once_within_the_budget(count, item, budget):
    slices = budget_slices(count, item, budget)
    assert [i for s in slices for i in range(count)[s]] == list(range(count))
    size = max(1, budget // max(1, item))
    assert [s.stop - s.start for s in slices] == [size] * (count // size) + [count % size] * (count % size > 0)
    # within the budget, unless one item alone exceeds it
    assert all((s.stop - s.start) * item <= max(budget, item) for s in slices)
