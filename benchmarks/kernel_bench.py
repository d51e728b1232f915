"""Kernel benchmarks: the Triton attention backend against torch SDPA over a dense copy of the KV.

Owns: building paged KV + metadata for a benchmark config, timing the Triton backend's per-layer
attention (KV write + attention, what the model calls per layer) and SDPA on the same data, and
printing one JSON line per config. Must not: assert correctness (tests/kernels does); it reports
the largest difference to SDPA only as a sanity figure.

Timing (ms per layer, medians): `triton.testing.do_bench` (L2 flushed between runs; includes the
Python launch overhead of ~3 kernel launches per layer) and `do_bench_cudagraph` (replays of a
CUDA graph: GPU time only, as in the engine's captured decode steps; bandwidth and FLOP/s figures
use it). Each timed call runs `layers` layers of distinct KV, at least 512 MiB in all, so that the
50 MB L2 cannot hold the working set of small configs.

Usage: python -m benchmarks.kernel_bench [--quick] [--out FILE]
       python -m benchmarks.kernel_bench --smoke  (tiny shapes in the CPU interpreter; code check)
Decode tilings and schedules: python -m benchmarks.decode_sweep (see there).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from loopserve.attention.base import AttentionSpec
from loopserve.attention.triton_backend import TritonAttentionBackend
from loopserve.kv.metadata import AttentionMetadata
from loopserve.kv.storage import KVStorage

COPY_BANDWIDTH = 4.28e12  # bytes/s, measured copy bandwidth of the H200 (docs/benchmarks.md)
BF16_MATMUL = 790e12  # FLOP/s, measured bf16 matmul ceiling of the H200
MAX_LAYERS = 256

Timer = Callable[[Callable[[], object]], dict[str, float]]  # fn -> {"name_ms": median, ...}
Config = tuple[Callable[..., dict], tuple[int, ...], dict[str, int]]  # bench, args, tiling


@dataclass(frozen=True, slots=True)
class KernelShape:
    num_heads: int = 16  # Ouro-1.4B
    num_kv_heads: int = 16
    head_dim: int = 128
    block_size: int = 16
    dtype: torch.dtype = torch.bfloat16
    kv_dtype: torch.dtype | None = None  # how K/V are stored (an fp8 cache); None: as `dtype`

    @property
    def cache_dtype(self) -> torch.dtype:
        return self.dtype if self.kv_dtype is None else self.kv_dtype


@dataclass(frozen=True, slots=True)
class BenchSettings:
    """Where and how every config of a run is measured."""

    device: torch.device
    timer: Timer
    shape: KernelShape = dataclasses.field(default_factory=KernelShape)
    min_working_set: int = 512 * 2**20  # bytes of KV per timed call, well above the L2 size


@dataclass(slots=True)
class Workload:
    """One benchmark config's data: paged KV over `layers` layers and this pass's q/k/v."""

    backend: TritonAttentionBackend
    kv: KVStorage
    metadata: AttentionMetadata
    q: torch.Tensor  # [T, Nq, D]
    k: torch.Tensor  # [T, Nkv, D]
    v: torch.Tensor  # [T, Nkv, D]
    out: torch.Tensor  # [T, Nq, D]
    layers: int

    def triton_step(self) -> None:
        for layer in range(self.layers):
            self.backend.forward_into(
                self.q, self.k, self.v, self.kv, layer, self.metadata, self.out
            )


def _layers_for(bytes_per_layer: int, min_working_set: int) -> int:
    return max(1, min(MAX_LAYERS, -(-min_working_set // max(1, bytes_per_layer))))


def _paging(
    seq_lens: list[int], query_lens: list[int], block_size: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """Page table [rows, P] over a random permutation of pages 1.., and the new tokens' slots."""
    pages_per_row = [-(-n // block_size) for n in seq_lens]
    order = torch.randperm(sum(pages_per_row), device=device).to(torch.int32) + 1
    table = torch.zeros(len(seq_lens), max(pages_per_row), dtype=torch.int32, device=device)
    slots, start = [], 0
    rows = zip(pages_per_row, seq_lens, query_lens, strict=True)
    for row, (pages, seq_len, query_len) in enumerate(rows):
        table[row, :pages] = order[start : start + pages]
        start += pages
        positions = torch.arange(seq_len - query_len, seq_len, device=device)
        slots.append(
            table[row, positions // block_size].long() * block_size + positions % block_size
        )
    return table, torch.cat(slots)


def _spec(shape: KernelShape, device: torch.device) -> AttentionSpec:
    on_cuda = device.type == "cuda"
    return AttentionSpec(
        device_type=device.type,
        compute_capability=torch.cuda.get_device_capability(device) if on_cuda else None,
        dtype=shape.dtype,
        head_size=shape.head_dim,
        num_heads=shape.num_heads,
        num_kv_heads=shape.num_kv_heads,
        block_size=shape.block_size,
        cuda_graphs=on_cuda,
        kv_dtype=shape.kv_dtype,
    )


def build_workload(seq_lens: list[int], query_lens: list[int], settings: BenchSettings) -> Workload:
    """Rows with contexts `seq_lens` whose last `query_lens` tokens are new, over permuted pages."""
    shape, device = settings.shape, settings.device
    layers = _layers_for(kv_bytes_per_layer(seq_lens, shape), settings.min_working_set)
    kv, metadata, q, k, v = paged_pass(seq_lens, query_lens, shape, device, layers, True)
    backend = TritonAttentionBackend(_spec(shape, device))
    return Workload(backend, kv, metadata, q, k, v, torch.empty_like(q), layers)


def kv_bytes_per_layer(seq_lens: list[int], shape: KernelShape) -> int:
    """Bytes of K and V of every row's context in one layer."""
    element = torch.empty((), dtype=shape.cache_dtype).element_size()
    return 2 * sum(seq_lens) * shape.num_kv_heads * shape.head_dim * element


def paged_pass(
    seq_lens: list[int],
    query_lens: list[int],
    shape: KernelShape,
    device: torch.device,
    layers: int,
    host_lengths: bool,
) -> tuple[KVStorage, AttentionMetadata, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(KV of `layers` random layers over permuted pages, the pass's metadata, q, k, v) for rows
    with contexts `seq_lens` whose last `query_lens` tokens are new. Without `host_lengths` the
    metadata has no host copies of the lengths, as the device-resident decode step's."""
    table, slots = _paging(seq_lens, query_lens, shape.block_size, device)
    kv = KVStorage(
        num_layers=layers, num_pages=int(table.max()) + 1, block_size=shape.block_size,
        num_kv_heads=shape.num_kv_heads, head_dim=shape.head_dim, dtype=shape.cache_dtype,
        device=device,
    )  # fmt: skip
    for layer in kv.cache:  # normal values, rounded to the cache's dtype (one layer at a time)
        layer.copy_(torch.randn(layer.shape, dtype=shape.dtype, device=device))
    starts = [0]
    for query_len in query_lens:
        starts.append(starts[-1] + query_len)
    metadata = AttentionMetadata(
        query_start=torch.tensor(starts, dtype=torch.int32, device=device),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
        page_table=table,
        slot_mapping=slots,
        max_query_len=max(query_lens),
        max_seq_len=max(seq_lens),
        query_start_host=starts if host_lengths else None,
        seq_lens_host=list(seq_lens) if host_lengths else None,
    )

    def randn(heads: int) -> torch.Tensor:
        return torch.randn(starts[-1], heads, shape.head_dim, dtype=shape.dtype, device=device)

    return (
        kv,
        metadata,
        randn(shape.num_heads),
        randn(shape.num_kv_heads),
        randn(shape.num_kv_heads),
    )


def _dense(workload: Workload, layer: int, context: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Dense K/V [rows, Nq, context, D] of one layer (KV heads repeated for GQA)."""
    table = workload.metadata.page_table.long()
    group = workload.q.shape[1] // workload.kv.num_kv_heads
    result = []
    for cache in (workload.kv.key_cache(layer), workload.kv.value_cache(layer)):
        dense = cache[table].flatten(1, 2)[:, :context]  # [rows, context, Nkv, D]
        if group > 1:
            dense = dense.repeat_interleave(group, dim=2)
        result.append(dense.transpose(1, 2).contiguous())
    return result[0], result[1]


def _sdpa_step(
    queries: torch.Tensor, dense: list[tuple[torch.Tensor, torch.Tensor]], causal: bool
) -> Callable[[], torch.Tensor]:
    """queries [rows, Nq, Q, D]; one SDPA per layer over that layer's dense K/V."""

    def step() -> torch.Tensor:
        out = queries
        for keys, values in dense:
            out = F.scaled_dot_product_attention(queries, keys, values, is_causal=causal)
        return out

    return step


def _compare(workload: Workload, timer: Timer, queries: torch.Tensor, causal: bool) -> dict:
    """Time both; the SDPA output of the last layer against the backend's, as a sanity figure."""
    workload.backend.prepare(workload.metadata)
    workload.triton_step()  # compiles, and writes this pass's K/V before the dense copy
    context = workload.metadata.max_seq_len
    dense = [_dense(workload, layer, context) for layer in range(workload.layers)]
    sdpa = _sdpa_step(queries, dense, causal)
    expected = sdpa()  # [rows, Nq, Q, D]
    got = workload.out.view(queries.shape[0], -1, *workload.out.shape[1:]).transpose(1, 2)
    figures = {
        f"triton_{name}": ms / workload.layers for name, ms in timer(workload.triton_step).items()
    }
    figures |= {f"sdpa_{name}": ms / workload.layers for name, ms in timer(sdpa).items()}
    figures["max_abs_diff_vs_sdpa"] = (got.float() - expected.float()).abs().max().item()
    return figures


def bench_decode(batch: int, context: int, settings: BenchSettings, **tiling: Any) -> dict:
    """Decode rows of one query token over `context` tokens each (tiling: DecodeTiling fields)."""
    shape = settings.shape
    workload = build_workload([context] * batch, [1] * batch, settings)
    workload.backend.decode_tiling = dataclasses.replace(workload.backend.decode_tiling, **tiling)
    queries = workload.q.view(batch, 1, *workload.q.shape[1:]).transpose(1, 2).contiguous()
    figures = _compare(workload, settings.timer, queries, causal=False)
    element = torch.empty((), dtype=shape.dtype).element_size()
    kv_read = 2 * batch * context * shape.num_kv_heads * shape.head_dim * element
    q_out_kv_write = 2 * batch * (shape.num_heads + shape.num_kv_heads) * shape.head_dim * element
    moved = kv_read + q_out_kv_write
    seconds = figures["triton_graph_ms"] / 1e3
    return {
        "bench": "kernel_decode",
        "batch": batch,
        "context": context,
        "tiling": dataclasses.asdict(workload.backend.decode_tiling),
        "layers_per_call": workload.layers,
        "bytes_per_layer": moved,
        "triton_graph_gbps": moved / seconds / 1e9,
        "fraction_of_copy_bandwidth": moved / seconds / COPY_BANDWIDTH,
        "speedup_vs_sdpa_graph": figures["sdpa_graph_ms"] / figures["triton_graph_ms"],
        **figures,
    }


def bench_prefill(prompts: int, prompt_len: int, settings: BenchSettings, **tiling: int) -> dict:
    """`prompts` whole prompts of `prompt_len` tokens packed in one pass (tiling: PrefillTiling)."""
    shape = settings.shape
    workload = build_workload([prompt_len] * prompts, [prompt_len] * prompts, settings)
    workload.backend.prefill_tiling = dataclasses.replace(workload.backend.prefill_tiling, **tiling)
    rows = workload.q.view(prompts, prompt_len, *workload.q.shape[1:])
    queries = rows.transpose(1, 2).contiguous()  # [prompts, Nq, L, D]
    figures = _compare(workload, settings.timer, queries, causal=True)
    flops = 4 * shape.num_heads * shape.head_dim * prompts * prompt_len * (prompt_len + 1) // 2
    seconds = figures["triton_graph_ms"] / 1e3
    return {
        "bench": "kernel_prefill",
        "prompts": prompts,
        "prompt_len": prompt_len,
        "tiling": dataclasses.asdict(workload.backend.prefill_tiling),
        "layers_per_call": workload.layers,
        "causal_flops_per_layer": flops,
        "triton_graph_tflops": flops / seconds / 1e12,
        "fraction_of_bf16_matmul": flops / seconds / BF16_MATMUL,
        "speedup_vs_sdpa_graph": figures["sdpa_graph_ms"] / figures["triton_graph_ms"],
        **figures,
    }


def cuda_timer(fn: Callable[[], object]) -> dict[str, float]:
    from triton.testing import do_bench, do_bench_cudagraph

    quantiles = [0.2, 0.5, 0.8]
    eager = do_bench(fn, warmup=25, rep=100, quantiles=quantiles)
    graph = do_bench_cudagraph(fn, rep=50, quantiles=quantiles)  # 10 replays of ~50 ms graphs
    return {
        "ms": eager[1],
        "graph_ms": graph[1],
        "graph_p20_ms": graph[0],
        "graph_p80_ms": graph[2],
    }


def wall_timer(fn: Callable[[], object]) -> dict[str, float]:
    """CPU stand-in for `cuda_timer` (the smoke run): median wall time of three calls."""
    times = []
    for _ in range(3):
        start = time.perf_counter()
        fn()
        times.append((time.perf_counter() - start) * 1e3)
    median = statistics.median(times)
    return {
        "ms": median,
        "graph_ms": median,
        "graph_p20_ms": min(times),
        "graph_p80_ms": max(times),
    }


PREFILL_CANDIDATES = (  # PrefillTiling overrides tried on 1 and 8 prompts of 1024 tokens
    {"block_m": 128, "block_n": 64, "num_warps": 8, "num_stages": 2},
    {"block_m": 128, "block_n": 32, "num_warps": 8, "num_stages": 3},
    {"block_m": 64, "block_n": 64, "num_warps": 4, "num_stages": 3},
)


def configs(quick: bool) -> Iterator[Config]:
    """The standard H200 run: Ouro-shaped decode and prefill, then prefill tiling candidates.

    Decode tilings and schedules are swept by `benchmarks.decode_sweep`.
    """
    batches = (1, 128) if quick else (1, 32, 128)
    contexts = (1024, 8192) if quick else (512, 1024, 2048, 4096, 8192)
    for batch in batches:
        for context in contexts:
            yield bench_decode, (batch, context), {}
    yield bench_prefill, (1, 1024), {}
    yield bench_prefill, (8, 1024), {}
    if quick:
        return
    for prompts in (1, 8):
        for tiling in PREFILL_CANDIDATES:
            yield bench_prefill, (prompts, 1024), tiling


SMOKE_SETTINGS = BenchSettings(
    torch.device("cpu"),
    wall_timer,
    KernelShape(num_heads=2, num_kv_heads=2, head_dim=32, block_size=8),
    min_working_set=0,
)


def smoke_configs() -> Iterator[Config]:
    yield bench_decode, (1, 40), {"partition_min": 16, "block_n": 16}
    yield bench_decode, (3, 100), {"block_n": 16}
    yield bench_prefill, (1, 48), {}
    yield bench_prefill, (2, 20), {"block_m": 16, "block_n": 16}


def _environment(device: torch.device) -> dict:
    import triton

    sha = os.environ.get("LOOPSERVE_GIT_SHA")  # for trees copied without .git
    if not sha:
        git = ["git", "rev-parse", "--short", "HEAD"]
        try:
            sha = subprocess.run(git, capture_output=True, text=True, check=True).stdout.strip()
        except (OSError, subprocess.CalledProcessError):
            sha = "unknown"
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu (interpreter)"
    return {
        "git_sha": sha,
        "device": name,
        "torch": torch.__version__,
        "triton": triton.__version__,
    }


def run(
    entries: Iterator[Config],
    settings: BenchSettings,
    out: Callable[[str], None] = print,
) -> list[dict]:
    """Run every config and emit one JSON line each; a failing config emits its error instead."""
    shape, device = settings.shape, settings.device
    environment = _environment(device)
    common = {
        **dataclasses.asdict(shape),
        "dtype": str(shape.dtype).removeprefix("torch."),
        "kv_dtype": str(shape.cache_dtype).removeprefix("torch."),
    }
    records = []
    for bench, args, tiling in entries:
        try:
            record = bench(*args, settings, **tiling)
        except Exception as error:  # one bad config must not hide the others
            record = {"bench": bench.__name__, "args": args, "tiling": tiling, "error": repr(error)}
        record = {**record, **common, **environment}
        out(json.dumps(record))
        records.append(record)
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return records


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer configs, no tiling sweeps")
    parser.add_argument("--smoke", action="store_true", help="tiny shapes in the CPU interpreter")
    parser.add_argument("--out", help="also append the JSON lines to this file")
    args = parser.parse_args(argv)
    if not args.smoke and not torch.cuda.is_available():
        parser.error("needs a CUDA GPU (or --smoke)")
    with contextlib.ExitStack() as stack:
        sink = stack.enter_context(open(args.out, "a")) if args.out else None

        def emit(line: str) -> None:
            print(line, flush=True)
            if sink is not None:
                sink.write(line + "\n")
                sink.flush()

        if args.smoke:
            records = run(smoke_configs(), SMOKE_SETTINGS, emit)
        else:
            records = run(
                configs(args.quick), BenchSettings(torch.device("cuda"), cuda_timer), emit
            )
    return 1 if any("error" in record for record in records) else 0


if __name__ == "__main__":
    if "--smoke" in sys.argv:  # the interpreter must be chosen before the kernels are defined
        os.environ["TRITON_INTERPRET"] = "1"
    sys.exit(main())
