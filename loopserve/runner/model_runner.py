"""Runs a `SchedulerOutput` on the device: one loop for the decode rows, every loop for the prompt
chunks, the exit gate, and the coda (LM head + sampling) for rows that may exit.

Owns: every device tensor of the engine (weights, KV storage, page tables, the per-slot hidden
state that carries a token from one loop to the next). Must not: make scheduling decisions; it
executes exactly what it is given and reports what happened in a `RunnerOutput`.

The coda runs only for rows whose exit is possible this loop (known on the host from `ExitCheck`),
so no host round trip is needed between the gate and the LM head; a row whose gate says "continue"
discards its sampled token.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from loopserve.attention.base import AttentionBackend
from loopserve.engine.scheduler_output import (
    DecodeRow,
    ExitCheck,
    PrefillChunk,
    RunnerOutput,
    SampledToken,
    SamplingInfo,
    SchedulerOutput,
    SlotStepResult,
)
from loopserve.models.exit_rule import next_survival, threshold_reached
from loopserve.models.ouro import LoopContext, OuroForCausalLM
from loopserve.outputs import TokenLogprobs
from loopserve.runner.block_tables import BlockTables
from loopserve.runner.cuda_graphs import GraphedSlotStep
from loopserve.runner.kv_storage import KVStorage
from loopserve.runner.paged_attention import PagedAttention
from loopserve.runner.slot_decoder import (
    EXITED,
    LOGPROB,
    LOOP,
    RAN,
    RESULT_COLUMNS,
    STOPPED,
    TOKEN,
    SlotDecoder,
)
from loopserve.sample.sampler import SampleResult, SamplingBatch, sample


class PendingOutput:
    """A step's `RunnerOutput`, whose device-decode part may still be in flight on the GPU.

    The slot step's result record is copied to pinned host memory without blocking; `result()`
    waits for that copy (polling its event, never a blocking device synchronisation).
    """

    def __init__(
        self,
        output: RunnerOutput,
        record: torch.Tensor | None = None,
        event: torch.cuda.Event | None = None,
        logprob_counts: list[int | None] | None = None,
    ) -> None:
        self._output = output
        self._record = record
        self._event = event
        self._logprob_counts = logprob_counts or []

    def ready(self) -> bool:
        return self._event is None or self._event.query()

    def result(self) -> RunnerOutput:
        if self._record is not None:
            while not self.ready():
                time.sleep(0)
            self._output.slot_step = _slot_step_result(self._record, self._logprob_counts)
            self._record = None
        return self._output


def _slot_step_result(record: torch.Tensor, counts: list[int | None]) -> SlotStepResult:
    rows = record.tolist()
    tokens: list[SampledToken | None] = []
    for row, count in zip(rows, counts, strict=False):
        if not row[EXITED]:
            tokens.append(None)
            continue
        token = int(row[TOKEN])
        entry = None
        if count is not None:
            top_count = (len(row) - RESULT_COLUMNS) // 2
            ids = row[RESULT_COLUMNS : RESULT_COLUMNS + top_count][:count]
            values = row[RESULT_COLUMNS + top_count :][:count]
            top = tuple((int(i), v) for i, v in zip(ids, values, strict=True))
            entry = TokenLogprobs(token, row[LOGPROB], top)
        tokens.append(SampledToken(token, entry))
    return SlotStepResult(
        ran=[bool(row[RAN]) for row in rows],
        loops=[int(row[LOOP]) for row in rows],
        exited=[bool(row[EXITED]) for row in rows],
        tokens=tokens,
        stopped=[bool(row[STOPPED]) for row in rows],
    )


@dataclass(slots=True)
class _DecodeResult:
    exited: list[bool]
    survival: list[float]
    exit_test: list[bool]
    tokens: list[SampledToken | None]


class ModelRunner:
    def __init__(
        self,
        model: OuroForCausalLM,
        kv: KVStorage,
        backend: AttentionBackend,
        block_tables: BlockTables,
        max_num_seqs: int,
        decoder: SlotDecoder | None = None,
        cuda_graphs: bool = False,
    ) -> None:
        self.decoder = decoder
        self.graphs = (
            GraphedSlotStep(decoder, max_num_seqs) if decoder is not None and cuda_graphs else None
        )
        self.model = model
        self.kv = kv
        self.backend = backend
        self.block_tables = block_tables
        self.device = block_tables.device
        self.vocab_size = model.config.vocab_size
        # [slots, H]: the hidden state a decoding token carries between loops.
        self.hidden = torch.zeros(
            max_num_seqs, model.config.hidden_size, dtype=model.dtype, device=self.device
        )

    @torch.inference_mode()
    def execute(self, scheduled: SchedulerOutput) -> PendingOutput:
        """Run one step. Only the device-decode part may still be running when this returns."""
        self.block_tables.apply(scheduled.page_updates, scheduled.cleared_slots)
        if scheduled.kv_copies:
            sources = [copy.source for copy in scheduled.kv_copies for _ in copy.destinations]
            destinations = [slot for copy in scheduled.kv_copies for slot in copy.destinations]
            self.kv.copy_slots(self._long(sources), self._long(destinations))
        record, event, counts = self._run_slot_step(scheduled)
        decode = _DecodeResult([], [], [], [])
        if scheduled.decode_rows:
            decode = self._run_decode(scheduled.decode_rows)
        prefill_tokens: list[SampledToken | None] = []
        if scheduled.prefill_chunks:
            prefill_tokens = self._run_prefill(scheduled.prefill_chunks)
        output = RunnerOutput(
            exited=decode.exited,
            survival=decode.survival,
            exit_test=decode.exit_test,
            decode_tokens=decode.tokens,
            prefill_tokens=prefill_tokens,
        )
        return PendingOutput(output, record, event, counts)

    def _run_slot_step(
        self, scheduled: SchedulerOutput
    ) -> tuple[torch.Tensor | None, torch.cuda.Event | None, list[int | None]]:
        """Device decode mode: stops, starts, then one loop over the slots, copied out async."""
        decoder = self.decoder
        if decoder is None:
            return None, None, []
        if scheduled.slot_stops:
            decoder.stop(scheduled.slot_stops)
        if scheduled.slot_setups:
            decoder.start(scheduled.slot_setups)
        if not scheduled.run_slot_step:
            return None, None, []
        slots = list(scheduled.slot_requests)
        rows = max(slots) + 1
        kind = decoder.sampling_kind(slots)
        if self.graphs is not None:
            record = self.graphs.run(rows, kind)
        else:
            record = decoder.step(rows, kind)
        counts = decoder.logprob_counts[:rows]
        if self.device.type != "cuda":
            return record, None, counts
        host = torch.empty(record.shape, dtype=record.dtype, pin_memory=True)
        host.copy_(record, non_blocking=True)
        event = torch.cuda.Event()
        event.record()
        return host, event, counts

    def _long(self, values: Sequence[int]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.int64, device=self.device)

    def _run_decode(self, rows: list[DecodeRow]) -> _DecodeResult:
        slots = self._long([row.slot for row in rows])
        positions_host = [row.position for row in rows]
        positions = self._long(positions_host)
        hidden = self.hidden[slots]  # [R, H]
        first = [index for index, row in enumerate(rows) if row.loop == 1]
        if first:
            first_tokens = self._long([rows[index].input_token for index in first])
            hidden[first] = self.model.embed(first_tokens)
        metadata = self.block_tables.decode_metadata(
            slots, self._long([row.plane for row in rows]), positions, positions_host
        )
        cos, sin = self.model.rope(positions)
        hidden = self.model.run_loop(
            hidden, LoopContext(cos, sin, PagedAttention(self.backend, self.kv, metadata))
        )
        self.hidden[slots] = hidden
        survival, exit_test = self._evaluate_gate(rows, hidden)
        forced = torch.tensor([row.exit is ExitCheck.EXIT for row in rows], device=self.device)
        if_gate = torch.tensor([row.exit is ExitCheck.IF_GATE for row in rows], device=self.device)
        exited = forced | (if_gate & exit_test)
        candidates = [index for index, row in enumerate(rows) if row.exit is not ExitCheck.CONTINUE]
        sampled = None
        if candidates:
            logits = self.model.compute_logits(hidden[candidates])
            sampled = self._sample(logits, [rows[index].sampling for index in candidates])
        exited_host = exited.tolist()
        tokens: list[SampledToken | None] = [None] * len(rows)
        for slot_in_candidates, index in enumerate(candidates):
            if exited_host[index]:
                assert sampled is not None
                tokens[index] = sampled[slot_in_candidates]
        return _DecodeResult(exited_host, survival.tolist(), exit_test.tolist(), tokens)

    def _evaluate_gate(
        self, rows: list[DecodeRow], hidden: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Survival after this loop [R] fp32 and the exit test [R] bool."""
        survival = torch.tensor(
            [row.survival for row in rows], dtype=torch.float32, device=self.device
        )
        exit_test = torch.zeros(len(rows), dtype=torch.bool, device=self.device)
        gated = [index for index, row in enumerate(rows) if row.evaluate_gate]
        if gated:
            hazard = self.model.exit_probability(hidden[gated])
            updated = next_survival(survival[gated], hazard)
            survival[gated] = updated
            exit_test[gated] = threshold_reached(
                updated,
                self._long([rows[index].loop for index in gated]),
                self._long([rows[index].min_loops for index in gated]),
                torch.tensor(
                    [rows[index].exit_threshold for index in gated],
                    dtype=torch.float32,
                    device=self.device,
                ),
            )
        return survival, exit_test

    def _run_prefill(self, chunks: list[PrefillChunk]) -> list[SampledToken | None]:
        lengths = [len(chunk.token_ids) for chunk in chunks]
        query_start = [0]
        for length in lengths:
            query_start.append(query_start[-1] + length)
        seq_lens = [chunk.start + length for chunk, length in zip(chunks, lengths, strict=True)]
        token_ids = self._long([token for chunk in chunks for token in chunk.token_ids])
        positions = self._long(
            [
                p
                for chunk, n in zip(chunks, lengths, strict=True)
                for p in range(chunk.start, chunk.start + n)
            ]
        )
        sequence_of_token = self._long([s for s, n in enumerate(lengths) for _ in range(n)])
        slots = self._long([chunk.slot for chunk in chunks])
        cos, sin = self.model.rope(positions)
        hidden = self.model.embed(token_ids)  # [T, H]
        for loop in range(1, max(chunk.num_loops for chunk in chunks) + 1):
            active = [index for index, chunk in enumerate(chunks) if chunk.num_loops >= loop]
            if len(active) == len(chunks):
                metadata = self.block_tables.prefill_metadata(
                    slots, loop - 1, positions, sequence_of_token, query_start, seq_lens
                )
                context = LoopContext(cos, sin, PagedAttention(self.backend, self.kv, metadata))
                hidden = self.model.run_loop(hidden, context)
            else:
                hidden = self._run_prefill_subset(
                    hidden, active, loop, lengths, query_start, seq_lens, slots, positions, cos, sin
                )
        finishing = [index for index, chunk in enumerate(chunks) if chunk.completes_prompt]
        results: list[SampledToken | None] = [None] * len(chunks)
        if finishing:
            last = [query_start[index + 1] - 1 for index in finishing]
            logits = self.model.compute_logits(hidden[last])
            sampled = self._sample(logits, [chunks[index].sampling for index in finishing])
            for position, index in enumerate(finishing):
                results[index] = sampled[position]
        return results

    def _run_prefill_subset(
        self,
        hidden: torch.Tensor,
        active: list[int],
        loop: int,
        lengths: list[int],
        query_start: list[int],
        seq_lens: list[int],
        slots: torch.Tensor,
        positions: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
    ) -> torch.Tensor:
        """Run one loop for the chunks in `active` only (requests with fewer loops are done)."""
        tokens = [t for index in active for t in range(query_start[index], query_start[index + 1])]
        token_index = self._long(tokens)
        sub_start = [0]
        for index in active:
            sub_start.append(sub_start[-1] + lengths[index])
        sequence_of_token = self._long([s for s, i in enumerate(active) for _ in range(lengths[i])])
        metadata = self.block_tables.prefill_metadata(
            slots[active],
            loop - 1,
            positions[token_index],
            sequence_of_token,
            sub_start,
            [seq_lens[index] for index in active],
        )
        context = LoopContext(
            cos[token_index], sin[token_index], PagedAttention(self.backend, self.kv, metadata)
        )
        hidden = hidden.clone()
        hidden[token_index] = self.model.run_loop(hidden[token_index], context)
        return hidden

    def _sample(self, logits: torch.Tensor, infos: list[SamplingInfo]) -> list[SampledToken]:
        batch = SamplingBatch.build(infos, self.vocab_size, self.device)
        return to_sampled_tokens(sample(logits, batch), batch)


def to_sampled_tokens(result: SampleResult, batch: SamplingBatch) -> list[SampledToken]:
    """Move a SampleResult to the host (one copy per tensor) as SampledTokens."""
    tokens = result.tokens.tolist()
    logprobs = result.logprobs.tolist()
    top_ids = result.top_ids.tolist()
    top_logprobs = result.top_logprobs.tolist()
    sampled = []
    for row, token in enumerate(tokens):
        entry = None
        count = batch.logprob_counts[row]
        if count is not None:
            top = tuple(zip(top_ids[row][:count], top_logprobs[row][:count], strict=True))
            entry = TokenLogprobs(token, logprobs[row], top)
        sampled.append(SampledToken(token, entry))
    return sampled
