"""Capturing one piece of device work into a CUDA graph, the way both of the runner's graphs do.

Owns: `capture` (a warm-up run on a side stream, so kernels compile and workspaces are sized
outside the capture; an optional undo of what the warm-up changed; then the capture into a
shared memory pool) and `Captured` (the graph and the output every replay rewrites). Used by the
decode step's graphs (`runner/cuda_graphs.py`), the prompt loop's (`runner/prompt_graphs.py`)
and the workbench's replay timer (`benchmarks/graph_replay.py`). Must not: decide what is
captured or when.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

import torch

Output = TypeVar("Output")


@dataclass(slots=True)
class Captured(Generic[Output]):
    graph: torch.cuda.CUDAGraph
    output: Output  # written by every replay

    def replay(self) -> Output:
        self.graph.replay()
        return self.output


def capture(
    work: Callable[[], Output], pool: Any, undo_warm_up: Callable[[], None] | None = None
) -> Captured[Output]:
    """`work` captured into a graph whose memory comes from `pool`. `work` runs once first, on a
    side stream, then `undo_warm_up` (there too) restores whatever state that run changed."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        work()
        if undo_warm_up is not None:
            undo_warm_up()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=pool):
        output = work()
    return Captured(graph, output)
