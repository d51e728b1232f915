"""The depth policy and the KV layouts on their own: one definition, for ints and tensors alike."""

from __future__ import annotations

import pytest
import torch

from loopserve.depth import policy
from loopserve.depth.policy import ExitMode, RowDepth, Scheduling, SlotRule, slot_rule
from loopserve.kv.layout import KVLayout


@pytest.mark.parametrize("layout", list(KVLayout))
def test_layout_rules_agree_on_ints_and_tensors(layout: KVLayout) -> None:
    loops = torch.tensor([1, 2, 3, 4, 2])
    max_loops = torch.tensor([4, 4, 4, 4, 3])
    planes = layout.decode_plane(loops, max_loops)
    assert planes.tolist() == [
        layout.decode_plane(int(loop), int(top)) for loop, top in zip(loops, max_loops, strict=True)
    ]
    plane = torch.arange(4)[None, :]
    targets = KVLayout.copy_on_exit_target(plane, loops[:, None], max_loops[:, None])
    for row, (loop, top) in enumerate(zip(loops.tolist(), max_loops.tolist(), strict=True)):
        expected = [bool(KVLayout.copy_on_exit_target(p, loop, top)) for p in range(4)]
        assert targets[row].tolist() == expected


def test_layout_planes_and_pages() -> None:
    full, shared = KVLayout.FULL, KVLayout.SHARED
    assert full.decode_plane(2, 4) == 1 and shared.decode_plane(2, 4) == 3
    assert list(full.generated_planes(4)) == [0, 1, 2, 3] and list(shared.generated_planes(4)) == [
        3
    ]
    assert list(full.prompt_only_planes(4)) == [] and list(shared.prompt_only_planes(4)) == [
        0,
        1,
        2,
    ]
    # A token that exited after loop 2 of 4 is copied into planes 2 and 3.
    assert [p for p in range(4) if KVLayout.copy_on_exit_target(p, 2, 4)] == [2, 3]
    assert full.copies_on_exit and not shared.copies_on_exit
    # 40 prompt tokens + 29 generated positions, pages of 16: 5 pages per full plane, 3 for a
    # prompt-only plane.
    assert full.pages_needed(4, 40, 69, 16) == 4 * 5
    assert shared.pages_needed(4, 40, 69, 16) == 3 * 3 + 5


def test_slot_rules() -> None:
    assert slot_rule(ExitMode.TRACE, 0.5) is SlotRule.TRACE
    assert slot_rule(ExitMode.OURO, 1.0) is SlotRule.FIXED
    assert slot_rule(ExitMode.OURO_DELAYED, 1.0) is SlotRule.FIXED
    assert slot_rule(ExitMode.OURO, 0.7) is SlotRule.GATE
    assert slot_rule(ExitMode.OURO_DELAYED, 0.7) is SlotRule.DELAYED_GATE


def rows(**columns: list) -> RowDepth:  # type: ignore[type-arg]
    count = len(next(iter(columns.values())))
    defaults = {
        "loop": [1] * count,
        "min_loops": [1] * count,
        "max_loops": [4] * count,
        "rule": [SlotRule.GATE] * count,
        "threshold": [0.5] * count,
        "survival": [1.0] * count,
        "stop_next": [False] * count,
        "trace_depth": [4] * count,
    }
    merged = defaults | columns
    dtypes = {"threshold": torch.float32, "survival": torch.float32, "stop_next": torch.bool}
    return RowDepth(
        **{
            name: torch.tensor(values, dtype=dtypes.get(name, torch.int64))
            for name, values in merged.items()
        }
    )


GATE, DELAYED = SlotRule.GATE, SlotRule.DELAYED_GATE


def test_after_loop_decides_each_rule() -> None:
    row = rows(
        rule=[GATE, GATE, DELAYED, DELAYED, SlotRule.TRACE, SlotRule.FIXED, SlotRule.FIXED, GATE],
        loop=[2, 2, 2, 3, 2, 3, 4, 1],
        stop_next=[False, False, False, True, False, False, False, False],
        trace_depth=[4, 4, 4, 4, 2, 4, 4, 4],
        min_loops=[1, 3, 1, 1, 1, 1, 1, 1],
    )
    ran = torch.tensor([True] * 7 + [False])
    hazard = torch.full((8,), 0.6)
    outcome = policy.after_loop(row, ran, hazard)
    # gate: CDF 0.6 >= 0.5 exits; below min_loops it does not; delayed: the test holds but the
    # token goes one loop deeper, then exits; trace at its depth; fixed only at max_loops; a row
    # that did not run never exits.
    assert outcome.exited.tolist() == [True, False, False, True, True, False, True, False]
    assert outcome.test.tolist() == [True, False, True, False, False, False, False, False]
    following = policy.advance(
        row, ran, torch.zeros(8, dtype=torch.bool), outcome, Scheduling.REFILL
    )
    assert following.loop.tolist() == [1, 3, 3, 1, 1, 4, 1, 1]
    assert following.stop_next.tolist() == [False, False, True, False, False, False, False, False]
    assert following.survival[0] == 1.0 and following.survival[1] == pytest.approx(0.4)


def test_no_refill_holds_exited_rows_until_the_cohort_drains() -> None:
    active = torch.tensor([True, True, True])
    waiting = torch.tensor([True, False, False])
    ran, still = policy.runs(active, waiting, Scheduling.NO_REFILL)
    assert ran.tolist() == [False, True, True] and still.tolist() == [True, False, False]
    ran, still = policy.runs(active, torch.tensor([True, True, True]), Scheduling.NO_REFILL)
    assert ran.tolist() == [True, True, True] and not still.any()
    ran, _ = policy.runs(active, waiting, Scheduling.REFILL)
    assert ran.tolist() == [False, True, True]
