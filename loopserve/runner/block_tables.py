"""Device page tables per (request slot, plane), and attention metadata built from them.

Owns: the int32 table `[slot, plane, page index] -> page id` kept in step with the scheduler's
`PageTableUpdate`s, and the construction of `AttentionMetadata` for the decode step and prompt
chunks. Must not: decide anything; it mirrors the torch-free KV manager on the device. The decode
metadata's device tensors have a Triton twin in the CUDA decode step's prologue
(`kernels/decode_state.py`), which hands them to `decode_metadata_from`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from itertools import pairwise

import torch

from loopserve.engine.scheduler_output import PageTableUpdate
from loopserve.kv.metadata import AttentionMetadata
from loopserve.kv.pages import NULL_PAGE, pages_for
from loopserve.kv.transfer import to_device


@dataclass(frozen=True, slots=True)
class PromptPass:
    """One loop of a step's prompt chunks: what its attention metadata is built from."""

    slots: torch.Tensor  # [S] int64: each sequence's request slot
    plane: int  # the plane every sequence reads and writes in this loop
    positions: torch.Tensor  # [T] int64: each query token's position
    sequence_of_token: torch.Tensor  # [T] int64: which sequence each query token belongs to
    query_start: list[int]  # [S + 1] cumulative query lengths
    seq_lens: list[int]  # [S] context length after this pass's writes
    # [N] int64 indices into the pass's tokens whose K/V this loop must not write: replayed
    # tokens past their exit loop, whose plane already holds their exit version (copy-on-exit).
    kept: torch.Tensor | None = None

    @property
    def query_lens(self) -> list[int]:
        return [b - a for a, b in pairwise(self.query_start)]

    @property
    def max_query_len(self) -> int:
        return max(self.query_lens)


class BlockTables:
    def __init__(
        self,
        max_num_seqs: int,
        num_planes: int,
        max_pages: int,
        block_size: int,
        device: torch.device,
        max_decode_rows: int | None = None,  # default: one per slot
    ) -> None:
        self.block_size = block_size
        self.device = device
        # [slots, planes, pages] int32, NULL_PAGE where nothing is mapped
        self.tables = torch.full(
            (max_num_seqs, num_planes, max_pages), NULL_PAGE, dtype=torch.int32, device=device
        )
        # One query per decode row: the same starts every step (a view, no launch).
        rows = max_decode_rows if max_decode_rows is not None else max_num_seqs
        self._query_start = torch.arange(rows + 1, dtype=torch.int32, device=device)

    def apply(self, updates: Sequence[PageTableUpdate], cleared_slots: Sequence[int]) -> None:
        """Clear freed slots first (a slot may be reused by this very step), then add pages.

        Indices and page ids reach the device through pinned host memory (an asynchronous
        copy), so a step that grows a request's pages does not synchronise with the GPU."""
        if cleared_slots:
            self.tables[to_device(list(cleared_slots), torch.int64, self.device)] = NULL_PAGE
        if not updates:
            return
        slots: list[int] = []
        planes: list[int] = []
        indices: list[int] = []
        page_ids: list[int] = []
        for update in updates:
            count = len(update.page_ids)
            slots += [update.slot] * count
            planes += [update.plane] * count
            indices += range(update.start, update.start + count)
            page_ids += update.page_ids
        where = to_device([slots, planes, indices], torch.int64, self.device)
        self.tables[where[0], where[1], where[2]] = to_device(page_ids, torch.int32, self.device)

    def decode_metadata(
        self,
        ran: torch.Tensor,  # [R] bool: the row of slot r runs this step
        planes: torch.Tensor,  # [R] int64: the plane slot r writes and reads
        positions: torch.Tensor,  # [R] int64: the position of slot r's in-flight token
        host_lengths: bool,
        table_rows: torch.Tensor | None = None,  # [R] int64: row r's slot (default: r)
    ) -> AttentionMetadata:
        """One query per slot 0..R-1, built on the device with no host synchronisation unless
        `host_lengths` (for backends that loop over rows on the host). Rows that do not run have
        length 0 and write into the null page; every row's table spans the whole context. A
        speculating request's rows (`table_rows`) share its slot's tables."""
        rows = ran.shape[0]
        row_index = torch.arange(rows, device=self.device)
        slot_index = row_index if table_rows is None else table_rows
        page_table = self.tables[slot_index, planes]  # [R, P]
        slots = self.flat_slots(page_table, row_index, positions)
        seq_lens = torch.where(ran, positions + 1, torch.zeros_like(positions)).to(torch.int32)
        slot_mapping = torch.where(ran, slots, NULL_PAGE * self.block_size)
        return self.decode_metadata_from(seq_lens, page_table, slot_mapping, host_lengths)

    def decode_metadata_from(
        self,
        seq_lens: torch.Tensor,  # [R] int32
        page_table: torch.Tensor,  # [R, P] int32
        slot_mapping: torch.Tensor,  # [R] int64
        host_lengths: bool,
    ) -> AttentionMetadata:
        """`decode_metadata` from its device tensors, built by `decode_metadata` or by the
        decode step's prologue kernel (kernels/decode_state.py)."""
        rows = seq_lens.shape[0]
        if rows >= self._query_start.shape[0]:
            raise ValueError(
                f"decode metadata for {rows} rows from block tables built for "
                f"{self._query_start.shape[0] - 1} (pass max_decode_rows: speculating requests "
                "hold several rows each)"
            )
        host = seq_lens.tolist() if host_lengths else None
        return AttentionMetadata(
            query_start=self._query_start[: rows + 1],
            seq_lens=seq_lens,
            page_table=page_table,
            slot_mapping=slot_mapping,
            max_query_len=1,
            max_seq_len=page_table.shape[1] * self.block_size,
            query_start_host=None if host is None else list(range(rows + 1)),
            seq_lens_host=host,
        )

    def prefill_metadata(self, prompt: PromptPass) -> AttentionMetadata:
        """Packed chunks of S sequences, all reading and writing one plane."""
        max_seq_len = max(prompt.seq_lens)
        width = pages_for(max_seq_len, self.block_size)
        page_table = self.tables[prompt.slots, prompt.plane, :width]  # [S, width]
        return AttentionMetadata(
            query_start=to_device(prompt.query_start, torch.int32, self.device),
            seq_lens=to_device(prompt.seq_lens, torch.int32, self.device),
            page_table=page_table,
            slot_mapping=self._pass_slots(page_table, prompt),
            max_query_len=prompt.max_query_len,
            max_seq_len=max_seq_len,
            query_start_host=prompt.query_start,
            seq_lens_host=prompt.seq_lens,
        )

    def static_prefill_metadata(self, max_sequences: int, max_tokens: int) -> AttentionMetadata:
        """Buffers for `padded_prefill_metadata` (whole page-table rows), to be filled by it."""
        device, pages = self.device, self.tables.shape[2]
        return AttentionMetadata(
            query_start=torch.zeros(max_sequences + 1, dtype=torch.int32, device=device),
            seq_lens=torch.zeros(max_sequences, dtype=torch.int32, device=device),
            page_table=torch.full(
                (max_sequences, pages), NULL_PAGE, dtype=torch.int32, device=device
            ),
            slot_mapping=torch.full(
                (max_tokens,), NULL_PAGE * self.block_size, dtype=torch.int64, device=device
            ),
            max_query_len=0,
            max_seq_len=0,
            query_start_host=None,
            seq_lens_host=None,
            padded=True,
        )

    def padded_prefill_metadata(
        self, prompt: PromptPass, static: AttentionMetadata
    ) -> AttentionMetadata:
        """`prefill_metadata` written into the tensors of `static` (a prompt CUDA graph's
        buffers: room for more sequences and tokens, whole page-table rows) as a padded pass
        (kv/metadata.py): sequences past the real ones are empty, tokens past them write into
        the null page."""
        sequences, tokens = len(prompt.seq_lens), prompt.positions.shape[0]
        padding = static.num_sequences - sequences
        if padding < 0 or tokens > static.slot_mapping.shape[0]:
            raise ValueError(
                f"a prompt pass of {sequences} sequences and {tokens} tokens does not fit buffers "
                f"for {static.num_sequences} and {static.slot_mapping.shape[0]}"
            )
        lengths = to_device(
            [*prompt.query_start, *[tokens] * padding, *prompt.seq_lens, *[0] * padding],
            torch.int32,
            self.device,
        )
        static.query_start.copy_(lengths[: sequences + padding + 1])
        static.seq_lens.copy_(lengths[sequences + padding + 1 :])
        page_table = static.page_table[:sequences]
        page_table.copy_(self.tables[prompt.slots, prompt.plane])
        static.slot_mapping[:tokens].copy_(self._pass_slots(page_table, prompt))
        static.slot_mapping[tokens:].fill_(NULL_PAGE * self.block_size)
        return AttentionMetadata(
            query_start=static.query_start,
            seq_lens=static.seq_lens,
            page_table=static.page_table,
            slot_mapping=static.slot_mapping,
            max_query_len=prompt.max_query_len,
            max_seq_len=max(prompt.seq_lens),
            query_start_host=prompt.query_start,
            seq_lens_host=prompt.seq_lens,
            padded=True,
        )

    def _pass_slots(self, page_table: torch.Tensor, prompt: PromptPass) -> torch.Tensor:
        """The pass's slot mapping: each token's slot in the pass's plane, the null page for the
        tokens it keeps."""
        slots = self.flat_slots(page_table, prompt.sequence_of_token, prompt.positions)
        if prompt.kept is not None:
            slots[prompt.kept] = NULL_PAGE * self.block_size
        return slots

    def position_slots(self, slot: int, plane: int, positions: torch.Tensor) -> torch.Tensor:
        """Flat KV slots of one request's `positions` [N] in one plane."""
        return self.flat_slots(
            self.tables[slot, plane][None], torch.zeros_like(positions), positions
        )

    def flat_slots(
        self, page_table: torch.Tensor, row: torch.Tensor, positions: torch.Tensor
    ) -> torch.Tensor:
        """Flat KV slot of each token: page_table[row, pos // block] * block + pos % block."""
        pages = page_table[row, positions // self.block_size].to(torch.int64)
        return pages * self.block_size + positions % self.block_size
