"""The decode step: one loop over every slot, on the device.

Owns: `step`, which runs one loop for slots [0, rows) of the state it extends
(`runner.decode_slots.DecodeSlots`), asks `depth.policy` which rows exit, samples, copies exited
K/V as `kv.layout` says, starts the next token of exited rows and stops finished slots, with no
host synchronisation, so it can be captured in a CUDA graph and run ahead of the host. Must
not: read anything from the host during `step` (every per-step input is already in device
tensors), or decide exits or planes itself.

This is the only decode path, on every device; the serial reference is held to it by the tests.
Where the layer ops are fused Triton kernels (CUDA; `fused_kernels`, set by the runner's setup),
the bookkeeping around the loop runs as two launches, `kernels/decode_state.py`'s prologue and
coda, twins of the torch code here, which stays the reference (tests/kernels/test_decode_state.py
holds them bit for bit) and the path everywhere else; the copy-on-exit then runs as one launch
(`kernels/kv_copy.py`), and RoPE runs inside the decode attention kernel where the backend
can (`decode_rotary`) and the model's ops rotate as that kernel does (`rotary_is_fused_ops`).
The exit decision comes before the LM head, which computes only the exiting rows' logits (the
others are 0): with the fused ops a step where no row exits reads none of the LM head's weights.
A speculating request's lanes run through `runner.speculation` instead (fused likewise:
`fused_loop`, then its own coda launch, kernels/lanes_state.py).
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

import torch

from loopserve.attention.base import AttentionBackend
from loopserve.attention.paged import PagedAttention
from loopserve.config import SchedulerConfig
from loopserve.depth import policy
from loopserve.depth.policy import RowDepth
from loopserve.kv.layout import KVLayout
from loopserve.kv.metadata import AttentionMetadata
from loopserve.kv.pages import NULL_PAGE
from loopserve.kv.storage import KVStorage
from loopserve.models.layers import LoopContext
from loopserve.models.looped import LoopedForCausalLM
from loopserve.runner.block_tables import BlockTables
from loopserve.runner.decode_slots import DecodeSlots, SamplingKind
from loopserve.runner.step_record import RESULT_COLUMNS
from loopserve.sample.sampler import (
    SampleResult,
    SamplingBatch,
    sample,
)

if TYPE_CHECKING:
    from loopserve.kernels.decode_state import DecodeKernels, Prologue


class DecodeStep(DecodeSlots):
    def __init__(
        self,
        model: LoopedForCausalLM,
        kv: KVStorage,
        backend: AttentionBackend,
        block_tables: BlockTables,
        config: SchedulerConfig,
        max_trace_length: int,
        fused_kernels: bool,
    ) -> None:
        super().__init__(model, block_tables, config, max_trace_length)
        self.kv = kv
        self.backend = backend
        device = self.device
        # Where the layer ops are fused Triton kernels (CUDA), the bookkeeping is too.
        self.kernels: DecodeKernels | None = None
        if fused_kernels and model.fused_bookkeeping:
            from loopserve.kernels.decode_state import DecodeKernels

            # RoPE rows of every position a page table holds (2 * positions * D values).
            positions = block_tables.tables.shape[2] * block_tables.block_size
            self.kernels = DecodeKernels(
                self,
                block_tables.tables,
                block_tables.block_size,
                embedding=model.embedding,
                rope=model.rope(torch.arange(positions, device=device)),
                no_refill=self.scheduling is policy.Scheduling.NO_REFILL,
                full_layout=self.layout.copies_on_exit,
                lanes=self.lanes,
            )

    # ----- one loop (device only) -----------------------------------------------------------

    def step(self, rows: int, kind: SamplingKind) -> torch.Tensor:
        """One loop for slots [0, rows). Returns the result record [rows, RESULT_COLUMNS + 2K]."""
        if self.lanes > 1:
            if self.speculation is None:
                raise RuntimeError("a speculative_config's decode step was handed no lanes")
            return self.speculation.step(rows, kind)
        if self.kernels is not None:
            return self._fused_step(rows, kind, self.kernels)
        active = self.active[:rows]
        row = self.row_depth(rows)
        ran, waiting = policy.runs(
            self._runnable(rows, kind, row), self.waiting[:rows], self.scheduling
        )
        position = self.position[:rows]
        hidden, out, cos, sin = self.forward(ran, row, position)
        loop = (hidden, out, position, cos, sin)
        outcome, sampled = self._exit_and_sample(rows, kind, row, ran, *loop)
        exited = outcome.exited
        if self.layout.copies_on_exit:
            self.copy_on_exit(exited, row, position)
        count = self.output_count[:rows] + exited.long()
        is_stop = (sampled.tokens[:, None] == self.stop_ids[:rows]).any(-1)
        stopped = exited & (is_stop | (count >= self.max_tokens[:rows]))
        if kind.constrained:
            self.masks.begin(rows, exited, sampled.tokens)
        columns = [ran, row.loop, exited, sampled.tokens, stopped, sampled.logprobs]
        record = torch.cat(
            [torch.stack(columns, 1).float(), sampled.top_ids.float(), sampled.top_logprobs], dim=1
        )
        # State for the next step.
        following = policy.advance(row, ran, waiting, outcome, self.scheduling)
        self.hidden[:rows] = torch.where(ran[:, None], out, self.hidden[:rows])
        self.token[:rows] = torch.where(exited, sampled.tokens, self.token[:rows])
        self.position[:rows] = position + exited.long()
        self.output_count[:rows] = count
        self.loop[:rows] = following.loop
        self.survival[:rows] = following.survival
        self.stop_next[:rows] = following.stop_next
        self.waiting[:rows] = following.waiting
        self.active[:rows] = active & ~stopped
        return record

    def _fused_step(self, rows: int, kind: SamplingKind, kernels: DecodeKernels) -> torch.Tensor:
        """`step` with the bookkeeping around the loop in two launches (kernels/decode_state.py,
        the twin of the torch path above, which is the reference it is tested against)."""
        start, out = self.fused_loop(kernels, rows, self._runnable(rows, kind))
        hazard = self.model.exit_probability(out, start.hidden, self.threshold[:rows])
        outcome = kernels.decide(start, hazard)
        sampled = self.choose(rows, kind, out, outcome.exited)
        width = RESULT_COLUMNS + 2 * sampled.top_ids.shape[1]
        columns = (sampled.tokens, sampled.logprobs, sampled.top_ids, sampled.top_logprobs)
        coda = kernels.coda(start, outcome, out, columns, width)
        if kind.constrained:
            self.masks.begin(rows, outcome.exited, sampled.tokens)
        if coda.copies is not None:
            from loopserve.kernels.kv_copy import copy_kv_slots

            copy_kv_slots(self.kv, *coda.copies)  # `kv.copy_slots` in one launch
        return coda.record

    def fused_loop(
        self, kernels: DecodeKernels, rows: int, runnable: torch.Tensor
    ) -> tuple[Prologue, torch.Tensor]:
        """The prologue launch and one loop of rows [0, rows) (those of `runnable` [rows] that
        `policy.runs` lets run): (the prologue's tensors, the loop's output)."""
        start = kernels.prologue(rows, runnable)
        metadata = self.block_tables.decode_metadata_from(
            start.seq_lens, start.page_table, start.slot_mapping, self._host_lengths
        )
        if self.backend.decode_rotary and self.model.ops.rotary_is_fused_ops:
            # RoPE inside the decode kernel (one launch less a layer), with the ops' own bits.
            metadata = dataclasses.replace(metadata, rope=(start.cos, start.sin))
        return start, self._loop(start.hidden, start.cos, start.sin, metadata)

    def forward(
        self,
        ran: torch.Tensor,
        row: RowDepth,
        position: torch.Tensor,
        table_rows: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """One loop of rows [0, R): (its input, its output, cos, sin). `table_rows` [R]: the
        slot whose page tables each row uses (default: row r, slot r)."""
        rows = ran.shape[0]
        cos, sin = self.model.rope(position)
        starts = row.loop == 1
        beginning = ran & starts
        first = self.model.start(
            self.token[:rows],
            position,
            self.seed[:rows],
            self._stage_context(beginning, row, position, cos, sin),
            rows=beginning,
        )
        hidden = torch.where(starts[:, None], first, self.hidden[:rows])
        plane = self.layout.decode_plane(row.loop, row.max_loops)
        metadata = self.block_tables.decode_metadata(
            ran, plane, position, self._host_lengths, table_rows
        )
        return hidden, self._loop(hidden, cos, sin, metadata), cos, sin

    def _runnable(self, rows: int, kind: SamplingKind, row: RowDepth | None = None) -> torch.Tensor:
        """Active rows, less constrained rows held for their bitmask (`runner.token_masks`)."""
        active = self.active[:rows]
        if not kind.constrained:
            return active
        row = row if row is not None else self.row_depth(rows)
        return active & ~self.masks.held(rows, row, self.output_count[:rows])

    @property
    def _host_lengths(self) -> bool:
        return not self.backend.supports_cuda_graphs

    def _loop(
        self,
        hidden: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        metadata: AttentionMetadata,
    ) -> torch.Tensor:
        """The loop itself: [rows, carried] -> [rows, carried]."""
        attention = PagedAttention(self.backend, self.kv, metadata)
        context = LoopContext(cos, sin, attention, attention_rotates=attention.rotates)
        return self.model.run_loop(hidden, context)

    def _exit_and_sample(
        self,
        rows: int,
        kind: SamplingKind,
        row: RowDepth,
        ran: torch.Tensor,
        hidden: torch.Tensor,
        out: torch.Tensor,
        position: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
    ) -> tuple[policy.LoopOutcome, SampleResult]:
        """Which rows exit after this loop, and every row's next token. A criterion that reads
        the loop's logits gets every running row's readout (their coda K/V rewritten each loop,
        so the exit loop's stays) and carries its memory in `exit_memory`."""
        threshold = self.threshold[:rows]
        if not self.model.exit_needs_readout:
            hazard = self.model.exit_probability(out, hidden, threshold)
            outcome = policy.after_loop(row, ran, hazard)
            coda = self._stage_context(outcome.exited, row, position, cos, sin)
            return outcome, self.choose(rows, kind, out, outcome.exited, coda)
        coda = self._stage_context(ran, row, position, cos, sin)
        logits = self.model.compute_logits(out, rows=ran, ctx=coda)  # [rows, V]
        fresh = self.model.initial_exit_memory(rows)
        memory = torch.where((row.loop == 1)[:, None], fresh, self.exit_memory[:rows])
        hazard, updated = self.model.readout_exit(logits, memory, threshold)
        self.exit_memory[:rows] = torch.where(ran[:, None], updated, memory)
        outcome = policy.after_loop(row, ran, hazard)
        return outcome, sample(logits, self._sampling_batch(rows, kind))

    def _stage_context(
        self,
        writes: torch.Tensor,
        row: RowDepth,
        position: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
    ) -> LoopContext | None:
        """Attention of the prelude or coda layers (families that have them): one plane, the
        request's last (which covers every position in both layouts); only rows in `writes` [R]
        store their K/V (the prelude's: rows starting a token; the coda's: rows exiting), the
        others write into the null page and their outputs are not used."""
        if not self.model.has_stage_layers:
            return None
        plane = row.max_loops - 1
        metadata = self.block_tables.decode_metadata(writes, plane, position, self._host_lengths)
        return LoopContext(cos, sin, PagedAttention(self.backend, self.kv, metadata))

    def choose(
        self,
        rows: int,
        kind: SamplingKind,
        out: torch.Tensor,
        exited: torch.Tensor,
        coda: LoopContext | None = None,
    ) -> SampleResult:
        """The next token of every row. Only exiting rows' tokens are used, so only their logits
        are computed (the others are 0, and the fused LM head skips their weights: in a step
        where no row exits, all of them)."""
        logits = self.model.compute_logits(out, rows=exited, ctx=coda)  # [rows, V]
        return sample(logits, self._sampling_batch(rows, kind))

    def row_depth(self, rows: int) -> RowDepth:
        width = self.trace_depths.shape[1]
        decode_index = (self.output_count[:rows] - 1).clamp(min=0, max=width - 1)
        trace_depth = self.trace_depths[:rows].gather(1, decode_index[:, None]).squeeze(1)
        return RowDepth(
            loop=self.loop[:rows],
            min_loops=self.min_loops[:rows],
            max_loops=self.max_loops[:rows],
            rule=self.rule[:rows],
            threshold=self.threshold[:rows],
            survival=self.survival[:rows],
            stop_next=self.stop_next[:rows],
            trace_depth=trace_depth.long(),
        )

    def copy_on_exit(
        self,
        exited: torch.Tensor,
        row: RowDepth,
        position: torch.Tensor,
        table_rows: torch.Tensor | None = None,
    ) -> None:
        """Copy each exited token's K/V from the plane it last wrote into the planes the layout
        says must read it at that version (one masked copy; other rows copy into the null page).
        `table_rows` as in `forward`."""
        block = self.block_tables.block_size
        if table_rows is None:
            table_rows = torch.arange(exited.shape[0], device=self.device)
        pages = self.block_tables.tables[table_rows, :, position // block]  # [rows, planes]
        slots = pages.long() * block + (position % block)[:, None]
        written = self.layout.decode_plane(row.loop, row.max_loops)
        source = slots.gather(1, written[:, None]).expand_as(slots)
        planes = torch.arange(slots.shape[1], device=self.device)[None, :]
        target = KVLayout.copy_on_exit_target(planes, row.loop[:, None], row.max_loops[:, None])
        destination = torch.where(exited[:, None] & target, slots, NULL_PAGE * block)
        # The block's layers only: prelude and coda K/V live in the last plane alone.
        self.kv.copy_slots(
            source.reshape(-1), destination.reshape(-1), self.model.config.num_hidden_layers
        )

    def _sampling_batch(self, rows: int, kind: SamplingKind) -> SamplingBatch:
        masks = self.masks
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
            logprob_counts=self.row_logprob_counts(rows),
            any_logprobs=kind.any_logprobs,
            constrained=masks.constrained[:rows] if kind.constrained else None,
            token_mask=masks.token_mask[:rows] if kind.constrained else None,
        )
