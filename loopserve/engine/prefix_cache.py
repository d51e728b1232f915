"""The prefix cache: which page holds which block of prompt tokens in which plane.

Owns: the chained block hashes of a prompt, the (block hash, plane) -> page map, and the LRU order
of cached pages no request references (they are reused, oldest first, when pages run out). Must
not: import torch, count references (the KV manager does) or decide what may be cached (only full
pages of prompt tokens are: docs/looped-models.md §3 says why they are the same for every request
with that prefix, in every plane).

A block's hash covers its tokens and every token before it (each hash chains the previous one), so
equal hashes mean equal prefixes. BLAKE2b keeps collisions out of reach, also for prompts crafted to
collide (a collision would let one request read another's K/V).
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict

# (chained block hash, plane)
CacheKey = tuple[bytes, int]


def block_hashes(token_ids: list[int], block_size: int) -> list[bytes]:
    """The chained hash of every full block of `token_ids`."""
    hashes: list[bytes] = []
    previous = b""
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        block = token_ids[start : start + block_size]
        digest = hashlib.blake2b(previous, digest_size=16)
        digest.update(b"".join(token.to_bytes(8, "little", signed=True) for token in block))
        previous = digest.digest()
        hashes.append(previous)
    return hashes


class PrefixCache:
    def __init__(self) -> None:
        self._page_of: dict[CacheKey, int] = {}
        self._key_of: dict[int, CacheKey] = {}
        self._idle: OrderedDict[int, None] = OrderedDict()  # unreferenced cached pages, LRU first

    @property
    def num_idle(self) -> int:
        return len(self._idle)

    def lookup(self, key: CacheKey) -> int | None:
        return self._page_of.get(key)

    def insert(self, key: CacheKey, page: int) -> None:
        """Record that `page` (referenced) holds `key`; a key already cached keeps its page."""
        if key not in self._page_of and page not in self._key_of:
            self._page_of[key] = page
            self._key_of[page] = key

    def is_cached(self, page: int) -> bool:
        return page in self._key_of

    def park(self, page: int) -> None:
        """A cached page nobody references any more: keep its content, reusable last."""
        self._idle[page] = None

    def unpark(self, page: int) -> None:
        """A parked page is referenced again."""
        del self._idle[page]

    def evict(self) -> int:
        """Forget the least recently parked page and hand it out for new content."""
        page, _ = self._idle.popitem(last=False)
        del self._page_of[self._key_of.pop(page)]
        return page

    def clear(self) -> list[int]:
        """Forget every cached block; returns the idle pages (now plain free pages). Pages that
        requests still reference stay theirs, no longer cached."""
        idle = list(self._idle)
        self._idle.clear()
        self._page_of.clear()
        self._key_of.clear()
        return idle

    def check_invariants(self, referenced: set[int], free: set[int]) -> None:
        assert len(self._page_of) == len(self._key_of), "the cache maps are out of step"
        assert not set(self._idle) & free, "an idle cached page is also on the free list"
        assert all(self._page_of[key] == page for page, key in self._key_of.items())
        assert set(self._idle) <= set(self._key_of), "an idle page holds no cached block"
        assert not set(self._idle) & referenced, "a referenced page is idle"
        assert set(self._key_of) <= set(self._idle) | referenced, "a cached page was lost"
