"""Recompute preemption (`preemption_mode="recompute"`, fp32, CPU): a victim's pages are dropped
and, admitted again, its prompt and generated tokens are prefilled again, each generated token to
the loop it exited after, with the `full` layout's copies into deeper planes. Tokens, exit depths
and log-probs equal an unpressured run's (log-probs to fp32 noise: a replay that left a deeper
plane with the wrong version moves them by ~1e-2); the shared layout and a family with prelude
and coda layers are refused by name. `auto` swaps a victim while it fits the pinned swap space
and recomputes it otherwise."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from loopserve.config import EngineConfig, SchedulerConfig
from loopserve.engine.engine import Engine
from loopserve.engine.runner_api import PendingStep
from loopserve.engine.scheduler_output import SchedulerOutput
from loopserve.engine.stats import EngineStats
from loopserve.runner.setup import build_runner
from loopserve.sampling_params import SamplingParams
from tests.pressure import PREEMPTING
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


class PinnedSwapSpace:
    """The default runner, saying its pinned swap space holds `pages` (a CPU pins nothing)."""

    def __init__(self, config: EngineConfig, pages: int) -> None:
        self._runner = build_runner(config)
        self.info = dataclasses.replace(self._runner.info, pinned_swap_pages=pages)

    def execute(self, scheduled: SchedulerOutput) -> PendingStep:
        return self._runner.execute(scheduled)


def run(
    num_kv_pages: int, pinned_swap_pages: int | None = None, **options: object
) -> tuple[dict[str, Result], EngineStats]:
    config = EngineConfig.from_options(
        device="cpu", dtype="float32", max_num_seqs=8, exit_mode="ouro", prefill_chunk_size=5,
        max_num_batched_tokens=16, num_kv_pages=num_kv_pages, **(PREEMPTING | options),
    )  # fmt: skip
    runner = None if pinned_swap_pages is None else PinnedSwapSpace(config, pinned_swap_pages)
    engine = Engine(config, runner)
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
    SWAPPED_PAGES.append(engine.scheduler.stats.swapped_out_pages)
    return results, stats


SWAPPED_PAGES: list[int] = []  # pages swapped out by each run, in order


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


@pytest.mark.parametrize("pinned_pages", [0, 6, 10_000])
def test_auto_swaps_what_fits_the_pinned_swap_space_and_recomputes_the_rest(
    pinned_pages: int,
) -> None:
    """`auto`: a victim is swapped while its pages fit what is left of the pinned swap space,
    recomputed otherwise; either way the run equals an unpressured one."""
    expected, _ = run(256)
    got, stats = run(24, pinned_swap_pages=pinned_pages, preemption_mode="auto")
    swapped = SWAPPED_PAGES[-1]
    assert stats.num_preemptions > 0
    assert (stats.recomputed_tokens > 0) == (pinned_pages < 10_000)  # a large space holds all
    assert (swapped > 0) == (pinned_pages > 0)
    assert {k: v[:2] for k, v in got.items()} == {k: v[:2] for k, v in expected.items()}


def test_auto_swaps_where_nothing_needs_pinning_or_recompute_cannot_serve() -> None:
    _, on_cpu = run(24, preemption_mode="auto")  # no pinned swap space: swapping is cheap
    assert on_cpu.num_preemptions > 0 and on_cpu.recomputed_tokens == 0
    # 16 pages: enough pressure to preempt in the shared layout, which holds fewer pages
    _, shared = run(16, pinned_swap_pages=0, preemption_mode="auto", kv_layout="shared")
    assert shared.num_preemptions > 0 and shared.recomputed_tokens == 0


def test_recompute_needs_the_full_layout() -> None:
    with pytest.raises(ValueError, match=r"preemption_mode \(--preemption-mode\) recompute needs"):
        SchedulerConfig(preemption_mode="recompute", kv_layout="shared")  # type: ignore[arg-type]


def test_recompute_is_refused_for_a_family_with_stage_layers(tmp_path: Path) -> None:
    checkpoint = write_huginn_checkpoint(tmp_path / "huginn")
    with pytest.raises(ValueError, match="recompute is not served for huginn"):
        Engine(EngineConfig.from_options(model=str(checkpoint), preemption_mode="recompute"))
