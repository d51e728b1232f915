"""Scheduler behaviour with a fake runner: the batching really happens."""

from __future__ import annotations

import pytest

from loopserve.engine.scheduler_output import ExitCheck, SchedulerOutput
from tests.unit.fake_runner import FakeRunner, make_request, make_scheduler, run_to_completion


def loops_by_request(step: SchedulerOutput) -> dict[str, int]:
    return {row.request_id: row.loop for row in step.decode_rows}


def two_request_trace_run(scheduling: str) -> FakeRunner:
    """A exits every token after 1 loop, B after 4."""
    scheduler = make_scheduler(exit_mode="trace", scheduling=scheduling)
    scheduler.add(make_request("A", max_tokens=6, trace_depths=(1,) * 5))
    scheduler.add(make_request("B", max_tokens=3, trace_depths=(4,) * 2))
    runner = FakeRunner()
    run_to_completion(scheduler, runner)
    return runner


def test_one_step_holds_rows_at_different_loops() -> None:
    runner = two_request_trace_run("refill")
    mixed = [s for s in runner.steps if len(set(loops_by_request(s).values())) > 1]
    assert mixed, "no step ever mixed depths"
    assert any(loops_by_request(s) == {"A": 1, "B": 3} for s in runner.steps)


def test_refill_gives_the_freed_row_to_the_next_token_at_once() -> None:
    runner = two_request_trace_run("refill")
    decode_steps = [loops_by_request(s) for s in runner.steps if s.decode_rows]
    # B runs loops 1..4 for its first decode token while A streams a token per step.
    assert decode_steps[:4] == [
        {"A": 1, "B": 1},
        {"A": 1, "B": 2},
        {"A": 1, "B": 3},
        {"A": 1, "B": 4},
    ]


def test_no_refill_makes_exited_rows_wait_for_the_cohort() -> None:
    runner = two_request_trace_run("no_refill")
    decode_steps = [loops_by_request(s) for s in runner.steps if s.decode_rows]
    assert decode_steps[:5] == [{"A": 1, "B": 1}, {"B": 2}, {"B": 3}, {"B": 4}, {"A": 1, "B": 1}]


@pytest.mark.parametrize("scheduling", ["refill", "no_refill"])
def test_a_finished_requests_row_goes_to_a_waiting_request(scheduling: str) -> None:
    scheduler = make_scheduler(exit_mode="trace", scheduling=scheduling, max_num_seqs=2)
    scheduler.add(make_request("A", max_tokens=2, trace_depths=(1,)))
    scheduler.add(make_request("B", max_tokens=3, trace_depths=(4, 4)))
    scheduler.add(make_request("C", max_tokens=2, trace_depths=(1,)))
    runner = FakeRunner()
    run_to_completion(scheduler, runner)
    c_prefill = next(
        i for i, s in enumerate(runner.steps) if any(c.request_id == "C" for c in s.prefill_chunks)
    )
    c_first_decode = next(i for i, s in enumerate(runner.steps) if "C" in loops_by_request(s))
    b_loops_then = loops_by_request(runner.steps[c_first_decode]).get("B")
    if scheduling == "refill":
        assert c_first_decode == c_prefill + 1
        assert b_loops_then is not None and b_loops_then > 1  # C starts while B is mid-token
    else:
        assert b_loops_then in (None, 1)  # C waits for B's cohort to drain


@pytest.mark.parametrize("scheduling", ["refill", "no_refill"])
@pytest.mark.parametrize("layout", ["full", "shared"])
def test_row_loops_executed_equal_the_traced_depths(scheduling: str, layout: str) -> None:
    scheduler = make_scheduler(exit_mode="trace", scheduling=scheduling, kv_layout=layout)
    requests = [make_request(f"r{i}", prompt_len=3 + 7 * i, max_tokens=9) for i in range(5)]
    for request in requests:
        scheduler.add(request)  # no explicit depths: the seeded d2.6 distribution
    run_to_completion(scheduler, FakeRunner())
    traced = sum(sum(request.exit_depths[1:]) for request in requests)
    assert all(len(request.exit_depths) == 9 for request in requests)
    assert scheduler.stats.total_row_loops == traced
    assert len({d for r in requests for d in r.exit_depths[1:]}) > 1
    assert scheduler.stats.mean_rows_per_decode_step > 1.0
    assert scheduler.kv.num_used_pages == 0


def test_exit_checks_per_mode() -> None:
    ouro = make_scheduler(exit_mode="ouro")
    ouro.add(make_request("g", threshold=0.5, max_tokens=2))
    runner = FakeRunner(gate_depth={"g": 2})
    run_to_completion(ouro, runner)
    rows = [row for step in runner.steps for row in step.decode_rows]
    assert [(r.loop, r.exit, r.evaluate_gate) for r in rows] == [
        (1, ExitCheck.IF_GATE, True),
        (2, ExitCheck.IF_GATE, True),
    ]
    delayed = make_scheduler(exit_mode="ouro_delayed")
    delayed.add(make_request("g", threshold=0.5, max_tokens=2))
    runner = FakeRunner(gate_depth={"g": 2})
    run_to_completion(delayed, runner)
    rows = [row for step in runner.steps for row in step.decode_rows]
    assert [(r.loop, r.exit) for r in rows] == [
        (1, ExitCheck.CONTINUE),
        (2, ExitCheck.CONTINUE),
        (3, ExitCheck.EXIT),
    ]


def test_full_layout_copies_the_exit_version_into_deeper_planes() -> None:
    scheduler = make_scheduler(exit_mode="trace", kv_layout="full")
    request = make_request("A", prompt_len=5, max_tokens=3, trace_depths=(2, 2))
    scheduler.add(request)
    runner = FakeRunner()
    run_to_completion(scheduler, runner)
    copies = [copy for step in runner.steps for copy in step.kv_copies]
    assert len(copies) == 1  # the second decode token ends the request: nothing reads it
    # position 5 of plane 1 (loop 2) copied to planes 2 and 3
    (copy,) = copies
    assert copy.source % 16 == 5 and [d % 16 for d in copy.destinations] == [5, 5]
    assert len({copy.source // 16, *(d // 16 for d in copy.destinations)}) == 3


def test_shared_layout_releases_prompt_planes_after_prefill() -> None:
    scheduler = make_scheduler(exit_mode="trace", kv_layout="shared", prefill_chunk_size=4)
    scheduler.add(make_request("A", prompt_len=40, max_tokens=30))
    runner = FakeRunner()
    used = []
    while scheduler.num_unfinished:
        scheduled = scheduler.schedule()
        scheduler.update(scheduled, runner.execute(scheduled))
        used.append(scheduler.kv.num_used_pages)
    # while prefilling all 4 planes grow; afterwards only the final plane remains
    assert max(used) == 4 * 3
    assert used[-2] == 5  # 40 + 29 positions = 69 -> 5 pages
    assert used[-1] == 0


def test_a_request_that_can_never_fit_is_rejected() -> None:
    scheduler = make_scheduler(num_pages=10)
    with pytest.raises(ValueError, match=r"needs 12 KV pages.*only 9"):
        scheduler.add(make_request("big", prompt_len=40, max_tokens=9))
    assert scheduler.num_unfinished == 0


def test_admission_waits_for_pages_and_never_deadlocks() -> None:
    scheduler = make_scheduler(num_pages=13, exit_mode="trace")  # 12 usable: one request at a time
    for index in range(4):
        scheduler.add(make_request(f"r{index}", prompt_len=40, max_tokens=9))
    runner = FakeRunner()
    run_to_completion(scheduler, runner)
    concurrent = max(
        len({c.request_id for c in s.prefill_chunks} | set(loops_by_request(s)))
        for s in runner.steps
    )
    assert concurrent == 1
    assert scheduler.kv.num_used_pages == 0


def test_abort_frees_everything() -> None:
    scheduler = make_scheduler(exit_mode="trace")
    scheduler.add(make_request("A", max_tokens=50))
    scheduler.add(make_request("B", max_tokens=50))
    runner = FakeRunner()
    for _ in range(6):
        scheduled = scheduler.schedule()
        scheduler.update(scheduled, runner.execute(scheduled))
    assert scheduler.kv.num_used_pages > 0
    aborted = scheduler.abort("A")
    assert aborted is not None and aborted.finish_reason == "abort"
    assert scheduler.abort("nonexistent") is None
    scheduler.abort("B")
    scheduler.kv.check_invariants()
    assert scheduler.kv.num_used_pages == 0 and scheduler.num_unfinished == 0
    assert scheduler.schedule().cleared_slots  # the runner is told to clear their tables


def test_priorities_order_admission() -> None:
    scheduler = make_scheduler(max_num_seqs=1)
    scheduler.add(make_request("late", priority=5, max_tokens=1))
    scheduler.add(make_request("urgent", priority=-1, max_tokens=1))
    scheduler.add(make_request("normal", priority=0, max_tokens=1))
    runner = FakeRunner()
    run_to_completion(scheduler, runner)
    order = [c.request_id for s in runner.steps for c in s.prefill_chunks]
    assert order == ["urgent", "normal", "late"]


def test_prompt_chunks_respect_the_token_budget() -> None:
    scheduler = make_scheduler(max_num_batched_tokens=8, max_num_seqs=4, prefill_chunk_size=5)
    for index in range(3):
        scheduler.add(make_request(f"r{index}", prompt_len=12, max_tokens=3))
    runner = FakeRunner()
    run_to_completion(scheduler, runner)
    for step in runner.steps:
        assert step.num_scheduled_tokens <= 8
        assert all(len(c.token_ids) <= 5 for c in step.prefill_chunks)
