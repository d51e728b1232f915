"""Profile the steady-state decode step of an Ouro-1.4B-shaped model on a GPU.

Owns: `python -m loopserve.bench.step_profile`, which prints (1) the wall time of `Engine.step`
split into schedule / launch / wait / update, (2) the device time of one decode step (graph
replay and eager), and (3) the kernels of one eager step by device time (torch.profiler).
Must not: assert speed; it is a diagnostic for finding what a step spends its time on.
"""

from __future__ import annotations

import argparse
import gc
import json
import tempfile
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

from loopserve.config import EngineConfig
from loopserve.engine.engine import Engine
from loopserve.models.ouro_config import OuroConfig
from loopserve.sampling_params import SamplingParams


def steady_engine(
    concurrency: int, temperature: float, model_dir: Path, max_model_len: int | None
) -> Engine:
    engine = Engine(
        EngineConfig(
            model=str(model_dir), load_format="dummy", device="cuda", max_model_len=max_model_len,
            max_num_seqs=max(concurrency, 8), gpu_memory_utilization=0.4,
        )
    )  # fmt: skip
    generator = torch.Generator().manual_seed(0)
    for _ in range(concurrency):
        prompt = torch.randint(0, 49152, (512,), generator=generator).tolist()
        params = SamplingParams(max_tokens=1024, ignore_eos=True, temperature=temperature)
        engine.add_request(prompt, params)
    while engine.scheduler.has_prompt_work():
        engine.step()
    for _ in range(20):
        engine.step()
    return engine


def step_breakdown(engine: Engine, steps: int = 50) -> dict[str, float]:
    """Mean milliseconds per step of each part of `Engine.step` (async pipeline kept)."""
    totals = {"schedule": 0.0, "launch": 0.0, "wait": 0.0, "update": 0.0}
    start = time.perf_counter()
    for _ in range(steps):
        t0 = time.perf_counter()
        scheduled = engine.scheduler.schedule()
        t1 = time.perf_counter()
        pending = engine.runner.execute(scheduled)
        t2 = time.perf_counter()
        previous, engine._in_flight = engine._in_flight, (scheduled, pending)
        if previous is not None:
            result = previous[1].result()
            t3 = time.perf_counter()
            changed = engine.scheduler.update(previous[0], result)
            now = time.monotonic()
            for request in changed:
                engine._after_token(request, now)
            t4 = time.perf_counter()
            totals["wait"] += t3 - t2
            totals["update"] += t4 - t3
        totals["schedule"] += t1 - t0
        totals["launch"] += t2 - t1
    totals["total"] = time.perf_counter() - start
    return {name: 1000 * value / steps for name, value in totals.items()}


def device_step_ms(engine: Engine, graphs: bool, repeats: int = 30) -> float:
    """Device time of one decode step over the engine's active slots (events around it)."""
    decoder = engine.runner.decoder
    assert decoder is not None
    slots = list(engine.scheduler.device_slots._requests)  # type: ignore[union-attr]
    rows, kind = max(slots) + 1, decoder.sampling_kind(slots)
    saved = [tensor.clone() for tensor in decoder.state_tensors()]

    def once() -> None:
        if graphs and engine.runner.graphs is not None:
            engine.runner.graphs.run(rows, kind)
        else:
            decoder.step(rows, kind)

    once()
    torch.cuda.synchronize()
    begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    begin.record()
    for _ in range(repeats):
        once()
    end.record()
    end.synchronize()
    for tensor, copy in zip(decoder.state_tensors(), saved, strict=True):
        tensor.copy_(copy)
    return begin.elapsed_time(end) / repeats


def top_kernels(engine: Engine, count: int = 15) -> list[dict[str, object]]:
    decoder = engine.runner.decoder
    assert decoder is not None
    slots = list(engine.scheduler.device_slots._requests)  # type: ignore[union-attr]
    rows, kind = max(slots) + 1, decoder.sampling_kind(slots)
    saved = [tensor.clone() for tensor in decoder.state_tensors()]
    with profile(activities=[ProfilerActivity.CUDA]) as prof, torch.inference_mode():
        decoder.step(rows, kind)
        torch.cuda.synchronize()
    for tensor, copy in zip(decoder.state_tensors(), saved, strict=True):
        tensor.copy_(copy)
    events = sorted(
        prof.key_averages(), key=lambda e: getattr(e, "device_time_total", 0.0), reverse=True
    )
    return [
        {"kernel": e.key[:90], "calls": e.count, "device_us": round(e.device_time_total, 1)}
        for e in events[:count]
    ]


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
    args = parser.parse_args()
    print(json.dumps({"launch_overhead_us": launch_overhead_us()}), flush=True)
    with tempfile.TemporaryDirectory() as directory:
        model_dir = Path(directory)
        (model_dir / "config.json").write_text(json.dumps(OuroConfig().to_hf_dict()))
        for concurrency in [int(c) for c in args.concurrency.split(",")]:
            engine = steady_engine(concurrency, args.temperature, model_dir, args.max_model_len)
            record: dict[str, object] = {
                "concurrency": concurrency,
                "max_model_len": engine.max_model_len,
                "temperature": args.temperature,
            }
            record["step_ms"] = step_breakdown(engine)
            record["device_graph_ms"] = device_step_ms(engine, graphs=True)
            record["device_eager_ms"] = device_step_ms(engine, graphs=False)
            record["top_kernels"] = top_kernels(engine)
            print(json.dumps(record), flush=True)
            del engine
            gc.collect()
            torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
