"""Server metrics and their Prometheus text rendering (`GET /metrics`).

Owns: latency and exit-depth histograms, finished-request counters, and rendering them with the
engine's latest `EngineStats` snapshot. Observations come from the thread that hands outputs
over (the engine process's reader, or the engine thread) and rendering from the event loop; one
lock guards the numbers. Must not: touch the engine (outputs and stats are handed over) or depend
on prometheus_client.

Names follow vLLM's with a `loopserve:` prefix; times are in seconds.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from loopserve.engine.engine import EngineStats
from loopserve.outputs import RequestOutput

LATENCY_BUCKETS = (
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5,
    0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0,
)  # fmt: skip
# Content type of the Prometheus text exposition format.
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


@dataclass(slots=True)
class Histogram:
    """A cumulative Prometheus histogram over fixed upper bounds."""

    bounds: tuple[float, ...]
    counts: list[int] = field(init=False)  # counts[i]: observations <= bounds[i] (not cumulated)
    total: float = 0.0
    count: int = 0

    def __post_init__(self) -> None:
        self.counts = [0] * len(self.bounds)

    def observe(self, value: float) -> None:
        self.total += value
        self.count += 1
        for index, bound in enumerate(self.bounds):
            if value <= bound:
                self.counts[index] += 1
                return

    def render(self, metric: str) -> list[str]:
        """`loopserve:{metric}` (a histogram of `METRICS`) in the text format."""
        name = f"loopserve:{metric}"
        lines = metric_header(metric)
        cumulative = 0
        for bound, count in zip(self.bounds, self.counts, strict=True):
            cumulative += count
            lines.append(f'{name}_bucket{{le="{prometheus_number(bound)}"}} {cumulative}')
        lines.append(f'{name}_bucket{{le="+Inf"}} {self.count}')
        lines.append(f"{name}_sum {prometheus_number(self.total)}")
        lines.append(f"{name}_count {self.count}")
        return lines


# Every metric's kind and help text by name (after the `loopserve:` prefix): the one place for
# the server's `/metrics` and the Ray fleet ingress's (`ray.fleet_metrics`), which share names.
METRICS: dict[str, tuple[str, str]] = {
    "num_requests_running": ("gauge", "Requests in the running batch."),
    "num_requests_waiting": ("gauge", "Requests waiting to be admitted."),
    "kv_pages_used": ("gauge", "KV cache pages in use."),
    "kv_pages_free": ("gauge", "KV cache pages free."),
    "kv_pages_total": ("gauge", "Usable KV cache pages."),
    "kv_pages_cached": ("gauge", "Free KV pages still holding a cached prompt block."),
    "kv_cache_usage": ("gauge", "KV pages in use / usable KV pages."),
    "prefix_cache_hit_rate": (
        "gauge", "Prompt tokens found in the prefix cache / prompt tokens."),
    "mean_exit_depth": ("gauge", "Mean loops run per generated token."),
    "prompt_tokens_total": ("counter", "Prompt tokens prefilled."),
    "generation_tokens_total": ("counter", "Tokens generated."),
    "engine_steps_total": ("counter", "Engine steps run."),
    "num_preemptions_total": (
        "counter", "Requests preempted (KV swapped to host memory, or dropped to be recomputed)."),
    "recomputed_tokens_total": (
        "counter", "Positions prefilled again after recompute preemptions."),
    "prefix_cache_queries_total": ("counter", "Prompt tokens looked up in the prefix cache."),
    "prefix_cache_hits_total": ("counter", "Prompt tokens found in the prefix cache."),
    "spec_decode_num_draft_tokens_total": (
        "counter", "Speculation: proposed tokens that got a decode row."),
    "spec_decode_num_accepted_tokens_total": (
        "counter", "Speculation: proposed tokens found equal to the final token."),
    "spec_decode_num_drafts_total": (
        "counter",
        "Speculation: chains of proposals (1 + accepted / drafts is the mean accepted length)."),
    "requests_finished_total": ("counter", "Requests finished, by finish reason."),
    "time_to_first_token_seconds": ("histogram", "Arrival to first token."),
    "time_per_output_token_seconds": (
        "histogram", "Mean time per output token after the first, per finished request."),
    "e2e_request_latency_seconds": (
        "histogram", "Arrival to finish of requests that were not aborted."),
    "exit_depth": ("histogram", "Loops run by each generated token."),
    "replica_up": ("gauge", "1 while the ingress routes to the replica."),
    "requests_in_flight": ("gauge", "Requests the ingress has on the replica."),
    "router_requests_total": ("counter", "Requests routed, by replica and reason."),
}  # fmt: skip


def metric_header(name: str) -> list[str]:
    """The HELP and TYPE lines of `loopserve:{name}` (a name of `METRICS`)."""
    kind, help_text = METRICS[name]
    return [f"# HELP loopserve:{name} {help_text}", f"# TYPE loopserve:{name} {kind}"]


@dataclass(frozen=True, slots=True)
class MetricTotals:
    """A consistent copy of the counters (what a replica reports to a fleet's ingress)."""

    finished: dict[str, int]  # requests finished, by finish reason
    exit_depth_sum: float  # loops run by all generated tokens
    exit_depth_count: int  # generated tokens


class ServerMetrics:
    """Counters and histograms of finished requests and generated tokens."""

    def __init__(self, num_loops: int) -> None:
        self._lock = threading.Lock()
        self.time_to_first_token = Histogram(LATENCY_BUCKETS)
        self.time_per_output_token = Histogram(LATENCY_BUCKETS)
        self.e2e_latency = Histogram(LATENCY_BUCKETS)
        self.exit_depth = Histogram(tuple(float(depth) for depth in range(1, num_loops + 1)))
        self.finished: dict[str, int] = {"stop": 0, "length": 0, "abort": 0}

    def observe(self, outputs: Iterable[tuple[RequestOutput, int]]) -> None:
        """Record engine outputs, each with how many of its tokens are new (the thread that
        hands them over)."""
        with self._lock:
            for output, num_new in outputs:
                self._observe_one(output, num_new)

    def _observe_one(self, request: RequestOutput, num_new: int) -> None:
        output = request.outputs[0]
        for depth in output.exit_depths[len(output.exit_depths) - num_new :]:
            self.exit_depth.observe(depth)
        times = request.metrics
        if num_new and len(output.token_ids) == num_new and times.first_token_time is not None:
            self.time_to_first_token.observe(times.first_token_time - times.arrival_time)
        if not output.finished:
            return
        reason = output.finish_reason or "abort"
        self.finished[reason] = self.finished.get(reason, 0) + 1
        if reason == "abort" or times.finished_time is None:
            return
        self.e2e_latency.observe(times.finished_time - times.arrival_time)
        if len(output.token_ids) > 1 and times.first_token_time is not None:
            decode_time = times.finished_time - times.first_token_time
            self.time_per_output_token.observe(decode_time / (len(output.token_ids) - 1))

    def totals(self) -> MetricTotals:
        with self._lock:
            return MetricTotals(dict(self.finished), self.exit_depth.total, self.exit_depth.count)

    def render(self, stats: EngineStats) -> str:
        """The Prometheus text exposition of these metrics and an engine stats snapshot."""
        samples = {
            "num_requests_running": stats.num_running,
            "num_requests_waiting": stats.num_waiting,
            "kv_pages_used": stats.kv_pages_used,
            "kv_pages_free": stats.kv_pages_free,
            "kv_pages_total": stats.kv_pages_total,
            "kv_pages_cached": stats.kv_pages_cached,
            "prefix_cache_hit_rate": stats.prefix_cache_hit_rate,
            "prompt_tokens_total": stats.prefill_tokens,
            "generation_tokens_total": stats.generated_tokens,
            "engine_steps_total": stats.steps,
            "num_preemptions_total": stats.num_preemptions,
            "recomputed_tokens_total": stats.recomputed_tokens,
            "prefix_cache_queries_total": stats.prefix_query_tokens,
            "prefix_cache_hits_total": stats.prefix_hit_tokens,
            "spec_decode_num_draft_tokens_total": stats.proposed_tokens,
            "spec_decode_num_accepted_tokens_total": stats.confirmed_tokens,
            "spec_decode_num_drafts_total": stats.speculative_drafts,
        }
        lines: list[str] = []
        for name, value in samples.items():
            lines += [*metric_header(name), f"loopserve:{name} {prometheus_number(value)}"]
        with self._lock:
            lines += self._render_locked()
        return "\n".join(lines) + "\n"

    def _render_locked(self) -> list[str]:
        lines = metric_header("requests_finished_total")
        for reason, count in self.finished.items():
            lines.append(f'loopserve:requests_finished_total{{finish_reason="{reason}"}} {count}')
        histograms: Sequence[tuple[str, Histogram]] = (
            ("time_to_first_token_seconds", self.time_to_first_token),
            ("time_per_output_token_seconds", self.time_per_output_token),
            ("e2e_request_latency_seconds", self.e2e_latency),
            ("exit_depth", self.exit_depth),
        )
        for metric, histogram in histograms:
            lines += histogram.render(metric)
        return lines


def prometheus_number(value: float) -> str:
    if isinstance(value, int) or (math.isfinite(value) and value == int(value)):
        return str(int(value))
    return repr(float(value))
