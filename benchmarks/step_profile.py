"""Profile the steady-state decode step of an Ouro-1.4B-shaped model on a GPU.

Owns: `python -m benchmarks.step_profile`, which prints (1) the wall time of `Engine.step`
split into launching the step, waiting for its results and the host's own work, (2) the device
time of one decode step (graph replay and eager), and (3) the kernels of one eager step by device
time (torch.profiler). Must not: assert speed, or reach into the engine: it hands the engine a
runner that times the real one, and drives the decode step through the runner's public methods.
"""

from __future__ import annotations

import argparse
import gc
import json
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from torch.profiler import ProfilerActivity, profile

from loopserve.bench.timed_runner import TimedRunner
from loopserve.config import EngineConfig
from loopserve.engine.engine import Engine
from loopserve.models.ouro_config import OuroConfig
from loopserve.runner.cuda_graphs import GraphedDecodeStep
from loopserve.runner.decode_slots import SamplingKind
from loopserve.runner.decode_step import DecodeStep
from loopserve.runner.model_runner import ModelRunner
from loopserve.runner.setup import build_runner
from loopserve.sampling_params import SamplingParams


def steady_engine(
    concurrency: int,
    temperature: float,
    model_dir: Path,
    max_model_len: int | None,
    speculative_config: dict[str, Any] | None = None,
    quantization: str = "none",
    kv_cache_dtype: str = "auto",
) -> tuple[Engine, TimedRunner]:
    config = EngineConfig.from_options(
        model=str(model_dir), load_format="dummy", device="cuda", max_model_len=max_model_len,
        max_num_seqs=max(concurrency, 8), gpu_memory_utilization=0.4,
        speculative_config=speculative_config, quantization=quantization,
        kv_cache_dtype=kv_cache_dtype,
    )  # fmt: skip
    runner = TimedRunner(build_runner(config))
    engine = Engine(config, runner)
    generator = torch.Generator().manual_seed(0)
    for _ in range(concurrency):
        prompt = torch.randint(0, 49152, (512,), generator=generator).tolist()
        params = SamplingParams(max_tokens=1024, ignore_eos=True, temperature=temperature)
        engine.add_request(prompt, params)
    while engine.scheduler.needs_sync():
        engine.step()
    for _ in range(20):
        engine.step()
    return engine, runner


def step_breakdown(engine: Engine, runner: TimedRunner, steps: int = 50) -> dict[str, float]:
    """Mean milliseconds per `Engine.step` (async pipeline kept) and its parts."""
    runner.launch_s = runner.wait_s = 0.0
    start = time.perf_counter()
    for _ in range(steps):
        engine.step()
    total = time.perf_counter() - start
    parts = {"launch": runner.launch_s, "wait": runner.wait_s}
    parts["host"] = total - runner.launch_s - runner.wait_s  # schedule, update, detokenize
    parts["total"] = total
    return {name: 1000 * value / steps for name, value in parts.items()}


def _in_use(runner: ModelRunner) -> tuple[DecodeStep, GraphedDecodeStep | None]:
    """The decode step the engine's steps run: the speculating lanes' where the runner has them
    (this profile keeps the batch under `disable_by_batch_size`), else the plain one."""
    if runner.speculating is not None:
        return runner.speculating
    return runner.decode, runner.graphs


def _decode_rows(engine: Engine, runner: ModelRunner) -> tuple[int, SamplingKind]:
    slots = list(engine.scheduler.slots.decoding)
    return max(slots) + 1, _in_use(runner)[0].sampling_kind(slots)


def device_step_ms(engine: Engine, runner: ModelRunner, graphs: bool, repeats: int = 30) -> float:
    """Device time of one decode step over the engine's live slots (events around it); the
    step's state is restored afterwards."""
    rows, kind = _decode_rows(engine, runner)
    step, graphed = _in_use(runner)
    saved = [tensor.clone() for tensor in step.state_tensors()]

    def once() -> None:
        if graphs and graphed is not None:
            graphed.run(rows, kind)
        else:
            step.step(rows, kind)

    with torch.inference_mode():
        once()
        torch.cuda.synchronize()
        begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        begin.record()
        for _ in range(repeats):
            once()
        end.record()
        end.synchronize()
        for tensor, copy in zip(step.state_tensors(), saved, strict=True):
            tensor.copy_(copy)
    return begin.elapsed_time(end) / repeats


def decode_step_kernels(step: DecodeStep, rows: int, kind: SamplingKind) -> list[Any]:
    """The profiler's per-kernel averages of one eager decode step; the step's state is restored
    afterwards."""
    saved = [tensor.clone() for tensor in step.state_tensors()]
    with profile(activities=[ProfilerActivity.CUDA]) as prof, torch.inference_mode():
        step.step(rows, kind)
        torch.cuda.synchronize()
        for tensor, copy in zip(step.state_tensors(), saved, strict=True):
            tensor.copy_(copy)
    return list(prof.key_averages())


def eager_kernels(engine: Engine, runner: ModelRunner, count: int = 25) -> dict[str, object]:
    """The eager step's kernels: how many launches, their summed device time, the top `count`."""
    rows, kind = _decode_rows(engine, runner)
    events = sorted(
        decode_step_kernels(_in_use(runner)[0], rows, kind),
        key=lambda e: getattr(e, "device_time_total", 0.0),
        reverse=True,
    )
    top = [
        {"kernel": e.key[:90], "calls": e.count, "device_us": round(e.device_time_total, 1)}
        for e in events[:count]
    ]
    return {
        "launches": sum(e.count for e in events),
        "device_us": round(sum(getattr(e, "device_time_total", 0.0) for e in events), 1),
        "top": top,
    }


def launch_overhead_us(count: int = 2000) -> float:
    """Host microseconds per eager launch of a tiny kernel (what an un-graphed op costs)."""
    x = torch.ones(16, device="cuda")
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(count):
        x = x + 1
    torch.cuda.synchronize()
    return 1e6 * (time.perf_counter() - start) / count


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--concurrency", default="1,32")
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--max-model-len", type=int, default=None)
    parser.add_argument(
        "--speculative-config", type=json.loads, default=None, help="JSON, as on bench offline"
    )
    args = parser.parse_args()
    print(json.dumps({"launch_overhead_us": launch_overhead_us()}), flush=True)
    with tempfile.TemporaryDirectory() as directory:
        model_dir = Path(directory)
        (model_dir / "config.json").write_text(json.dumps(OuroConfig().to_hf_dict()))
        for concurrency in [int(c) for c in args.concurrency.split(",")]:
            engine, timed = steady_engine(
                concurrency,
                args.temperature,
                model_dir,
                args.max_model_len,
                args.speculative_config,
            )
            runner = timed.runner
            record: dict[str, object] = {
                "concurrency": concurrency,
                "max_model_len": engine.max_model_len,
                "temperature": args.temperature,
                "speculative_config": args.speculative_config,
                "step_ms": step_breakdown(engine, timed),
                "device_graph_ms": device_step_ms(engine, runner, graphs=True),
                "device_eager_ms": device_step_ms(engine, runner, graphs=False),
                "eager_kernels": eager_kernels(engine, runner),
            }
            print(json.dumps(record), flush=True)
            del engine, timed, runner
            gc.collect()
            torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
