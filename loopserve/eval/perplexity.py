"""Held-out perplexity against depth: one curve point per exit setting.

Owns: building the held-out evaluation windows from the corpus split with a checkpoint's own
tokenizer, the list of settings a curve covers (every fixed depth, then each exit threshold at
full depth), and aggregating `score_windows` into perplexity, mean exit depth and the exit-depth
histogram. Must not: define the scoring semantics (see `early_exit_perplexity`) or draw plots.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import torch

from loopserve.data.corpus import load_split
from loopserve.data.windows import eval_windows, token_stream
from loopserve.eval.early_exit_perplexity import ExitSettings, score_windows
from loopserve.kv.storage import KVScales
from loopserve.models.looped import LoopedForCausalLM
from loopserve.tokenizer import Tokenizer


@dataclass(frozen=True, slots=True)
class CurvePoint:
    """Quality and depth of one exit setting over the same predicted tokens."""

    label: str  # "fixed depth 2" or "threshold 0.7"
    exit_threshold: float
    max_loops: int
    min_loops: int
    tokens: int  # predicted tokens
    mean_nll: float  # nats per token
    perplexity: float
    mean_depth: float
    depth_histogram: list[int]  # index d-1 counts the predictions made after loop d


def curve_settings(
    num_loops: int, thresholds: list[float], fixed_depths: bool, min_loops: int = 1
) -> list[ExitSettings]:
    """Fixed depths 1..num_loops (if asked), then each threshold with max_loops = num_loops."""
    settings = []
    if fixed_depths:
        settings = [ExitSettings(1.0, max_loops=depth) for depth in range(1, num_loops + 1)]
    for threshold in thresholds:
        if threshold >= 1.0 and fixed_depths:
            continue  # already the fixed-depth point at num_loops
        settings.append(ExitSettings(threshold, max_loops=num_loops, min_loops=min_loops))
    return settings


def held_out_windows(
    tokenizer: Tokenizer,
    separator_id: int,
    seq_len: int,
    max_tokens: int | None,
    corpus_root: Path | None = None,
    held_out_fraction: float = 0.05,
    max_files: int | None = None,
) -> torch.Tensor:
    """Windows [W, seq_len + 1] of the held-out files: seq_len predicted tokens each."""
    split = load_split(corpus_root, held_out_fraction, max_files)
    documents = [tokenizer.encode(file.text, add_special_tokens=False) for file in split.held_out]
    window = seq_len + 1
    budget = None if max_tokens is None else (max_tokens // seq_len) * window
    return eval_windows(token_stream(documents, separator_id), window, budget)


def _label(settings: ExitSettings) -> str:
    if settings.exit_threshold >= 1.0:
        return f"fixed depth {settings.max_loops}"
    return f"threshold {settings.exit_threshold:g}"


def evaluate_setting(
    model: LoopedForCausalLM,
    windows: torch.Tensor,
    settings: ExitSettings,
    batch_size: int,
    kv_dtype: torch.dtype | None = None,
    kv_scales: KVScales | None = None,
) -> CurvePoint:
    """Score every window [W, S] under `settings` (K/V rounded to `kv_dtype` if given, with the
    per-layer `kv_scales`) and aggregate."""
    total_nll = 0.0
    histogram = torch.zeros(settings.max_loops + 1, dtype=torch.int64)
    for start in range(0, windows.shape[0], batch_size):
        batch = windows[start : start + batch_size]
        scores = score_windows(model, batch, settings, kv_dtype, kv_scales)
        total_nll -= scores.logprobs.double().sum().item()
        histogram += torch.bincount(
            scores.exit_depths.reshape(-1).cpu(), minlength=histogram.numel()
        )
    counts = histogram[1:].tolist()
    tokens = sum(counts)
    mean_nll = total_nll / tokens
    return CurvePoint(
        label=_label(settings),
        exit_threshold=settings.exit_threshold,
        max_loops=settings.max_loops,
        min_loops=settings.min_loops,
        tokens=tokens,
        mean_nll=mean_nll,
        perplexity=math.exp(mean_nll),
        mean_depth=sum(depth * count for depth, count in enumerate(counts, start=1)) / tokens,
        depth_histogram=counts,
    )


def markdown_table(points: list[CurvePoint]) -> str:
    """The curve as a Markdown table; perplexity change is relative to the deepest fixed depth."""
    full = [point for point in points if point.exit_threshold >= 1.0]
    baseline = max(full, key=lambda point: point.max_loops).perplexity if full else None
    lines = [
        "| setting | mean depth | perplexity | vs full depth | exits after loop 1, 2, ... |",
        "| --- | --- | --- | --- | --- |",
    ]
    for point in points:
        change = "" if baseline is None else f"{100 * (point.perplexity / baseline - 1):+.1f} %"
        shares = " / ".join(f"{100 * count / point.tokens:.0f}" for count in point.depth_histogram)
        lines.append(
            f"| {point.label} | {point.mean_depth:.2f} | {point.perplexity:.3f} | {change} "
            f"| {shares} % |"
        )
    return "\n".join(lines)
