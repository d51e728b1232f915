"""Applying a step's results to its requests: computed prompt chunks, sampled tokens, finishes.

Owns: counting computed prompt chunks (and offering their full blocks to the prefix cache),
recording sampled tokens with their exit depths and logprobs, the host's stop rule (EOS,
stop_token_ids, max_tokens), checking that the decode step and the host agree on it, and the
decode statistics. Must not: import torch, or schedule anything (`engine.scheduler` does; this
works through its public surface: `running_request`, `slots`, `kv`, `finish`, `stats`).
"""

from __future__ import annotations

from typing import Protocol

from loopserve.config import SchedulerConfig
from loopserve.engine.kv_manager import KVCacheManager
from loopserve.engine.request_slots import RequestSlots
from loopserve.engine.scheduler_output import (
    DecodeResult,
    RunnerOutput,
    SampledToken,
    SchedulerOutput,
)
from loopserve.engine.stats import SchedulerStats
from loopserve.kv.layout import KVLayout
from loopserve.request import Request


class Scheduler(Protocol):
    """What applying results needs of `engine.scheduler.Scheduler` (which imports this)."""

    config: SchedulerConfig
    layout: KVLayout
    kv: KVCacheManager
    slots: RequestSlots
    stats: SchedulerStats

    def running_request(self, request_id: str | None) -> Request | None: ...

    def finish(
        self, request: Request, reason: str, stop_reason: str | int | None = None
    ) -> None: ...


# Requests that gained tokens or finished in a step, each with its number of new tokens.
Changed = list[tuple[Request, int]]


def apply_results(
    scheduler: Scheduler, scheduled: SchedulerOutput, result: RunnerOutput
) -> Changed:
    """What `Scheduler.update` does (its docstring)."""
    changed: Changed = []
    for chunk, token in zip(scheduled.prefill_chunks, result.prefill_tokens, strict=True):
        request = scheduler.running_request(chunk.request_id)
        if request is None:
            continue  # aborted while its chunk ran
        _chunk_done(scheduler, request, len(chunk.token_ids))
        if chunk.completes_replay:  # K/V recomputed: its in-flight token restarts at loop 1
            request.num_replay_tokens = 0
            request.num_computed_tokens = request.num_prompt_tokens
            scheduler.slots.start(request)
        if not chunk.completes_prompt:
            continue
        assert token is not None
        for plane in scheduler.layout.prompt_only_planes(request.params.max_loops):
            scheduler.kv.release_plane(request.request_id, plane)
        _append_token(scheduler, request, token, depth=chunk.num_loops)
        if not request.finished:
            scheduler.slots.start(request)
        changed.append((request, 1))
    if result.decode is not None:
        _apply_decode(scheduler, scheduled, result.decode, changed)
    return changed


def _chunk_done(scheduler: Scheduler, request: Request, size: int) -> None:
    """Count a computed chunk and offer its full prompt blocks to the prefix cache."""
    block = scheduler.config.block_size
    first = request.num_computed_tokens // block
    request.num_computed_tokens += size
    for index in range(first, request.num_computed_tokens // block):
        if index < len(request.block_hashes):
            for plane in range(request.params.max_loops):
                scheduler.kv.register(request.request_id, plane, index, request.block_hashes[index])


def _apply_decode(
    scheduler: Scheduler, scheduled: SchedulerOutput, result: DecodeResult, changed: Changed
) -> None:
    """Record what the decode step did (a step after it did it, when asynchronous)."""
    stats = scheduler.stats
    ran = sum(result.ran)
    if ran:
        stats.decode_steps += 1
        stats.rows_per_step[ran] += 1
        stats.row_loops.update(
            loop for loop, did in zip(result.loops, result.ran, strict=True) if did
        )
    stats.proposed_tokens += result.proposed
    stats.confirmed_tokens += result.confirmed
    for slot, tokens in enumerate(result.tokens):
        request = scheduler.running_request(scheduled.decode_slots.get(slot))
        if not tokens or request is None:
            continue  # finished meanwhile (stop string, abort): its extra tokens are dropped
        for token, depth in zip(tokens, result.depths[slot], strict=True):
            if request.finished:
                raise RuntimeError(
                    f"the decode step gave {request.request_id!r} a token after its last"
                )
            _append_token(scheduler, request, token, depth)
        if result.stopped[slot] != request.finished:
            raise RuntimeError(
                f"the decode step and the scheduler disagree on whether "
                f"{request.request_id!r} stopped"
            )
        changed.append((request, len(tokens)))
        if scheduled.speculate:
            stats.speculative_tokens += len(tokens)


def _append_token(
    scheduler: Scheduler, request: Request, sampled: SampledToken, depth: int
) -> None:
    """Record a generated token and finish the request if it ends it. The decode step applies
    the same stop rule on the device (stop_token_ids, eos ids, max_tokens) to stop its slot
    without a host round trip; `_apply_decode` checks that the two agree."""
    request.output_token_ids.append(sampled.token_id)
    request.exit_depths.append(depth)
    if sampled.logprobs is not None:
        request.logprobs.append(sampled.logprobs)
    scheduler.stats.generated_tokens += 1
    params = request.params
    token = sampled.token_id
    if token in params.eos_token_ids:
        scheduler.finish(request, "stop")
    elif token in params.params.stop_token_ids:
        scheduler.finish(request, "stop", stop_reason=token)
    elif request.num_output_tokens >= params.params.max_tokens:
        scheduler.finish(request, "length")
