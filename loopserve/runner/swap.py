"""Host memory for the K/V of preempted requests.

Owns: copying a request's pages out of the device KV cache into host memory (pinned on CUDA, so
the copies do not block the host) and back into the pages it is given when it resumes, bit for
bit. Must not: decide what is preempted or which pages it gets (the scheduler does).

Copies run on the step's stream in order: a step's swap-outs are issued before any page they free
is written again, and its swap-ins before anything reads the pages they fill.
"""

from __future__ import annotations

import torch

from loopserve.engine.scheduler_output import PageMove
from loopserve.kv.storage import KVStorage
from loopserve.kv.transfer import to_device


class HostSwap:
    def __init__(self, kv: KVStorage) -> None:
        self.kv = kv
        self.device = kv.cache.device
        self._saved: dict[str, torch.Tensor] = {}  # request id -> [L, 2, N, block, Nkv, D]

    @property
    def num_saved_pages(self) -> int:
        return sum(data.shape[2] for data in self._saved.values())

    def save(self, moves: list[PageMove]) -> None:
        for move in moves:
            data = self.kv.read_pages(self._pages(move))
            if self.device.type == "cuda":
                host = torch.empty(data.shape, dtype=data.dtype, pin_memory=True)
                data = host.copy_(data, non_blocking=True)
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

    def drop(self, request_ids: list[str]) -> None:
        for request_id in request_ids:
            self._saved.pop(request_id, None)

    def _pages(self, move: PageMove) -> torch.Tensor:
        return to_device(move.page_ids, torch.int64, self.device)
