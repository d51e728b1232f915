"""`loopserve bench offline`'s command line: the sweep, protocol, engine and output flags.

Owns: declaring the flags and their help. Must not: interpret them (`bench.offline` makes the
plan; `bench.sweep_spec` parses the lists).
"""

from __future__ import annotations

import argparse
from pathlib import Path

from loopserve.bench.presets import PRESETS
from loopserve.config import GrowthEstimate


def add_arguments(parser: argparse.ArgumentParser) -> None:
    _sweep_arguments(parser.add_argument_group("sweep (--preset fixes these)"))
    protocol = parser.add_argument_group("protocol")
    protocol.add_argument("--preset", choices=sorted(PRESETS), help="a named sweep (see docs)")
    protocol.add_argument(
        "--ab",
        action="store_true",
        help="alternate the variants trial by trial at each point (A B B A)",
    )
    protocol.add_argument(
        "--warmup-output-len",
        type=int,
        default=None,
        help="output tokens of the warm-up wave's requests (default: the workload's; 0: none)",
    )
    protocol.add_argument(
        "--time-budget",
        type=float,
        default=None,
        help="seconds; configurations not started by then are skipped (default: the preset's)",
    )
    _engine_arguments(parser.add_argument_group("engine"))
    output = parser.add_argument_group("output")
    output.add_argument("--output", type=Path, help="also write the JSON lines to this file")
    output.add_argument("--summary", type=Path, help="also write the markdown summary here")
    output.add_argument("--plot", type=Path, help="PNG of output tok/s vs concurrency")
    output.add_argument(
        "--step-timeline",
        type=Path,
        help="write one JSON line per engine step of every measured trial here and print where "
        "the step time went (docs/serving-capacity.md)",
    )
    output.add_argument(
        "--profile-steps",
        metavar="START:COUNT",
        help="with --step-timeline: run COUNT steps (default 30) from step START of the first "
        "trial that reaches it under torch.profiler; tables go to TIMELINE-profile.txt, the trace "
        "to TIMELINE-profile.trace.json",
    )


def _sweep_arguments(group: argparse._ArgumentGroup) -> None:
    group.add_argument(
        "--workload", action="append", help="PROMPT/OUTPUT tokens, repeatable (default 512/128)"
    )
    group.add_argument(
        "--concurrency", help="comma list of requests in flight (default 1,8,32,128)"
    )
    group.add_argument(
        "--exits", help="comma list of fixed, trace (d2.6: trace's old name; default both)"
    )
    group.add_argument(
        "--trace-distribution",
        help="P(depth = 1, 2, ...) of the trace exits, summing to 1 (default: the model "
        "family's, d2.6 = 0.1,0.4,0.3,0.2 for Ouro)",
    )
    group.add_argument("--scheduling", help="comma list of refill, no_refill (default both)")
    group.add_argument("--graphs", help="comma list of on, off (default both; CPU: eager only)")
    group.add_argument("--trials", type=int, help="measured trials per configuration (default 3)")
    group.add_argument("--prefix-caching", help="comma list of on, off (default on)")
    group.add_argument(
        "--kv-allocation", help="comma list of incremental, reserve (default incremental)"
    )
    group.add_argument(
        "--preemption-mode", help="comma list of swap, recompute, auto (default swap)"
    )
    group.add_argument(
        "--shared-prefix",
        type=int,
        help="the first N prompt tokens are the same in every request (default 0)",
    )


def _engine_arguments(group: argparse._ArgumentGroup) -> None:
    group.add_argument(
        "--model",
        default=None,
        help="checkpoint directory (default: a random Ouro-1.4B written once to "
        "~/.cache/loopserve/ouro-1.4b-random)",
    )
    group.add_argument("--device", default=None, help="cpu, cuda or cuda:N (default: cuda if any)")
    group.add_argument("--dtype", default="auto", help="auto (bf16 on CUDA), bfloat16, float32")
    group.add_argument("--kv-layout", default="full", help="comma list of full, shared")
    group.add_argument("--attention-backend", default="auto")
    group.add_argument(
        "--kv-cache-dtype", default="auto", help="auto (the model's dtype) or fp8 (float8 e4m3)"
    )
    group.add_argument(
        "--calculate-kv-scales",
        action="store_true",
        help="fp8 KV: per-layer scales from calibration prompts at start-up (docs/quantization.md)",
    )
    group.add_argument(
        "--quantization", default="none", help="weights: none or fp8 (docs/quantization.md)"
    )
    group.add_argument("--max-num-seqs", type=int, default=None, help="default: the largest C")
    group.add_argument(
        "--max-num-batched-tokens", type=int, default=None, help="default: max(2048, max-num-seqs)"
    )
    group.add_argument("--prefill-chunk-size", type=int, default=2048)
    group.add_argument(
        "--kv-growth-estimate",
        default=GrowthEstimate.LEARNED.value,
        choices=[estimate.value for estimate in GrowthEstimate],
        help="incremental allocation's admission: learned (running requests' expected growth "
        "kept free) or none (vLLM's rule); docs/serving-capacity.md",
    )
    group.add_argument("--max-model-len", type=int, default=None, help="default: the model's")
    group.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    group.add_argument(
        "--num-kv-pages", type=int, default=None, help="exact KV pages (default: sized from memory)"
    )
    group.add_argument("--temperature", type=float, default=1.0)
    group.add_argument("--seed", type=int, default=0)
    group.add_argument(
        "--speculative-config",
        default=None,
        help="the engine's speculative_config as JSON (docs/speculation.md); on random weights "
        'add "forced_acceptance": P to measure the mechanism at acceptance P (outputs are '
        "then not the model's, and the record says so)",
    )
    group.add_argument(
        "--batch-invariant",
        action="store_true",
        help="the engine's batch_invariant setting (CUDA: the down projection as a Triton "
        "matmul with one reduction order at every batch size)",
    )
