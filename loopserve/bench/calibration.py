"""Measures the device ceilings the floor is computed against: copy bandwidth and matmul FLOP/s.

Owns: timing a large device-to-device copy (bytes read + written) and a large matmul in the model's
dtype, medians of several repeats after a warm-up. Must not: keep memory (everything it allocates
is freed before it returns), or run while an engine is measuring.

On CUDA the copy moves 1 GiB each way and the matmul is 8192³ (CUDA events time them); on the CPU
the same code runs on small sizes with a wall clock, so the floor stays defined (if meaningless).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import torch

from loopserve.bench.floor import Ceilings

CUDA_COPY_BYTES = 1 << 30
CUDA_MATMUL_SIZE = 8192
CPU_COPY_BYTES = 64 << 20
CPU_MATMUL_SIZE = 512


def measure_ceilings(device: torch.device, dtype: torch.dtype, repeats: int = 10) -> Ceilings:
    """Median copy bandwidth (bytes read + written per second) and matmul FLOP/s on `device`."""
    on_cuda = device.type == "cuda"
    copy_bytes = CUDA_COPY_BYTES if on_cuda else CPU_COPY_BYTES
    size = CUDA_MATMUL_SIZE if on_cuda else CPU_MATMUL_SIZE
    copy_s = _copy_seconds(device, copy_bytes, repeats)
    matmul_s = _matmul_seconds(device, dtype, size, repeats)
    if on_cuda:
        torch.cuda.empty_cache()
    return Ceilings(
        copy_bytes_per_s=2 * copy_bytes / copy_s, matmul_flops_per_s=2 * size**3 / matmul_s
    )


def _copy_seconds(device: torch.device, num_bytes: int, repeats: int) -> float:
    source = torch.empty(num_bytes, dtype=torch.uint8, device=device)
    destination = torch.empty_like(source)
    return _median_seconds(lambda: destination.copy_(source), device, repeats)


def _matmul_seconds(device: torch.device, dtype: torch.dtype, size: int, repeats: int) -> float:
    left = torch.randn(size, size, device=device).to(dtype)
    right = torch.randn(size, size, device=device).to(dtype)
    return _median_seconds(lambda: torch.matmul(left, right), device, repeats)


def _median_seconds(work: Callable[[], object], device: torch.device, repeats: int) -> float:
    work()  # warm-up: first-call allocation, kernel selection
    if device.type != "cuda":
        samples = []
        for _ in range(repeats):
            began = time.perf_counter()
            work()
            samples.append(time.perf_counter() - began)
        return statistics.median(samples)
    with torch.cuda.device(device):
        torch.cuda.synchronize()
        events = [
            (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
            for _ in range(repeats)
        ]
        for start, end in events:
            start.record()
            work()
            end.record()
        torch.cuda.synchronize()
    return statistics.median(start.elapsed_time(end) / 1000.0 for start, end in events)
