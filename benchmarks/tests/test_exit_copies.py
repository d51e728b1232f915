"""The `full` layout's copy count, by hand."""

from __future__ import annotations

import pytest

from benchmarks.exit_copies import count_copies


def test_copies_by_hand() -> None:
    # Two pages of 2 tokens, 4 loops. Page 1: depths (1, 2); page 2: (4, 3).
    record = count_copies([1, 2, 4, 3], num_loops=4, block_size=2)
    # Copy slots: depth 1 -> planes 1, 2, 3; depth 2 -> planes 2, 3; depth 3 -> plane 3.
    assert record["copy_slot_fraction"] == pytest.approx(6 / 16)
    # Pure copies: page 1 in planes 2 and 3 (max depth 2); page 2 in none.
    assert (record["pure_copy_pages"], record["pages"]) == (2, 8)
