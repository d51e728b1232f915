"""The engines a benchmark sweep runs on: built once per `EngineKey`, released before others.

Owns: turning the sweep's settings and an `EngineKey` into an `EngineConfig` (always the `trace`
exit mode: fixed depth is requested per request), timing start-up, sharing GPU memory between
engines that must be alive together (A/B runs), freeing an engine's memory before the next one
is built, and reading the model's sizes for the floor. Must not: run requests or time them.

Scheduling, KV layout and CUDA graphs (`EngineConfig.cuda_graphs`, used by the decode step on
CUDA) are engine settings, so each combination needs its own engine; exit depths are per request,
so fixed-depth and traced runs share one. Weights are read from the checkpoint on local disk for
every engine (the OS page cache keeps the later reads cheap); start-up time is reported separately
from every measured figure.
"""

from __future__ import annotations

import gc
import sys
import time
from dataclasses import dataclass

import torch

from loopserve.bench.floor import ModelBytes
from loopserve.bench.sweep_spec import EngineKey
from loopserve.bench.timed_runner import TimedRunner
from loopserve.config import EngineConfig, GrowthEstimate
from loopserve.engine.engine import Engine
from loopserve.runner.model_runner import ModelRunner
from loopserve.runner.setup import build_runner

# Device memory still allocated after the engines are freed that is worth a warning.
LEAK_WARNING_BYTES = 1 << 30


@dataclass(frozen=True, slots=True)
class EngineSettings:
    """What every engine of a sweep shares."""

    model: str
    device: str
    dtype: str
    attention_backend: str
    max_num_seqs: int
    max_num_batched_tokens: int
    prefill_chunk_size: int
    max_model_len: int | None  # None: the model's max_position_embeddings
    gpu_memory_utilization: float  # split evenly between engines that are alive together
    num_kv_pages: int | None  # None: sized from memory
    seed: int
    trace_distribution: tuple[float, ...] = ()  # the trace exits' (empty: the family's default)
    batch_invariant: bool = False  # the engine setting of that name
    kv_cache_dtype: str = "auto"  # the engine settings of those names
    calculate_kv_scales: bool = False
    quantization: str = "none"
    speculative_config: str | None = None  # the engine setting (JSON text), None: off
    kv_growth_estimate: str = GrowthEstimate.LEARNED.value  # the engine setting
    timed: bool = False  # drive each engine through a TimedRunner (the step timeline reads it)


@dataclass(frozen=True, slots=True)
class BuiltEngine:
    engine: Engine
    runner: ModelRunner  # the engine's runner (the weights the floor is computed from)
    key: EngineKey
    startup_s: float  # seconds to construct the engine (weights, KV cache, graphs if eager)
    timed: TimedRunner | None = None  # what the engine drives when `EngineSettings.timed`


def engine_config(settings: EngineSettings, key: EngineKey, memory_share: float) -> EngineConfig:
    return EngineConfig.from_options(
        model=settings.model,
        load_format="auto",
        device=settings.device,
        dtype=settings.dtype,
        kv_layout=key.kv_layout,
        attention_backend=settings.attention_backend,
        kv_cache_dtype=settings.kv_cache_dtype,
        calculate_kv_scales=settings.calculate_kv_scales,
        quantization=settings.quantization,
        num_kv_pages=settings.num_kv_pages,
        gpu_memory_utilization=settings.gpu_memory_utilization * memory_share,
        max_num_seqs=settings.max_num_seqs,
        max_num_batched_tokens=settings.max_num_batched_tokens,
        prefill_chunk_size=settings.prefill_chunk_size,
        max_model_len=settings.max_model_len,
        scheduling=key.scheduling,
        exit_mode="trace",
        trace_distribution=settings.trace_distribution,
        seed=settings.seed,
        cuda_graphs=key.graphs,
        prefix_caching=key.prefix_caching,
        kv_allocation=key.kv_allocation,
        preemption_mode=key.preemption_mode,
        kv_growth_estimate=settings.kv_growth_estimate,
        batch_invariant=settings.batch_invariant,
        speculative_config=settings.speculative_config,
    )


class EnginePool:
    """Keeps exactly the engines the current part of a sweep needs."""

    def __init__(self, settings: EngineSettings) -> None:
        self.settings = settings
        self._engines: dict[EngineKey, BuiltEngine] = {}

    def open(self, keys: list[EngineKey]) -> dict[EngineKey, BuiltEngine]:
        """Engines for `keys`, alive together. The same set is reused; any other set is built
        anew after the current engines are freed. Engine i of n is built with the fraction
        (i + 1) / n of the memory utilisation: each engine sizes its KV cache from the memory
        the earlier ones left, so they end up with about equal shares."""
        keys = list(dict.fromkeys(keys))
        if set(keys) == set(self._engines):
            return dict(self._engines)
        self.close()
        for index, key in enumerate(keys):
            config = engine_config(self.settings, key, (index + 1) / len(keys))
            _say(f"building engine {_describe(key)} ...")
            started = time.monotonic()
            runner = build_runner(config)
            timed = TimedRunner(runner) if self.settings.timed else None
            engine = Engine(config, timed or runner)
            startup = time.monotonic() - started
            _say(f"  ready in {startup:.1f} s ({engine.info.num_kv_pages} KV pages)")
            self._engines[key] = BuiltEngine(engine, runner, key, startup, timed)
        return dict(self._engines)

    def close(self) -> None:
        """Free every engine and give its device memory back before another is built."""
        device_type = next(
            (torch.device(built.engine.info.device).type for built in self._engines.values()),
            None,
        )
        self._engines.clear()
        gc.collect()
        if device_type == "cuda":
            torch.cuda.empty_cache()
            left = torch.cuda.memory_allocated()
            if left > LEAK_WARNING_BYTES:
                _say(f"warning: {left / 2**30:.1f} GiB still allocated after freeing the engines")


def model_bytes(runner: ModelRunner) -> ModelBytes:
    """The model's sizes for the floor, from the loaded weights themselves."""
    model = runner.model
    core_bytes = core_params = lm_head_bytes = 0
    for name, parameter in model.named_parameters():
        size = parameter.numel() * parameter.element_size()
        stage = model.parameter_stage(name)
        if stage == "loop":
            core_bytes += size
            core_params += parameter.numel()
        elif stage == "token":
            lm_head_bytes += size
    # One plane's K/V per token, of the block's layers (a row-loop reads those).
    per_token = runner.info.kv_bytes_per_page // runner.decode.kv.block_size
    block_share = per_token * model.config.num_hidden_layers // model.num_kv_layers
    return ModelBytes(
        core_weight_bytes=core_bytes,
        lm_head_bytes=lm_head_bytes,
        kv_bytes_per_token_plane=block_share,
        core_params=core_params,
    )


def reset_peak_memory(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


def peak_memory_bytes(device: torch.device) -> int | None:
    return int(torch.cuda.max_memory_allocated(device)) if device.type == "cuda" else None


def _describe(key: EngineKey) -> str:
    graphs = "graphs" if key.graphs else "eager"
    return (
        f"({graphs}, kv_layout={key.kv_layout}, scheduling={key.scheduling}, prefix_caching="
        f"{'on' if key.prefix_caching else 'off'}, kv_allocation={key.kv_allocation}, "
        f"preemption_mode={key.preemption_mode})"
    )


def _say(message: str) -> None:
    print(message, file=sys.stderr, flush=True)
