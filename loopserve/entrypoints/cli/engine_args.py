"""Command-line flags for `EngineConfig`, shared by generate, serve, bench and eval."""

from __future__ import annotations

import argparse
from typing import Any


def add_engine_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("engine (EngineConfig)")
    group.add_argument("--model", default=None, help="checkpoint directory (default: built-in)")
    group.add_argument("--load-format", default="auto", choices=["auto", "dummy"])
    group.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N")
    group.add_argument("--dtype", default="auto", help="auto, float32, bfloat16 or float16")
    group.add_argument("--kv-layout", default="full", choices=["full", "shared"])
    group.add_argument("--attention-backend", default="auto")
    group.add_argument("--exit-mode", default="ouro", choices=["ouro", "ouro_delayed", "trace"])
    group.add_argument("--scheduling", default="refill", choices=["refill", "no_refill"])
    group.add_argument("--block-size", type=int, default=16)
    group.add_argument("--num-kv-pages", type=int, default=None)
    group.add_argument("--kv-cache-memory-gb", type=float, default=1.0, help="CPU KV budget")
    group.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    group.add_argument("--max-model-len", type=int, default=None)
    group.add_argument("--max-num-seqs", type=int, default=64)
    group.add_argument("--max-num-batched-tokens", type=int, default=2048)
    group.add_argument("--prefill-chunk-size", type=int, default=2048)
    group.add_argument("--engine-seed", type=int, default=0, help="seed of the engine itself")
    group.add_argument("--decode-mode", default="auto", choices=["auto", "host", "device"])
    group.add_argument(
        "--no-cuda-graphs", action="store_true", help="run the device decode step eagerly"
    )
    group.add_argument(
        "--no-async-scheduling", action="store_true", help="read each step back before the next"
    )
    group.add_argument(
        "--no-fused-kernels", action="store_true", help="torch ops instead of fused Triton kernels"
    )


def engine_options(args: argparse.Namespace) -> dict[str, Any]:
    """EngineConfig keyword arguments (everything but `model`) from parsed flags."""
    return {
        "load_format": args.load_format,
        "device": args.device,
        "dtype": args.dtype,
        "kv_layout": args.kv_layout,
        "attention_backend": args.attention_backend,
        "exit_mode": args.exit_mode,
        "scheduling": args.scheduling,
        "block_size": args.block_size,
        "num_kv_pages": args.num_kv_pages,
        "kv_cache_memory_gb": args.kv_cache_memory_gb,
        "gpu_memory_utilization": args.gpu_memory_utilization,
        "max_model_len": args.max_model_len,
        "max_num_seqs": args.max_num_seqs,
        "max_num_batched_tokens": args.max_num_batched_tokens,
        "prefill_chunk_size": args.prefill_chunk_size,
        "seed": args.engine_seed,
        "decode_mode": args.decode_mode,
        "cuda_graphs": not args.no_cuda_graphs,
        "async_scheduling": not args.no_async_scheduling,
        "fused_kernels": not args.no_fused_kernels,
    }
