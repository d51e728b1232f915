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
import heapq
import itertools

from loopserve.engine.device_decode import MAX_STOP_TOKEN_IDS, DeviceSlots
from loopserve.engine.kv_manager import KVCacheManager, pages_needed
from loopserve.engine.scheduler_config import SchedulerConfig, SchedulerStats
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
    SlotStepResult,
)
from loopserve.engine.trace import resolved_trace_depth
from loopserve.request import Request, RequestStatus


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
        self._free_slots = list(range(config.max_num_seqs))  # a heap: lowest slot first
        self.device_slots = (
            DeviceSlots(config.exit_mode, config.trace_distribution)
            if config.decode_on_device
            else None
        )
        self._cohort: set[str] = set()
        self._pending_copies: list[tuple[str, KVCopy]] = []
        self._pending_clears: list[int] = []

    # ----- requests in and out -------------------------------------------------------------

    def pages_needed(self, request: Request) -> int:
        """Every page the request can ever hold (reserved at admission)."""
        # The last generated token is never fed back, so it needs no K/V.
        positions = request.num_prompt_tokens + request.params.params.max_tokens - 1
        return pages_needed(
            self.config.kv_layout,
            request.params.max_loops,
            request.num_prompt_tokens,
            positions,
            self.config.block_size,
        )

    def add(self, request: Request) -> None:
        stop_ids = request.params.eos_token_ids | set(request.params.params.stop_token_ids)
        if self.device_slots is not None and len(stop_ids) > MAX_STOP_TOKEN_IDS:
            raise ValueError(
                f"at most {MAX_STOP_TOKEN_IDS} end-of-sequence plus stop token ids per request "
                f"in device decode mode, got {len(stop_ids)}"
            )
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
        if self.device_slots is not None:
            self.device_slots.stop(request)
        if request.slot is not None:
            heapq.heappush(self._free_slots, request.slot)
            self._pending_clears.append(request.slot)
            request.slot = None

    @property
    def num_unfinished(self) -> int:
        return len(self.waiting) + len(self.running)

    def has_prompt_work(self) -> bool:
        """Whether the next step would run a prompt chunk."""
        if any(request.is_prefilling for request in self.running):
            return True
        if not self.waiting or not self._free_slots:
            return False
        return self.kv.can_reserve(self.pages_needed(self.waiting[0]))

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
            self._admit(request, output)
            budget -= self._schedule_chunk(request, budget, output)
        if self.device_slots is not None:
            self.device_slots.fill(output)
        if output.decode_rows:
            self.stats.decode_steps += 1
            self.stats.rows_per_step[len(output.decode_rows)] += 1
            self.stats.row_loops.update(row.loop for row in output.decode_rows)
        return output

    def _decode_candidates(self) -> list[Request]:
        if self.device_slots is not None:
            return []
        decoding = [r for r in self.running if not r.is_prefilling]
        if self.config.scheduling == "refill":
            return decoding
        if not self._cohort:
            self._cohort = {request.request_id for request in decoding}
        return [request for request in decoding if request.request_id in self._cohort]

    def _admit(self, request: Request, output: SchedulerOutput) -> None:
        self.waiting.pop(0)
        self._waiting_keys.pop(0)
        self.kv.reserve(request.request_id, request.params.max_loops, self.pages_needed(request))
        request.slot = heapq.heappop(self._free_slots)
        request.status = RequestStatus.RUNNING
        self.running.append(request)
        self._running_by_id[request.request_id] = request
        if self.device_slots is not None:
            # The device moves positions on by itself: every page is mapped from the start.
            loops = request.params.max_loops
            positions = request.num_prompt_tokens + request.params.params.max_tokens - 1
            for plane in range(loops):
                final = plane == loops - 1 or self.config.kv_layout == "full"
                self._grow(
                    request, plane, positions if final else request.num_prompt_tokens, output
                )

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
        return resolved_trace_depth(
            request.params, request.decode_index, self.config.trace_distribution
        )

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
            if self.device_slots is not None and not request.finished:
                self.device_slots.start(request)
            changed.append(request)
        if result.slot_step is not None:
            self._apply_slot_step(scheduled, result.slot_step, changed)
        return changed

    def _apply_slot_step(
        self, scheduled: SchedulerOutput, result: SlotStepResult, changed: list[Request]
    ) -> None:
        """Device decode mode: record what the device did, a step after it did it."""
        ran = sum(result.ran)
        if ran:
            self.stats.decode_steps += 1
            self.stats.rows_per_step[ran] += 1
            self.stats.row_loops.update(
                loop for loop, did in zip(result.loops, result.ran, strict=True) if did
            )
        for slot, exited in enumerate(result.exited):
            request_id = scheduled.slot_requests.get(slot)
            request = self._running_by_id.get(request_id) if request_id is not None else None
            if not exited or request is None:
                continue  # finished meanwhile (stop string, abort): its extra token is dropped
            token = result.tokens[slot]
            assert token is not None
            self._append_token(request, token, depth=result.loops[slot])
            if result.stopped[slot] != request.finished:
                raise RuntimeError(
                    f"device and host disagree on whether {request.request_id!r} stopped"
                )
            changed.append(request)

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
