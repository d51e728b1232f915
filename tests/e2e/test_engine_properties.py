"""Random arrivals, aborts and lengths on the real engine: pages balance after every step."""

from __future__ import annotations

from pathlib import Path

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from loopserve.config import EngineConfig
from loopserve.engine.engine import Engine
from loopserve.sampling_params import SamplingParams

actions = st.lists(
    st.tuples(
        st.sampled_from(["add", "step", "step", "abort"]), st.integers(1, 30), st.integers(1, 8)
    ),
    min_size=1,
    max_size=25,
)


def play(engine: Engine, actions: list[tuple[str, int, int]]) -> None:
    """Add, abort and step as `actions` say, then run to the end; the KV manager's invariants
    hold after every action and every page is free at the end."""
    ids: list[str] = []
    for kind, length, max_tokens in actions:
        if kind == "add":
            params = SamplingParams(max_tokens=max_tokens, temperature=0.0, exit_threshold=0.6)
            ids.append(engine.add_request(list(range(1, length + 1)), params))
        elif kind == "abort" and ids:
            engine.abort(ids[length % len(ids)])
        else:
            engine.step()
        engine.kv.check_invariants()
    while engine.has_unfinished_requests():
        engine.step()
        engine.kv.check_invariants()
    assert engine.stats().kv_pages_used == 0


@settings(
    max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    actions=actions,
    layout=st.sampled_from(["full", "shared"]),
    scheduling=st.sampled_from(["refill", "no_refill"]),
)
def test_engine_frees_every_page(
    tiny_checkpoint: Path, actions, layout: str, scheduling: str
) -> None:  # type: ignore[no-untyped-def]
    engine = Engine(
        EngineConfig.from_options(
            model=str(tiny_checkpoint),
            kv_layout=layout,
            scheduling=scheduling,
            num_kv_pages=40,
            max_num_seqs=3,
            prefill_chunk_size=7,
            max_num_batched_tokens=8,
        )
    )
    play(engine, actions)


@settings(
    max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    actions=actions,
    scheduling=st.sampled_from(["refill", "no_refill"]),
    speculative=st.tuples(st.sampled_from([1, 2, 4]), st.sampled_from([1, 2, 3])),
    off_above=st.sampled_from([None, 1, 2]),
    preemption_mode=st.sampled_from(["swap", "recompute"]),
)
def test_speculating_engine_frees_every_page(
    tiny_checkpoint: Path,
    actions,
    scheduling: str,
    speculative: tuple[int, int],
    off_above: int | None,
    preemption_mode: str,
) -> None:  # type: ignore[no-untyped-def]
    """The same with speculation: lanes running ahead, switches on and off, preemption of
    speculating requests, aborts between steps."""
    k, d = speculative
    engine = Engine(
        EngineConfig.from_options(
            model=str(tiny_checkpoint),
            scheduling=scheduling,
            num_kv_pages=40,
            max_num_seqs=3,
            prefill_chunk_size=7,
            max_num_batched_tokens=8,
            preemption_mode=preemption_mode,
            speculative_config={
                "num_speculative_tokens": k,
                "draft_loops": d,
                "disable_by_batch_size": off_above,
            },
        )
    )
    play(engine, actions)
