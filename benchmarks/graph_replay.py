"""Device time of a piece of GPU work, by replaying it from a CUDA graph.

Owns: `replay_ms`, the one timer of the benchmarks that time kernels the way the engine runs
them (captured, so no Python launch cost): `attention_table`, `decode_sweep`, `invariant_matmul`.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable

import torch

from loopserve.runner.graph_capture import capture


def replay_ms(fn: Callable[[], object], budget_ms: float = 20.0) -> float:
    """Median milliseconds of one replay of `fn` captured in a CUDA graph (`runner.graph_capture`:
    `fn` runs once on a side stream first, so kernels compile and plans and workspaces are made
    outside the capture); the graph replays three times untimed, then as often as fits
    `budget_ms` (3 to 100 times)."""
    graph = capture(fn, pool=None).graph
    for _ in range(3):
        graph.replay()
    begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times: list[float] = []
    replays = 3
    while len(times) < replays:
        begin.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(begin.elapsed_time(end))
        replays = max(3, min(100, int(budget_ms / max(times[0], 1e-3))))
    del graph
    return statistics.median(times)
