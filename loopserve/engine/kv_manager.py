"""Torch-free logical KV pages: the free pool, per-request page tables per plane, reference counts,
reservations and the prefix cache.

Owns: which pages each (request, plane) table holds, how many tables reference each page, and the
page arithmetic of admission. Must not: import torch or touch device memory (that is
`kv.storage.KVStorage`), know what the planes mean (that is `kv.layout`), or decide who gets pages
(that is the scheduler).

Every usable page is in exactly one place: the free list, the prefix cache's idle list (holding a
cached block nobody references, reused oldest first when the free list is empty), or referenced by
one or more table entries (prefix sharing). A request may hold a *reservation*: pages promised at
admission and drawn as its tables grow (`kv_allocation="reserve"`); without one, tables grow from
the pool and the scheduler makes room by preemption. Page 0 is the null page and is never given
out.
"""

from __future__ import annotations

import bisect
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from loopserve.engine.prefix_cache import PrefixCache
from loopserve.kv.pages import NULL_PAGE, pages_for


@dataclass(slots=True)
class _RequestPages:
    tables: list[list[int]]  # plane -> page ids
    reserved: int  # pages promised to the request and not yet drawn
    freed_planes: set[int] = field(default_factory=set)


class KVCacheManager:
    def __init__(
        self,
        num_pages: int,
        block_size: int,
        prefix_caching: bool = True,
        last_plane_differs: bool = False,
    ) -> None:
        """`last_plane_differs`: a request's last plane also holds K/V that its other planes do
        not (a family's prelude and coda layers), so a cached page of plane p serves only
        requests for which p is the last plane as well, or only requests for which it is not."""
        if num_pages < 2:
            raise ValueError(
                f"the KV cache needs at least 2 pages (one is the null page), got {num_pages}"
            )
        self.num_pages = num_pages
        self.block_size = block_size
        self._free: list[int] = list(range(num_pages - 1, NULL_PAGE, -1))  # pop(): low ids first
        self._refs: Counter[int] = Counter()
        self.cache = PrefixCache() if prefix_caching else None
        self._last_plane_differs = last_plane_differs
        self._requests: dict[str, _RequestPages] = {}
        self._total_reserved = 0
        # Pages taken from the pool (free or idle cached) and given back, since start-up; their
        # difference is `num_used_pages`. Observers diff them per step.
        self.pages_taken = 0
        self.pages_released = 0

    @property
    def num_usable_pages(self) -> int:
        return self.num_pages - 1

    @property
    def num_used_pages(self) -> int:
        """Pages some request references."""
        return len(self._refs)

    @property
    def num_cached_pages(self) -> int:
        """Pages that hold a cached prompt block nobody references (reusable)."""
        return self.cache.num_idle if self.cache is not None else 0

    @property
    def num_free_pages(self) -> int:
        """Pages a table can grow into: free ones and unreferenced cached ones."""
        return len(self._free) + self.num_cached_pages

    @property
    def num_available_pages(self) -> int:
        """Free pages not promised to an admitted request."""
        return self.num_free_pages - self._total_reserved

    def admit(self, request_id: str, num_planes: int, reserve: int = 0) -> None:
        """Give a request empty page tables and, optionally, a reservation of `reserve` pages."""
        if request_id in self._requests:
            raise ValueError(f"request {request_id!r} already holds KV pages")
        if reserve > self.num_available_pages:
            raise ValueError(
                f"cannot reserve {reserve} pages: only {self.num_available_pages} are available"
            )
        self._requests[request_id] = _RequestPages([[] for _ in range(num_planes)], reserve)
        self._total_reserved += reserve

    def reservation(self, request_id: str) -> int:
        """Pages still promised to the request."""
        return self._requests[request_id].reserved

    def pages_to_grow(self, request_id: str, plane: int, num_tokens: int) -> int:
        """New pages `grow(request_id, plane, num_tokens)` would take."""
        return self.pages_to_grow_planes(request_id, (plane,), num_tokens)

    def pages_to_grow_planes(self, request_id: str, planes: Iterable[int], num_tokens: int) -> int:
        """New pages growing each of `planes` to `num_tokens` positions would take in all (one
        lookup: the scheduler asks this of every decoding request every step)."""
        tables = self._requests[request_id].tables
        pages = pages_for(num_tokens, self.block_size)
        return sum(max(0, pages - len(tables[plane])) for plane in planes)

    def grow(self, request_id: str, plane: int, num_tokens: int) -> tuple[int, list[int]]:
        """Extend a plane's table to cover `num_tokens` positions.

        Returns (index of the first new entry, new page ids), for the runner's device tables.
        """
        pages = self._requests[request_id]
        if plane in pages.freed_planes:
            raise ValueError(f"plane {plane} of {request_id!r} was already freed")
        table = pages.tables[plane]
        start = len(table)
        missing = self.pages_to_grow(request_id, plane, num_tokens)
        from_reservation = min(missing, pages.reserved)
        if missing - from_reservation > self.num_available_pages:
            raise RuntimeError(
                f"request {request_id!r} needs {missing} more pages but only "
                f"{self.num_available_pages} are available; the scheduler must make room first"
            )
        pages.reserved -= from_reservation
        self._total_reserved -= from_reservation
        new = [self._take_page() for _ in range(missing)]
        self.pages_taken += missing
        self._refs.update(new)
        table.extend(new)
        return start, new

    def cached_prefix(self, hashes: list[bytes], num_planes: int) -> list[list[int]]:
        """Per block of the longest run of `hashes` cached in every plane: its page per plane."""
        found: list[list[int]] = []
        cache = self.cache
        if cache is None:
            return found
        for block_hash in hashes:
            pages = [
                cache.lookup((block_hash, self._cache_plane(plane, num_planes)))
                for plane in range(num_planes)
            ]
            if None in pages:
                break
            found.append([page for page in pages if page is not None])
        return found

    def share_prefix(self, request_id: str, blocks: list[list[int]]) -> None:
        """Put cached pages (`cached_prefix`'s answer) at the start of an empty request's tables."""
        pages = self._requests[request_id]
        assert self.cache is not None and all(not table for table in pages.tables)
        for block in blocks:
            for plane, page in enumerate(block):
                if page not in self._refs:
                    self.cache.unpark(page)
                    self.pages_taken += 1
                self._refs[page] += 1
                pages.tables[plane].append(page)

    def register(self, request_id: str, plane: int, block: int, block_hash: bytes) -> None:
        """Block `block` of the request's plane now holds the prompt block `block_hash`."""
        if self.cache is not None:
            tables = self._requests[request_id].tables
            key = (block_hash, self._cache_plane(plane, len(tables)))
            self.cache.insert(key, tables[plane][block])

    def _cache_plane(self, plane: int, num_planes: int) -> int:
        """The plane part of a prefix-cache key: the plane, or (where the last plane differs)
        -1 - plane for a request's last plane."""
        last = self._last_plane_differs and plane == num_planes - 1
        return -1 - plane if last else plane

    def release_plane(self, request_id: str, plane: int) -> None:
        """Drop one plane's pages (the `shared` layout's prompt planes once prefill is done)."""
        pages = self._requests[request_id]
        self._drop(pages.tables[plane])
        pages.tables[plane] = []
        pages.freed_planes.add(plane)

    def free(self, request_id: str) -> None:
        """Drop every page of a request and cancel what is left of its reservation."""
        pages = self._requests.pop(request_id, None)
        if pages is None:
            return
        for table in pages.tables:
            self._drop(table)
        self._total_reserved -= pages.reserved

    def num_idle(self, pages: Iterable[int]) -> int:
        """How many of `pages` (cached pages) nobody references: sharing them takes them from
        the pool."""
        return sum(1 for page in pages if page not in self._refs)

    def tables(self, request_id: str) -> list[list[int]]:
        return [list(table) for table in self._requests[request_id].tables]

    def page_counts(self, request_id: str) -> tuple[int, int]:
        """(pages in the request's tables, those nobody else references: what freeing it now
        would give back). Only cached prompt blocks are shared, and whoever shares one shares
        every block before it, so in each table the shared pages come first, with reference
        counts that never rise along the table: a binary search finds where they end."""
        held = own = 0
        for table in self._requests[request_id].tables:
            held += len(table)
            if not table or self._refs[table[0]] == 1:  # nothing shared (the common case)
                own += len(table)
                continue
            shared = bisect.bisect_left(range(len(table)), True, key=self._alone(table))
            own += len(table) - shared
        return held, own

    def _alone(self, table: list[int]) -> Callable[[int], bool]:
        return lambda index: self._refs[table[index]] == 1

    def freed_planes(self, request_id: str) -> set[int]:
        return set(self._requests[request_id].freed_planes)

    def holds(self, request_id: str) -> bool:
        return request_id in self._requests

    def _take_page(self) -> int:
        if self._free:
            return self._free.pop()
        assert self.cache is not None, "no page left to take"
        return self.cache.evict()

    def reset_prefix_cache(self) -> None:
        """Forget every cached prompt block (its idle pages become free); tables keep their
        pages."""
        if self.cache is not None:
            self._free.extend(self.cache.clear())

    def _drop(self, table: list[int]) -> None:
        """One reference less to every page of `table`; unreferenced pages go back."""
        for page in table:
            self._refs[page] -= 1
            if self._refs[page]:
                continue
            del self._refs[page]
            self.pages_released += 1
            if self.cache is not None and self.cache.is_cached(page):
                self.cache.park(page)
            else:
                self._free.append(page)

    def check_invariants(self) -> None:
        """Raise AssertionError if the bookkeeping is inconsistent (tests call this every step)."""
        free = set(self._free)
        referenced = set(self._refs)
        assert len(free) == len(self._free), "a page is on the free list twice"
        assert NULL_PAGE not in free | referenced, "the null page was handed out"
        assert not free & referenced, "a page is both free and referenced"
        references = Counter(
            page for pages in self._requests.values() for table in pages.tables for page in table
        )
        assert references == self._refs, "reference counts differ from the page tables"
        assert len(free) + len(referenced) + self.num_cached_pages == self.num_usable_pages, (
            "a page was lost"
        )
        assert self.pages_taken - self.pages_released == len(referenced), "a page was miscounted"
        if self.cache is not None:
            self.cache.check_invariants(referenced, free)
        assert all(pages.reserved >= 0 for pages in self._requests.values())
        assert self._total_reserved == sum(p.reserved for p in self._requests.values())
        assert self._total_reserved <= self.num_free_pages, "reservations exceed free pages"
