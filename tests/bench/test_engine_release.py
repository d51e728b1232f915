"""A sweep frees each engine before it builds the next (on a GPU, the next engine sizes its KV
cache from the memory the previous one left), and A/B runs keep their variants' engines together."""

from __future__ import annotations

import weakref
from pathlib import Path
from typing import Any, ClassVar

import pytest

import loopserve.bench.engine_pool as engine_pool
from loopserve.bench.engine_pool import EnginePool, EngineSettings
from loopserve.bench.floor import Ceilings
from loopserve.bench.records import Record
from loopserve.bench.sweep import SweepRunner
from loopserve.bench.sweep_spec import Point, RunSpec, Variant, Workload
from loopserve.engine.engine import Engine

WORKLOAD = Workload(4, 2)


class CountingEngine(Engine):
    """Records how many engines were alive each time one was built."""

    alive: ClassVar[weakref.WeakSet[Engine]] = weakref.WeakSet()
    alive_at_build: ClassVar[list[int]] = []

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        CountingEngine.alive_at_build.append(len(CountingEngine.alive))
        super().__init__(*args, **kwargs)
        CountingEngine.alive.add(self)


def _runner(checkpoint: Path, records: list[Record]) -> SweepRunner:
    settings = EngineSettings(
        model=str(checkpoint), device="cpu", dtype="auto", attention_backend="auto",
        max_num_seqs=2, max_num_batched_tokens=64, prefill_chunk_size=64, max_model_len=None,
        gpu_memory_utilization=0.9, num_kv_pages=40, seed=0,
    )  # fmt: skip
    return SweepRunner(
        EnginePool(settings),
        Ceilings(copy_bytes_per_s=1e10, matmul_flops_per_s=1e10),
        records.append,
        workloads=[WORKLOAD],
        temperature=1.0,
        seed=0,
        deadline=None,
    )


def _specs(*schedulings: str) -> list[RunSpec]:
    return [
        RunSpec(Variant(exits, scheduling, False, "full"), Point(WORKLOAD, 2), 2, 1)
        for scheduling in schedulings
        for exits in ("fixed", "trace")
    ]


@pytest.fixture(autouse=True)
def _counting(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(engine_pool, "Engine", CountingEngine)
    CountingEngine.alive_at_build.clear()


def test_plain_sweep_builds_one_engine_at_a_time(tiny_checkpoint: Path) -> None:
    records: list[Record] = []
    runner = _runner(tiny_checkpoint, records)
    results = runner.run(_specs("refill", "no_refill", "refill"))
    assert len(results) == 6
    # Three engine runs (refill, no_refill, refill again), each built with no other alive.
    assert CountingEngine.alive_at_build == [0, 0, 0]
    runner.pool.close()
    assert len(CountingEngine.alive) == 0


def test_ab_builds_the_variants_engines_together(tiny_checkpoint: Path) -> None:
    records: list[Record] = []
    runner = _runner(tiny_checkpoint, records)
    results = runner.run_ab(_specs("refill", "no_refill"))
    assert len(results) == 4
    assert CountingEngine.alive_at_build == [0, 1]
    orders = {record["ab_order"] for record in records if record["record"] == "offline"}
    assert orders == {"ABCDDCBA"}
    runner.pool.close()
