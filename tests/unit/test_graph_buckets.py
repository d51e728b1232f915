"""Which CUDA graph a decode step replays: every row count up to the slot count has one."""

from __future__ import annotations

import pytest

from loopserve.runner.cuda_graphs import ROW_BUCKETS, row_bucket


@pytest.mark.parametrize("max_rows", [1, 3, 8, 40, 100, 256, 600])
def test_every_step_up_to_the_slot_count_replays_a_graph_that_holds_it(max_rows: int) -> None:
    buckets = [row_bucket(rows, max_rows) for rows in range(1, max_rows + 1)]
    assert all(rows <= bucket <= max_rows for rows, bucket in enumerate(buckets, 1))
    assert buckets[-1] == max_rows  # the top bucket is the slot count itself
    assert set(buckets) <= {*ROW_BUCKETS, max_rows}
    assert buckets == sorted(buckets)


def test_forty_slots_give_steps_over_32_rows_a_graph_of_40() -> None:
    assert [row_bucket(rows, 40) for rows in (1, 3, 17, 32, 33, 40)] == [1, 4, 24, 32, 40, 40]


@pytest.mark.parametrize("rows", [0, 41])
def test_rows_outside_the_slots_are_refused(rows: int) -> None:
    with pytest.raises(ValueError, match="slots"):
        row_bucket(rows, 40)
