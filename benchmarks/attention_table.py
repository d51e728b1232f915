"""Per-layer attention of every attention backend on one GPU: a table of microseconds and
effective bandwidth for decode (rows x context) and of microseconds for prompt prefill.

Owns: building paged KV and metadata for each config, timing each backend's per-layer call (KV
write + attention, what the model calls) from CUDA-graph replays, and printing one JSON line per
(backend, config) plus a markdown table. Must not: assert correctness (the GPU tests do) or pick
a backend for the engine (the registry's order does; this table is what that order should cite).

Decode: the decode step's metadata (device lengths only, rows of equal context over randomly
permuted pages); a captured graph holds the backend's `prepare` (once per step: FlashInfer FA2
refills its page lists there) and `layers` layer calls over distinct KV (at least 512 MiB in all,
so the 50 MB L2 cannot hold it). Reported: `layer_us` (median replay / layers), `prepare_us` (a
graph of `prepare` alone), `tb_per_s` (K and V bytes of the context read per layer / layer_us).
Prefill: fresh prompts, planned outside the graph (as the engine plans them per pass).

Usage: python -m benchmarks.attention_table [--backends triton,flashinfer_fa2,...]
           [--rows 1,8,32,128] [--contexts 512,640,2048,8192] [--prefill 1x1024,8x1024]
           [--kv-cache-dtype auto|fp8] [--out FILE.jsonl] [--markdown FILE.md]
Backend names are the registry's, plus `flashinfer_fa2:cuda_core` / `:tensor_core` to force one
FA2 decode kernel. A backend that cannot serve the shape is reported with its reasons, not timed.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from dataclasses import dataclass

import torch

from benchmarks.graph_replay import replay_ms
from benchmarks.kernel_bench import KernelShape as Shape
from benchmarks.kernel_bench import kv_bytes_per_layer, paged_pass
from loopserve.attention.base import AttentionBackend, AttentionSpec
from loopserve.attention.registry import backend_class
from loopserve.bench.provenance import describe
from loopserve.config import KV_CACHE_DTYPES
from loopserve.kv.metadata import AttentionMetadata
from loopserve.kv.storage import KVStorage, special_cache_dtype

DEFAULT_BACKENDS = (
    "triton",
    "flashinfer_fa2:cuda_core",
    "flashinfer_fa2:tensor_core",
    "flashinfer_xqa",
)
MIN_WORKING_SET = 512 * 2**20  # bytes of KV per timed replay
MAX_LAYERS = 64


@dataclass(slots=True)
class Workload:
    """One config's data, shared by every backend timed on it."""

    kv: KVStorage  # `layers` layers
    metadata: AttentionMetadata
    q: torch.Tensor  # [T, Nq, D]
    k: torch.Tensor  # [T, Nkv, D]
    v: torch.Tensor  # [T, Nkv, D]
    kv_bytes_per_layer: int  # K and V of every row's context


def layers_for(bytes_per_layer: int, min_working_set: int = MIN_WORKING_SET) -> int:
    return max(1, min(MAX_LAYERS, -(-min_working_set // max(1, bytes_per_layer))))


def parse_list(text: str) -> list[int]:
    return [int(item) for item in text.split(",") if item]


def parse_prompts(text: str) -> list[tuple[int, int]]:
    """ "1x1024,8x1024" -> [(1, 1024), (8, 1024)]: (prompts, tokens each)."""
    return [(int(a), int(b)) for a, b in (item.split("x") for item in text.split(",") if item)]


def make_backend(name: str, spec: AttentionSpec) -> AttentionBackend | list[str]:
    """Backend `name` (or `name:decode_kernel`) for `spec`, or the reasons it cannot serve it."""
    base, _, kernel = name.partition(":")
    cls = backend_class(base)
    reasons = cls.unsupported_reasons(spec)
    if reasons:
        return reasons
    if kernel:
        return cls(spec, decode_kernel=kernel)  # type: ignore[call-arg]
    return cls(spec)


def build(
    seq_lens: list[int], query_lens: list[int], shape: Shape, device: torch.device, decode: bool
) -> Workload:
    """Rows with contexts `seq_lens` whose last `query_lens` tokens are new, over permuted pages;
    decode passes carry no host lengths, as the device-resident step's."""
    kv_bytes = kv_bytes_per_layer(seq_lens, shape)
    layers = layers_for(kv_bytes)
    kv, metadata, q, k, v = paged_pass(seq_lens, query_lens, shape, device, layers, not decode)
    return Workload(kv, metadata, q, k, v, kv_bytes)


def time_backend(backend: AttentionBackend, work: Workload, with_prepare: bool) -> dict[str, float]:
    """`layer_us` (and `prepare_us` when `prepare` is part of every step) for one backend."""
    out = torch.empty_like(work.q)
    layers = work.kv.num_layers
    forward_into = backend.forward_into  # type: ignore[attr-defined]

    def step() -> None:
        if with_prepare:
            backend.prepare(work.metadata)
        for layer in range(layers):
            forward_into(work.q, work.k, work.v, work.kv, layer, work.metadata, out)

    if not with_prepare:
        backend.prepare(work.metadata)  # prompt passes plan outside the graph
    figures = {"layer_us": 1000 * replay_ms(step) / layers}
    if with_prepare:
        figures["prepare_us"] = 1000 * replay_ms(lambda: backend.prepare(work.metadata))
        figures["layer_us"] -= figures["prepare_us"] / layers
    return figures


def _spec(shape: Shape, device: torch.device) -> AttentionSpec:
    return AttentionSpec(
        device_type="cuda", compute_capability=torch.cuda.get_device_capability(device),
        dtype=shape.dtype, head_size=shape.head_dim, num_heads=shape.num_heads,
        num_kv_heads=shape.num_kv_heads, block_size=shape.block_size, cuda_graphs=True,
        kv_dtype=shape.kv_dtype,
    )  # fmt: skip


def run_table(args: argparse.Namespace, emit: Callable[[dict], None]) -> list[dict]:
    device = torch.device("cuda", torch.cuda.current_device())
    shape, records = Shape(kv_dtype=special_cache_dtype(args.kv_cache_dtype)), []
    spec = _spec(shape, device)
    backends = {name: make_backend(name, spec) for name in args.backends.split(",")}
    base = {
        "git": describe(device).git_sha,
        "device": describe(device).device,
        "kv_cache_dtype": args.kv_cache_dtype,
    }
    configs = [("decode", rows, context) for rows in args.rows for context in args.contexts]
    configs += [("prefill", count, tokens) for count, tokens in args.prefill]
    for kind, rows, context in configs:
        decode = kind == "decode"
        work = build([context] * rows, [1 if decode else context] * rows, shape, device, decode)
        for name, backend in backends.items():
            record = {**base, "kind": kind, "backend": name, "rows": rows, "context": context}
            if isinstance(backend, list):
                record["unsupported"] = backend
            else:
                try:
                    record |= time_backend(backend, work, with_prepare=decode)
                except Exception as error:  # one backend failing must not hide the others
                    record["error"] = f"{type(error).__name__}: {error}"[:500]
            if decode and "layer_us" in record:
                record["tb_per_s"] = work.kv_bytes_per_layer / record["layer_us"] / 1e6
            record["layers"] = work.kv.num_layers
            records.append(record)
            emit(record)
        del work
        torch.cuda.empty_cache()
    return records


def markdown(records: list[dict]) -> str:
    """One row per config, one column per backend: `us (TB/s)` for decode, `us` for prefill."""
    names = list(dict.fromkeys(record["backend"] for record in records))
    lines = ["| kind | rows | context | " + " | ".join(names) + " |"]
    lines.append("|" + "---|" * (3 + len(names)))
    configs = list(dict.fromkeys((r["kind"], r["rows"], r["context"]) for r in records))
    for kind, rows, context in configs:
        cells = []
        for name in names:
            found = [
                r for r in records
                if (r["kind"], r["rows"], r["context"], r["backend"]) == (kind, rows, context, name)
            ]  # fmt: skip
            cells.append(_cell(found[0]) if found else "")
        lines.append(f"| {kind} | {rows} | {context} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def _cell(record: dict) -> str:
    if "layer_us" not in record:
        return "n/a" if "unsupported" in record else "error"
    text = f"{record['layer_us']:.1f}"
    if "tb_per_s" in record:
        text += f" ({record['tb_per_s']:.2f})"
    return text


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--backends", default=",".join(DEFAULT_BACKENDS))
    parser.add_argument("--rows", type=parse_list, default=[1, 8, 32, 128])
    parser.add_argument("--contexts", type=parse_list, default=[512, 640, 2048, 8192])
    parser.add_argument("--prefill", type=parse_prompts, default=[(1, 1024), (8, 1024)])
    parser.add_argument(
        "--kv-cache-dtype", choices=KV_CACHE_DTYPES, default="auto",
        help="fp8: every backend reads an e4m3 cache (scales 1); tb_per_s counts its bytes",
    )  # fmt: skip
    parser.add_argument("--out", help="append the JSON lines to this file too")
    parser.add_argument("--markdown", help="write the table to this file too")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("attention_table needs a CUDA GPU", file=sys.stderr)
        return 2

    def emit(record: dict) -> None:
        line = json.dumps(record)
        print(line, flush=True)
        if args.out:
            with open(args.out, "a") as handle:
                handle.write(line + "\n")

    table = markdown(run_table(args, emit))
    print(table)
    if args.markdown:
        with open(args.markdown, "w") as handle:
            handle.write(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
