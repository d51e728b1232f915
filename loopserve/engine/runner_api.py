"""The seam between the engine and whatever executes its steps.

Owns: the `Runner` protocol the engine drives, `RunnerInfo` (what a runner resolved at start-up
and the engine must know), and how the engine finds its default runner. Must not: import torch or
the runner package; the default runner is named by a "module:function" string and imported only
when an engine is built without one, so tests and profilers can hand the engine any object that
satisfies the protocol (a wrapper that times the real runner, a runner around a fake model).
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from loopserve.engine.scheduler_output import RunnerOutput, SchedulerOutput
from loopserve.models.model_config import LoopedConfig

if TYPE_CHECKING:
    from loopserve.config import EngineConfig

# Built when `Engine(config)` is given no runner: loads the checkpoint onto config.device.
DEFAULT_RUNNER_FACTORY = "loopserve.runner.setup:build_runner"


@dataclass(frozen=True, slots=True)
class RunnerInfo:
    """What a runner resolved at start-up (never written back into `EngineConfig`)."""

    model_config: LoopedConfig  # the model the runner runs
    model_dir: str | None  # where its tokenizer and generation_config.json live, if anywhere
    num_kv_pages: int  # the null page included
    max_model_len: int
    max_stop_token_ids: int  # end-of-sequence plus stop token ids one request may have
    device: str
    dtype: str
    attention_backend: str
    cuda_graphs: bool  # the decode step is replayed from CUDA graphs
    kv_bytes_per_page: int
    # CUDA: pages of K/V the pinned swap space holds (a victim beyond it has host memory pinned
    # for it on the spot, slowly); None where host memory needs no pinning (a CPU).
    pinned_swap_pages: int | None = None
    kv_cache_dtype: str = ""  # how K/V are stored ("" in runners that do not say: as `dtype`)
    # fp8 K/V: where the per-layer scales came from ("1.0", "calculated" or "checkpoint"); None
    # where K/V are not fp8.
    kv_cache_scales: str | None = None
    quantization: str = "none"  # how the layers' weights are stored: none (as `dtype`) or fp8


class PendingStep(Protocol):
    """A step the runner launched; its results may still be on their way from the device."""

    def result(self) -> RunnerOutput: ...


class Runner(Protocol):
    @property
    def info(self) -> RunnerInfo: ...

    def execute(self, scheduled: SchedulerOutput) -> PendingStep:
        """Launch one step: page-table updates, slot stops and starts, the decode step, prompt
        chunks. Only the decode step's results may still be in flight when this returns."""
        ...


def default_runner(config: EngineConfig) -> Runner:
    """The runner `Engine(config)` builds when it is handed none."""
    module_name, function_name = DEFAULT_RUNNER_FACTORY.split(":")
    runner: Runner = getattr(importlib.import_module(module_name), function_name)(config)
    return runner
