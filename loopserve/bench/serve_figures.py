"""The figures of a `loopserve bench serve` run, from its timed streams.

Owns: `RequestResult` (one streamed request as the client timed it), `summarize` (vLLM's figures
and key names: counts, throughputs, `*_ms` latencies with mean/median/std/percentiles) and
`Goodput` (latency targets, as `vllm bench serve --goodput ttft:MS tpot:MS e2el:MS` takes them:
a request counts when it meets all of them). TTFT is the time to the first event carrying
tokens, TPOT = (E2E - TTFT) / (tokens - 1), ITL the gaps between a stream's token events: a
server whose streams carry fewer events than tokens gets no TTFT / TPOT / ITL (nor goodput on
them), and a `stream_warning` says why. Must not: speak HTTP or import torch.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

METRICS = ("ttft", "tpot", "itl", "e2el")
GOODPUT_METRICS = ("ttft", "tpot", "e2el")


@dataclass(slots=True)
class RequestResult:
    prompt_len: int
    success: bool = False
    error: str = ""
    output_tokens: int = 0
    ttft: float = 0.0  # seconds
    latency: float = 0.0
    itl: list[float] = field(default_factory=list)
    token_events: int = 0  # stream events that carried generated tokens


@dataclass(frozen=True, slots=True)
class Goodput:
    """Latency targets in milliseconds; a request is good when it meets every one."""

    targets_ms: dict[str, float]

    @classmethod
    def parse(cls, items: list[str]) -> Goodput:
        targets: dict[str, float] = {}
        for item in items:
            metric, _, value = item.partition(":")
            if metric not in GOODPUT_METRICS or not value:
                raise ValueError(
                    f"--goodput takes METRIC:MS with METRIC one of {', '.join(GOODPUT_METRICS)}, "
                    f"got {item!r}"
                )
            try:
                milliseconds = float(value)
            except ValueError:
                raise ValueError(f"--goodput {item!r}: {value!r} is not a number") from None
            if not milliseconds > 0:
                raise ValueError(f"--goodput {item!r}: the target must be positive")
            targets[metric] = milliseconds
        return cls(targets)

    def met(self, result: RequestResult) -> bool:
        seconds = {"ttft": result.ttft, "e2el": result.latency, "tpot": _tpot(result)}
        for metric, target in self.targets_ms.items():
            value = seconds[metric]
            if value is None or value * 1000.0 > target:
                return False
        return True


def _tpot(result: RequestResult) -> float | None:
    if result.output_tokens < 2:
        return None
    return (result.latency - result.ttft) / (result.output_tokens - 1)


def summarize(
    results: list[RequestResult],
    duration: float,
    percentiles: tuple[float, ...],
    goodput: Goodput | None = None,
) -> dict[str, Any]:
    """vLLM's figures: counts, throughputs, mean/median/std/percentiles of each latency, and
    the goodput (requests/s that met every target) when targets are given."""
    done = [result for result in results if result.success]
    input_tokens = sum(result.prompt_len for result in done)
    output_tokens = sum(result.output_tokens for result in done)
    samples: dict[str, list[float]] = {
        "ttft": [result.ttft for result in done],
        "tpot": [tpot for result in done if (tpot := _tpot(result)) is not None],
        "itl": [gap for result in done for gap in result.itl],
        "e2el": [result.latency for result in done],
    }
    summary: dict[str, Any] = {
        "duration": duration,
        "completed": len(done),
        "failed": len(results) - len(done),
        "errors": sorted({result.error for result in results if result.error})[:5],
        "total_input_tokens": input_tokens,
        "total_output_tokens": output_tokens,
        "request_throughput": len(done) / duration,
        "output_throughput": output_tokens / duration,
        "total_token_throughput": (input_tokens + output_tokens) / duration,
    }
    coarse = [result for result in done if result.token_events < result.output_tokens]
    summary["stream_warning"] = None
    if coarse:
        summary["stream_warning"] = (
            f"{len(coarse)} of {len(done)} streams carried fewer events than tokens (e.g. "
            f"{coarse[0].token_events} events for {coarse[0].output_tokens} tokens): the server "
            "does not stream a token per event, so TTFT, TPOT and ITL cannot be measured and "
            "are not reported"
        )
        for metric in ("ttft", "tpot", "itl"):
            samples[metric] = []
    for metric in METRICS:
        summary.update(_latency_figures(metric, samples[metric], percentiles))
    summary["goodput_targets_ms"] = goodput.targets_ms if goodput else None
    summary["request_goodput"] = (
        sum(goodput.met(result) for result in done) / duration if goodput and not coarse else None
    )
    return summary


def _latency_figures(
    metric: str, seconds: list[float], percentiles: tuple[float, ...]
) -> dict[str, float | None]:
    import numpy as np

    values = np.asarray(seconds, dtype=np.float64) * 1000.0
    empty = values.size == 0
    figures: dict[str, float | None] = {
        f"mean_{metric}_ms": None if empty else float(values.mean()),
        f"median_{metric}_ms": None if empty else float(np.median(values)),
        f"std_{metric}_ms": None if empty else float(values.std()),
    }
    for q in percentiles:
        label = f"{q:g}".replace(".", "_")
        figures[f"p{label}_{metric}_ms"] = None if empty else float(np.percentile(values, q))
    return figures
