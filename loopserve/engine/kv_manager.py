"""Torch-free logical KV pages: ids, free list, reservations and per-request page tables per plane.

Owns: which page belongs to which (request, plane), and the admission arithmetic that keeps every
admitted request able to finish. Must not: import torch or touch device memory (that is
`kv.storage.KVStorage`), or know what the planes mean (that is `kv.layout`).

A request reserves, when it is admitted, every page it can ever need (`KVLayout.pages_needed`);
pages are then drawn from that reservation as its tables grow, and both are returned when it
finishes. Since the free list always covers all outstanding reservations, no admitted request can
run out of pages: admission never deadlocks and nothing needs preempting. Page 0 is the null page
and is never given out.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from loopserve.kv.pages import NULL_PAGE, pages_for


@dataclass(slots=True)
class _RequestPages:
    tables: list[list[int]]  # plane -> page ids
    reserved: int  # pages promised to the request and not yet drawn
    freed_planes: set[int] = field(default_factory=set)


class KVCacheManager:
    def __init__(self, num_pages: int, block_size: int) -> None:
        if num_pages < 2:
            raise ValueError(
                f"the KV cache needs at least 2 pages (one is the null page), got {num_pages}"
            )
        self.num_pages = num_pages
        self.block_size = block_size
        self._free: list[int] = list(
            range(num_pages - 1, NULL_PAGE, -1)
        )  # pop() gives low ids first
        self._owner: dict[int, str] = {}
        self._requests: dict[str, _RequestPages] = {}
        self._total_reserved = 0

    @property
    def num_usable_pages(self) -> int:
        return self.num_pages - 1

    @property
    def num_free_pages(self) -> int:
        return len(self._free)

    @property
    def num_used_pages(self) -> int:
        return self.num_usable_pages - len(self._free)

    @property
    def num_available_pages(self) -> int:
        """Free pages not promised to an admitted request."""
        return len(self._free) - self._total_reserved

    def can_reserve(self, num_pages: int) -> bool:
        return num_pages <= self.num_available_pages

    def reserve(self, request_id: str, num_planes: int, num_pages: int) -> None:
        """Admit a request: promise it `num_pages` pages over `num_planes` page tables."""
        if request_id in self._requests:
            raise ValueError(f"request {request_id!r} already holds KV pages")
        if not self.can_reserve(num_pages):
            raise ValueError(
                f"cannot reserve {num_pages} pages: only {self.num_available_pages} are available"
            )
        self._requests[request_id] = _RequestPages([[] for _ in range(num_planes)], num_pages)
        self._total_reserved += num_pages

    def grow(self, request_id: str, plane: int, num_tokens: int) -> tuple[int, list[int]]:
        """Extend a plane's table to cover `num_tokens` positions.

        Returns (index of the first new entry, new page ids), for the runner's device tables.
        """
        pages = self._requests[request_id]
        if plane in pages.freed_planes:
            raise ValueError(f"plane {plane} of {request_id!r} was already freed")
        table = pages.tables[plane]
        start = len(table)
        missing = pages_for(num_tokens, self.block_size) - start
        if missing <= 0:
            return start, []
        if missing > pages.reserved:
            raise RuntimeError(
                f"request {request_id!r} needs {missing} more pages than it reserved; "
                "the scheduler's reservation arithmetic is wrong"
            )
        new = [self._free.pop() for _ in range(missing)]
        for page in new:
            self._owner[page] = request_id
        table.extend(new)
        pages.reserved -= missing
        self._total_reserved -= missing
        return start, new

    def release_plane(self, request_id: str, plane: int) -> None:
        """Free one plane's pages (the `shared` layout's prompt planes once prefill is done)."""
        pages = self._requests[request_id]
        self._free_pages(pages.tables[plane])
        pages.tables[plane] = []
        pages.freed_planes.add(plane)

    def free(self, request_id: str) -> None:
        """Free every page of a request and cancel what is left of its reservation."""
        pages = self._requests.pop(request_id, None)
        if pages is None:
            return
        for table in pages.tables:
            self._free_pages(table)
        self._total_reserved -= pages.reserved

    def table(self, request_id: str, plane: int) -> list[int]:
        return self._requests[request_id].tables[plane]

    def slot(self, request_id: str, plane: int, position: int) -> int:
        """Flat KV slot (page * block_size + offset) of a position in a plane."""
        page = self._requests[request_id].tables[plane][position // self.block_size]
        return page * self.block_size + position % self.block_size

    def holds(self, request_id: str) -> bool:
        return request_id in self._requests

    def _free_pages(self, table: list[int]) -> None:
        for page in table:
            del self._owner[page]
        self._free.extend(reversed(table))

    def check_invariants(self) -> None:
        """Raise AssertionError if the bookkeeping is inconsistent (tests call this every step)."""
        free = set(self._free)
        assert len(free) == len(self._free), "a page is on the free list twice"
        assert NULL_PAGE not in free and NULL_PAGE not in self._owner, (
            "the null page was handed out"
        )
        assert not free & self._owner.keys(), "a page is both free and owned"
        assert len(free) + len(self._owner) == self.num_usable_pages, "a page was lost"
        for request_id, pages in self._requests.items():
            for table in pages.tables:
                assert all(self._owner[page] == request_id for page in table), "foreign page"
            assert pages.reserved >= 0
        assert self._total_reserved == sum(p.reserved for p in self._requests.values())
        assert self._total_reserved <= len(self._free), "reservations exceed free pages"
