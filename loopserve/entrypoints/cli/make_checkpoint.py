"""`loopserve make-checkpoint`: write a random-weight Ouro checkpoint in the HF layout."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from loopserve.models.families import PRESETS


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "make-checkpoint",
        help="write a random-weight Ouro checkpoint (HF layout) for tests and benchmarks",
    )
    parser.add_argument("output", type=Path, help="directory to create")
    parser.add_argument("--preset", choices=sorted(PRESETS), default="tiny")
    parser.add_argument(
        "--override",
        default="{}",
        help="JSON of config fields to change, e.g. '{\"total_ut_steps\": 2}'",
    )
    parser.add_argument("--dtype", default="bfloat16", help="float32, bfloat16 or float16")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--gate-bias", type=float, default=0.0, help="exit gate bias")
    parser.add_argument(
        "--max-shard-mb", type=float, default=None, help="shard the weights above this size"
    )


def run(args: argparse.Namespace) -> int:
    from loopserve.models.checkpoint_writer import RandomInit, write_random_checkpoint
    from loopserve.models.families import preset_config
    from loopserve.models.loader import resolve_dtype

    if args.output.exists() and any(args.output.iterdir()):
        raise ValueError(f"{args.output} exists and is not empty; choose a new directory")
    config = preset_config(args.preset, json.loads(args.override))
    shard = None if args.max_shard_mb is None else int(args.max_shard_mb * 2**20)
    write_random_checkpoint(
        args.output,
        config,
        seed=args.seed,
        dtype=resolve_dtype(args.dtype),
        init=RandomInit(gate_bias=args.gate_bias),
        max_shard_bytes=shard,
    )
    print(f"wrote {args.output}")
    return 0
