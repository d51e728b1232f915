"""How many KV pages a request needs, now and at most: the scheduler's page arithmetic.

Owns: a request's page needs under the configured layout and allocation mode — every page it can
ever hold (`pages_needed`), what admitting it takes from the pool now (`admission_cost`), what its
in-flight decode token needs covered before the next step (`decode_targets`, `decode_growth`),
the cached prompt blocks it can share, and `reserve` mode's reservation. Must not: change any
state (it reads the KV manager; the scheduler allocates, frees and preempts), or import torch.
"""

from __future__ import annotations

import math

from loopserve.config import KVAllocation, SchedulerConfig
from loopserve.engine.kv_manager import KVCacheManager
from loopserve.kv.pages import pages_for
from loopserve.request import Request


class PageBudget:
    def __init__(self, config: SchedulerConfig, kv: KVCacheManager, lanes: int) -> None:
        self.config = config
        self.layout = config.kv_layout
        self.reserve = config.kv_allocation is KVAllocation.RESERVE
        self.kv = kv
        self.watermark = math.ceil(config.kv_watermark * kv.num_usable_pages)
        self.lanes = lanes  # decode rows per request (SchedulerConfig.lanes)

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
        """Tokens each plane must cover before the next decode step: up to the position after
        the in-flight token (the step may run one token ahead of the host). A speculating
        request's step may be `lanes` tokens ahead and run `lanes` positions from there."""
        tokens = min(request.position + 2 * self.lanes, self.num_positions(request))
        return {plane: tokens for plane in self.layout.generated_planes(request.params.max_loops)}

    def decode_growth(self, request: Request) -> int:
        """Pages the request's next decode step takes from the pool (0 when not decoding)."""
        if not request.is_decoding:
            return 0
        targets = self.decode_targets(request)
        need = sum(self.kv.pages_to_grow(request.request_id, p, t) for p, t in targets.items())
        return max(0, need - self.kv.reservation(request.request_id))

    def admission_cost(self, request: Request, others_running: bool) -> int | None:
        """Pages admitting the request now takes from the pool, or None if it cannot be admitted
        now (in `incremental` mode `kv_watermark` of the cache stays free, unless nothing runs)."""
        planes = request.params.max_loops
        if request.swapped_pages is not None:
            cost = sum(request.swapped_pages) + len(self.layout.generated_planes(planes))
        else:
            hit = self.cached_blocks(request)
            idle_hits = self.kv.num_idle(page for block in hit for page in block)
            if self.reserve:
                cost = self.reservation(request, len(hit)) + idle_hits
            else:
                start = len(hit) * self.config.block_size
                end = min(request.num_prefill_tokens, start + self.config.prefill_chunk_size)
                cost = planes * (pages_for(end, self.config.block_size) - len(hit)) + idle_hits
        margin = 0 if self.reserve or not others_running else self.watermark
        return cost if cost + margin <= self.kv.num_available_pages else None

    def reservation(self, request: Request, hit_blocks: int) -> int:
        """`reserve` mode: every page the request can need beyond the cached ones it shares."""
        return self.pages_needed(request) - hit_blocks * request.params.max_loops

    def cached_blocks(self, request: Request) -> list[list[int]]:
        """The cached prompt blocks it can share: at least one prompt token is always computed
        (the first output token is sampled from it)."""
        usable = (request.num_prompt_tokens - 1) // self.config.block_size
        return self.kv.cached_prefix(request.block_hashes[:usable], request.params.max_loops)
