"""The offline closed loop on the real engine (tiny checkpoint, CPU): C in flight, 2 × C requests,
work counts that agree with the engine's statistics, and the same trace for every scheduling."""

from __future__ import annotations

from pathlib import Path

import pytest

from loopserve.bench.closed_loop import make_requests, run_closed_loop
from loopserve.bench.sweep_spec import Workload
from loopserve.bench.trial import TrialRecord
from loopserve.config import EngineConfig
from loopserve.engine.engine import Engine
from tests.conftest import TINY_CONFIG

WORKLOAD = Workload(prompt_len=6, output_len=5)


def _run(checkpoint: Path, concurrency: int, exits: str, scheduling: str) -> TrialRecord:
    engine = Engine(
        EngineConfig.from_options(
            model=str(checkpoint),
            num_kv_pages=200,
            max_num_seqs=4,  # more slots than C: only the closed loop keeps C in flight
            scheduling=scheduling,
            exit_mode="trace",
        )
    )
    requests = make_requests(
        WORKLOAD,
        2 * concurrency,
        seed=(0, 1),
        vocab_size=TINY_CONFIG.vocab_size,
        num_loops=TINY_CONFIG.num_loops,
        exits=exits,
        temperature=1.0,
    )
    record = run_closed_loop(engine, requests, concurrency, "t")
    assert not engine.has_unfinished_requests()
    return record


@pytest.mark.parametrize("concurrency", [1, 2])
def test_closed_loop_keeps_c_in_flight(tiny_checkpoint: Path, concurrency: int) -> None:
    record = _run(tiny_checkpoint, concurrency, "trace", "refill")
    assert len(record.requests) == 2 * concurrency
    assert sorted(r.request_id for r in record.requests) == [
        f"t-{index}" for index in range(2 * concurrency)
    ]
    assert record.min_in_flight_while_queued == concurrency
    assert record.peak_running == concurrency
    assert all(len(r.exit_depths) == WORKLOAD.output_len for r in record.requests)
    assert record.counters.generated_tokens == 2 * concurrency * WORKLOAD.output_len
    assert record.counters.prefill_tokens == 2 * concurrency * WORKLOAD.prompt_len
    # The floor counts row-loops from the exit depths; the engine counts the rows it ran.
    decode_depths = [depth for r in record.requests for depth in r.exit_depths[1:]]
    assert record.counters.row_loops == sum(decode_depths)
    assert record.duration_s > 0
    assert record.peak_kv_pages > 0


def test_fixed_exits_run_every_loop_and_trace_exits_vary(tiny_checkpoint: Path) -> None:
    fixed = _run(tiny_checkpoint, 2, "fixed", "refill")
    assert {d for r in fixed.requests for d in r.exit_depths} == {TINY_CONFIG.num_loops}
    traced = _run(tiny_checkpoint, 2, "trace", "refill")
    depths = {d for r in traced.requests for d in r.exit_depths[1:]}
    assert depths <= set(range(1, TINY_CONFIG.num_loops + 1)) and len(depths) > 1
    assert all(r.exit_depths[0] == TINY_CONFIG.num_loops for r in traced.requests)


def test_every_scheduling_gets_the_same_trace(tiny_checkpoint: Path) -> None:
    by_mode = {}
    for scheduling in ("refill", "no_refill"):
        record = _run(tiny_checkpoint, 2, "trace", scheduling)
        by_mode[scheduling] = {r.request_id: r.exit_depths for r in record.requests}
    assert by_mode["refill"] == by_mode["no_refill"]


def test_a_wave_never_reuses_the_prefill_of_the_wave_before(tiny_checkpoint: Path) -> None:
    """The same requests twice on one engine (another variant's trial, say): the second wave
    computes its prompts again instead of finding them in the prefix cache."""
    engine = Engine(EngineConfig.from_options(model=str(tiny_checkpoint), num_kv_pages=200))
    workload = Workload(prompt_len=40, output_len=3)
    requests = make_requests(
        workload, 4, seed=(0, 2), vocab_size=TINY_CONFIG.vocab_size,
        num_loops=TINY_CONFIG.num_loops, exits="fixed", temperature=1.0,
    )  # fmt: skip
    first = run_closed_loop(engine, requests, 2, "a")
    second = run_closed_loop(engine, requests, 2, "b")
    assert first.counters.prefix_hit_rate == second.counters.prefix_hit_rate == 0.0
    assert engine.kv.num_cached_pages > 0  # the cache was on, and filled by each wave
