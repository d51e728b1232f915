"""The per-kernel time budget of one decode loop: what runs, how long, how many bytes, how fast.

Owns: `python -m benchmarks.step_budget`, a GPU diagnostic for an Ouro-1.4B-shaped model with
dummy weights. For each concurrency C it brings an engine to a steady decode state at fixed depth
(the dummy model's threshold is 1: every row runs every loop, so one step = one loop of C
rows), profiles one eager decode step with
torch.profiler, sorts its kernels into categories (weight matmuls, LM head, attention, norms,
RoPE, KV write and copies, sampling, other small ops), and prints per category the kernels, the
device microseconds, the bytes they must move and the effective TB/s; then the CUDA-graph replay
time of the whole step, whose excess over the summed kernel time is launch gaps. Must not: assert
speed or touch engine internals (it drives the engine and runner through public methods, like
step_profile).

Bytes counted (the floor each category cannot beat): matmuls read their weights once per step;
the LM head its weight; attention reads every running row's context K/V in every layer; the rest
are counted as zero bytes (they are small and their time is overhead).
"""

from __future__ import annotations

import argparse
import json
import re
import tempfile
from collections import defaultdict
from pathlib import Path

import torch

from benchmarks.jsonl import emit
from benchmarks.step_profile import decode_step_kernels, device_step_ms, steady_engine
from loopserve.config import KV_CACHE_DTYPES, QUANTIZATIONS
from loopserve.models.model_config import LoopedConfig
from loopserve.models.ouro_config import OuroConfig
from loopserve.runner.decode_slots import SamplingKind
from loopserve.runner.model_runner import ModelRunner

# Category -> kernel-name pattern, first match wins.
CATEGORIES: tuple[tuple[str, str], ...] = (
    ("attention", r"decode|prefill|attention|flash|xqa|fmha"),
    ("kv_write_and_copies", r"kv_write|index_put|scatter|copy_slots|Memcpy|copy_kernel"),
    ("norms", r"rms_norm|add_norm|_norm"),
    ("rope", r"rotary"),
    ("silu_mul", r"silu"),
    ("matmul", r"gemm|gemv|nvjet|cutlass|xmma|sm90|splitK|matmul"),
    ("sampling", r"sort|topk|softmax|log_softmax|argmax|cumsum|exp|log"),
)


def categorize(name: str) -> str:
    for category, pattern in CATEGORIES:
        if re.search(pattern, name, flags=re.IGNORECASE):
            return category
    return "other_small_ops"


def profile_step(runner: ModelRunner, rows: int, kind: SamplingKind) -> dict[str, dict[str, float]]:
    """Per category: kernel launches and device microseconds of one eager decode step."""
    budget: dict[str, dict[str, float]] = defaultdict(lambda: {"kernels": 0, "device_us": 0.0})
    for event in decode_step_kernels(runner.decode, rows, kind):
        device_us = getattr(event, "device_time_total", 0.0)
        if device_us <= 0:
            continue
        entry = budget[categorize(event.key)]
        entry["kernels"] += event.count
        entry["device_us"] += device_us
    return dict(budget)


def step_bytes(
    config: LoopedConfig, rows: int, context: int, weight_bytes: int = 2, kv_bytes: int = 2
) -> dict[str, float]:
    """Bytes each category must move in one decode loop of `rows` rows of `context` tokens, the
    layers' weights at `weight_bytes` a value (1: fp8; the LM head stays bf16) and K/V at
    `kv_bytes` (1: an fp8 cache)."""
    hidden, inner, layers = config.hidden_size, config.intermediate_size, config.num_hidden_layers
    q_size = config.num_attention_heads * config.head_dim
    kv_size = config.num_key_value_heads * config.head_dim
    per_layer = hidden * (q_size + 2 * kv_size) + q_size * hidden + 3 * hidden * inner
    return {
        "matmul": float(weight_bytes * layers * per_layer),
        "lm_head": 2.0 * config.vocab_size * hidden,
        "attention": float(kv_bytes * 2 * layers * kv_size * context * rows),
    }


def budget_record(
    concurrency: int,
    model_dir: Path,
    max_model_len: int | None,
    quantization: str = "none",
    kv_cache_dtype: str = "auto",
) -> dict[str, object]:
    engine, timed = steady_engine(
        concurrency, 0.0, model_dir, max_model_len, quantization=quantization,
        kv_cache_dtype=kv_cache_dtype,
    )  # fmt: skip
    runner = timed.runner
    slots = list(engine.scheduler.slots.decoding)
    rows, kind = max(slots) + 1, runner.decode.sampling_kind(slots)
    context = int(runner.decode.position[:rows].float().mean().item())
    budget = profile_step(runner, rows, kind)
    # The LM head is one matmul per step; the profile cannot tell it from the weight matmuls by
    # name, so its bytes are added to theirs.
    weight_bytes = 1 if quantization == "fp8" else 2
    kv_bytes = 1 if kv_cache_dtype == "fp8" else 2
    volumes = step_bytes(engine.model_config, concurrency, context, weight_bytes, kv_bytes)
    volumes["matmul"] += volumes.pop("lm_head")
    table = {}
    for category, entry in sorted(budget.items(), key=lambda item: -item[1]["device_us"]):
        moved = volumes.get(category, 0.0)
        seconds = entry["device_us"] * 1e-6
        table[category] = {
            "kernels": int(entry["kernels"]),
            "device_us": round(entry["device_us"], 1),
            "bytes_mb": round(moved / 1e6, 2),
            "tb_s": round(moved / seconds / 1e12, 3) if moved and seconds else None,
        }
    kernels_us = sum(entry["device_us"] for entry in budget.values())
    graph_ms = device_step_ms(engine, runner, graphs=True)
    return {
        "concurrency": concurrency,
        "quantization": quantization,
        "kv_cache_dtype": kv_cache_dtype,
        "rows": rows,
        "mean_context": context,
        "categories": table,
        "kernels_total_us": round(kernels_us, 1),
        "kernel_launches": int(sum(entry["kernels"] for entry in budget.values())),
        "graph_replay_us": round(1000 * graph_ms, 1),
        "gaps_us": round(1000 * graph_ms - kernels_us, 1),
        "weights_floor_us": round(1e6 * volumes["matmul"] / 4.28e12, 1),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--concurrency", default="1,32")
    parser.add_argument("--max-model-len", type=int, default=4096)
    parser.add_argument("--quantization", choices=QUANTIZATIONS, default="none")
    parser.add_argument("--kv-cache-dtype", choices=KV_CACHE_DTYPES, default="auto")
    parser.add_argument("--out", type=Path, help="also append the JSON lines here")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as directory:
        model_dir = Path(directory)
        (model_dir / "config.json").write_text(json.dumps(OuroConfig().to_hf_dict()))
        for concurrency in (int(c) for c in args.concurrency.split(",")):
            record = budget_record(
                concurrency, model_dir, args.max_model_len, args.quantization, args.kv_cache_dtype
            )
            emit(record, args.out)
            torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
