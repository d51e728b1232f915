"""Scheduling on the one decode path, with a fake model: the batching really happens.

Every test drives a real `Engine`, scheduler and decode step; only the model is fake (see
fake_model.py), so exits follow the traced depths or the scripted gate exactly.
"""

from __future__ import annotations

import pytest
import torch

from loopserve.engine.engine import Engine
from tests.unit.fake_model import (
    FakeLoopedModel,
    RecordingRunner,
    make_engine,
    params,
    prompt,
    run_to_completion,
)


def decode_loops(runner: RecordingRunner) -> list[dict[str, int]]:
    """Per decode step that ran anything: request id -> the loop it ran."""
    return [loops for step in runner.steps if (loops := step.loops())]


def two_request_trace_run(scheduling: str) -> RecordingRunner:
    """A exits every token after 1 loop, B after 4."""
    engine, runner = make_engine(exit_mode="trace", scheduling=scheduling)
    engine.add_request(prompt(), params(6, trace_depths=(1,) * 5), request_id="A")
    engine.add_request(prompt(), params(3, trace_depths=(4,) * 2), request_id="B")
    run_to_completion(engine)
    return runner


def test_one_step_holds_rows_at_different_loops() -> None:
    steps = decode_loops(two_request_trace_run("refill"))
    assert any(len(set(loops.values())) > 1 for loops in steps), "no step ever mixed depths"
    assert {"A": 1, "B": 3} in steps


def test_refill_gives_the_freed_row_to_the_next_token_at_once() -> None:
    # B runs loops 1..4 for its first decode token while A streams a token per step.
    steps = decode_loops(two_request_trace_run("refill"))
    assert steps[:4] == [{"A": 1, "B": 1}, {"A": 1, "B": 2}, {"A": 1, "B": 3}, {"A": 1, "B": 4}]


def test_no_refill_makes_exited_rows_wait_for_the_cohort() -> None:
    steps = decode_loops(two_request_trace_run("no_refill"))
    assert steps[:5] == [{"A": 1, "B": 1}, {"B": 2}, {"B": 3}, {"B": 4}, {"A": 1, "B": 1}]


@pytest.mark.parametrize("scheduling", ["refill", "no_refill"])
def test_a_finished_requests_row_goes_to_a_waiting_request(scheduling: str) -> None:
    engine, runner = make_engine(exit_mode="trace", scheduling=scheduling, max_num_seqs=2)
    engine.add_request(prompt(), params(2, trace_depths=(1,)), request_id="A")
    engine.add_request(prompt(), params(3, trace_depths=(4, 4)), request_id="B")
    engine.add_request(prompt(), params(2, trace_depths=(1,)), request_id="C")
    run_to_completion(engine)
    steps = runner.steps
    c_prefill = next(
        i
        for i, s in enumerate(steps)
        if any(c.request_id == "C" for c in s.scheduled.prefill_chunks)
    )
    c_first_decode = next(i for i, s in enumerate(steps) if "C" in s.loops())
    b_loop_then = steps[c_first_decode].loops().get("B")
    if scheduling == "refill":
        assert c_first_decode == c_prefill + 1
        assert b_loop_then is not None and b_loop_then > 1  # C starts while B is mid-token
    else:
        assert b_loop_then in (None, 1)  # C waits for B's cohort to drain


@pytest.mark.parametrize("scheduling", ["refill", "no_refill"])
@pytest.mark.parametrize("layout", ["full", "shared"])
def test_row_loops_executed_equal_the_traced_depths(scheduling: str, layout: str) -> None:
    engine, _ = make_engine(exit_mode="trace", scheduling=scheduling, kv_layout=layout)
    for index in range(5):  # no explicit depths: the seeded d2.6 distribution
        engine.add_request(prompt(3 + 7 * index), params(9), request_id=f"r{index}")
    done = run_to_completion(engine)
    traced = [depth for output in done.values() for depth in output.outputs[0].exit_depths[1:]]
    assert all(len(output.outputs[0].exit_depths) == 9 for output in done.values())
    stats = engine.stats()
    assert sum(stats.row_loops_by_loop.values()) == sum(traced)
    assert len(set(traced)) > 1
    assert stats.mean_rows_per_decode_step > 1.0
    assert stats.kv_pages_used == 0


@pytest.mark.parametrize(("mode", "depth"), [("ouro", 2), ("ouro_delayed", 3)])
def test_the_gate_decides_exits_in_both_ouro_modes(mode: str, depth: int) -> None:
    """The gate's test holds first after loop 2: `ouro` exits there, `ouro_delayed` a loop later."""
    engine, _ = make_engine(FakeLoopedModel(hazards={2: 1.0}), exit_mode=mode)
    engine.add_request(prompt(), params(4, exit_threshold=0.5), request_id="g")
    engine.add_request(prompt(), params(4, exit_threshold=0.5, min_loops=3), request_id="m")
    engine.add_request(prompt(), params(4, exit_threshold=1.0), request_id="fixed")
    done = run_to_completion(engine)
    assert done["g"].outputs[0].exit_depths == [4, depth, depth, depth]
    # With min_loops 3 the test after loop 2 does not count; loop 3's hazard is 0, so the CDF
    # (already 1 after loop 2) holds at loop 3: `ouro` exits there, `ouro_delayed` at loop 4.
    assert done["m"].outputs[0].exit_depths == [4, depth + 1, depth + 1, depth + 1]
    assert done["fixed"].outputs[0].exit_depths == [4, 4, 4, 4]


def kv_marker(engine: Engine, runner: RecordingRunner, slot: int, plane: int, position: int) -> int:
    """The loop whose K/V the fake model left at (slot, plane, position)."""
    tables = runner.runner.block_tables
    block = tables.block_size
    page = int(tables.tables[slot, plane, position // block])
    keys = runner.runner.decode.kv.key_cache(0)  # [pages, block, 1, 2]
    return int(keys[page, position % block, 0, 0])


def test_full_layout_copies_the_exit_version_into_deeper_planes() -> None:
    engine, runner = make_engine(exit_mode="trace", kv_layout="full", max_num_seqs=1)
    engine.add_request(prompt(5), params(3, trace_depths=(2, 2)), request_id="A")
    while engine.stats().generated_tokens < 2:  # until the token at position 5 has exited
        engine.step()
    assert [kv_marker(engine, runner, 0, plane, 5) for plane in range(4)] == [1, 2, 2, 2]
    # Prompt tokens ran every loop: plane p holds loop p + 1.
    assert [kv_marker(engine, runner, 0, plane, 4) for plane in range(4)] == [1, 2, 3, 4]


def test_shared_layout_writes_the_final_plane_and_frees_prompt_planes() -> None:
    engine, runner = make_engine(exit_mode="trace", kv_layout="shared", prefill_chunk_size=4)
    engine.add_request(prompt(40), params(30, trace_depths=(2,) * 29), request_id="A")
    used = []
    while engine.has_unfinished_requests():
        engine.step()
        used.append(engine.stats().kv_pages_used)
        if engine.stats().generated_tokens == 3:
            # Every loop of a generated token writes the final plane: it holds its exit version.
            assert kv_marker(engine, runner, 0, 3, 40) == 2
    # Pages grow with the prompt in all 4 planes (3 pages each for 40 tokens); then only the
    # final plane remains, and grows to the 69 positions' 5 pages.
    peak = used.index(4 * 3)
    assert max(used) == 4 * 3 and used[: peak + 1] == sorted(used[: peak + 1])
    after_prompt = used[peak + 1 :]
    assert after_prompt[0] <= 4 and max(after_prompt) == 5 and after_prompt[-1] == 0


def test_a_request_that_can_never_fit_is_rejected() -> None:
    engine, _ = make_engine(num_kv_pages=10)
    with pytest.raises(ValueError, match=r"needs 12 KV pages.*only 9"):
        engine.add_request(prompt(40), params(9))
    assert not engine.has_unfinished_requests()


def test_admission_waits_for_pages_and_never_deadlocks() -> None:
    engine, runner = make_engine(num_kv_pages=13, exit_mode="trace")  # one request at a time
    for index in range(4):
        engine.add_request(prompt(40), params(9), request_id=f"r{index}")
    done = run_to_completion(engine)
    assert len(done) == 4
    concurrent = max(
        len(
            {c.request_id for c in s.scheduled.prefill_chunks}
            | set(s.scheduled.decode_slots.values())
        )
        for s in runner.steps
    )
    assert concurrent == 1
    assert engine.stats().kv_pages_used == 0


def test_abort_frees_everything() -> None:
    engine, _ = make_engine(exit_mode="trace")
    engine.add_request(prompt(), params(50), request_id="A")
    engine.add_request(prompt(), params(50), request_id="B")
    for _ in range(6):
        engine.step()
    assert engine.stats().kv_pages_used > 0
    aborted = engine.abort("A")
    assert aborted is not None and aborted.outputs[0].finish_reason == "abort"
    assert engine.abort("nonexistent") is None
    engine.abort("B")
    engine.kv.check_invariants()
    assert engine.stats().kv_pages_used == 0 and engine.stats().num_running == 0
    scheduled = engine.scheduler.schedule()
    assert sorted(scheduled.cleared_slots) == [0, 1]  # the runner is told to clear their tables
    assert sorted(scheduled.slot_stops) == [0, 1] and not scheduled.decode_slots


def test_priorities_order_admission() -> None:
    engine, runner = make_engine(max_num_seqs=1)
    engine.add_request(prompt(), params(1, priority=5), request_id="late")
    engine.add_request(prompt(), params(1, priority=-1), request_id="urgent")
    engine.add_request(prompt(), params(1, priority=0), request_id="normal")
    run_to_completion(engine)
    order = [c.request_id for s in runner.steps for c in s.scheduled.prefill_chunks]
    assert order == ["urgent", "normal", "late"]


def test_prompt_chunks_respect_the_token_budget() -> None:
    engine, runner = make_engine(max_num_batched_tokens=8, max_num_seqs=4, prefill_chunk_size=5)
    for index in range(3):
        engine.add_request(prompt(12), params(3), request_id=f"r{index}")
    run_to_completion(engine)
    for step in runner.steps:
        chunks = step.scheduled.prefill_chunks
        assert sum(len(c.token_ids) for c in chunks) <= 8
        assert all(len(c.token_ids) <= 5 for c in chunks)


def test_the_step_stops_on_stop_ids_and_max_tokens_like_the_host() -> None:
    """The fake model counts up from the last prompt token: 6, 7, 8, ..."""
    engine, _ = make_engine(FakeLoopedModel(eos_token_ids=(9,)), exit_mode="trace")
    engine.add_request(prompt(5), params(10, trace_depths=(1,) * 9), request_id="eos")
    engine.add_request(prompt(5), params(10, stop_token_ids=[8]), request_id="stop")
    engine.add_request(prompt(5), params(2), request_id="length")
    engine.add_request(prompt(5), params(6, ignore_eos=True), request_id="ignore")
    done = run_to_completion(engine)
    eos, stop, length, ignore = (
        done[name].outputs[0] for name in ("eos", "stop", "length", "ignore")
    )
    assert (eos.token_ids, eos.finish_reason) == ([6, 7, 8, 9], "stop")
    assert (stop.token_ids, stop.stop_reason) == ([6, 7, 8], 8)
    assert (length.token_ids, length.finish_reason) == ([6, 7], "length")
    assert ignore.token_ids == [6, 7, 8, 9, 10, 11]


def test_the_fake_model_reaches_the_real_kv_cache() -> None:
    """Guards the KV assertions above: the step really writes through the attention backend."""
    engine, runner = make_engine()
    keys = runner.runner.decode.kv.key_cache(0)
    keys.zero_()  # the CPU cache starts uninitialised
    engine.add_request(prompt(3), params(1))
    run_to_completion(engine)
    assert torch.count_nonzero(keys) > 0
