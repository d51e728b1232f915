"""The pinned swap space's page ranges: first fit, merged on return, never handed out twice."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from loopserve.runner.swap import HostPagePool


def test_first_fit_then_merge_back_to_one_range() -> None:
    pool = HostPagePool(10)
    assert [pool.take(3), pool.take(3), pool.take(3)] == [0, 3, 6]
    assert pool.take(2) is None  # one page left
    pool.give_back(3, 3)
    assert pool.take(4) is None and pool.take(2) == 3  # the hole, first fit
    pool.give_back(0, 3)
    pool.give_back(3, 2)
    pool.give_back(6, 3)
    assert pool.num_free == 10 and pool.take(10) == 0


def test_an_empty_pool_fits_nothing() -> None:
    assert HostPagePool(0).take(1) is None


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.booleans(), st.integers(1, 12)), max_size=60))
def test_ranges_never_overlap_and_all_come_back(ops: list[tuple[bool, int]]) -> None:
    pool, taken, owner = HostPagePool(40), [], [None] * 40
    for take, count in ops:
        if take or not taken:
            start = pool.take(count)
            if start is None:
                continue
            assert all(owner[page] is None for page in range(start, start + count))
            owner[start : start + count] = [len(taken)] * count
            taken.append((start, count))
        else:
            start, count = taken.pop(count % len(taken))
            owner[start : start + count] = [None] * count
            pool.give_back(start, count)
        assert pool.num_free == owner.count(None)
    for start, count in taken:
        pool.give_back(start, count)
    assert pool.take(40) == 0
