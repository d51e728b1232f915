"""Self-speculative decoding changes no output: engine tokens and exit depths with a
`speculative_config` equal the serial reference (fp32, CPU) on random Ouro checkpoints with 4, 3
and 2 loops and on Nanbeige, for K in {1, 2, 4, 8} proposed tokens, draft depths d in {1, 2, 3},
every exit mode, both schedulings, synchronous reads, preemption (swap and recompute), prefix
hits, reserved allocation and switches of speculation off and on; and 1,024 seeded draws on a
small vocabulary equal to decoding without speculation. On random weights most proposals are
wrong, so these runs mostly exercise dropping lanes; `test_speculation_shipped_model.py` holds
the runs where they are right."""

from __future__ import annotations

import dataclasses
from collections import Counter
from pathlib import Path

import pytest

from loopserve.config import EngineConfig
from loopserve.engine.engine import Engine
from loopserve.engine.stats import EngineStats
from loopserve.models.checkpoint_writer import write_random_checkpoint
from loopserve.sampling_params import SamplingParams
from tests.conftest import TINY_CONFIG, VARIED_GATE
from tests.e2e.test_engine_vs_reference import (
    MODES,
    NANBEIGE_MODES,
    PREFIXED,
    PROMPTS,
    RUN_STATS,
    checkpoint,
    reference,
    run_engine,
)
from tests.pressure import PREEMPTING

__all__ = ["checkpoint", "reference"]  # the fixtures this module shares

# (K, d) pairs: every K and every d with each loop count, d below the loop count.
PAIRS = {
    4: [(1, 1), (2, 2), (4, 3), (8, 1), (4, 2), (1, 3), (8, 2), (2, 1)],
    3: [(1, 1), (2, 2), (4, 1), (8, 2)],
    2: [(1, 1), (4, 1), (8, 1), (2, 1)],
    "nanbeige": [(4, 1), (2, 1), (8, 1), (1, 1)],
}
CASES = [
    (loops, mode, scheduling, k, d)
    for loops, pairs in PAIRS.items()
    for mode in (NANBEIGE_MODES if loops == "nanbeige" else MODES)
    for scheduling in ("refill", "no_refill")
    for k, d in pairs[:: 2 if scheduling == "no_refill" else 1]
]


def speculative(k: int, d: int, off_above: int | None = None) -> dict[str, object]:
    """Speculating at every batch size unless `off_above` says otherwise."""
    return {
        "method": "draft_loops",
        "num_speculative_tokens": k,
        "draft_loops": d,
        "disable_by_batch_size": off_above,
    }


# Proposals made and confirmed over the whole matrix, for the guard at the end.
TOTALS = {"proposed": 0, "confirmed": 0, "dropped": 0}


@pytest.mark.parametrize(
    ("checkpoint", "mode", "scheduling", "k", "d"), CASES, indirect=["checkpoint"]
)
def test_speculation_equals_serial_reference(
    checkpoint: Path, reference, mode: str, scheduling: str, k: int, d: int
) -> None:  # type: ignore[no-untyped-def]
    results = run_engine(
        checkpoint, "full", mode, scheduling, len(PROMPTS), 5, speculative_config=speculative(k, d)
    )
    stats = RUN_STATS[checkpoint, "full", mode, scheduling, len(PROMPTS), 5]
    TOTALS["proposed"] += stats.proposed_tokens
    TOTALS["confirmed"] += stats.confirmed_tokens
    TOTALS["dropped"] += stats.proposed_tokens - stats.confirmed_tokens
    for index in range(len(PROMPTS)):
        assert results[str(index)] == reference("full", mode, index), f"request {index}"


@pytest.mark.parametrize(
    ("checkpoint", "mode"),
    [(4, "ouro"), (3, "trace"), ("nanbeige", "fixed")],
    indirect=["checkpoint"],
)
def test_synchronous_reads_with_speculation(checkpoint: Path, reference, mode: str) -> None:  # type: ignore[no-untyped-def]
    results = run_engine(
        checkpoint,
        "full",
        mode,
        "refill",
        len(PROMPTS),
        5,
        async_scheduling=False,
        speculative_config=speculative(4, 1),
    )
    for index in range(len(PROMPTS)):
        assert results[str(index)] == reference("full", mode, index), f"request {index}"


@pytest.mark.parametrize("preemption_mode", ["swap", "recompute"])
@pytest.mark.parametrize(
    ("checkpoint", "mode"), [(4, "ouro"), (4, "trace")], indirect=["checkpoint"]
)
def test_preempted_speculating_requests_keep_every_token(
    checkpoint: Path, reference, mode: str, preemption_mode: str
) -> None:  # type: ignore[no-untyped-def]
    """A small cache: speculating requests are preempted while their lanes run ahead."""
    results = run_engine(
        checkpoint,
        "full",
        mode,
        "refill",
        8,
        5,
        num_kv_pages=24,
        preemption_mode=preemption_mode,
        speculative_config=speculative(2, 1),
        **PREEMPTING,
    )
    assert RUN_STATS[checkpoint, "full", mode, "refill", 8, 5].num_preemptions > 0
    for index in range(8):
        assert results[str(index)] == reference("full", mode, index), f"request {index}"


@pytest.mark.parametrize("checkpoint", [4], indirect=True)
def test_reserved_allocation_with_speculation(checkpoint: Path, reference) -> None:  # type: ignore[no-untyped-def]
    results = run_engine(
        checkpoint,
        "full",
        "ouro",
        "refill",
        8,
        5,
        kv_allocation="reserve",
        speculative_config=speculative(8, 1),
    )
    for index in range(8):
        assert results[str(index)] == reference("full", "ouro", index), f"request {index}"


@pytest.mark.parametrize("scheduling", ["refill", "no_refill"])
@pytest.mark.parametrize(
    ("checkpoint", "mode"), [(4, "ouro"), (3, "trace")], indirect=["checkpoint"]
)
def test_switching_speculation_off_and_on_changes_no_output(
    checkpoint: Path, reference, mode: str, scheduling: str
) -> None:  # type: ignore[no-untyped-def]
    """Off above 2 decoding requests: staggered arrivals and finishes switch it off and on, and
    each switch starts every decoding token again in the other decode step."""
    results = run_engine(
        checkpoint,
        "full",
        mode,
        scheduling,
        len(PROMPTS),
        5,
        speculative_config=speculative(4, 1, off_above=2),
    )
    stats = RUN_STATS[checkpoint, "full", mode, scheduling, len(PROMPTS), 5]
    assert stats.speculation_switches >= 2 and stats.proposed_tokens > 0, stats
    for index in range(len(PROMPTS)):
        assert results[str(index)] == reference("full", mode, index), f"request {index}"


@pytest.mark.parametrize(
    ("checkpoint", "mode"), [(4, "ouro"), ("nanbeige", "trace")], indirect=["checkpoint"]
)
def test_prefix_cache_hits_with_speculation(checkpoint: Path, reference, mode: str) -> None:  # type: ignore[no-untyped-def]
    results = run_engine(
        checkpoint,
        "full",
        mode,
        "refill",
        6,
        7,
        prompts=PREFIXED,
        speculative_config=speculative(4, 1),
    )
    assert RUN_STATS[checkpoint, "full", mode, "refill", 6, 7].prefix_cache_hit_rate > 0.3
    for index, prompt in enumerate(PREFIXED):
        assert results[str(index)] == reference("full", mode, index, tuple(prompt)), (
            f"request {index}"
        )


def test_thousands_of_seeded_draws_on_a_small_vocabulary(tmp_path: Path) -> None:
    """Sampling at temperature 1 on a 12-token vocabulary, 1,024 seeds x 3 tokens: every draw
    is the one decoding without speculation makes (so their distributions are equal, not only
    close), and the draws really spread over the vocabulary."""
    config = dataclasses.replace(TINY_CONFIG, vocab_size=12)
    model = write_random_checkpoint(tmp_path, config, seed=5, init=VARIED_GATE)

    def draws(speculating: bool) -> tuple[list[list[int]], EngineStats]:
        options: dict[str, object] = (
            {"speculative_config": speculative(4, 1)} if speculating else {}
        )
        engine = Engine(
            EngineConfig.from_options(
                model=str(model), num_kv_pages=512, max_num_seqs=64, **options
            )
        )
        ids = [
            engine.add_request(
                [1, 2, 3],
                SamplingParams(max_tokens=3, temperature=1.0, seed=seed, exit_threshold=0.6),
            )
            for seed in range(1024)
        ]
        done: dict[str, list[int]] = {}
        while engine.has_unfinished_requests():
            for output in engine.step():
                if output.finished:
                    done[output.request_id] = output.outputs[0].token_ids
        return [done[i] for i in ids], engine.stats()

    plain, _ = draws(False)
    speculated, stats = draws(True)
    assert speculated == plain
    assert stats.proposed_tokens > 500 and 0 < stats.confirmed_tokens < stats.proposed_tokens
    counts = Counter(tokens[2] for tokens in plain)
    assert len(counts) >= 10 and max(counts.values()) < 0.3 * len(plain), counts


def test_the_matrix_proposed_and_dropped_tokens() -> None:
    """Guards the matrix against passing without speculating (runs after it, in file order)."""
    assert TOTALS["proposed"] > 2000, TOTALS
    assert TOTALS["confirmed"] > 200 and TOTALS["dropped"] > 1000, TOTALS


@pytest.mark.parametrize("checkpoint", [4], indirect=True)
def test_forced_acceptance_zero_drops_every_proposal(checkpoint: Path, reference) -> None:  # type: ignore[no-untyped-def]
    """The benchmark trace at 0: every proposal dropped, right or not, so outputs are exact."""
    config = speculative(4, 1) | {"forced_acceptance": 0.0}
    results = run_engine(checkpoint, "full", "ouro", "refill", 8, 5, speculative_config=config)
    stats = RUN_STATS[checkpoint, "full", "ouro", "refill", 8, 5]
    assert stats.proposed_tokens > 30 and stats.confirmed_tokens == 0
    for index in range(8):
        assert results[str(index)] == reference("full", "ouro", index), f"request {index}"


def test_forced_acceptance_keeps_that_share_of_proposals(tiny_checkpoint: Path) -> None:
    """The benchmark trace at 0.85 on random weights: about 85 % of proposals kept (each then
    stands for the token), every page freed, and a rerun gives the same outputs. One proposal
    in flight at a time (K = 1), so each is judged on its own draw: with more, a dropped
    proposal drops those after it too, and the share kept is lower than the draw's."""

    def run() -> tuple[list[list[int]], EngineStats]:
        config = speculative(1, 2) | {"forced_acceptance": 0.85}
        engine = Engine(
            EngineConfig.from_options(
                model=str(tiny_checkpoint), num_kv_pages=256, speculative_config=config
            )
        )
        params = SamplingParams(max_tokens=48, temperature=0.0, ignore_eos=True, seed=3)
        for index, prompt in enumerate(PROMPTS):
            engine.add_request(prompt, params, request_id=str(index))
        outputs: dict[str, list[int]] = {}
        while engine.has_unfinished_requests():
            for output in engine.step():
                if output.finished:
                    outputs[output.request_id] = output.outputs[0].token_ids
        assert all(len(tokens) == 48 for tokens in outputs.values())
        return [outputs[str(index)] for index in range(len(PROMPTS))], engine.stats()

    first, stats = run()
    assert stats.proposed_tokens > 250 and stats.kv_pages_used == 0
    assert 0.8 < stats.confirmed_tokens / stats.proposed_tokens < 0.9, stats
    assert run()[0] == first
