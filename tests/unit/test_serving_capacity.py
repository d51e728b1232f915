"""Incremental pages, preemption, the prefix cache and priorities, on the real engine and decode
step with a fake model; and a long random fuzz of all of them against the page invariants."""

from __future__ import annotations

import random

import hypothesis
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from loopserve.engine.engine import Engine
from tests.pressure import PREEMPTING
from tests.unit.fake_model import FakeLoopedModel, make_engine, params, prompt, run_to_completion


def test_a_host_side_finish_reaches_the_device_even_when_nothing_else_runs() -> None:
    """An abort (or stop string) with no other work used to be dropped with the empty step, so the
    slot stayed live on the device with stale page tables."""
    engine, runner = make_engine(exit_mode="trace")
    engine.add_request(prompt(), params(50), request_id="A")
    for _ in range(4):
        engine.step()
    assert bool(runner.runner.decode.active[0])
    engine.abort("A")
    while engine.has_unfinished_requests():
        engine.step()
    engine.step()
    assert not bool(runner.runner.decode.active[0])
    assert any(0 in step.scheduled.slot_stops for step in runner.steps)


def test_incremental_pages_follow_the_tokens() -> None:
    engine, _ = make_engine(exit_mode="trace")  # one plane per loop: 4 planes
    engine.add_request(prompt(20), params(40, trace_depths=(1,) * 39), request_id="A")
    engine.step()  # the prompt: 2 pages per plane, and the first token sampled
    assert engine.stats().kv_pages_used == 4 * 2
    while engine.stats().generated_tokens < 20:
        engine.step()
    # 40 tokens with K/V (+1 ahead): 3 pages per plane, not the 4 of prompt + max_tokens.
    assert engine.stats().kv_pages_used == 4 * 3


def test_the_lowest_priority_latest_request_is_preempted_and_resumes_intact() -> None:
    engine, runner = make_engine(
        num_kv_pages=1 + 4 * 6, exit_mode="trace", kv_watermark=0.0, **PREEMPTING
    )
    engine.add_request(prompt(30), params(40, trace_depths=(1,) * 39), request_id="old")
    engine.add_request(prompt(30), params(40, trace_depths=(1,) * 39), request_id="new")
    engine.add_request(
        prompt(30), params(40, trace_depths=(1,) * 39, priority=-1), request_id="vip"
    )
    done = run_to_completion(engine)
    swapped = [move.request_id for step in runner.steps for move in step.scheduled.swap_out]
    assert swapped and "vip" not in swapped and swapped[0] == "new"
    assert engine.stats().num_preemptions == len(swapped)
    # The fake model's tokens count up from the prompt: a restored request continues exactly.
    for name in ("old", "new", "vip"):
        assert done[name].outputs[0].token_ids == list(range(31, 71)), name
        assert done[name].outputs[0].exit_depths == [4] + [1] * 39


def test_priorities_never_starve_a_request() -> None:
    """A stream of urgent requests passes a waiting one at most `priority_bypass_limit` times."""
    engine, runner = make_engine(max_num_seqs=1, priority_bypass_limit=3)
    engine.add_request(prompt(), params(1, priority=5), request_id="patient")
    for index in range(8):
        engine.add_request(prompt(), params(1, priority=0), request_id=f"urgent{index}")
    run_to_completion(engine)
    order = [c.request_id for s in runner.steps for c in s.scheduled.prefill_chunks]
    assert order.index("patient") == 3


def test_a_hit_skips_the_cached_pages_and_counts_as_hit() -> None:
    engine, runner = make_engine()
    shared = list(range(1, 33))  # two full pages
    engine.add_request([*shared, 40], params(2), request_id="first")
    run_to_completion(engine)
    engine.add_request([*shared, 41, 42], params(2), request_id="second")
    run_to_completion(engine)
    chunks = [c for s in runner.steps for c in s.scheduled.prefill_chunks]
    assert [(c.request_id, c.start, len(c.token_ids)) for c in chunks] == [
        ("first", 0, 33),
        ("second", 32, 2),
    ]
    assert engine.stats().prefix_cache_hit_rate == pytest.approx(32 / (33 + 34))


actions = st.lists(
    st.tuples(
        st.sampled_from(["add", "add", "step", "step", "step", "step", "abort"]),
        st.integers(0, 3),  # which shared prefix
        st.integers(1, 40),  # suffix length
        st.integers(1, 30),  # max tokens
        st.integers(-1, 2),  # priority
    ),
    min_size=80,
    max_size=200,
)
PREFIXES = [[], list(range(100, 116)), list(range(100, 132)), list(range(200, 248))]


# 40 examples, not 60 (the time is linear in the engine steps they run: 67 s -> 42 s). The seed
# is pinned so that editing this function does not reshuffle them (derandomize seeds on the
# source text, and step counts per example vary 2x between seeds); these 40 run 10,800 engine
# steps and 182 preemptions (7 examples recompute, 1,862 positions) and hit the prefix cache:
# test_the_fuzz_ran_long_and_preempted_and_hit keeps its floors (10,000 steps, a preemption, a
# hit, a recompute).
@hypothesis.seed(0)  # not the `seed` argument below
@settings(max_examples=40, deadline=None, derandomize=True)
@given(
    actions=actions,
    layout=st.sampled_from(["full", "shared"]),
    mode=st.sampled_from(["ouro", "ouro_delayed", "trace"]),
    scheduling=st.sampled_from(["refill", "no_refill"]),
    allocation=st.sampled_from(["incremental", "incremental", "reserve"]),
    asynchronous=st.booleans(),
    seed=st.integers(0, 2**16),
    recompute=st.booleans(),  # recompute preemption where the layout allows it (full)
    estimate=st.sampled_from(["learned", "none"]),  # incremental admission's growth estimate
)
def test_fuzz_pages_balance_and_every_request_ends(
    actions: list[tuple[str, int, int, int, int]],
    layout: str,
    mode: str,
    scheduling: str,
    allocation: str,
    asynchronous: bool,
    seed: int,
    recompute: bool,
    estimate: str,
) -> None:
    """Random arrivals, prompt prefixes, lengths, priorities and aborts on a pool small enough
    to preempt: after every step the page books balance (no leak, no double free, reference counts
    equal the page tables); every request ends, finished or aborted, within a bounded number of
    steps. Examples of 80-200 actions plus the drain: over 10,000 engine steps in all."""
    hazards = {loop: random.Random(seed + loop).choice([0.0, 0.4, 1.0]) for loop in range(1, 5)}
    engine, _ = make_engine(
        FakeLoopedModel(hazards=hazards, eos_token_ids=(7,)),
        num_kv_pages=48,
        kv_layout=layout,
        exit_mode=mode,
        scheduling=scheduling,
        kv_allocation=allocation,
        preemption_mode="recompute" if recompute and layout == "full" else "swap",
        kv_growth_estimate=estimate,
        async_scheduling=asynchronous,
        max_num_seqs=6,
        prefill_chunk_size=16,
        max_num_batched_tokens=24,
        priority_bypass_limit=4,
    )
    added: list[str] = []
    ended: set[str] = set()
    for index, (kind, prefix, length, max_tokens, priority) in enumerate(actions):
        if kind == "add":
            tokens = PREFIXES[prefix] + [300 + (index * 7 + i) % 200 for i in range(length)]
            request_params = params(max_tokens, exit_threshold=0.5, priority=priority)
            try:
                engine.add_request(tokens, request_params, f"r{index}")
            except ValueError:
                continue  # can never fit in the pool: refused up front, nothing held
            added.append(f"r{index}")
        elif kind == "abort" and added:
            output = engine.abort(added[length % len(added)])
            if output is not None:
                ended.add(output.request_id)
        else:
            ended.update(_step(engine))
    for _ in range(3000):
        if not engine.has_unfinished_requests():
            break
        ended.update(_step(engine))
    else:
        raise AssertionError("requests are left that never finish")
    assert ended == set(added)
    stats = engine.stats()
    assert stats.kv_pages_used == 0
    FUZZ.append((stats.steps, stats.num_preemptions, stats.prefix_cache_hit_rate))
    RECOMPUTED.append(stats.recomputed_tokens)


FUZZ: list[tuple[int, int, float]] = []  # (steps, preemptions, prefix hit rate) per example
RECOMPUTED: list[int] = []  # positions prefilled again after recompute preemptions, per example


def _step(engine: Engine) -> set[str]:
    finished = {output.request_id for output in engine.step() if output.finished}
    engine.kv.check_invariants()
    return finished


def test_the_fuzz_ran_long_and_preempted_and_hit() -> None:
    """Guards the fuzz above against passing vacuously (runs after it, in file order)."""
    if not FUZZ:
        pytest.skip("run the fuzz test in the same session to measure what it did")
    steps, preemptions, hit_rates = zip(*FUZZ, strict=True)
    assert sum(steps) >= 10_000, sum(steps)
    assert sum(preemptions) > 0 and max(hit_rates) > 0
    assert sum(RECOMPUTED) > 0  # some examples preempted by recompute
