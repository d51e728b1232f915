"""A bounded cache of decode plans keyed by (rows, page-width bucket), with pinned entries.

Owns: which plans are kept, their keys and eviction. Must not: make plans itself (the backend
passes a factory) or know what a plan holds.

A plan owns device buffers that a captured CUDA graph points at, so an entry that was used while a
graph was being captured is pinned and never evicted; the others are evicted least recently used
first once the cache holds `capacity` entries. The page-width bucket is the next power of two at
or above the page table's width, so tables of similar width share a plan (and its buffers).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Generic, TypeVar

Entry = TypeVar("Entry")


@dataclass(frozen=True, slots=True)
class PlanKey:
    rows: int  # rows of the pass (the plan's batch size)
    width_bucket: int  # pages per row the plan's buffers can hold (a power of two)


def width_bucket(width: int) -> int:
    """The power of two at or above `width` (at least 1)."""
    return 1 << max(0, width - 1).bit_length()


def plan_key(rows: int, width: int) -> PlanKey:
    return PlanKey(rows, width_bucket(width))


class PlanCacheError(RuntimeError):
    """A plan was needed where none may be made (inside a CUDA-graph capture)."""


class PlanCache(Generic[Entry]):
    def __init__(self, capacity: int) -> None:
        if capacity < 1:
            raise ValueError("a plan cache holds at least one plan")
        self.capacity = capacity
        self._entries: OrderedDict[PlanKey, Entry] = OrderedDict()  # least recent first
        self._pinned: set[PlanKey] = set()

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, key: PlanKey) -> bool:
        return key in self._entries

    @property
    def keys(self) -> list[PlanKey]:
        return list(self._entries)

    @property
    def pinned(self) -> frozenset[PlanKey]:
        return frozenset(self._pinned)

    def get(self, key: PlanKey, create: Callable[[], Entry], *, capturing: bool = False) -> Entry:
        """The plan for `key`, made by `create` on a miss. While a CUDA graph is being captured
        the plan must already exist (it is made by the eager warm-up step) and is pinned."""
        entry = self._entries.get(key)
        if entry is None:
            if capturing:
                raise PlanCacheError(
                    f"no decode plan for {key} while capturing a CUDA graph: run the same step "
                    "eagerly first (plans copy host data and allocate, which a capture forbids)"
                )
            self._evict_for_one_more()
            entry = create()
            self._entries[key] = entry
        self._entries.move_to_end(key)
        if capturing:
            self._pinned.add(key)
        return entry

    def _evict_for_one_more(self) -> None:
        for key in list(self._entries):
            if len(self._entries) < self.capacity:
                return
            if key not in self._pinned:
                del self._entries[key]
        # Only pinned plans are left: graphs need each of them, so the cache grows past capacity
        # (bounded by the number of captured graphs).
