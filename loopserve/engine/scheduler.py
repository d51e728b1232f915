"""Continuous depth batching: which loops of which requests run in the next engine step.

Owns: the waiting and running queues, admission against the KV reservation, request slots, the
per-step batch (decode rows at mixed loops plus prompt chunks within a token budget), exit-mode
bookkeeping, stop conditions, and the torch-free statistics. Must not: import torch or look at
hidden states; exits it cannot know in advance (the `ouro` gate) come back in `RunnerOutput`.

Every step runs exactly one loop for every scheduled decode row. Under `refill` every decoding
request is in every step: a token that exits is sampled by the coda and its successor starts at
loop 1 in the next step, next to rows that are deeper in their own token. Under `no_refill` rows
move in cohorts: a row that exits waits until every row of its cohort has exited, and then the
next cohort (every decoding request) starts together at loop 1. Prompt chunks run all their loops
inside the step that schedules them.
"""

from __future__ import annotations

import bisect
import itertools
from collections import Counter
from dataclasses import dataclass, field

from loopserve.engine.kv_manager import KVCacheManager, pages_for
from loopserve.engine.scheduler_output import (
    DecodeRow,
    ExitCheck,
    KVCopy,
    PageTableUpdate,
    PrefillChunk,
    RunnerOutput,
    SampledToken,
    SamplingInfo,
    SchedulerOutput,
)
from loopserve.engine.trace import D2_6, traced_depth
from loopserve.request import Request, RequestStatus

KV_LAYOUTS = ("full", "shared")
SCHEDULING_MODES = ("refill", "no_refill")
EXIT_MODES = ("ouro", "ouro_delayed", "trace")


@dataclass(frozen=True, slots=True)
class SchedulerConfig:
    # Requests admitted at once (each holds a row of the runner's per-slot state).
    max_num_seqs: int = 64
    # Decode rows plus prompt-chunk tokens per step.
    max_num_batched_tokens: int = 2048
    # Longest prompt chunk of one request in one step.
    prefill_chunk_size: int = 512
    # "refill": a slot freed by an exit is reused at once; "no_refill": cohorts drain first.
    scheduling: str = "refill"
    # "ouro" (exact gate), "ouro_delayed" (stop one loop after the test holds), "trace".
    exit_mode: str = "ouro"
    # "full": one KV plane per loop; "shared": prompts keep per-loop planes while prefilling,
    # afterwards every token keeps only its final version.
    kv_layout: str = "full"
    block_size: int = 16
    # P(depth = 1, 2, ...) for traced tokens whose request gives no explicit depths.
    trace_distribution: tuple[float, ...] = D2_6

    def __post_init__(self) -> None:
        checks = {
            "scheduling": (self.scheduling, SCHEDULING_MODES),
            "exit_mode": (self.exit_mode, EXIT_MODES),
            "kv_layout": (self.kv_layout, KV_LAYOUTS),
        }
        for name, (value, choices) in checks.items():
            if value not in choices:
                raise ValueError(f"{name} must be one of {choices}, got {value!r}")
        if min(self.max_num_seqs, self.prefill_chunk_size, self.block_size) < 1:
            raise ValueError("max_num_seqs, prefill_chunk_size and block_size must be positive")
        if self.max_num_batched_tokens < self.max_num_seqs:
            raise ValueError(
                f"max_num_batched_tokens ({self.max_num_batched_tokens}) must be at least "
                f"max_num_seqs ({self.max_num_seqs}) so every decode row fits in a step"
            )


@dataclass(slots=True)
class SchedulerStats:
    steps: int = 0
    decode_steps: int = 0
    # Rows executed per loop index (1-based) and steps by their number of decode rows.
    row_loops: Counter[int] = field(default_factory=Counter)
    rows_per_step: Counter[int] = field(default_factory=Counter)
    prefill_tokens: int = 0
    generated_tokens: int = 0

    @property
    def total_row_loops(self) -> int:
        return sum(self.row_loops.values())

    @property
    def mean_rows_per_decode_step(self) -> float:
        return self.total_row_loops / self.decode_steps if self.decode_steps else 0.0


class Scheduler:
    def __init__(self, config: SchedulerConfig, kv: KVCacheManager) -> None:
        self.config = config
        self.kv = kv
        self.waiting: list[Request] = []
        self.running: list[Request] = []
        self._running_by_id: dict[str, Request] = {}
        self.stats = SchedulerStats()
        self._order = itertools.count()
        self._waiting_keys: list[tuple[int, int]] = []
        self._free_slots = list(range(config.max_num_seqs - 1, -1, -1))
        self._cohort: set[str] = set()
        self._pending_copies: list[tuple[str, KVCopy]] = []
        self._pending_clears: list[int] = []

    # ----- requests in and out -------------------------------------------------------------

    def pages_needed(self, request: Request) -> int:
        """Every page the request can ever hold (reserved at admission)."""
        loops = request.params.max_loops
        # The last generated token is never fed back, so it needs no K/V.
        positions = request.num_prompt_tokens + request.params.params.max_tokens - 1
        if self.config.kv_layout == "full":
            return loops * pages_for(positions, self.config.block_size)
        prompt_pages = pages_for(request.num_prompt_tokens, self.config.block_size)
        return (loops - 1) * prompt_pages + pages_for(positions, self.config.block_size)

    def add(self, request: Request) -> None:
        needed = self.pages_needed(request)
        if needed > self.kv.num_usable_pages:
            raise ValueError(
                f"request {request.request_id!r} needs {needed} KV pages (prompt + max_tokens over "
                f"{request.params.max_loops} loop planes) but the cache has only "
                f"{self.kv.num_usable_pages}; lower max_tokens or max_loops, use "
                "kv_layout='shared', or give the KV cache more memory"
            )
        key = (request.priority, next(self._order))
        index = bisect.bisect(self._waiting_keys, key)
        self._waiting_keys.insert(index, key)
        self.waiting.insert(index, request)

    def abort(self, request_id: str) -> Request | None:
        for index, request in enumerate(self.waiting):
            if request.request_id == request_id:
                del self.waiting[index], self._waiting_keys[index]
                request.status = RequestStatus.FINISHED
                request.finish_reason = "abort"
                return request
        running = self._running_by_id.get(request_id)
        if running is not None:
            self.finish(running, "abort")
        return running

    def finish(self, request: Request, reason: str, stop_reason: str | int | None = None) -> None:
        """End a running request now and free everything it holds."""
        request.status = RequestStatus.FINISHED
        request.finish_reason = reason
        request.stop_reason = stop_reason
        self.running.remove(request)
        del self._running_by_id[request.request_id]
        self.kv.free(request.request_id)
        self._cohort.discard(request.request_id)
        if request.slot is not None:
            self._free_slots.append(request.slot)
            self._pending_clears.append(request.slot)
            request.slot = None

    @property
    def num_unfinished(self) -> int:
        return len(self.waiting) + len(self.running)

    # ----- one step ------------------------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        self.stats.steps += 1
        output = SchedulerOutput(step=self.stats.steps)
        output.cleared_slots, self._pending_clears = self._pending_clears, []
        output.kv_copies = [c for rid, c in self._pending_copies if rid in self._running_by_id]
        self._pending_copies = []
        budget = self.config.max_num_batched_tokens
        for request in self._decode_candidates():
            output.decode_rows.append(self._decode_row(request, output))
            budget -= 1
        for request in self.running:
            if request.is_prefilling and budget > 0:
                budget -= self._schedule_chunk(request, budget, output)
        while self.waiting and self._free_slots and budget > 0:
            request = self.waiting[0]
            if not self.kv.can_reserve(self.pages_needed(request)):
                break  # strict order: a large request is not starved by smaller ones behind it
            self._admit(request)
            budget -= self._schedule_chunk(request, budget, output)
        if output.decode_rows:
            self.stats.decode_steps += 1
            self.stats.rows_per_step[len(output.decode_rows)] += 1
            self.stats.row_loops.update(row.loop for row in output.decode_rows)
        return output

    def _decode_candidates(self) -> list[Request]:
        decoding = [r for r in self.running if not r.is_prefilling]
        if self.config.scheduling == "refill":
            return decoding
        if not self._cohort:
            self._cohort = {request.request_id for request in decoding}
        return [request for request in decoding if request.request_id in self._cohort]

    def _admit(self, request: Request) -> None:
        self.waiting.pop(0)
        self._waiting_keys.pop(0)
        self.kv.reserve(request.request_id, request.params.max_loops, self.pages_needed(request))
        request.slot = self._free_slots.pop()
        request.status = RequestStatus.RUNNING
        self.running.append(request)
        self._running_by_id[request.request_id] = request

    def _grow(self, request: Request, plane: int, num_tokens: int, output: SchedulerOutput) -> None:
        start, pages = self.kv.grow(request.request_id, plane, num_tokens)
        if pages:
            assert request.slot is not None
            output.page_updates.append(PageTableUpdate(request.slot, plane, start, pages))

    def _schedule_chunk(self, request: Request, budget: int, output: SchedulerOutput) -> int:
        start = request.num_computed_tokens
        size = min(request.num_prompt_tokens - start, self.config.prefill_chunk_size, budget)
        end = start + size
        for plane in range(request.params.max_loops):
            self._grow(request, plane, end, output)
        assert request.slot is not None
        output.prefill_chunks.append(
            PrefillChunk(
                request_id=request.request_id,
                slot=request.slot,
                start=start,
                token_ids=request.prompt_token_ids[start:end],
                num_loops=request.params.max_loops,
                completes_prompt=end == request.num_prompt_tokens,
                sampling=SamplingInfo(request.params.params, request.params.seed, 0),
            )
        )
        self.stats.prefill_tokens += size
        return size

    def _decode_row(self, request: Request, output: SchedulerOutput) -> DecodeRow:
        params = request.params
        final_plane = params.max_loops - 1
        loop = request.next_loop
        if loop == 1:
            planes = range(params.max_loops) if self.config.kv_layout == "full" else [final_plane]
            for plane in planes:
                self._grow(request, plane, request.position + 1, output)
        exit_check, evaluate_gate = self._exit_check(request)
        assert request.slot is not None
        return DecodeRow(
            request_id=request.request_id,
            slot=request.slot,
            loop=loop,
            position=request.position,
            input_token=request.output_token_ids[-1],
            plane=loop - 1 if self.config.kv_layout == "full" else final_plane,
            exit=exit_check,
            evaluate_gate=evaluate_gate,
            survival=request.survival,
            min_loops=params.min_loops,
            exit_threshold=params.exit_threshold,
            sampling=SamplingInfo(params.params, params.seed, request.num_output_tokens),
        )

    def _exit_check(self, request: Request) -> tuple[ExitCheck, bool]:
        """(how this loop's exit is decided, whether the gate must be evaluated)."""
        params = request.params
        loop = request.next_loop
        if loop >= params.max_loops:
            return ExitCheck.EXIT, False
        if self.config.exit_mode == "trace":
            return (
                ExitCheck.EXIT if loop >= self.trace_depth(request) else ExitCheck.CONTINUE
            ), False
        if params.fixed_depth:
            return ExitCheck.CONTINUE, False
        if self.config.exit_mode == "ouro_delayed":
            if request.stop_after_next_loop:
                return ExitCheck.EXIT, False
            return ExitCheck.CONTINUE, True
        return (ExitCheck.IF_GATE if loop >= params.min_loops else ExitCheck.CONTINUE), True

    def trace_depth(self, request: Request) -> int:
        params = request.params
        depth = params.trace_depth(request.decode_index)
        if depth is None:
            if params.params.trace_depths is not None:
                depth = params.max_loops  # an explicit list that ran out: full depth
            else:
                depth = traced_depth(
                    params.seed, request.decode_index, self.config.trace_distribution
                )
        return max(params.min_loops, min(depth, params.max_loops))

    # ----- results -------------------------------------------------------------------------

    def update(self, scheduled: SchedulerOutput, result: RunnerOutput) -> list[Request]:
        """Apply a step's results; returns the requests that gained a token or finished."""
        changed: list[Request] = []
        for index, row in enumerate(scheduled.decode_rows):
            request = self._running_by_id.get(row.request_id)
            if request is None:
                continue  # finished (stop string) between schedule and update
            request.survival = result.survival[index]
            token = result.decode_tokens[index]
            if not result.exited[index]:
                request.next_loop += 1
                if result.exit_test[index] and self.config.exit_mode == "ouro_delayed":
                    request.stop_after_next_loop = True
                continue
            assert token is not None
            self._queue_exit_copy(request, row)
            self._cohort.discard(request.request_id)
            self._append_token(request, token, depth=row.loop)
            changed.append(request)
        for index, chunk in enumerate(scheduled.prefill_chunks):
            request = self._running_by_id.get(chunk.request_id)
            if request is None:
                continue
            request.num_computed_tokens += len(chunk.token_ids)
            token = result.prefill_tokens[index]
            if not chunk.completes_prompt:
                continue
            assert token is not None
            if self.config.kv_layout == "shared":
                for plane in range(request.params.max_loops - 1):
                    self.kv.release_plane(request.request_id, plane)
            self._append_token(request, token, depth=chunk.num_loops)
            changed.append(request)
        return changed

    def _queue_exit_copy(self, request: Request, row: DecodeRow) -> None:
        """`full` layout: make the exited token's K/V the version of every deeper plane."""
        if self.config.kv_layout != "full" or row.loop >= request.params.max_loops:
            return
        rid, position = request.request_id, row.position
        destinations = [
            self.kv.slot(rid, plane, position)
            for plane in range(row.loop, request.params.max_loops)
        ]
        copy = KVCopy(self.kv.slot(rid, row.loop - 1, position), destinations)
        self._pending_copies.append((rid, copy))

    def _append_token(self, request: Request, sampled: SampledToken, depth: int) -> None:
        request.output_token_ids.append(sampled.token_id)
        request.exit_depths.append(depth)
        if sampled.logprobs is not None:
            request.logprobs.append(sampled.logprobs)
        self.stats.generated_tokens += 1
        params = request.params
        token = sampled.token_id
        if token in params.eos_token_ids:
            self.finish(request, "stop")
        elif token in params.params.stop_token_ids:
            self.finish(request, "stop", stop_reason=token)
        elif request.num_output_tokens >= params.params.max_tokens:
            self.finish(request, "length")
        else:
            request.start_next_token()
