"""The JSON records an offline benchmark prints, one line each.

Owns: the shape of every record ("floor": the device ceilings and per-token floors; "offline": one
measured configuration; "skipped": one that was not run and why) and their serialisation (floats
to 6 significant digits). Must not: measure or decide anything.

Every "offline" record carries `config` (what was asked and what the engine resolved), the
provenance (git SHA, device), `figures` (medians over trials), `spread` ([min, max] over
trials), the floor's ceilings and method, and the engine's start-up time (never part of a figure).
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict
from typing import TYPE_CHECKING, Any

from loopserve.bench.floor import FLOOR_METHOD, Ceilings, ModelBytes, per_token_floor_s
from loopserve.bench.sweep_spec import RunSpec, Workload

if TYPE_CHECKING:
    from loopserve.bench.engine_pool import BuiltEngine

Record = dict[str, Any]


def spec_config(spec: RunSpec, *, temperature: float, seed: int) -> Record:
    variant, point = spec.variant, spec.point
    return {
        "workload": point.workload.name,
        "prompt_len": point.workload.prompt_len,
        "output_len": point.workload.output_len,
        "concurrency": point.concurrency,
        "num_requests": 2 * point.concurrency,
        "exits": variant.exits,
        "exit_mode": "trace",
        "scheduling": variant.scheduling,
        "graphs": variant.graphs,
        "kv_layout": variant.kv_layout,
        "prefix_caching": variant.prefix_caching,
        "kv_allocation": variant.kv_allocation,
        "preemption_mode": variant.preemption_mode,
        "shared_prefix": point.workload.shared_prefix,
        "trials": spec.trials,
        "warmup_output_len": spec.warmup_output_len,
        "temperature": temperature,
        "seed": seed,
    }


def engine_fields(built: BuiltEngine) -> Record:
    """What the engine resolved at start-up."""
    config, info = built.engine.config, built.engine.info
    scheduler = config.scheduler
    return {
        "dtype": info.dtype,
        "attention_backend": info.attention_backend,
        "kv_cache_dtype": info.kv_cache_dtype,
        "kv_cache_scales": info.kv_cache_scales,
        "quantization": info.quantization,
        "num_kv_pages": info.num_kv_pages,
        "kv_cache_gib": info.num_kv_pages * info.kv_bytes_per_page / 2**30,
        "block_size": scheduler.block_size,
        "max_num_seqs": scheduler.max_num_seqs,
        "max_num_batched_tokens": scheduler.max_num_batched_tokens,
        "prefill_chunk_size": scheduler.prefill_chunk_size,
        "kv_growth_estimate": scheduler.kv_growth_estimate.value,
        "max_model_len": info.max_model_len,
        "async_scheduling": config.async_scheduling,
        "cuda_graphs_active": info.cuda_graphs,
        "batch_invariant": config.batch_invariant,
        "speculative_config": (
            None if scheduler.speculative_config is None else asdict(scheduler.speculative_config)
        ),
    }


def floor_record(
    model: ModelBytes, ceilings: Ceilings, num_loops: int, workloads: list[Workload]
) -> Record:
    """Ceilings, model sizes and the batch-1 full-depth floor per token (docs/benchmarks.md
    gives ≈ 2.35 ms for Ouro-1.4B on an H200, weights only)."""
    with_kv = {
        # A decode token of this workload sees prompt_len + output_len / 2 tokens on average.
        workload.name: 1000.0
        * per_token_floor_s(
            model, ceilings, num_loops, workload.prompt_len + workload.output_len // 2
        )
        for workload in workloads
    }
    return {
        "record": "floor",
        "copy_gb_s": ceilings.copy_bytes_per_s / 1e9,
        "matmul_tflop_s": ceilings.matmul_flops_per_s / 1e12,
        "core_weight_gb": model.core_weight_bytes / 1e9,
        "lm_head_gb": model.lm_head_bytes / 1e9,
        "kv_kib_per_token_plane": model.kv_bytes_per_token_plane / 1024,
        "num_loops": num_loops,
        "c1_fixed_floor_ms_per_token_weights_only": 1000.0
        * per_token_floor_s(model, ceilings, num_loops, 0),
        "c1_fixed_floor_ms_per_token_with_kv": with_kv,
    }


def floor_fields(ceilings: Ceilings) -> Record:
    return {
        "copy_gb_s": ceilings.copy_bytes_per_s / 1e9,
        "matmul_tflop_s": ceilings.matmul_flops_per_s / 1e12,
        "method": FLOOR_METHOD,
    }


def json_line(record: Record) -> str:
    return json.dumps(_rounded(record), separators=(",", ":"))


def _rounded(value: Any) -> Any:
    if isinstance(value, float):
        return float(f"{value:.6g}") if math.isfinite(value) else None
    if isinstance(value, dict):
        return {key: _rounded(item) for key, item in value.items()}
    if isinstance(value, list | tuple):
        return [_rounded(item) for item in value]
    return value
