"""The figures of one offline trial, and their medians and spread over trials.

Owns: percentiles, the per-trial figures of docs/benchmarks.md (throughput, TTFT, TPOT, ITL, exit
depth, KV pages, memory, occupancy, floor ratio) and their aggregation. Must not: run an engine,
import torch, or judge a figure (the summary compares; nothing here asserts speed).

Definitions (milliseconds for latencies): TTFT = first token − arrival (arrival is the
`add_request` call); TPOT = (E2E − TTFT) / (n − 1) per request with n ≥ 2 tokens; ITL = gaps
between consecutive tokens of a request, pooled; E2E = last token − arrival. Percentiles
interpolate linearly (numpy's default, as `vllm bench` does). `decode_floor_ms_per_token` is the
decode floor over the tokens after the first: at C = 1 it is the floor of TPOT.
"""

from __future__ import annotations

import itertools
import statistics

import numpy as np

from loopserve.bench.floor import Ceilings, ModelBytes, floor_estimate, work_counts
from loopserve.bench.trial import TrialRecord

Figure = float | int | None

# Every figure of a result line, in print order.
FIGURES = (
    "output_tok_s",
    "total_tok_s",
    "ttft_p50_ms",
    "ttft_p99_ms",
    "tpot_p50_ms",
    "tpot_p99_ms",
    "itl_p50_ms",
    "itl_p99_ms",
    "e2e_p50_ms",
    "mean_exit_depth",
    "kv_pages_peak",
    "kv_pages_total",
    "peak_gpu_memory_gib",
    "occupancy",
    "floor_ratio",
    "floor_s",
    "floor_decode_s",
    "floor_prefill_s",
    "decode_floor_ms_per_token",
    "duration_s",
    "output_tokens",
    "prompt_tokens",
    "decode_steps",
    "row_loops",
    "lm_head_steps",
    "peak_running",
    "preemptions",
    "prefix_hit_rate",
    "proposed_tokens",
    "proposal_acceptance",
    "mean_accepted_length",
)


def percentile(values: list[float], q: float) -> float | None:
    """The q-th percentile (0..100) with linear interpolation; None for no values."""
    if not values:
        return None
    return float(np.percentile(np.asarray(values, dtype=np.float64), q))


def latencies_ms(trial: TrialRecord) -> dict[str, list[float]]:
    """Per-request TTFT, TPOT and E2E, and the pooled inter-token latencies."""
    ttft: list[float] = []
    tpot: list[float] = []
    e2e: list[float] = []
    itl: list[float] = []
    for request in trial.requests:
        first = request.first_token_time - request.arrival_time
        total = request.finished_time - request.arrival_time
        ttft.append(1000.0 * first)
        e2e.append(1000.0 * total)
        count = len(request.token_times)
        if count >= 2:
            tpot.append(1000.0 * (total - first) / (count - 1))
        times = request.token_times
        itl.extend(1000.0 * (later - earlier) for earlier, later in itertools.pairwise(times))
    return {"ttft": ttft, "tpot": tpot, "e2e": e2e, "itl": itl}


def trial_figures(trial: TrialRecord, model: ModelBytes, ceilings: Ceilings) -> dict[str, Figure]:
    """Every figure of `FIGURES` for one trial."""
    output_tokens = sum(len(request.exit_depths) for request in trial.requests)
    prompt_tokens = sum(request.num_prompt_tokens for request in trial.requests)
    decode_depths = [depth for request in trial.requests for depth in request.exit_depths[1:]]
    work = work_counts(trial)
    floor = floor_estimate(model, ceilings, work)
    latencies = latencies_ms(trial)
    counters = trial.counters
    figures: dict[str, Figure] = {
        "output_tok_s": output_tokens / trial.duration_s,
        "total_tok_s": (output_tokens + prompt_tokens) / trial.duration_s,
        "mean_exit_depth": statistics.fmean(decode_depths) if decode_depths else None,
        "kv_pages_peak": trial.peak_kv_pages,
        "kv_pages_total": trial.kv_pages_total,
        "peak_gpu_memory_gib": (
            None if trial.peak_memory_bytes is None else trial.peak_memory_bytes / 2**30
        ),
        "occupancy": counters.row_loops / counters.decode_steps if counters.decode_steps else 0.0,
        "floor_ratio": floor.total_s / trial.duration_s,
        "floor_s": floor.total_s,
        "floor_decode_s": floor.decode_s,
        "floor_prefill_s": floor.prefill_s,
        "decode_floor_ms_per_token": (
            1000.0 * floor.decode_s / len(decode_depths) if decode_depths else None
        ),
        "duration_s": trial.duration_s,
        "output_tokens": output_tokens,
        "prompt_tokens": prompt_tokens,
        "decode_steps": counters.decode_steps,
        "row_loops": counters.row_loops,
        "lm_head_steps": work.lm_head_steps,
        "peak_running": trial.peak_running,
        "preemptions": counters.preemptions,
        "prefix_hit_rate": counters.prefix_hit_rate,
        "proposed_tokens": counters.proposed_tokens,
        "proposal_acceptance": (
            counters.confirmed_tokens / counters.proposed_tokens
            if counters.proposed_tokens
            else None
        ),
        "mean_accepted_length": (
            1 + counters.confirmed_tokens / counters.speculative_drafts
            if counters.speculative_drafts
            else None
        ),
    }
    for name in ("ttft", "tpot", "itl"):
        figures[f"{name}_p50_ms"] = percentile(latencies[name], 50)
        figures[f"{name}_p99_ms"] = percentile(latencies[name], 99)
    figures["e2e_p50_ms"] = percentile(latencies["e2e"], 50)
    return {name: figures[name] for name in FIGURES}


def aggregate(trials: list[dict[str, Figure]]) -> tuple[dict[str, Figure], dict[str, list[Figure]]]:
    """(median of each figure, [min, max] of each figure) over trials; None stays None, and
    a median of counts stays an int when it is whole."""
    medians: dict[str, Figure] = {}
    spread: dict[str, list[Figure]] = {}
    for name in FIGURES:
        values = [value for value in (trial[name] for trial in trials) if value is not None]
        if not values:
            medians[name], spread[name] = None, [None, None]
            continue
        median = statistics.median(values)
        integral = all(isinstance(value, int) for value in values) and median == int(median)
        medians[name] = int(median) if integral else median
        spread[name] = [min(values), max(values)]
    return medians, spread
