"""The device-resident decoder: per-slot decode state on the device, and one loop over all slots.

Owns: the state of every slot's in-flight token (loop, position, token, hidden state, survival,
sampling settings, stop ids) and `step`, which runs one loop for slots [0, rows), evaluates the
gate, samples for the rows that exit, copies their K/V into deeper planes (`full` layout), starts
their next token at loop 1 and stops finished slots — with no host synchronisation, so it can be
captured in a CUDA graph and run ahead of the host. Must not: read anything from the host during
`step`; every per-step input is already in device tensors.

The exit rules are those of the host-driven scheduler (engine/scheduler.py `_exit_check`) and
the serial reference; tests hold all three to the same tokens and depths.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from loopserve.attention.base import AttentionBackend
from loopserve.attention.metadata import AttentionMetadata
from loopserve.engine.device_decode import MAX_STOP_TOKEN_IDS
from loopserve.engine.scheduler_output import (
    GATE_DELAYED,
    GATE_OURO,
    GATE_TRACE,
    SlotSetup,
)
from loopserve.models.exit_rule import next_survival, threshold_reached
from loopserve.models.ouro import LoopContext, OuroForCausalLM
from loopserve.runner.block_tables import BlockTables
from loopserve.runner.kv_storage import NULL_PAGE, KVStorage
from loopserve.runner.paged_attention import PagedAttention
from loopserve.sample.sampler import (
    SamplingBatch,
    effective_temperature,
    effective_top_k,
    needs_filter,
    sample,
)

# Columns of the per-row result record (fp32: token ids < 2**24 are exact).
RAN, LOOP, EXITED, TOKEN, STOPPED, LOGPROB = range(6)
RESULT_COLUMNS = 6


@dataclass(frozen=True, slots=True)
class SamplingKind:
    """What the step's coda must support; one CUDA graph per kind and row bucket."""

    all_greedy: bool
    needs_filter: bool
    num_logprobs: int


class SlotDecoder:
    def __init__(
        self,
        model: OuroForCausalLM,
        kv: KVStorage,
        backend: AttentionBackend,
        block_tables: BlockTables,
        max_num_seqs: int,
        kv_layout: str,
        no_refill: bool,
        max_trace_length: int,
    ) -> None:
        self.model = model
        self.kv = kv
        self.backend = backend
        self.block_tables = block_tables
        self.shared_layout = kv_layout == "shared"
        self.no_refill = no_refill
        self.vocab_size = model.config.vocab_size
        device = self.device = block_tables.device
        slots = max_num_seqs

        def zeros(dtype: torch.dtype, *shape: int) -> torch.Tensor:
            return torch.zeros((slots, *shape), dtype=dtype, device=device)

        # In-flight token of each slot.
        self.active, self.waiting, self.stop_next = (zeros(torch.bool) for _ in range(3))
        self.loop = zeros(torch.int64) + 1  # the loop it runs next (1-based)
        self.position, self.token, self.output_count = (zeros(torch.int64) for _ in range(3))
        self.survival = zeros(torch.float32) + 1.0
        self.hidden = zeros(model.dtype, model.config.hidden_size)
        # Per-request settings.
        self.min_loops, self.max_loops = zeros(torch.int64) + 1, zeros(torch.int64) + 1
        self.gate_mode, self.max_tokens = zeros(torch.int64), zeros(torch.int64) + 1
        self.threshold = zeros(torch.float32) + 1.0
        self.stop_ids = zeros(torch.int64, MAX_STOP_TOKEN_IDS) - 1
        self.trace_depths = zeros(torch.int8, max(max_trace_length, 1))
        self.temperature, self.top_p = zeros(torch.float32) + 1.0, zeros(torch.float32) + 1.0
        self.min_p = zeros(torch.float32)
        self.greedy = zeros(torch.bool)
        self.top_k = zeros(torch.int64) + self.vocab_size
        self.seed = zeros(torch.int64)
        self.logprob_counts: list[int | None] = [None] * slots
        self._greedy_host = [True] * slots
        self._filter_host = [False] * slots

    # ----- host -> device (between steps) --------------------------------------------------

    def stop(self, slots: list[int]) -> None:
        index = self._long(slots)
        self.active[index] = False
        self.waiting[index] = False

    def start(self, setups: list[SlotSetup]) -> None:
        """Write the state of newly handed-over slots (one small copy per field)."""
        index = self._long([s.slot for s in setups])
        params = [s.sampling.params for s in setups]
        self._put(self.token, index, [s.token for s in setups])
        self._put(self.position, index, [s.position for s in setups])
        self._put(self.output_count, index, [s.sampling.output_index for s in setups])
        self._put(self.min_loops, index, [s.min_loops for s in setups])
        self._put(self.max_loops, index, [s.max_loops for s in setups])
        self._put(self.gate_mode, index, [s.gate_mode for s in setups])
        self._put(self.max_tokens, index, [s.max_tokens for s in setups])
        self._put(self.threshold, index, [s.exit_threshold for s in setups])
        self._put(self.seed, index, [s.sampling.seed for s in setups])
        self._put(self.temperature, index, [effective_temperature(p) for p in params])
        self._put(self.greedy, index, [p.greedy for p in params])
        self._put(self.top_k, index, [effective_top_k(p, self.vocab_size) for p in params])
        self._put(self.top_p, index, [p.top_p for p in params])
        self._put(self.min_p, index, [p.min_p for p in params])
        self._put(
            self.stop_ids,
            index,
            [_padded(s.stop_token_ids, MAX_STOP_TOKEN_IDS, -1) for s in setups],
        )
        width = self.trace_depths.shape[1]
        self._put(self.trace_depths, index, [_padded(s.trace_depths, width, 0) for s in setups])
        self.loop[index] = 1
        self.survival[index] = 1.0
        self.stop_next[index] = False
        # Under no_refill a new slot waits for the next cohort (released when no row runs).
        self.waiting[index] = self.no_refill
        self.active[index] = True
        for setup, param in zip(setups, params, strict=True):
            self.logprob_counts[setup.slot] = param.logprobs
            self._greedy_host[setup.slot] = param.greedy
            self._filter_host[setup.slot] = needs_filter(param, self.vocab_size)

    def sampling_kind(self, slots: list[int]) -> SamplingKind:
        counts = [self.logprob_counts[slot] or 0 for slot in slots]
        return SamplingKind(
            all_greedy=all(self._greedy_host[slot] for slot in slots),
            needs_filter=any(self._filter_host[slot] for slot in slots),
            num_logprobs=max(counts, default=0) and 20,
        )

    def _long(self, values: list[int]) -> torch.Tensor:
        return self._upload(values, torch.int64)

    def _put(self, target: torch.Tensor, index: torch.Tensor, values: list[Any]) -> None:
        target[index] = self._upload(values, target.dtype)

    def _upload(self, values: list[Any], dtype: torch.dtype) -> torch.Tensor:
        """Host values to the device through pinned memory: no host synchronisation."""
        source = torch.tensor(values, dtype=dtype)
        if self.device.type == "cuda":
            source = source.pin_memory()
        return source.to(self.device, non_blocking=True)

    def state_tensors(self) -> list[torch.Tensor]:
        """Everything `step` mutates besides the KV cache (for snapshots around graph capture)."""
        return [
            self.active, self.waiting, self.stop_next, self.loop, self.position, self.token,
            self.output_count, self.survival, self.hidden,
        ]  # fmt: skip

    # ----- one loop (device only) -----------------------------------------------------------

    def step(self, rows: int, kind: SamplingKind) -> torch.Tensor:
        """One loop for slots [0, rows). Returns the result record [rows, RESULT_COLUMNS + 2K]."""
        active, waiting = self.active[:rows], self.waiting[:rows]
        if self.no_refill:  # a drained cohort releases every waiting row
            waiting = waiting & (active & ~waiting).any()
        run = active & ~waiting
        loop, position = self.loop[:rows], self.position[:rows]
        max_loops = self.max_loops[:rows]
        hidden = torch.where(
            (loop == 1)[:, None], self.model.embed(self.token[:rows]), self.hidden[:rows]
        )
        plane = max_loops - 1 if self.shared_layout else loop - 1
        metadata = self._metadata(rows, run, plane, position)
        cos, sin = self.model.rope(position)
        context = LoopContext(cos, sin, PagedAttention(self.backend, self.kv, metadata))
        out = self.model.run_loop(hidden, context)  # [rows, H]
        exited, survival, test = self._exits(rows, run, out)
        logits = self.model.compute_logits(out)  # [rows, V], used only where a row exits
        sampled = sample(logits, self._sampling_batch(rows, kind))
        if not self.shared_layout:
            self._copy_on_exit(rows, exited, loop, position, max_loops)
        count = self.output_count[:rows] + exited.long()
        is_stop = (sampled.tokens[:, None] == self.stop_ids[:rows]).any(-1)
        stopped = exited & (is_stop | (count >= self.max_tokens[:rows]))
        columns = [run, loop, exited, sampled.tokens, stopped, sampled.logprobs]
        record = torch.cat(
            [torch.stack(columns, 1).float(), sampled.top_ids.float(), sampled.top_logprobs], dim=1
        )
        # State for the next step.
        gate_delayed = self.gate_mode[:rows] == GATE_DELAYED
        self.hidden[:rows] = torch.where(run[:, None], out, self.hidden[:rows])
        self.token[:rows] = torch.where(exited, sampled.tokens, self.token[:rows])
        self.stop_next[:rows] = ~exited & (self.stop_next[:rows] | (test & gate_delayed))
        self.survival[:rows] = torch.where(exited, torch.ones_like(survival), survival)
        self.position[:rows] = position + exited.long()
        self.loop[:rows] = torch.where(exited, torch.ones_like(loop), loop + run.long())
        self.output_count[:rows] = count
        self.waiting[:rows] = waiting | (exited & self.no_refill)
        self.active[:rows] = active & ~stopped
        return record

    def _metadata(
        self, rows: int, run: torch.Tensor, plane: torch.Tensor, position: torch.Tensor
    ) -> AttentionMetadata:
        tables = self.block_tables.tables
        slot_index = torch.arange(rows, device=self.device)
        page_table = tables[slot_index, plane]  # [rows, P]
        block = self.block_tables.block_size
        slots = self.block_tables.flat_slots(page_table, slot_index, position)
        slot_mapping = torch.where(run, slots, NULL_PAGE * block)
        seq_lens = torch.where(run, position + 1, torch.zeros_like(position)).to(torch.int32)
        host = None if self.backend.supports_cuda_graphs else seq_lens.tolist()
        return AttentionMetadata(
            query_start=torch.arange(rows + 1, dtype=torch.int32, device=self.device),
            seq_lens=seq_lens,
            page_table=page_table,
            slot_mapping=slot_mapping,
            max_query_len=1,
            max_seq_len=page_table.shape[1] * block,
            query_start_host=None if host is None else list(range(rows + 1)),
            seq_lens_host=host,
        )

    def _exits(
        self, rows: int, run: torch.Tensor, out: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(exited, survival after this loop, exit test) for each row; the rules of §1."""
        loop, mode = self.loop[:rows], self.gate_mode[:rows]
        at_max = loop >= self.max_loops[:rows]
        stop_next = self.stop_next[:rows]
        gated = (mode == GATE_OURO) | ((mode == GATE_DELAYED) & ~stop_next)
        evaluate = run & gated & ~at_max
        survival = self.survival[:rows]
        updated = next_survival(survival, self.model.exit_probability(out))
        survival = torch.where(evaluate, updated, survival)
        min_loops, threshold = self.min_loops[:rows], self.threshold[:rows]
        test = evaluate & threshold_reached(survival, loop, min_loops, threshold)
        width = self.trace_depths.shape[1]
        decode_index = (self.output_count[:rows] - 1).clamp(min=0, max=width - 1)
        trace_depth = self.trace_depths[:rows].gather(1, decode_index[:, None]).squeeze(1)
        exits = (
            at_max
            | ((mode == GATE_TRACE) & (loop >= trace_depth.long()))
            | ((mode == GATE_OURO) & test)
            | ((mode == GATE_DELAYED) & stop_next)
        )
        return run & exits, survival, test

    def _copy_on_exit(
        self,
        rows: int,
        exited: torch.Tensor,
        loop: torch.Tensor,
        position: torch.Tensor,
        max_loops: torch.Tensor,
    ) -> None:
        """`full` layout: an exited token's K/V becomes its version in every deeper plane."""
        tables = self.block_tables.tables[:rows]  # [rows, planes, P]
        block = self.block_tables.block_size
        row = torch.arange(rows, device=self.device)
        pages = tables[row, :, position // block]  # [rows, planes]
        slots = pages.long() * block + (position % block)[:, None]
        source = slots.gather(1, (loop - 1)[:, None]).expand_as(slots)
        planes = torch.arange(slots.shape[1], device=self.device)[None, :]
        deeper = exited[:, None] & (planes >= loop[:, None]) & (planes < max_loops[:, None])
        destination = torch.where(deeper, slots, torch.full_like(slots, NULL_PAGE * block))
        self.kv.copy_slots(source.reshape(-1), destination.reshape(-1))

    def _sampling_batch(self, rows: int, kind: SamplingKind) -> SamplingBatch:
        return SamplingBatch(
            temperature=self.temperature[:rows],
            greedy=self.greedy[:rows],
            top_k=self.top_k[:rows],
            top_p=self.top_p[:rows],
            min_p=self.min_p[:rows],
            seeds=self.seed[:rows],
            counters=self.output_count[:rows],
            needs_filter=kind.needs_filter,
            all_greedy=kind.all_greedy,
            num_logprobs=kind.num_logprobs,
            logprob_counts=self.logprob_counts[:rows],
        )


def _padded(values: tuple[int, ...], width: int, fill: int) -> list[int]:
    return list(values[:width]) + [fill] * (width - len(values[:width]))
