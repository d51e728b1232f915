"""Recompute preemption (`preemption_mode="recompute"`, fp32, CPU): a victim's pages are dropped
and, admitted again, its prompt and generated tokens are prefilled again, each generated token to
the loop it exited after, with the `full` layout's copies into deeper planes. Tokens, exit depths
and log-probs equal an unpressured run's (log-probs to fp32 noise: a replay that left a deeper
plane with the wrong version moves them by ~1e-2); the shared layout and a family with prelude
and coda layers are refused by name."""

from __future__ import annotations

from pathlib import Path

import pytest

from loopserve.config import EngineConfig, SchedulerConfig
from loopserve.engine.engine import Engine
from loopserve.engine.stats import EngineStats
from loopserve.sampling_params import SamplingParams
from tests.published_configs import write_huginn_checkpoint

PROMPTS = [
    [7, 3, 9, 120, 44, 2, 18, 99, 5, 61, 17],
    [200],
    list(range(30, 70)),
    [5, 5, 5, 5, 81],
    [11, 250, 13, 14, 15, 16, 17, 18, 19, 20],
    [90, 91],
]
Result = tuple[list[int], list[int], list[float]]


def run(num_kv_pages: int, **options: object) -> tuple[dict[str, Result], EngineStats]:
    config = EngineConfig.from_options(
        device="cpu", dtype="float32", max_num_seqs=8, exit_mode="ouro", prefill_chunk_size=5,
        max_num_batched_tokens=16, num_kv_pages=num_kv_pages, **options,
    )  # fmt: skip
    engine = Engine(config)
    for index, prompt in enumerate(PROMPTS):
        params = SamplingParams(
            max_tokens=12,
            temperature=0.0 if index % 2 else 1.0,
            seed=index,
            exit_threshold=0.6,
            logprobs=0,
        )
        engine.add_request(prompt, params, request_id=str(index))
    results: dict[str, Result] = {}
    while len(results) < len(PROMPTS):
        for output in engine.step():
            if output.finished:
                sequence = output.outputs[0]
                assert sequence.logprobs is not None
                logprobs = [entry.logprob for entry in sequence.logprobs]
                results[output.request_id] = (sequence.token_ids, sequence.exit_depths, logprobs)
    stats = engine.stats()
    assert stats.kv_pages_used == 0
    return results, stats


@pytest.mark.parametrize("scheduling", ["refill", "no_refill"])
def test_recomputed_requests_equal_an_unpressured_run(scheduling: str) -> None:
    expected, _ = run(256, scheduling=scheduling)
    got, stats = run(24, scheduling=scheduling, preemption_mode="recompute")
    # Victims had generated tokens to replay, some of which exited before the last loop.
    assert stats.num_preemptions > 0 and stats.recomputed_tokens > sum(map(len, PROMPTS[:2]))
    assert any(depth < 4 for _, depths, _ in expected.values() for depth in depths[1:])
    for request_id, (tokens, depths, logprobs) in expected.items():
        assert got[request_id][:2] == (tokens, depths), request_id
        assert got[request_id][2] == pytest.approx(logprobs, abs=1e-4), request_id


def test_swap_and_recompute_agree() -> None:
    swapped, swap_stats = run(24)
    recomputed, _ = run(24, preemption_mode="recompute")
    assert swap_stats.num_preemptions > 0 and swap_stats.recomputed_tokens == 0
    assert {k: v[:2] for k, v in swapped.items()} == {k: v[:2] for k, v in recomputed.items()}


def test_recompute_needs_the_full_layout() -> None:
    with pytest.raises(ValueError, match=r"preemption_mode \(--preemption-mode\) recompute needs"):
        SchedulerConfig(preemption_mode="recompute", kv_layout="shared")  # type: ignore[arg-type]


def test_recompute_is_refused_for_a_family_with_stage_layers(tmp_path: Path) -> None:
    checkpoint = write_huginn_checkpoint(tmp_path / "huginn")
    with pytest.raises(ValueError, match="recompute is not served for huginn"):
        Engine(EngineConfig.from_options(model=str(checkpoint), preemption_mode="recompute"))
