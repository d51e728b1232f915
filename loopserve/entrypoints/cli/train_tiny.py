"""`loopserve train-tiny`: train the small built-in looped model from scratch.

Owns: the command-line flags of tiny-model training and turning them into a `TrainTinyConfig`.
Must not: contain training logic (see `loopserve.train.pipeline`).
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from loopserve.train.config import TrainTinyConfig


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "train-tiny",
        help="train the small looped model (Ouro architecture) on the Python standard library",
        description=(
            "Train a byte-level BPE tokenizer and a small Ouro-architecture looped model from "
            "scratch on the source of the Python standard library (held-out split by file): "
            "stage 1 trains everything on the exit-weighted loss with an entropy bonus, stage 2 "
            "trains only the exit gate. Writes an HF-layout checkpoint directory."
        ),
    )
    parser.add_argument("output", type=Path, help="checkpoint directory to write")
    parser.add_argument(
        "--small", action="store_true", help="a tiny CPU run for tests and CI (seconds)"
    )
    parser.add_argument("--device", default="auto", help="auto (cuda if present), cpu or cuda[:N]")
    parser.add_argument("--seed", type=int, default=None, help="seed of everything (default 0)")
    parser.add_argument(
        "--steps", type=int, default=None, help="stage-1 steps (at most max_epochs passes)"
    )
    parser.add_argument("--gate-steps", type=int, default=None, help="stage-2 (gate) steps")
    parser.add_argument(
        "--time-limit",
        type=float,
        default=None,
        help="stage-1 wall-time budget in seconds (the schedule is compressed to fit)",
    )
    parser.add_argument("--batch-size", type=int, default=None, help="windows per step")
    parser.add_argument("--seq-len", type=int, default=None, help="training window in tokens")
    parser.add_argument("--max-files", type=int, default=None, help="use only this many files")
    parser.add_argument(
        "--corpus-root", type=Path, default=None, help="corpus directory (default: the stdlib)"
    )
    parser.add_argument(
        "--threads",
        type=int,
        default=None,
        help="CPU threads (default: torch's own; 1 with --small, whose matrices are too small to "
        "gain from more)",
    )
    parser.add_argument("--save-dtype", default="bfloat16", help="dtype of the saved weights")
    parser.add_argument(
        "--overwrite", action="store_true", help="replace an existing tiny checkpoint in OUTPUT"
    )


def _config(args: argparse.Namespace) -> TrainTinyConfig:
    from dataclasses import replace

    from loopserve.train.config import preset

    config = preset("small" if args.small else "default")
    top = {"seed": args.seed, "seq_len": args.seq_len, "max_files": args.max_files}
    config = replace(config, **{key: value for key, value in top.items() if value is not None})
    stage1 = {"steps": args.steps, "batch_size": args.batch_size, "time_limit_s": args.time_limit}
    stage2 = {"steps": args.gate_steps, "batch_size": args.batch_size}
    return replace(
        config,
        stage1=replace(config.stage1, **{k: v for k, v in stage1.items() if v is not None}),
        stage2=replace(config.stage2, **{k: v for k, v in stage2.items() if v is not None}),
    )


def _check(args: argparse.Namespace) -> None:
    names = ("steps", "gate_steps", "batch_size", "seq_len", "max_files", "time_limit", "threads")
    for name in names:
        value = getattr(args, name)
        if value is not None and value < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be at least 1, got {value}")


def run(args: argparse.Namespace) -> int:
    import torch

    from loopserve.models.loader import resolve_dtype
    from loopserve.train.pipeline import train_tiny
    from loopserve.train.progress import ProgressLog

    _check(args)
    device_name = args.device
    if device_name == "auto":
        device_name = "cuda" if torch.cuda.is_available() else "cpu"
    device = torch.device(device_name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda, but torch sees no CUDA device")
    config = _config(args)
    log = ProgressLog()
    log.message(f"training on {device} with preset {'small' if args.small else 'default'}")
    threads = args.threads or (1 if args.small else None)
    previous_threads = torch.get_num_threads()
    if threads is not None:
        torch.set_num_threads(threads)
    try:
        train_tiny(
            config,
            args.output,
            device,
            log,
            overwrite=args.overwrite,
            corpus_root=args.corpus_root,
            save_dtype=resolve_dtype(args.save_dtype),
        )
    finally:
        torch.set_num_threads(previous_threads)
    return 0
