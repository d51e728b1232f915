"""Prompt chunks through every loop: packed causal attention over paged K/V, then the first token.

Owns: running a step's prompt chunks (one packed pass per loop, each loop d writing and reading
plane d - 1 as `kv.layout` says; a CUDA graph replay per loop where `prompt_graphs` has one that
fits), the prelude before the loops and the coda after them (their layers' K/V, for a family
that has such layers, in each request's last plane), and sampling the first output token of the
chunks that complete a prompt. Must not: schedule anything; it runs exactly the chunks it is
given.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from itertools import accumulate

import torch

from loopserve.attention.base import AttentionBackend
from loopserve.attention.paged import PagedAttention
from loopserve.engine.scheduler_output import PrefillChunk, SampledToken
from loopserve.kv.layout import KVLayout
from loopserve.kv.metadata import AttentionMetadata
from loopserve.kv.storage import KVStorage
from loopserve.kv.transfer import to_device
from loopserve.models.layers import LoopContext
from loopserve.models.looped import PROMPT_STATE_SEED, LoopedForCausalLM
from loopserve.outputs import TokenLogprobs
from loopserve.runner.block_tables import BlockTables, PromptPass
from loopserve.runner.prompt_graphs import GraphedPromptLoop
from loopserve.sample.sampler import SampleResult, SamplingBatch, sample


class PromptRunner:
    def __init__(
        self,
        model: LoopedForCausalLM,
        kv: KVStorage,
        backend: AttentionBackend,
        block_tables: BlockTables,
        graphs: GraphedPromptLoop | None = None,
    ) -> None:
        self.model = model
        self.kv = kv
        self.backend = backend
        self.block_tables = block_tables
        self.graphs = graphs
        self.device = block_tables.device

    def run(self, chunks: list[PrefillChunk]) -> list[SampledToken | None]:
        """Every loop of every chunk; the first output token of chunks that complete a prompt."""
        query_start = [0, *accumulate(len(chunk.token_ids) for chunk in chunks)]
        token_ids = self._long([token for chunk in chunks for token in chunk.token_ids])
        positions = self._long(
            [p for chunk in chunks for p in range(chunk.start, chunk.start + len(chunk.token_ids))]
        )
        cos, sin = self.model.rope(positions)
        seeds = torch.full_like(positions, PROMPT_STATE_SEED)
        stages = self._stage_passes(chunks, query_start, positions)

        def prelude(tokens: torch.Tensor | None, ctx: LoopContext | None) -> torch.Tensor:
            if tokens is None:
                return self.model.start(token_ids, positions, seeds, ctx)
            return self.model.start(token_ids[tokens], positions[tokens], seeds[tokens], ctx)

        hidden = self._run_stage(stages, cos, sin, prelude)
        for loop in range(1, max(chunk.num_loops for chunk in chunks) + 1):
            # The chunks still running (requests with fewer loops are done).
            active = [index for index, chunk in enumerate(chunks) if chunk.num_loops >= loop]
            if len(active) == len(chunks):
                prompt = self._pass(chunks, active, loop, positions)
                hidden = self._run_loop(hidden, cos, sin, prompt)
            else:
                tokens = self._long([t for i in active for t in range(*query_start[i : i + 2])])
                prompt = self._pass(chunks, active, loop, positions[tokens])
                hidden = hidden.clone()
                hidden[tokens] = self._run_loop(hidden[tokens], cos[tokens], sin[tokens], prompt)
            self._copy_on_exit(chunks, active, loop)
        finishing = [index for index, chunk in enumerate(chunks) if chunk.completes_prompt]
        last = [query_start[index + 1] - 1 for index in finishing]

        def coda(tokens: torch.Tensor | None, ctx: LoopContext | None) -> torch.Tensor:
            return self.model.coda(hidden if tokens is None else hidden[tokens], ctx)

        if stages is None:  # no coda layers: only the sampled positions' readout is needed
            readout = self.model.coda(hidden[last])
        else:  # the coda runs on every prompt token: later tokens' coda layers read their K/V
            readout = self._run_stage(stages, cos, sin, coda)[last]
        results: list[SampledToken | None] = [None] * len(chunks)
        if finishing:
            logits = self.model.head(readout)
            infos = [chunks[index].sampling for index in finishing]
            masks = [chunks[index].token_mask for index in finishing]
            batch = SamplingBatch.build(infos, self.model.config.vocab_size, self.device, masks)
            for row, token in zip(
                finishing, sampled_tokens(sample(logits, batch), batch), strict=True
            ):
                results[row] = token
        return results

    def _stage_passes(
        self, chunks: list[PrefillChunk], query_start: list[int], positions: torch.Tensor
    ) -> list[tuple[torch.Tensor | None, AttentionMetadata]] | None:
        """The passes of the prelude and coda layers over every token of the chunks, their K/V in
        each request's last plane: one per distinct loop count, as (the pass's token indices,
        None for all of them; its metadata); None for a family without such layers."""
        if not self.model.has_stage_layers:
            return None
        groups: dict[int, list[int]] = {}
        for index, chunk in enumerate(chunks):
            groups.setdefault(chunk.num_loops, []).append(index)
        passes = []
        for loops, members in groups.items():
            tokens = (
                None
                if len(members) == len(chunks)
                else self._long([t for i in members for t in range(*query_start[i : i + 2])])
            )
            picked = positions if tokens is None else positions[tokens]
            prompt = self._pass(chunks, members, loops, picked)
            passes.append((tokens, self.block_tables.prefill_metadata(prompt)))
        return passes

    def _run_stage(
        self,
        passes: list[tuple[torch.Tensor | None, AttentionMetadata]] | None,
        cos: torch.Tensor,
        sin: torch.Tensor,
        stage: Callable[[torch.Tensor | None, LoopContext | None], torch.Tensor],
    ) -> torch.Tensor:
        """`stage` (the prelude or the coda) over every token, pass by pass: stage(tokens, ctx)
        gets a pass's token indices (None: all of them) and its attention (None: no passes)."""
        if passes is None:
            return stage(None, None)
        outputs = []
        for tokens, metadata in passes:
            attention = PagedAttention(self.backend, self.kv, metadata)
            rows = slice(None) if tokens is None else tokens
            outputs.append((tokens, stage(tokens, LoopContext(cos[rows], sin[rows], attention))))
        if outputs[0][0] is None:
            return outputs[0][1]
        result = outputs[0][1].new_empty((cos.shape[0], outputs[0][1].shape[1]))
        for tokens, output in outputs:
            result[tokens] = output
        return result

    def _pass(
        self,
        chunks: list[PrefillChunk],
        active: list[int],
        loop: int,
        positions: torch.Tensor,  # [T'] int64, the active chunks' tokens
    ) -> PromptPass:
        """One loop of the chunks in `active`, in the plane that loop uses."""
        lengths = [len(chunks[i].token_ids) for i in active]
        query_start = [0, *accumulate(lengths)]
        kept = [
            offset + index
            for offset, i in zip(query_start, active, strict=False)  # query_start has one more
            for index, loops in enumerate(chunks[i].token_loops or ())
            if loops < loop
        ]
        return PromptPass(
            slots=self._long([chunks[i].slot for i in active]),
            plane=KVLayout.prompt_plane(loop),
            positions=positions,
            sequence_of_token=self._long([s for s, n in enumerate(lengths) for _ in range(n)]),
            query_start=query_start,
            seq_lens=[chunks[i].start + len(chunks[i].token_ids) for i in active],
            kept=self._long(kept) if kept else None,
        )

    def _copy_on_exit(self, chunks: list[PrefillChunk], active: list[int], loop: int) -> None:
        """The `full` layout's copy-on-exit for replayed tokens whose last loop this was: their
        K/V of this loop's plane into every deeper plane, as the decode step did when they ran."""
        for index in active:
            chunk = chunks[index]
            offsets = [i for i, loops in enumerate(chunk.token_loops or ()) if loops == loop]
            if not offsets or loop == chunk.num_loops:
                continue
            positions = self._long([chunk.start + offset for offset in offsets])
            plane = KVLayout.prompt_plane(loop)
            source = self.block_tables.position_slots(chunk.slot, plane, positions)
            for deeper in range(plane + 1, chunk.num_loops):
                target = self.block_tables.position_slots(chunk.slot, deeper, positions)
                self.kv.copy_slots(source, target)

    def _run_loop(
        self, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, prompt: PromptPass
    ) -> torch.Tensor:
        """One loop over the pass's tokens: a graph replay where one fits."""
        if self.graphs is not None and self.graphs.fits(prompt):
            return self.graphs.run(hidden, cos, sin, prompt)
        metadata = self.block_tables.prefill_metadata(prompt)
        attention = PagedAttention(self.backend, self.kv, metadata)
        return self.model.run_loop(hidden, LoopContext(cos, sin, attention))

    def _long(self, values: Sequence[int]) -> torch.Tensor:
        return to_device(values, torch.int64, self.device)


def sampled_tokens(result: SampleResult, batch: SamplingBatch) -> list[SampledToken]:
    """Move a SampleResult to the host (one copy per tensor) as SampledTokens."""
    tokens = result.tokens.tolist()
    logprobs = result.logprobs.tolist()
    top_ids = result.top_ids.tolist()
    top_logprobs = result.top_logprobs.tolist()
    return [
        sampled_token(token, logprobs[row], top_ids[row], top_logprobs[row], count)
        for row, (token, count) in enumerate(zip(tokens, batch.logprob_counts, strict=True))
    ]


def sampled_token(
    token: int,
    logprob: float,
    top_ids: Sequence[float],
    top_logprobs: Sequence[float],
    count: int | None,
) -> SampledToken:
    """One sampled token, with its log-prob and `count` alternatives when it asked for them."""
    if count is None:
        return SampledToken(int(token), None)
    top = tuple((int(i), v) for i, v in zip(top_ids[:count], top_logprobs[:count], strict=True))
    return SampledToken(int(token), TokenLogprobs(int(token), logprob, top))
