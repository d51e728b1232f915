"""Runs a `SchedulerOutput` on the device: the decode step over every slot, then the prompt chunks.

Owns: every device tensor of the engine (weights, KV storage, page tables, the decode step's
per-slot state), and the hand-off of the decode step's results to the host (one pinned copy per
step, read without a blocking synchronisation). Must not: make scheduling decisions; it executes
exactly what it is given and reports what happened in a `RunnerOutput`. It satisfies the engine's
`Runner` protocol.
"""

from __future__ import annotations

import time

import torch

from loopserve.engine.runner_api import RunnerInfo
from loopserve.engine.scheduler_output import (
    RunnerOutput,
    SampledToken,
    SchedulerOutput,
)
from loopserve.models.looped import LoopedForCausalLM
from loopserve.runner.block_tables import BlockTables
from loopserve.runner.cuda_graphs import GraphedDecodeStep
from loopserve.runner.decode_slots import SamplingKind
from loopserve.runner.decode_step import DecodeStep
from loopserve.runner.prefill import PromptRunner
from loopserve.runner.step_record import decode_result
from loopserve.runner.swap import HostSwap


class PendingOutput:
    """A step's `RunnerOutput`, whose decode part may still be in flight on the GPU.

    The decode step's result record is copied to pinned host memory without blocking; `result()`
    waits for that copy (polling its event, never a blocking device synchronisation).
    """

    def __init__(
        self,
        output: RunnerOutput,
        record: torch.Tensor | None = None,
        event: torch.cuda.Event | None = None,
        logprob_counts: list[int | None] | None = None,
        lanes: int = 1,
    ) -> None:
        self._output = output
        self._record = record
        self._event = event
        self._logprob_counts = logprob_counts or []
        self._lanes = lanes

    def ready(self) -> bool:
        return self._event is None or self._event.query()

    def result(self) -> RunnerOutput:
        if self._record is not None:
            while not self.ready():
                time.sleep(0)
            self._output.decode = decode_result(self._record, self._logprob_counts, self._lanes)
            self._record = None
        return self._output


class ModelRunner:
    """Args:
    decode: the decode step (and `graphs`, its CUDA graphs).
    speculating: with a `speculative_config`, the decode step of speculating requests' lanes
        and its graphs; a step runs one of the two (`SchedulerOutput.speculate`).
    """

    def __init__(
        self,
        model: LoopedForCausalLM,
        block_tables: BlockTables,
        decode: DecodeStep,
        prompts: PromptRunner,
        swap: HostSwap,
        info: RunnerInfo,
        graphs: GraphedDecodeStep | None = None,
        speculating: tuple[DecodeStep, GraphedDecodeStep | None] | None = None,
    ) -> None:
        self.model = model
        self.block_tables = block_tables
        self.decode = decode
        self.prompts = prompts
        self.swap = swap
        self.graphs = graphs
        self.speculating = speculating
        self.device = block_tables.device
        self._info = info

    @property
    def info(self) -> RunnerInfo:
        return self._info

    @property
    def graphs_captured(self) -> int:
        """CUDA graphs captured so far: the decode step's, the speculating step's and the
        prompt loop's (each is captured on first use of its shape)."""
        all_graphs = [self.graphs, self.prompts.graphs]
        if self.speculating is not None:
            all_graphs.append(self.speculating[1])
        return sum(graphs.num_captured for graphs in all_graphs if graphs is not None)

    @torch.inference_mode()
    def execute(self, scheduled: SchedulerOutput) -> PendingOutput:
        """Run one step. Only the decode step's part may still be running when this returns."""
        self.swap.save(scheduled.swap_out)  # before any page it frees is written again
        self.block_tables.apply(scheduled.page_updates, scheduled.cleared_slots)
        self.swap.restore(scheduled.swap_in)
        self.swap.drop(scheduled.dropped_swaps)
        step, graphs = self._mode(scheduled)
        record, event, counts = self._run_decode(scheduled, step, graphs)
        prefill_tokens: list[SampledToken | None] = []
        if scheduled.prefill_chunks:
            prefill_tokens = self.prompts.run(scheduled.prefill_chunks)
        output = RunnerOutput(prefill_tokens)
        return PendingOutput(output, record, event, counts, step.lanes)

    def _mode(self, scheduled: SchedulerOutput) -> tuple[DecodeStep, GraphedDecodeStep | None]:
        """The decode step this step runs (emptying the other one when the mode switched)."""
        plain = (self.decode, self.graphs)
        if self.speculating is None:
            if scheduled.speculate:
                raise RuntimeError("a speculating step for a runner built without speculation")
            return plain
        chosen, other = (
            (self.speculating, plain) if scheduled.speculate else (plain, self.speculating)
        )
        if scheduled.switched:
            other[0].stop_all()
        return chosen

    def _run_decode(
        self, scheduled: SchedulerOutput, step: DecodeStep, graphs: GraphedDecodeStep | None
    ) -> tuple[torch.Tensor | None, torch.cuda.Event | None, list[int | None]]:
        """Slot stops, slot starts, token bitmasks, then one loop over the slots, copied out
        asynchronously."""
        if scheduled.slot_stops:
            step.stop(scheduled.slot_stops)
        if scheduled.slot_starts:
            step.start(scheduled.slot_starts)
        step.masks.apply(scheduled.token_masks)
        if not scheduled.runs_decode:
            return None, None, []
        slots = list(scheduled.decode_slots)
        rows = max(slots) + 1
        kind = step.sampling_kind(slots)
        record = graphs.run(rows, kind) if graphs is not None else step.step(rows, kind)
        counts = step.row_logprob_counts(step.record_rows(rows))
        if self.device.type != "cuda":
            return record, None, counts
        host = torch.empty(record.shape, dtype=record.dtype, pin_memory=True)
        host.copy_(record, non_blocking=True)
        event = torch.cuda.Event()
        event.record()
        return host, event, counts

    def run_decode_step(self, rows: int, kind: SamplingKind) -> torch.Tensor:
        """One decode step over slots [0, rows): a graph replay where graphs are on."""
        if self.graphs is not None:
            return self.graphs.run(rows, kind)
        return self.decode.step(rows, kind)
