"""Device page tables per (request slot, plane), and attention metadata built from them.

Owns: the int32 table `[slot, plane, page index] -> page id` kept in step with the scheduler's
`PageTableUpdate`s, and the construction of `AttentionMetadata` for the decode step and prompt
chunks. Must not: decide anything; it mirrors the torch-free KV manager on the device. The decode
metadata's device tensors have a Triton twin in the CUDA decode step's prologue
(`kernels/decode_state.py`), which hands them to `decode_metadata_from`.
"""

from __future__ import annotations

from collections.abc import Sequence
from itertools import pairwise

import torch

from loopserve.engine.scheduler_output import PageTableUpdate
from loopserve.kv.metadata import AttentionMetadata
from loopserve.kv.pages import NULL_PAGE, pages_for
from loopserve.kv.transfer import to_device


class BlockTables:
    def __init__(
        self,
        max_num_seqs: int,
        num_planes: int,
        max_pages: int,
        block_size: int,
        device: torch.device,
    ) -> None:
        self.block_size = block_size
        self.device = device
        # [slots, planes, pages] int32, NULL_PAGE where nothing is mapped
        self.tables = torch.full(
            (max_num_seqs, num_planes, max_pages), NULL_PAGE, dtype=torch.int32, device=device
        )
        # One query per decode row: the same starts every step (a view, no launch).
        self._query_start = torch.arange(max_num_seqs + 1, dtype=torch.int32, device=device)

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
    ) -> AttentionMetadata:
        """One query per slot 0..R-1, built on the device with no host synchronisation unless
        `host_lengths` (for backends that loop over rows on the host). Rows that do not run have
        length 0 and write into the null page; every row's table spans the whole context."""
        rows = ran.shape[0]
        slot_index = torch.arange(rows, device=self.device)
        page_table = self.tables[slot_index, planes]  # [R, P]
        slots = self.flat_slots(page_table, slot_index, positions)
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

    def prefill_metadata(
        self,
        slots: torch.Tensor,  # [S] int64
        plane: int,
        positions: torch.Tensor,  # [T] int64
        sequence_of_token: torch.Tensor,  # [T] int64: which sequence each query token belongs to
        query_start_host: list[int],
        seq_lens_host: list[int],
    ) -> AttentionMetadata:
        """Packed chunks of S sequences, all reading and writing one plane."""
        max_seq_len = max(seq_lens_host)
        width = pages_for(max_seq_len, self.block_size)
        page_table = self.tables[slots, plane, :width]  # [S, width]
        return AttentionMetadata(
            query_start=to_device(query_start_host, torch.int32, self.device),
            seq_lens=to_device(seq_lens_host, torch.int32, self.device),
            page_table=page_table,
            slot_mapping=self.flat_slots(page_table, sequence_of_token, positions),
            max_query_len=max(b - a for a, b in pairwise(query_start_host)),
            max_seq_len=max_seq_len,
            query_start_host=query_start_host,
            seq_lens_host=seq_lens_host,
        )

    def flat_slots(
        self, page_table: torch.Tensor, row: torch.Tensor, positions: torch.Tensor
    ) -> torch.Tensor:
        """Flat KV slot of each token: page_table[row, pos // block] * block + pos % block."""
        pages = page_table[row, positions // self.block_size].to(torch.int64)
        return pages * self.block_size + positions % self.block_size
