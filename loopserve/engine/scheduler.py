"""Admission, prompt chunks, decode slots, KV pages and preemption: what the next step runs.

Owns: the waiting and running requests and their order (priority, then arrival, with a bound on
how often a request is passed over), admission, request slots, prompt chunks within the token
budget, growing every request's page tables before the step that needs them, preemption when
pages run out, prefix-cache lookups and registrations, handing a request's in-flight token to the
decode step and taking it back, and applying a step's results. Must not: import torch, or decide
exits and refills: the decode step does, by `depth.policy`. Which planes a request holds and when
they are freed comes from `kv.layout`; how many pages a request needs, from `engine.page_budget`.

Pages. With `kv_allocation="incremental"` a request holds pages for what it has computed plus what
the next step can write: a prompt chunk's positions in every plane before the chunk runs, and for a
decoding request the position after its in-flight token (the step may run one token ahead of what
the host has read back). Admission keeps `kv_watermark` of the cache free so running requests can
grow, and (`kv_growth_estimate="learned"`) the pages they and the new request are expected to take
(`page_budget.UsedShare`). When a request cannot grow, the latest, lowest-priority running request
is preempted: its K/V are copied to host memory (bit for bit), its pages and slot freed, and it
waits at its old place in line; admitted again, it gets new pages, its K/V come back, and its
in-flight token restarts at loop 1 (which recomputes it exactly). With `preemption_mode="recompute"`
its K/V are dropped instead, and admitted again it prefills its prompt and generated tokens (each
to its recorded exit depth, `Request.replay_loops`) before its in-flight token restarts. With
`kv_allocation="reserve"` admission reserves every page a request can need and nothing is ever
preempted.
"""

from __future__ import annotations

import itertools

from loopserve.config import PreemptionMode, SchedulerConfig
from loopserve.engine.kv_manager import KVCacheManager
from loopserve.engine.page_budget import ExpectedEnd, PageBudget
from loopserve.engine.prefix_cache import block_hashes
from loopserve.engine.request_slots import RequestSlots
from loopserve.engine.scheduler_output import (
    PageMove,
    PageTableUpdate,
    PrefillChunk,
    RunnerOutput,
    SchedulerOutput,
)
from loopserve.engine.stats import SchedulerStats
from loopserve.engine.step_results import apply_results
from loopserve.kv.layout import KVLayout
from loopserve.request import Request, RequestStatus
from loopserve.sampling_params import SamplingInfo


class Scheduler:
    """Args:
    num_loops: the model's loop count (a speculating request's lanes depend on it).
    pinned_swap_pages: pages the runner's pinned swap space holds (None: host memory needs no
        pinning), for `preemption_mode="auto"`.
    replays: the model's prefill can replay generated tokens (no prelude or coda layers).
    """

    def __init__(
        self,
        config: SchedulerConfig,
        kv: KVCacheManager,
        num_loops: int,
        pinned_swap_pages: int | None = None,
        replays: bool = True,
    ) -> None:
        self.config = config
        self.layout = config.kv_layout
        self.kv = kv
        self.pages = PageBudget(config, kv, config.lanes(num_loops))
        self.waiting: list[Request] = []
        self.running: list[Request] = []
        self._running_by_id: dict[str, Request] = {}
        self.stats = SchedulerStats()
        self._arrivals = itertools.count()
        self.slots = RequestSlots(config.max_num_seqs)
        self._swap_out: list[PageMove] = []
        self._dropped_swaps: list[str] = []
        self._pinned_swap_pages = pinned_swap_pages
        self._replays = replays and config.kv_layout is KVLayout.FULL
        # Speculation: whether decoding tokens run in the speculating decode step now.
        self._speculating = config.speculative_config is not None

    # ----- requests in and out -------------------------------------------------------------

    def add(self, request: Request) -> None:
        needed = self.pages.pages_needed(request)
        if needed > self.kv.num_usable_pages:
            raise ValueError(
                f"request {request.request_id!r} needs {needed} KV pages (prompt + max_tokens over "
                f"{request.params.max_loops} loop planes) but the cache has only "
                f"{self.kv.num_usable_pages}; lower max_tokens or max_loops, use "
                "kv_layout='shared', or give the KV cache more memory"
            )
        request.arrival_index = next(self._arrivals)
        if self.kv.cache is not None:
            request.block_hashes = block_hashes(request.prompt_token_ids, self.config.block_size)
        self.waiting.append(request)

    def abort(self, request_id: str) -> Request | None:
        for index, request in enumerate(self.waiting):
            if request.request_id == request_id:
                del self.waiting[index]
                request.status = RequestStatus.FINISHED
                request.finish_reason = "abort"
                if request.swapped_pages is not None:
                    request.swapped_pages = None
                    self._dropped_swaps.append(request_id)
                return request
        running = self._running_by_id.get(request_id)
        if running is not None:
            self.finish(running, "abort")
        return running

    def finish(self, request: Request, reason: str, stop_reason: str | int | None = None) -> None:
        """End a running request now and free everything it holds."""
        if reason != "abort":
            self.pages.used_share.observe(request)
        request.status = RequestStatus.FINISHED
        request.finish_reason = reason
        request.stop_reason = stop_reason
        self._leave_slot(request, self.slots.pending_clears)

    def stop_at(self, request: Request, num_outputs: int, stop_reason: str) -> None:
        """A stop string ended the request at output `num_outputs`: outputs after it (a
        speculating step may report several at once) are dropped, as decoding token by token
        would never have made them."""
        observed = request.num_output_tokens
        del request.output_token_ids[num_outputs:]
        del request.exit_depths[num_outputs:]
        del request.logprobs[num_outputs:]
        self.stats.generated_tokens -= observed - num_outputs
        if request.finished:  # by a later token of the same step, observed with every output
            if request.finish_reason != "abort":
                self.pages.used_share.amend(request, observed)
            request.finish_reason, request.stop_reason = "stop", stop_reason
        else:
            self.finish(request, "stop", stop_reason=stop_reason)

    def _leave_slot(self, request: Request, clears: list[int]) -> None:
        """Free a running request's pages and slot (it finished or is preempted); its slot's
        tables are cleared through `clears`."""
        self.running.remove(request)
        del self._running_by_id[request.request_id]
        self.kv.free(request.request_id)
        self.slots.release(request, clears)

    @property
    def speculating(self) -> bool:
        """Whether decoding tokens run in the speculating decode step now."""
        return self._speculating

    @property
    def num_unfinished(self) -> int:
        return len(self.waiting) + len(self.running)

    def needs_sync(self) -> bool:
        """Whether the next step must see every earlier step's results first: it runs a prompt
        chunk, it may have to preempt (which must know where each token stands), or it switches
        speculation on or off (which starts every decoding token again)."""
        if any(request.is_prefilling for request in self.running):
            return True
        if self._speculation_wanted() != self._speculating:
            return True
        if (
            self.waiting
            and self.slots.any_free
            and self._admission_cost(self._next_waiting()) is not None
        ):
            return True
        growth = sum(self.pages.decode_growth(request) for request in self.running)
        return growth > self.kv.num_available_pages

    # ----- one step ------------------------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        self.stats.steps += 1
        output = SchedulerOutput(step=self.stats.steps)
        output.cleared_slots, self.slots.pending_clears = self.slots.pending_clears, []
        self._switch_speculation(output)
        for request in self._by_rank(self.running):
            if request.status is RequestStatus.RUNNING and request.is_decoding:
                self._cover_decode(request, output)
        budget = self.config.max_num_batched_tokens
        for request in self._by_rank(self.running):
            if request.status is RequestStatus.RUNNING and request.is_prefilling and budget > 0:
                budget -= self._schedule_chunk(request, budget, output)
        # The running requests' expected ends, kept over this step's admissions (the growth
        # estimate; nothing running grows between them but the requests admitted).
        ends = None
        if self.pages.estimates and self.waiting and self.slots.any_free:
            ends = self.pages.expected_ends(self.running)
        while self.waiting and self.slots.any_free and budget > 0:
            request = self._next_waiting()
            if not self._admit(request, output, ends):
                break  # strict order: a large request is not starved by smaller ones behind it
            if request.is_prefilling:
                # Chunks scheduled above may belong to requests ranked below this one: no
                # preemption here (a preempted request must have nothing in this step).
                budget -= self._schedule_chunk(request, budget, output, may_preempt=False)
            if ends is not None:
                ends += self.pages.expected_ends([request])
        output.swap_out, self._swap_out = self._swap_out, []
        output.dropped_swaps, self._dropped_swaps = self._dropped_swaps, []
        self.slots.hand_over(output)
        return output

    def _speculation_wanted(self) -> bool:
        """Speculate while few enough requests decode (`SpeculativeConfig.speculates_with`)."""
        speculative = self.config.speculative_config
        if speculative is None:
            return False
        decoding = sum(r.is_decoding for r in self.running)
        return speculative.speculates_with(decoding, self._speculating)

    def _switch_speculation(self, output: SchedulerOutput) -> None:
        """Turn speculation on or off for this step and later ones. A switch empties the other
        decode step and starts every decoding request's token again at loop 1 in this one (its
        proposals are dropped), which recomputes it exactly; the engine read every earlier
        step back first (`needs_sync`)."""
        wanted = self._speculation_wanted()
        output.speculate = wanted
        if wanted == self._speculating:
            return
        self._speculating = wanted
        output.switched = True
        self.stats.speculation_switches += 1
        self.slots.restart([r for r in self.running if self.slots.is_decoding(r.slot)])

    def _by_rank(self, requests: list[Request]) -> list[Request]:
        """Most important first: urgent (passed over too often), then priority, then arrival."""
        limit = self.config.priority_bypass_limit
        return sorted(
            requests,
            key=lambda r: (r.times_bypassed < limit, r.priority, r.arrival_index),
        )

    def _next_waiting(self) -> Request:
        return self._by_rank(self.waiting)[0]

    def _ensure_pages(
        self,
        request: Request,
        tokens_per_plane: dict[int, int],
        output: SchedulerOutput,
        may_preempt: bool = True,
    ) -> bool:
        """Make room for the request's tables to cover `tokens_per_plane`, preempting requests
        ranked below it when `may_preempt`; False when that is not enough."""
        need = sum(
            self.kv.pages_to_grow(request.request_id, plane, tokens)
            for plane, tokens in tokens_per_plane.items()
        )
        need -= min(need, self.kv.reservation(request.request_id))
        while need > self.kv.num_available_pages:
            lowest = self._by_rank(self.running)[-1]
            if not may_preempt or lowest is request:
                return False
            self._preempt(lowest, output)
        return True

    def _grow(
        self, request: Request, tokens_per_plane: dict[int, int], output: SchedulerOutput
    ) -> None:
        assert request.slot is not None
        for plane, tokens in tokens_per_plane.items():
            start, pages = self.kv.grow(request.request_id, plane, tokens)
            if pages:
                output.page_updates.append(PageTableUpdate(request.slot, plane, start, pages))

    def _cover_decode(self, request: Request, output: SchedulerOutput) -> None:
        if not self.pages.decode_pages(request):
            return  # its tables cover the next step (nothing to grow, so nothing to preempt)
        targets = self.pages.decode_targets(request)
        if self._ensure_pages(request, targets, output):
            self._grow(request, targets, output)
        else:
            self._preempt(request, output)

    def _schedule_chunk(
        self, request: Request, budget: int, output: SchedulerOutput, may_preempt: bool = True
    ) -> int:
        start = request.num_computed_tokens
        size = min(request.num_prefill_tokens - start, self.config.prefill_chunk_size, budget)
        end = start + size
        last = end == request.num_prefill_tokens
        replaying = request.num_output_tokens > 0  # recomputing K/V: nothing to sample
        targets = {plane: end for plane in range(request.params.max_loops)}
        if not self._ensure_pages(request, targets, output, may_preempt):
            return 0  # it waits for pages (nothing ranked below it holds any)
        self._grow(request, targets, output)
        assert request.slot is not None
        output.prefill_chunks.append(
            PrefillChunk(
                request_id=request.request_id,
                slot=request.slot,
                start=start,
                token_ids=request.prefill_token_ids(start, end),
                num_loops=request.params.max_loops,
                completes_prompt=last and not replaying,
                sampling=SamplingInfo(request.params.params, request.params.seed, 0),
                token_loops=request.replay_loops(start, end),
                completes_replay=last and replaying,
            )
        )
        self.stats.prefill_tokens += size
        if replaying:
            self.stats.recomputed_tokens += size
        return size

    # ----- admission, preemption, resumption -----------------------------------------------

    def _admission_cost(
        self, request: Request, ends: list[ExpectedEnd] | None = None
    ) -> int | None:
        return self.pages.admission_cost(request, self.running, ends)

    def _admit(
        self, request: Request, output: SchedulerOutput, ends: list[ExpectedEnd] | None = None
    ) -> bool:
        if self._admission_cost(request, ends) is None:
            return False
        self.waiting.remove(request)
        for other in self.waiting:
            if other.arrival_index < request.arrival_index:
                other.times_bypassed += 1
        request.slot = self.slots.take()
        request.status = RequestStatus.RUNNING
        self.running.append(request)
        self._running_by_id[request.request_id] = request
        if request.swapped_pages is not None:  # never in `reserve` mode: nothing is preempted
            self.kv.admit(request.request_id, request.params.max_loops)
            self._resume(request, output)
            return True
        hit = self.pages.cached_blocks(request)
        reserve = self.pages.reservation(request, len(hit)) if self.pages.reserve else 0
        self.kv.admit(request.request_id, request.params.max_loops, reserve)
        self.stats.prefix_query_tokens += request.num_prompt_tokens
        if hit:
            self.kv.share_prefix(request.request_id, hit)
            for plane, table in enumerate(self.kv.tables(request.request_id)):
                output.page_updates.append(PageTableUpdate(request.slot, plane, 0, table))
            request.num_computed_tokens = len(hit) * self.config.block_size
            self.stats.prefix_hit_tokens += request.num_computed_tokens
        return True

    def _preempt(self, victim: Request, output: SchedulerOutput) -> None:
        """Move a running request's K/V to host memory (or drop them, to be recomputed) and put
        it back in line."""
        tables = self.kv.tables(victim.request_id)
        pages = [page for table in tables for page in table]
        if not self._recomputes(len(pages)):
            self._swap_out.append(PageMove(victim.request_id, pages))
            victim.swapped_pages = [len(table) for table in tables]
            self.stats.swapped_out_pages += len(pages)
        else:  # its prompt and all but its in-flight token are prefilled again when admitted
            victim.num_computed_tokens = 0
            victim.num_replay_tokens = max(victim.num_output_tokens - 1, 0)
        slot = victim.slot
        output.page_updates = [update for update in output.page_updates if update.slot != slot]
        self._leave_slot(victim, output.cleared_slots)
        victim.status = RequestStatus.WAITING
        victim.num_preemptions += 1
        self.stats.preemptions += 1
        self.waiting.append(victim)

    def _recomputes(self, num_pages: int) -> bool:
        """Whether a victim holding `num_pages` is recomputed rather than swapped."""
        mode = self.config.preemption_mode
        if mode is not PreemptionMode.AUTO:
            return mode is PreemptionMode.RECOMPUTE
        pinned = self._pinned_swap_pages
        if not self._replays or pinned is None:
            return False
        # Pages preempted requests hold in host memory (only waiting requests hold any).
        held = sum(sum(r.swapped_pages) for r in self.waiting if r.swapped_pages is not None)
        return held + num_pages > pinned

    def _resume(self, request: Request, output: SchedulerOutput) -> None:
        """Give a preempted request new pages, its K/V back, and (decoding) its slot."""
        assert request.swapped_pages is not None and request.slot is not None
        pages: list[int] = []
        for plane, count in enumerate(request.swapped_pages):
            start, new = self.kv.grow(request.request_id, plane, count * self.config.block_size)
            if new:
                output.page_updates.append(PageTableUpdate(request.slot, plane, start, new))
            pages += new
        output.swap_in.append(PageMove(request.request_id, pages))
        request.swapped_pages = None
        if request.is_decoding:
            for plane in self.layout.prompt_only_planes(request.params.max_loops):
                self.kv.release_plane(request.request_id, plane)
            self._grow(request, self.pages.decode_targets(request), output)
            self.slots.start(request)

    # ----- results -------------------------------------------------------------------------

    def running_request(self, request_id: str | None) -> Request | None:
        """The running request of that id (None: not running, or finished meanwhile)."""
        return self._running_by_id.get(request_id) if request_id is not None else None

    def update(self, scheduled: SchedulerOutput, result: RunnerOutput) -> list[tuple[Request, int]]:
        """Apply a step's results; returns the requests that gained tokens or finished, each
        with its number of new tokens (more than one only where requests speculate)."""
        return apply_results(self, scheduled, result)
