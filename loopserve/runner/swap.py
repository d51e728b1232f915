"""Host memory for the K/V of preempted requests.

Owns: copying a request's pages out of the device KV cache into host memory (pinned on CUDA, so
the copies do not block the host) and back into the pages it is given when it resumes, bit for
bit; and the pinned swap space set aside at start (`HostPagePool`). Must not: decide what is
preempted or which pages it gets (the scheduler does).

Copies run on the step's stream in order: a step's swap-outs are issued before any page they free
is written again, and its swap-ins before anything reads the pages they fill. The same order makes
it safe to hand a restored request's swap space to the next swap-out at once: that copy is queued
behind the restore's.

Pinning host memory is slow (0.4-0.8 s per GiB on the H200's host, measured): pinning each victim's
K/V when it is preempted stalled the engine ~0.4 s per preemption. So on CUDA the engine pins
`swap_space_gb` once at start and carves victims' K/V out of it; a victim that does not fit is
pinned on the spot, as before (slower, still exact), with a warning saying what to raise.
"""

from __future__ import annotations

import bisect
import logging
import time

import torch

from loopserve.engine.scheduler_output import PageMove
from loopserve.kv.storage import KVStorage
from loopserve.kv.transfer import to_device

logger = logging.getLogger(__name__)


class HostPagePool:
    """First-fit ranges of whole pages in one host buffer (page units; no torch here)."""

    def __init__(self, num_pages: int) -> None:
        self.num_pages = num_pages
        self._free: list[tuple[int, int]] = [(0, num_pages)] if num_pages else []  # (start, n)

    @property
    def num_free(self) -> int:
        return sum(length for _, length in self._free)

    def take(self, count: int) -> int | None:
        """The first page of `count` contiguous free pages, now taken; None if no range fits."""
        for index, (start, length) in enumerate(self._free):
            if length >= count:
                if length == count:
                    del self._free[index]
                else:
                    self._free[index] = (start + count, length - count)
                return start
        return None

    def give_back(self, start: int, count: int) -> None:
        """Return a range `take` gave, merging it with free neighbours."""
        index = bisect.bisect(self._free, (start, count))
        if index and self._free[index - 1][0] + self._free[index - 1][1] == start:
            index -= 1
            start, count = self._free[index][0], self._free[index][1] + count
            del self._free[index]
        if index < len(self._free) and start + count == self._free[index][0]:
            count += self._free[index][1]
            del self._free[index]
        self._free.insert(index, (start, count))


class HostSwap:
    def __init__(self, kv: KVStorage, swap_space_bytes: int = 0) -> None:
        self.kv = kv
        self.device = kv.cache.device
        self._saved: dict[str, torch.Tensor] = {}  # request id -> [L, 2, N, block, Nkv, D]
        self._ranges: dict[str, tuple[int, int]] = {}  # request id -> its range in the pool
        self._page_numel = kv.cache[:, :, :1].numel()  # one page of every layer: the unit
        pages = swap_space_bytes // (self._page_numel * kv.cache.element_size())
        pinned = self.device.type == "cuda" and pages > 0
        self.pool = HostPagePool(pages if pinned else 0)
        self._buffer: torch.Tensor | None = None
        if pinned:
            started = time.monotonic()
            self._buffer = torch.empty(
                pages * self._page_numel, dtype=kv.cache.dtype, pin_memory=True
            )
            logger.info(
                "swap space: %d pages (%.1f GiB) of pinned host memory in %.1f s",
                pages, self._buffer.nbytes / 2**30, time.monotonic() - started,
            )  # fmt: skip
        self._warned = False

    @property
    def num_saved_pages(self) -> int:
        return sum(data.shape[2] for data in self._saved.values())

    def save(self, moves: list[PageMove]) -> None:
        for move in moves:
            data = self.kv.read_pages(self._pages(move))
            if self.device.type == "cuda":
                data = self._host(move.request_id, data.shape).copy_(data, non_blocking=True)
            self._saved[move.request_id] = data

    def restore(self, moves: list[PageMove]) -> None:
        for move in moves:
            data = self._saved.pop(move.request_id)
            if data.shape[2] != len(move.page_ids):
                raise RuntimeError(
                    f"request {move.request_id!r} saved {data.shape[2]} pages but resumes with "
                    f"{len(move.page_ids)}"
                )
            self.kv.write_pages(self._pages(move), data.to(self.device, non_blocking=True))
            self._release(move.request_id)

    def drop(self, request_ids: list[str]) -> None:
        for request_id in request_ids:
            self._saved.pop(request_id, None)
            self._release(request_id)

    def _host(self, request_id: str, shape: torch.Size) -> torch.Tensor:
        """Pinned host memory for one victim's K/V: from the pool, else pinned now."""
        count = shape[2]
        start = self.pool.take(count) if self._buffer is not None else None
        if self._buffer is None or start is None:
            if self._buffer is not None and not self._warned:
                self._warned = True
                logger.warning(
                    "the pinned swap space (%d pages) is full: preempted requests' K/V are "
                    "pinned on the spot (about 0.5 s per GiB); raise --swap-space-gb",
                    self.pool.num_pages,
                )
            return torch.empty(shape, dtype=self.kv.cache.dtype, pin_memory=True)
        self._ranges[request_id] = (start, count)
        return self._buffer[start * self._page_numel : (start + count) * self._page_numel].view(
            shape
        )

    def _release(self, request_id: str) -> None:
        taken = self._ranges.pop(request_id, None)
        if taken is not None:
            self.pool.give_back(*taken)

    def _pages(self, move: PageMove) -> torch.Tensor:
        return to_device(move.page_ids, torch.int64, self.device)
