"""The closed loop of the offline protocol: keep C requests in flight until 2 × C have finished.

Owns: building a wave of seeded random requests (`make_requests`), driving an engine with them
(`run_closed_loop`) and recording what happened (a `trial.TrialRecord`). Must not: compute
figures (that is `figures.py`), time anything but the loop itself, or import torch.

A finished request is replaced before the next engine step, so the engine always holds C requests
while any are queued. The clock starts before the first `add_request` and stops when the last
request's last token is back: prefill and drain are inside, model load and warm-up are not. With
async scheduling the engine may still hold one launched step then; it is drained untimed (it runs
no rows: the device deactivates a slot in the step that stops it).
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from loopserve.bench.prompts import shared_prefix
from loopserve.bench.sweep_spec import Workload
from loopserve.bench.trial import EngineCounters, RequestRecord, TrialRecord
from loopserve.sampling_params import SamplingParams

if TYPE_CHECKING:
    from loopserve.engine.engine import Engine, EngineStats
    from loopserve.outputs import RequestOutput


@dataclass(frozen=True, slots=True)
class RequestSpec:
    prompt_token_ids: list[int]
    params: SamplingParams


def make_requests(
    workload: Workload,
    count: int,
    *,
    seed: tuple[int, ...],
    vocab_size: int,
    num_loops: int,
    exits: str,
    temperature: float,
) -> list[RequestSpec]:
    """`count` requests with random prompts; the same `seed` gives the same requests.

    exits "fixed": every generated token runs all `num_loops` loops (given as explicit trace
    depths, because the `trace` exit mode does not consult `exit_threshold`); "trace": no depths
    are given and the engine draws them from its trace distribution with each request's seed.
    """
    generator = np.random.default_rng(list(seed))
    # The shared prefix depends on the first seed alone: the same in every trial and wave.
    shared = shared_prefix(seed[0], workload.shared_prefix, vocab_size)
    fixed_depths = (num_loops,) * (workload.output_len - 1) if exits == "fixed" else None
    specs = []
    for _ in range(count):
        own = workload.prompt_len - len(shared)
        prompt = shared + generator.integers(0, vocab_size, size=own).tolist()
        params = SamplingParams(
            max_tokens=workload.output_len,
            ignore_eos=True,
            temperature=temperature,
            seed=int(generator.integers(0, 2**63 - 1)),
            exit_threshold=1.0 if exits == "fixed" else None,
            trace_depths=fixed_depths,
        )
        specs.append(RequestSpec(prompt, params))
    return specs


def run_closed_loop(
    engine: Engine,
    requests: list[RequestSpec],
    concurrency: int,
    tag: str,
    step: Callable[[], list[RequestOutput]] | None = None,
) -> TrialRecord:
    """Run `requests` keeping `concurrency` of them in the engine; ids are `{tag}-{index}`.
    `step` runs one engine step (default `engine.step`; the step timeline passes its own)."""
    step = step or engine.step
    if engine.has_unfinished_requests():
        raise RuntimeError("the engine must be idle before a closed loop starts")
    # Every wave computes its own prompts: a wave of the same requests run before (another
    # variant's trial on this engine) must not turn its prefill into prefix-cache hits.
    engine.reset_prefix_cache()
    queue = deque(enumerate(requests))
    before = engine.stats()
    finished: list[RequestRecord] = []
    in_flight = 0
    peak_pages = peak_running = 0
    min_in_flight = concurrency
    start = time.monotonic()
    while queue or in_flight:
        while queue and in_flight < concurrency:
            index, spec = queue.popleft()
            engine.add_request(spec.prompt_token_ids, spec.params, request_id=f"{tag}-{index}")
            in_flight += 1
        if queue:
            min_in_flight = min(min_in_flight, in_flight)
        for output in step():
            if output.finished:
                finished.append(_record(output))
                in_flight -= 1
        peak_pages = max(peak_pages, engine.kv.num_used_pages)
        peak_running = max(peak_running, len(engine.scheduler.running))
    duration = time.monotonic() - start
    while engine.has_unfinished_requests():
        engine.step()  # async scheduling: a step launched before the last exit was read back
    return TrialRecord(
        requests=finished,
        duration_s=duration,
        counters=_counters(before, engine.stats()),
        peak_kv_pages=peak_pages,
        kv_pages_total=before.kv_pages_total,
        peak_running=peak_running,
        min_in_flight_while_queued=min_in_flight,
    )


def _record(output: RequestOutput) -> RequestRecord:
    metrics = output.metrics
    sequence = output.outputs[0]
    if metrics.first_token_time is None or metrics.finished_time is None:
        raise RuntimeError(f"request {output.request_id} finished without token times")
    if sequence.finish_reason != "length":
        raise RuntimeError(
            f"request {output.request_id} ended with {sequence.finish_reason!r}, not 'length'"
        )
    return RequestRecord(
        request_id=output.request_id,
        num_prompt_tokens=output.num_prompt_tokens,
        exit_depths=tuple(sequence.exit_depths),
        arrival_time=metrics.arrival_time,
        first_token_time=metrics.first_token_time,
        token_times=tuple(metrics.token_times),
        finished_time=metrics.finished_time,
    )


def _counters(before: EngineStats, after: EngineStats) -> EngineCounters:
    return EngineCounters(
        decode_steps=after.decode_steps - before.decode_steps,
        row_loops=sum(after.row_loops_by_loop.values()) - sum(before.row_loops_by_loop.values()),
        prefill_tokens=after.prefill_tokens - before.prefill_tokens,
        generated_tokens=after.generated_tokens - before.generated_tokens,
        preemptions=after.num_preemptions - before.num_preemptions,
        proposed_tokens=after.proposed_tokens - before.proposed_tokens,
        confirmed_tokens=after.confirmed_tokens - before.confirmed_tokens,
        speculative_drafts=after.speculative_drafts - before.speculative_drafts,
        prefix_hit_rate=_rate(
            after.prefix_hit_tokens - before.prefix_hit_tokens,
            after.prefix_query_tokens - before.prefix_query_tokens,
        ),
    )


def _rate(part: int, whole: int) -> float:
    return part / whole if whole else 0.0
