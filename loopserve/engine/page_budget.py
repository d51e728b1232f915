"""How many KV pages a request needs, now and at most: the scheduler's page arithmetic.

Owns: a request's page needs under the configured layout and allocation mode — every page it can
ever hold (`pages_needed`), what admitting it takes from the pool now (`admission_cost`), what its
in-flight decode token needs covered before the next step (`decode_targets`, `decode_growth`), the
cached prompt blocks it can share, `reserve` mode's reservation, and `incremental` mode's estimate
of the pages running requests will still take (`expected_peak`, from `UsedShare`, which the
scheduler tells of each finished request). Must not: change the KV manager's state (it reads it; the
scheduler allocates, frees and preempts), or import torch.

The estimate is SGLang's new-token ratio turned into a measurement. Admitting on the first prompt
chunk alone (vLLM's rule, `kv_growth_estimate="none"`) fills the pool with prompts whose outputs
then have no room: each preemption after that throws work away (a recompute runs the prompt again).
Counting every request's whole max_tokens at once is `reserve` mode, which admits too few where
requests stop early at EOS, and more than needed even where they do not, since they end at different
times. So admission keeps free the peak of what the running requests and the new one are expected to
take: each is expected to run the share of its remaining max_tokens that finished requests actually
generated (an average that moves a tenth of the way to each new one, 0.7 before any finished),
growing until then and freeing its own pages at its end (prompt blocks shared through the prefix
cache stay with the others). Where requests run to max_tokens the share tends to 1 and nothing is
admitted that would be preempted later; where they stop at a tenth of max_tokens it tends to 0.1 and
admission is nearly vLLM's.
"""

from __future__ import annotations

import math
from typing import NamedTuple

from loopserve.config import GrowthEstimate, KVAllocation, SchedulerConfig
from loopserve.engine.kv_manager import KVCacheManager
from loopserve.kv.pages import pages_for
from loopserve.request import Request

# The most tokens the estimate expects any request to still generate (SGLang clips its estimate the
# same way): a request that leaves max_tokens at the rest of a long context is not counted as
# taking all of it.
CLIP_TOKENS = 4096


def token_budget(request: Request) -> int:
    """The max_tokens the estimate counts for a request: its own, at most `CLIP_TOKENS`."""
    return min(request.params.params.max_tokens, CLIP_TOKENS)


class UsedShare:
    """The share of its `token_budget` that finished requests generated: a running average that
    moves `WEIGHT` of the way to each new request's share, from `PRIOR`."""

    PRIOR = 0.7  # SGLang's initial new-token ratio
    WEIGHT = 0.1

    def __init__(self) -> None:
        self.value = self.PRIOR

    def observe(self, request: Request) -> None:
        """A request finished by EOS, a stop or its length (not aborted)."""
        self.value += self.WEIGHT * (self._share(request, request.num_output_tokens) - self.value)

    def amend(self, request: Request, observed_outputs: int) -> None:
        """The request was observed with `observed_outputs` outputs and has fewer now (a stop
        string in an earlier output of the same step): its share is replaced (exactly, unless
        other requests were observed since)."""
        now = self._share(request, request.num_output_tokens)
        self.value += self.WEIGHT * (now - self._share(request, observed_outputs))

    @staticmethod
    def _share(request: Request, outputs: int) -> float:
        return min(1.0, outputs / token_budget(request))


class ExpectedEnd(NamedTuple):
    """A request's expected end (`PageBudget.expected_end`), in the estimate's terms."""

    tokens: int  # generated tokens until it
    at_once: int  # pages it takes at once: the rest of its prompt, a partly filled page a plane
    per_token: float  # pages it takes per generated token after that
    frees: int  # of the pages it holds now, those it gives back at its end (no one else's)


class PageBudget:
    def __init__(self, config: SchedulerConfig, kv: KVCacheManager, lanes: int) -> None:
        self.config = config
        self.layout = config.kv_layout
        self.reserve = config.kv_allocation is KVAllocation.RESERVE
        self.kv = kv
        self.watermark = math.ceil(config.kv_watermark * kv.num_usable_pages)
        self.lanes = lanes  # decode rows per request (SchedulerConfig.lanes)
        self.estimates = config.kv_growth_estimate is GrowthEstimate.LEARNED and not self.reserve
        self.used_share = UsedShare()

    def pages_needed(self, request: Request) -> int:
        """Every page the request can ever hold at once."""
        return self.layout.pages_needed(
            request.params.max_loops,
            request.num_prompt_tokens,
            self.num_positions(request),
            self.config.block_size,
        )

    @staticmethod
    def num_positions(request: Request) -> int:
        """Positions with K/V: the prompt and every generated token but the last, which is
        never fed back."""
        return request.num_prompt_tokens + request.params.params.max_tokens - 1

    def decode_targets(self, request: Request) -> dict[int, int]:
        """Tokens each plane must cover before the next decode step (`_decode_tokens`)."""
        tokens = self._decode_tokens(request)
        return {plane: tokens for plane in self.layout.generated_planes(request.params.max_loops)}

    def decode_pages(self, request: Request) -> int:
        """New pages `decode_targets` takes, reservation included (0: the tables cover the next
        step already, as in most steps, a page holding `block_size` positions)."""
        planes = self.layout.generated_planes(request.params.max_loops)
        tokens = self._decode_tokens(request)
        return self.kv.pages_to_grow_planes(request.request_id, planes, tokens)

    def decode_growth(self, request: Request) -> int:
        """Pages the request's next decode step takes from the pool (0 when not decoding)."""
        if not request.is_decoding:
            return 0
        need = self.decode_pages(request)
        return max(0, need - self.kv.reservation(request.request_id)) if need else 0

    def _decode_tokens(self, request: Request) -> int:
        """Up to the position after the in-flight token (the step may run one token ahead of
        the host). A speculating request's step may be `lanes` tokens ahead and run `lanes`
        positions from there."""
        return min(request.position + 2 * self.lanes, self.num_positions(request))

    def admission_cost(
        self, request: Request, running: list[Request], ends: list[ExpectedEnd] | None = None
    ) -> int | None:
        """Pages admitting the request now takes from the pool, or None if it cannot be admitted
        now. In `incremental` mode, unless nothing runs, `kv_watermark` of the cache stays free
        and, with the learned estimate, the most pages the running requests and this one are
        expected to take on top at any one time (`expected_peak`). `ends`: the running
        requests' `expected_ends`, when the caller keeps them over several admissions."""
        planes = request.params.max_loops
        if request.swapped_pages is not None:
            cost = sum(request.swapped_pages) + len(self.layout.generated_planes(planes))
            holds, shared = cost, 0
        else:
            hit = self.cached_blocks(request)
            idle_hits = self.kv.num_idle(page for block in hit for page in block)
            if self.reserve:
                cost = self.reservation(request, len(hit)) + idle_hits
            else:
                start = len(hit) * self.config.block_size
                end = min(request.num_prefill_tokens, start + self.config.prefill_chunk_size)
                cost = planes * (pages_for(end, self.config.block_size) - len(hit)) + idle_hits
            holds, shared = cost - idle_hits + planes * len(hit), planes * len(hit)
        margin = 0
        if running and not self.reserve:
            margin = self.watermark
            if self.estimates:
                if ends is None:
                    ends = self.expected_ends(running)
                candidate = self.expected_end(request, holds, holds - shared)
                margin += self.expected_peak([*ends, candidate])
        return cost if cost + margin <= self.kv.num_available_pages else None

    def expected_ends(self, running: list[Request]) -> list[ExpectedEnd]:
        """The running requests' `expected_end`s, from the pages they hold now."""
        return [self.expected_end(r, *self.kv.page_counts(r.request_id)) for r in running]

    def expected_end(self, request: Request, held: int, own: int) -> ExpectedEnd:
        """When a request holding `held` pages (`own` of them referenced by it alone) is
        expected to end (the `UsedShare` of the tokens max_tokens leaves it, at most
        `CLIP_TOKENS`), what it takes until then, and what it frees at its end."""
        loops = request.params.max_loops
        planes = len(self.layout.generated_planes(loops))
        positions = min(request.num_prompt_tokens + request.num_output_tokens,
                        self.num_positions(request))  # fmt: skip
        now = self.layout.pages_needed(
            loops, request.num_prompt_tokens, positions, self.config.block_size
        )
        left = min(request.params.params.max_tokens - request.num_output_tokens, CLIP_TOKENS)
        # Still prefilling, it takes the rest of its prompt at once; decoding, it holds all it
        # needs now (in the shared layout it has freed its prompt-only planes). A partly filled
        # page per plane goes on top of the straight line of its growth.
        at_once = max(0, now - held) if request.is_prefilling else 0
        return ExpectedEnd(
            tokens=max(1, math.ceil(self.used_share.value * left)),
            at_once=at_once + planes,
            per_token=planes / self.config.block_size,
            frees=own,
        )

    @staticmethod
    def expected_peak(ends: list[ExpectedEnd]) -> int:
        """The most pages, beyond those taken now, that requests with these `ends` are expected
        to hold at any one time: each grows until its end, then frees its own pages. So the peak
        comes just before an end; sorted by their ends, one pass finds it."""
        ends = sorted(ends)
        at_once = sum(end.at_once for end in ends)
        per_token = sum(end.per_token for end in ends)
        freed, peak = 0, 0.0
        for end in ends:  # just before this end, it and the later ones are still growing
            peak = max(peak, at_once + per_token * end.tokens - freed)
            at_once, per_token = at_once - end.at_once, per_token - end.per_token
            freed += end.frees
        return math.ceil(peak)

    def reservation(self, request: Request, hit_blocks: int) -> int:
        """`reserve` mode: every page the request can need beyond the cached ones it shares."""
        return self.pages_needed(request) - hit_blocks * request.params.max_loops

    def cached_blocks(self, request: Request) -> list[list[int]]:
        """The cached prompt blocks it can share: at least one prompt token is always computed
        (the first output token is sampled from it)."""
        usable = (request.num_prompt_tokens - 1) // self.config.block_size
        return self.kv.cached_prefix(request.block_hashes[:usable], request.params.max_loops)
