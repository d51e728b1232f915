"""The page lists FlashInfer's paged kernels read (CSR: `indptr`, `indices`, `last_page_len`), built
from loopserve's dense page tables.

Owns: `DecodeCSR` (device buffers filled from device lengths by torch ops, no host round trip, so
the fill can be captured in a CUDA graph) and `prefill_layout` (the host lists of a prompt pass,
which has host lengths). Must not: import flashinfer, or read a device tensor back to the host.

FlashInfer's layout: row b reads pages `indices[indptr[b] : indptr[b + 1]]`; its length is
`(indptr[b + 1] - indptr[b] - 1) * block + last_page_len[b]`, and 0 when it has no pages.
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import accumulate

import torch

from loopserve.kv.pages import NULL_PAGE, pages_for
from loopserve.kv.transfer import to_device


@dataclass(slots=True)
class DecodeCSR:
    """Device page lists for `rows` rows of at most `width` pages, refilled every step."""

    indptr: torch.Tensor  # [rows + 1] int32; indptr[0] stays 0
    indices: torch.Tensor  # [rows * width + 1] int32; the last entry absorbs unused positions
    last_page_len: torch.Tensor  # [rows] int32
    columns: torch.Tensor  # [width] int32: 0 .. width - 1 (allocated once, not per step)

    @classmethod
    def allocate(cls, rows: int, width: int, device: torch.device) -> DecodeCSR:
        def zeros(size: int) -> torch.Tensor:
            return torch.zeros(size, dtype=torch.int32, device=device)

        return cls(
            indptr=zeros(rows + 1),
            indices=zeros(cls.indices_size(rows, width)),
            last_page_len=zeros(rows),
            columns=torch.arange(width, dtype=torch.int32, device=device),
        )

    @staticmethod
    def indices_size(rows: int, width: int) -> int:
        return rows * width + 1  # every page of every row, and the dump entry

    @property
    def rows(self) -> int:
        return self.last_page_len.shape[0]

    @property
    def width(self) -> int:
        return self.columns.shape[0]

    def fill(self, seq_lens: torch.Tensor, page_table: torch.Tensor, block_size: int) -> None:
        """Rewrite the lists from device lengths [rows] int32 and a dense table [rows, P] int32.

        Only device ops with fixed shapes: no host synchronisation, no allocation the size of
        which depends on the lengths. Row b's first ceil(len_b / block) pages land at
        indices[indptr[b] + j]; every other table entry is sent to the last (dump) entry.
        """
        rows, width = page_table.shape
        if rows != self.rows or width > self.width:
            raise ValueError(
                f"page table [{rows}, {width}] does not fit lists of {self.rows} rows x "
                f"{self.width} pages"
            )
        pages = torch.div(seq_lens + (block_size - 1), block_size, rounding_mode="floor")  # [R]
        torch.cumsum(pages, dim=0, dtype=torch.int32, out=self.indptr[1:])
        # last = len - (pages - 1) * block, in [1, block] for a non-empty row (unread when empty)
        torch.add(seq_lens, pages, alpha=-block_size, out=self.last_page_len)
        self.last_page_len.add_(block_size)
        columns = self.columns[:width]
        target = self.indptr[:-1, None] + columns[None, :]  # [R, P]: where entry (b, j) goes
        dump = self.indices.shape[0] - 1
        target = torch.where(columns[None, :] < pages[:, None], target, dump)
        self.indices.scatter_(0, target.reshape(-1).long(), page_table.reshape(-1))


@dataclass(frozen=True, slots=True)
class PrefillLayout:
    """Host page lists of one packed prompt pass (host lengths exist there)."""

    qo_indptr: list[int]  # [S + 1] query tokens of each row
    kv_indptr: list[int]  # [S + 1]
    last_page_len: list[int]  # [S]
    table_positions: list[int]  # [kv_indptr[-1]] flat positions into the [S, P] page table
    empty_tokens: list[int]  # query tokens of rows with no context (zeroed after the kernel)


def prefill_layout(
    query_start: list[int], seq_lens: list[int], table_width: int, block_size: int
) -> PrefillLayout:
    """The CSR of a pass whose row s has context `seq_lens[s]` and queries
    `query_start[s]:query_start[s + 1]` (the last ones of that context).

    A row with no context (a padding row of a test batch) reads one slot of the null page so
    that the kernels never see an empty context under a query; its outputs are zeroed after.
    """
    counts: list[int] = []
    last: list[int] = []
    positions: list[int] = []
    empty: list[int] = []
    for row, length in enumerate(seq_lens):
        if length == 0:
            counts.append(1)
            last.append(1)
            positions.append(-1)  # the null page
            empty.extend(range(query_start[row], query_start[row + 1]))
            continue
        needed = pages_for(length, block_size)
        counts.append(needed)
        last.append(length - (needed - 1) * block_size)
        positions.extend(range(row * table_width, row * table_width + needed))
    return PrefillLayout(
        qo_indptr=list(query_start),
        kv_indptr=[0, *accumulate(counts)],
        last_page_len=last,
        table_positions=positions,
        empty_tokens=empty,
    )


def gather_pages(page_table: torch.Tensor, positions: list[int]) -> torch.Tensor:
    """indices [N] int32 on the table's device: the page at each flat position, NULL_PAGE at -1.

    The positions travel through pinned memory without a host synchronisation.
    """
    flat = torch.cat([page_table.reshape(-1), page_table.new_full((1,), NULL_PAGE)])
    index = to_device(positions, torch.int64, page_table.device)
    return flat[torch.where(index < 0, flat.shape[0] - 1, index)]
