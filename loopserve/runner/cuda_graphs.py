"""CUDA graphs of the decode step, one per (row bucket, sampling kind).

Owns: bucket choice, lazy capture (a warm-up run on a side stream with the slot state saved and
restored, then capture into one shared memory pool) and replay. Must not: change what a step
computes; a replay runs exactly the kernels the eager step runs, so graphs on equal graphs off.

The step only reads device state, so one graph serves any mix of depths: the depth of each row is
data. Rows of the bucket beyond the active slots are inactive slots and do nothing.
"""

from __future__ import annotations

import torch

from loopserve.runner.decode_slots import SamplingKind
from loopserve.runner.decode_step import DecodeStep
from loopserve.runner.graph_capture import Captured, capture

# Padded row counts that get a graph, below the engine's slot count (which is always one too).
ROW_BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 160, 192, 256, 320, 384, 512)


def row_bucket(rows: int, max_rows: int) -> int:
    """The padded row count whose graph a step over `rows` replays when `max_rows` slots exist:
    the smallest of `ROW_BUCKETS` that holds it, else `max_rows` itself, so every step replays a
    graph. (The top bucket used to be the largest listed one within `max_rows`: with 40 slots,
    steps over 33-40 rows ran eagerly, about 3x slower on the H200.)"""
    if not 0 < rows <= max_rows:
        raise ValueError(f"a decode step over {rows} rows with {max_rows} slots")
    return next((b for b in ROW_BUCKETS if rows <= b < max_rows), max_rows)


class GraphedDecodeStep:
    def __init__(self, step: DecodeStep, max_rows: int) -> None:
        self.step = step
        self.max_rows = max_rows
        # Output of each graph: the step's result record.
        self._graphs: dict[tuple[int, SamplingKind], Captured[torch.Tensor]] = {}
        self._pool = torch.cuda.graph_pool_handle()

    @property
    def num_captured(self) -> int:
        return len(self._graphs)

    def bucket(self, rows: int) -> int:
        return row_bucket(rows, self.max_rows)

    def run(self, rows: int, kind: SamplingKind) -> torch.Tensor:
        """The result record of one step over slots [0, rows)."""
        bucket = self.bucket(rows)
        captured = self._graphs.get((bucket, kind))
        if captured is None:
            captured = self._capture(bucket, kind)
            self._graphs[(bucket, kind)] = captured
        return captured.replay()[: self.step.record_rows(rows)]

    def _capture(self, rows: int, kind: SamplingKind) -> Captured[torch.Tensor]:
        state = self.step.state_tensors()
        saved = [tensor.clone() for tensor in state]

        def restore() -> None:
            # The warm-up's K/V are written again, identically, by the replay that follows
            # from the restored state.
            for tensor, copy in zip(state, saved, strict=True):
                tensor.copy_(copy)

        return capture(lambda: self.step.step(rows, kind), self._pool, undo_warm_up=restore)
