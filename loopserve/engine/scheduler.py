"""Admission, prompt chunks and decode slots: what the next engine step runs.

Owns: the waiting and running queues, admission against the KV reservation, request slots, prompt
chunks within the token budget, handing a request's in-flight token to the decode step and taking
it back, applying a step's results (tokens, finishes), and the torch-free statistics. Must not:
import torch, or decide exits and refills: the decode step does, by `depth.policy`. Which planes a
request holds and when they are freed comes from `kv.layout`.

Prompt chunks run all their loops inside the step that schedules them. Once a prompt is done and
its first token sampled, the request's slot is started in the decode step, which from then on runs
one loop per step for it, next to slots at other depths, until the step (a stop token id,
`max_tokens`) or the host (a stop string, an abort) ends it.
"""

from __future__ import annotations

import bisect
import heapq
import itertools

from loopserve.config import SchedulerConfig
from loopserve.engine.kv_manager import KVCacheManager
from loopserve.engine.scheduler_output import (
    DecodeResult,
    PageTableUpdate,
    PrefillChunk,
    RunnerOutput,
    SampledToken,
    SchedulerOutput,
    SlotStart,
)
from loopserve.engine.stats import SchedulerStats
from loopserve.request import Request, RequestStatus
from loopserve.sampling_params import SamplingInfo


class Scheduler:
    def __init__(self, config: SchedulerConfig, kv: KVCacheManager) -> None:
        self.config = config
        self.layout = config.kv_layout
        self.kv = kv
        self.waiting: list[Request] = []
        self.running: list[Request] = []
        self._running_by_id: dict[str, Request] = {}
        self.stats = SchedulerStats()
        self._order = itertools.count()
        self._waiting_keys: list[tuple[int, int]] = []
        self._free_slots = list(range(config.max_num_seqs))  # a heap: lowest slot first
        self._decoding: dict[int, str] = {}  # slot -> request id, for slots live in the step
        self._starts: list[SlotStart] = []
        self._stops: list[int] = []
        self._pending_clears: list[int] = []

    # ----- requests in and out -------------------------------------------------------------

    def pages_needed(self, request: Request) -> int:
        """Every page the request can ever hold (reserved at admission)."""
        return self.layout.pages_needed(
            request.params.max_loops,
            request.num_prompt_tokens,
            self._num_positions(request),
            self.config.block_size,
        )

    @staticmethod
    def _num_positions(request: Request) -> int:
        """Positions with K/V: the prompt and every generated token but the last, which is
        never fed back."""
        return request.num_prompt_tokens + request.params.params.max_tokens - 1

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
        slot = request.slot
        if slot is None:
            return
        if self._decoding.get(slot) == request.request_id:
            del self._decoding[slot]
            self._starts = [start for start in self._starts if start.slot != slot]
            self._stops.append(slot)
        heapq.heappush(self._free_slots, slot)
        self._pending_clears.append(slot)
        request.slot = None

    @property
    def decode_slots(self) -> dict[int, str]:
        """Slot -> request id of every request whose token is in the decode step."""
        return dict(self._decoding)

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
        budget = self.config.max_num_batched_tokens
        for request in self.running:
            if request.is_prefilling and budget > 0:
                budget -= self._schedule_chunk(request, budget, output)
        while self.waiting and self._free_slots and budget > 0:
            request = self.waiting[0]
            if not self.kv.can_reserve(self.pages_needed(request)):
                break  # strict order: a large request is not starved by smaller ones behind it
            self._admit(request, output)
            budget -= self._schedule_chunk(request, budget, output)
        output.slot_stops, self._stops = self._stops, []
        output.slot_starts, self._starts = self._starts, []
        output.decode_slots = self.decode_slots
        return output

    def _admit(self, request: Request, output: SchedulerOutput) -> None:
        self.waiting.pop(0)
        self._waiting_keys.pop(0)
        self.kv.reserve(request.request_id, request.params.max_loops, self.pages_needed(request))
        request.slot = heapq.heappop(self._free_slots)
        request.status = RequestStatus.RUNNING
        self.running.append(request)
        self._running_by_id[request.request_id] = request
        # The decode step moves positions on by itself, so every page is mapped from the start.
        loops = request.params.max_loops
        generated = self.layout.generated_planes(loops)
        for plane in range(loops):
            prompt_only = plane not in generated
            tokens = request.num_prompt_tokens if prompt_only else self._num_positions(request)
            self._grow(request, plane, tokens, output)

    def _grow(self, request: Request, plane: int, num_tokens: int, output: SchedulerOutput) -> None:
        start, pages = self.kv.grow(request.request_id, plane, num_tokens)
        if pages:
            assert request.slot is not None
            output.page_updates.append(PageTableUpdate(request.slot, plane, start, pages))

    def _schedule_chunk(self, request: Request, budget: int, output: SchedulerOutput) -> int:
        start = request.num_computed_tokens
        size = min(request.num_prompt_tokens - start, self.config.prefill_chunk_size, budget)
        end = start + size
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

    # ----- results -------------------------------------------------------------------------

    def update(self, scheduled: SchedulerOutput, result: RunnerOutput) -> list[Request]:
        """Apply a step's results; returns the requests that gained a token or finished."""
        changed: list[Request] = []
        for chunk, token in zip(scheduled.prefill_chunks, result.prefill_tokens, strict=True):
            request = self._running_by_id.get(chunk.request_id)
            if request is None:
                continue  # aborted while its chunk ran
            request.num_computed_tokens += len(chunk.token_ids)
            if not chunk.completes_prompt:
                continue
            assert token is not None
            for plane in self.layout.prompt_only_planes(request.params.max_loops):
                self.kv.release_plane(request.request_id, plane)
            self._append_token(request, token, depth=chunk.num_loops)
            if not request.finished:
                self._start_slot(request)
            changed.append(request)
        if result.decode is not None:
            self._apply_decode(scheduled, result.decode, changed)
        return changed

    def _start_slot(self, request: Request) -> None:
        assert request.slot is not None
        self._starts.append(
            SlotStart(
                slot=request.slot,
                token=request.output_token_ids[-1],
                position=request.position,
                num_output_tokens=request.num_output_tokens,
                params=request.params,
            )
        )
        self._decoding[request.slot] = request.request_id

    def _apply_decode(
        self, scheduled: SchedulerOutput, result: DecodeResult, changed: list[Request]
    ) -> None:
        """Record what the decode step did (a step after it did it, when asynchronous)."""
        ran = sum(result.ran)
        if ran:
            self.stats.decode_steps += 1
            self.stats.rows_per_step[ran] += 1
            self.stats.row_loops.update(
                loop for loop, did in zip(result.loops, result.ran, strict=True) if did
            )
        for slot, exited in enumerate(result.exited):
            request_id = scheduled.decode_slots.get(slot)
            request = self._running_by_id.get(request_id) if request_id is not None else None
            if not exited or request is None:
                continue  # finished meanwhile (stop string, abort): its extra token is dropped
            token = result.tokens[slot]
            assert token is not None
            self._append_token(request, token, depth=result.loops[slot])
            if result.stopped[slot] != request.finished:
                raise RuntimeError(
                    f"the decode step and the scheduler disagree on whether "
                    f"{request.request_id!r} stopped"
                )
            changed.append(request)

    def _append_token(self, request: Request, sampled: SampledToken, depth: int) -> None:
        """Record a generated token and finish the request if it ends it. The decode step applies
        the same stop rule on the device (stop_token_ids, eos ids, max_tokens) to stop its slot
        without a host round trip; `_apply_decode` checks that the two agree."""
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
