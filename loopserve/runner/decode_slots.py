"""The decode step's per-slot state on the device, and what the host writes into it between steps.

Owns: the state of every slot's in-flight token (loop, position, token, hidden state, survival,
sampling settings, stop ids), one row per slot or, for speculating requests, one per lane
(runner/speculation.py); starting and stopping slots (one small upload per field), the sampling
kind a step's graph is captured for, and the state a graph capture saves and restores. Must not:
run anything on the device in a step (`runner.decode_step.DecodeStep`, which extends it, does).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

import torch

from loopserve.config import SchedulerConfig
from loopserve.depth import policy
from loopserve.depth.policy import ExitMode, slot_rule
from loopserve.depth.trace import resolve_distribution, trace_depths
from loopserve.engine.scheduler_output import SlotStart
from loopserve.kv.layout import KVLayout
from loopserve.kv.transfer import to_device
from loopserve.models.looped import LoopedForCausalLM
from loopserve.runner.block_tables import BlockTables
from loopserve.runner.token_masks import SlotMasks
from loopserve.sample.sampler import effective_temperature, effective_top_k, needs_filter

# Most end-of-sequence plus stop token ids one request may have.
MAX_STOP_TOKEN_IDS = 16


class Lanes(Protocol):
    """The step of speculating requests' lanes (runner/speculation.py)."""

    def stop(self, rows: torch.Tensor) -> None: ...

    def start(self, rows: torch.Tensor, starts: list[SlotStart]) -> None: ...

    def state_tensors(self) -> list[torch.Tensor]: ...

    def step(self, rows: int, kind: SamplingKind) -> torch.Tensor: ...


@dataclass(frozen=True, slots=True)
class SamplingKind:
    """What the step's coda must support; one CUDA graph per kind and row bucket."""

    all_greedy: bool
    needs_filter: bool
    any_logprobs: bool
    num_logprobs: int
    constrained: bool = False  # some row has a constraint (token bitmasks, `token_masks`)


class DecodeSlots:
    def __init__(
        self,
        model: LoopedForCausalLM,
        block_tables: BlockTables,
        config: SchedulerConfig,
        max_trace_length: int,
    ) -> None:
        self.model = model
        self.block_tables = block_tables
        self.layout: KVLayout = config.kv_layout
        self.scheduling = config.scheduling
        self.exit_mode = config.exit_mode
        self.trace_distribution = resolve_distribution(
            config.trace_distribution, model.config.family, model.config.num_loops
        )
        self.vocab_size = model.config.vocab_size
        device = self.device = block_tables.device
        # Decode rows per request slot: 1, or one per token a speculating request has in flight
        # (its lanes, runner/speculation.py); row r belongs to slot r // lanes.
        self.lanes = config.lanes(model.config.num_loops)
        slots = config.max_decode_rows(model.config.num_loops)

        def zeros(dtype: torch.dtype, *shape: int) -> torch.Tensor:
            return torch.zeros((slots, *shape), dtype=dtype, device=device)

        # In-flight token of each slot.
        self.active, self.waiting, self.stop_next = (zeros(torch.bool) for _ in range(3))
        self.loop = zeros(torch.int64) + 1  # the loop it runs next (1-based)
        self.position, self.token, self.output_count = (zeros(torch.int64) for _ in range(3))
        self.survival = zeros(torch.float32) + 1.0
        self.hidden = zeros(model.dtype, model.carried_size)
        # What the exit criterion carries between loops (criteria that read logits).
        self.exit_memory = zeros(torch.float32, model.exit_memory_size)
        # Per-request settings.
        self.min_loops, self.max_loops = zeros(torch.int64) + 1, zeros(torch.int64) + 1
        self.rule, self.max_tokens = zeros(torch.int64), zeros(torch.int64) + 1
        self.threshold = zeros(torch.float32) + 1.0
        self.stop_ids = zeros(torch.int64, MAX_STOP_TOKEN_IDS) - 1
        self.trace_depths = zeros(torch.int8, max(max_trace_length, 1))
        self.temperature, self.top_p = zeros(torch.float32) + 1.0, zeros(torch.float32) + 1.0
        self.min_p = zeros(torch.float32)
        self.greedy = zeros(torch.bool)
        self.top_k = zeros(torch.int64) + self.vocab_size
        self.seed = zeros(torch.int64)
        requests = config.max_num_seqs
        self.logprob_counts: list[int | None] = [None] * requests  # per slot
        self.masks = SlotMasks(slots, self.vocab_size, device)
        self._greedy_host = [True] * requests
        self._filter_host = [False] * requests
        # The lanes of speculating requests (runner/speculation.py), handed in by `speculate`.
        self.speculation: Lanes | None = None

    def speculate(self, lanes: Lanes) -> None:
        """Run speculating requests' lanes (`config.speculative_config`) with `lanes`."""
        if self.lanes == 1:
            raise ValueError("lanes need a speculative_config")
        self.speculation = lanes

    # ----- host -> device (between steps) --------------------------------------------------

    def stop(self, slots: list[int]) -> None:
        index = self._long(self.lane_rows(slots))
        self.active[index] = False
        self.waiting[index] = False
        if self.speculation is not None:
            self.speculation.stop(index)

    def stop_all(self) -> None:
        """Stop every slot (the engine switched to its other decode step)."""
        self.active.fill_(False)
        self.waiting.fill_(False)
        if self.speculation is not None:
            self.speculation.stop(torch.arange(self.active.shape[0], device=self.device))

    def lane_rows(self, slots: list[int]) -> list[int]:
        """The decode rows of `slots` (one each unless requests speculate)."""
        lanes = self.lanes
        return [slot * lanes + lane for slot in slots for lane in range(lanes)]

    def start(self, starts: list[SlotStart]) -> None:
        """Write the state of newly started slots (one small copy per field; a speculating
        slot's settings go to each of its lanes, its token to the lane of its position)."""
        index = self._long(self.lane_rows([s.slot for s in starts]))
        self._start_rows(index, starts)
        if self.speculation is not None:
            self.speculation.start(index, starts)
        for start in starts:
            param = start.params.params
            self.logprob_counts[start.slot] = param.logprobs
            self._greedy_host[start.slot] = param.greedy
            self._filter_host[start.slot] = needs_filter(param, self.vocab_size)

    def _start_rows(self, index: torch.Tensor, starts: list[SlotStart]) -> None:
        """`index`: each start's `lanes` rows; every value is uploaded once per start."""
        resolved = [s.params for s in starts]
        params = [r.params for r in resolved]
        self._put(self.token, index, [s.token for s in starts])
        self._put(self.position, index, [s.position for s in starts])
        self._put(self.output_count, index, [s.num_output_tokens for s in starts])
        self._put(self.min_loops, index, [r.min_loops for r in resolved])
        self._put(self.max_loops, index, [r.max_loops for r in resolved])
        self._put(self.rule, index, [slot_rule(self.exit_mode, r.exit_threshold) for r in resolved])
        self._put(self.max_tokens, index, [p.max_tokens for p in params])
        self._put(self.threshold, index, [r.exit_threshold for r in resolved])
        self._put(self.seed, index, [r.seed for r in resolved])
        self._put(self.temperature, index, [effective_temperature(p) for p in params])
        self._put(self.greedy, index, [p.greedy for p in params])
        self._put(self.top_k, index, [effective_top_k(p, self.vocab_size) for p in params])
        self._put(self.top_p, index, [p.top_p for p in params])
        self._put(self.min_p, index, [p.min_p for p in params])
        stop_ids = [sorted(r.eos_token_ids | set(r.params.stop_token_ids)) for r in resolved]
        self._put(self.stop_ids, index, [_padded(ids, MAX_STOP_TOKEN_IDS, -1) for ids in stop_ids])
        width = self.trace_depths.shape[1]
        traced = self.exit_mode is ExitMode.TRACE
        depths = [trace_depths(r, self.trace_distribution) if traced else () for r in resolved]
        self._put(self.trace_depths, index, [_padded(d, width, 0) for d in depths])
        self.loop[index] = 1
        self.survival[index] = 1.0
        self.stop_next[index] = False
        # Under no_refill a new slot waits for the next cohort (released when no row runs).
        self.waiting[index] = self.scheduling is policy.Scheduling.NO_REFILL
        self.active[index] = True
        self.masks.reset(index, [s.slot for s in starts])

    def sampling_kind(self, slots: list[int]) -> SamplingKind:
        counts = [self.logprob_counts[slot] or 0 for slot in slots]
        return SamplingKind(
            all_greedy=all(self._greedy_host[slot] for slot in slots),
            needs_filter=any(self._filter_host[slot] for slot in slots),
            any_logprobs=any(self.logprob_counts[slot] is not None for slot in slots),
            num_logprobs=max(counts, default=0) and 20,
            constrained=self.masks.any(slots),
        )

    def _long(self, values: list[int]) -> torch.Tensor:
        return to_device(values, torch.int64, self.device)

    def _put(self, target: torch.Tensor, index: torch.Tensor, values: list[Any]) -> None:
        """One value per start into each of its `lanes` rows (`index`)."""
        uploaded = to_device(values, target.dtype, self.device)
        if self.lanes > 1:
            uploaded = uploaded.repeat_interleave(self.lanes, dim=0)
        target[index] = uploaded

    def state_tensors(self) -> list[torch.Tensor]:
        """Everything `step` mutates besides the KV cache (for snapshots around graph capture)."""
        lanes = self.speculation.state_tensors() if self.speculation is not None else []
        return [
            self.active, self.waiting, self.stop_next, self.loop, self.position, self.token,
            self.output_count, self.survival, self.hidden, self.exit_memory,
            self.masks.constrained, *lanes,
        ]  # fmt: skip

    def record_rows(self, rows: int) -> int:
        """Rows of the result record of a step over slots [0, rows)."""
        return rows * self.lanes

    def row_logprob_counts(self, rows: int) -> list[int | None]:
        """Per decode row [0, rows): the log-prob alternatives its request asked for."""
        return [self.logprob_counts[row // self.lanes] for row in range(rows)]


def _padded(values: Any, width: int, fill: int) -> list[int]:
    values = list(values)[:width]
    return values + [fill] * (width - len(values))
