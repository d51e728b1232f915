"""How many kernels one decode loop launches, and from where: a census on the CPU.

Owns: `python -m benchmarks.launch_census`, which runs the CUDA configuration of the decode
step (bf16, Triton attention, the fused Triton layer ops) on the CPU under triton's interpreter and
counts, for one decode step after a steady start, every torch operation that would launch a
kernel on a GPU (views and allocations excluded) and every Triton kernel launch, by operation
and by the loopserve line that issued it. Launches per loop are what a decode step's fixed cost
grows with (docs/latency.md); the count is exact and needs no GPU, so a change that fuses
work can be checked here before it is timed on one. Must not: time anything (step_budget does,
on a GPU).

Per-layer launches are told apart from per-step ones by running the census on models with
different layer counts (the difference per layer); only the counts come from the CPU: which of
them a CUDA graph replays, and what each costs, is step_budget's.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import traceback
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from benchmarks.jsonl import emit
from loopserve.config import QUANTIZATIONS  # imports no kernel module

# Views, aliases and allocations launch no kernel.
NO_KERNEL = frozenset(
    {
        "view", "_unsafe_view", "reshape", "expand", "slice", "select", "split",
        "split_with_sizes", "chunk", "unsqueeze", "squeeze", "permute", "t", "transpose",
        "as_strided", "alias", "detach", "unbind", "narrow", "empty", "empty_like",
        "empty_strided", "_reshape_alias", "lift_fresh",
    }
)  # fmt: skip


@dataclass
class Census:
    layers: int
    rows: int
    by_op: collections.Counter[str] = field(default_factory=collections.Counter)
    by_site: collections.Counter[str] = field(default_factory=collections.Counter)

    @property
    def launches(self) -> int:
        return sum(self.by_op.values())

    def as_dict(self) -> dict[str, Any]:
        return {
            "layers": self.layers,
            "rows": self.rows,
            "launches": self.launches,
            "by_op": dict(self.by_op.most_common()),
            "by_site": dict(self.by_site.most_common()),
        }


def decode_step_census(
    layers: int,
    rows: int,
    speculative_config: dict[str, Any] | None = None,
    quantization: str = "none",
) -> Census:
    """Launches of one decode step (one loop of `rows` rows) of a random model shaped like the
    built-in one but with `layers` layers (its projections fp8 with `quantization` "fp8", as
    the runner quantizes them at load). Needs TRITON_INTERPRET=1 set before the kernel modules
    are first imported (`main` sets it)."""
    import torch

    from loopserve.config import EngineConfig
    from loopserve.engine.engine import Engine
    from loopserve.models.builtin import resolve_model_dir
    from loopserve.models.loader import dummy_model
    from loopserve.models.ops import TritonOps
    from loopserve.models.ouro_config import OuroConfig
    from loopserve.models.quant import quantize_model
    from loopserve.runner.setup import build_runner
    from loopserve.sampling_params import SamplingParams

    base = OuroConfig.from_file(resolve_model_dir(None) / "config.json")
    model = dummy_model(replace(base, num_hidden_layers=layers), torch.bfloat16, "cpu")
    model.fuse_projections()
    if quantization == "fp8":
        quantize_model(model)
    model.ops = TritonOps(quantize_inputs=quantization == "fp8")  # a CUDA device's layer ops
    config = EngineConfig.from_options(
        device="cpu", dtype="bfloat16", attention_backend="triton", cuda_graphs=False,
        async_scheduling=False, max_num_seqs=8, speculative_config=speculative_config,
    )  # fmt: skip
    engine = Engine(config, build_runner(config, model=model))
    for row in range(rows):
        prompt = list(range(5, 13 + row))
        engine.add_request(prompt, SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True))
    for _ in range(3):  # prompts done, every row decoding
        engine.step()
    census = Census(layers=layers, rows=rows)
    with torch.no_grad(), _counting(census):
        engine.step()
    return census


@contextmanager
def _counting(census: Census) -> Iterator[None]:
    from torch.utils._python_dispatch import TorchDispatchMode
    from triton.runtime import interpreter

    state = {"on": True}
    launch = interpreter.GridExecutor.__call__

    def counted_launch(executor: Any, *args: Any, **kwargs: Any) -> Any:
        was, state["on"] = state["on"], False  # the interpreter's own host copies are not ours
        if was:
            census.by_op[f"triton:{executor.fn.__name__}"] += 1
            census.by_site[_site()] += 1
        try:
            return launch(executor, *args, **kwargs)
        finally:
            state["on"] = was

    class Count(TorchDispatchMode):
        def __torch_dispatch__(
            self, func: Any, types: Any, args: Any = (), kwargs: Any = None
        ) -> Any:
            if state["on"] and func.__name__.split(".")[0] not in NO_KERNEL:
                census.by_op[f"aten:{func.__name__}"] += 1
                census.by_site[_site()] += 1
            return func(*args, **(kwargs or {}))

    interpreter.GridExecutor.__call__ = counted_launch
    try:
        with Count():
            yield
    finally:
        interpreter.GridExecutor.__call__ = launch


def _site() -> str:
    ours = [frame for frame in traceback.extract_stack() if "/loopserve/" in frame.filename]
    ours = [frame for frame in ours if not frame.filename.endswith("launch_census.py")]
    if not ours:
        return "?"
    frame = ours[-1]
    return f"{frame.filename.split('/loopserve/')[-1]}:{frame.lineno} {(frame.line or '').strip()}"


def per_layer(small: Census, large: Census) -> float:
    return (large.launches - small.launches) / (large.layers - small.layers)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.launch_census")
    parser.add_argument("--rows", type=int, default=1, help="rows in the decode step")
    parser.add_argument("--sites", type=int, default=25, help="call sites to print")
    parser.add_argument("--out", type=Path, help="also append the JSON line here")
    parser.add_argument(
        "--speculative-config", type=json.loads, default=None, help="JSON: count a lanes step"
    )
    parser.add_argument("--quantization", choices=QUANTIZATIONS, default="none")
    args = parser.parse_args(argv)
    os.environ["TRITON_INTERPRET"] = "1"  # before the kernel modules are imported
    speculative = args.speculative_config
    small = decode_step_census(1, args.rows, speculative, args.quantization)
    large = decode_step_census(2, args.rows, speculative, args.quantization)
    layer = per_layer(small, large)
    fixed = small.launches - layer
    ouro = fixed + 24 * layer
    print(f"one decode loop, {args.rows} row(s): {layer:g} launches per layer, {fixed:g} per step")
    print(f"Ouro-1.4B (24 layers): {ouro:g} launches per loop")
    for site, count in large.by_site.most_common(args.sites):
        print(f"{count:5d}  {site}")
    record = {
        "bench": "launch_census",
        "speculative_config": speculative,
        "quantization": args.quantization,
        "per_layer": layer,
        "per_step": fixed,
        "ouro_24_layers": ouro,
        "two_layers": large.as_dict(),
    }
    emit(record, args.out)


if __name__ == "__main__":
    main()
