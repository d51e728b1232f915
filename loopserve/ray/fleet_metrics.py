"""The ingress's `/metrics`: every replica's numbers, labelled `replica="i"`, and their aggregate.

Owns: rendering a `Fleet` in the Prometheus text format, with the single-process server's metric
names where the meaning is the same (`loopserve:num_requests_running`, ...): the sample without
labels is the fleet's aggregate (sums; hit rate, KV usage and mean exit depth from the summed
parts), each `replica` sample is one replica's; plus `replica_up`, the ingress's in-flight
requests and its routing decisions by reason. Must not: poll replicas (the fleet holds their last
reports) or import Ray. A restarted replica starts its counters from zero, as a restarted
single-process server does.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from loopserve.entrypoints.openai.metrics import metric_header, prometheus_number
from loopserve.ray.fleet import Fleet, ReplicaReport

# (name in `metrics.METRICS`, value of a sequence of reports)
_Family = tuple[str, Callable[[Sequence[ReplicaReport]], float]]


def _total(field: str) -> Callable[[Sequence[ReplicaReport]], float]:
    return lambda reports: sum(getattr(report, field) for report in reports)


def _ratio(numerator: str, denominator: str) -> Callable[[Sequence[ReplicaReport]], float]:
    def ratio(reports: Sequence[ReplicaReport]) -> float:
        below = sum(getattr(report, denominator) for report in reports)
        return sum(getattr(report, numerator) for report in reports) / below if below else 0.0

    return ratio


_FAMILIES: tuple[_Family, ...] = (
    ("num_requests_running", _total("num_running")),
    ("num_requests_waiting", _total("num_waiting")),
    ("kv_pages_used", _total("kv_pages_used")),
    ("kv_pages_total", _total("kv_pages_total")),
    ("kv_cache_usage", _ratio("kv_pages_used", "kv_pages_total")),
    ("prefix_cache_hit_rate", _ratio("prefix_hit_tokens", "prefix_query_tokens")),
    ("mean_exit_depth", _ratio("exit_depth_sum", "exit_depth_count")),
    ("prompt_tokens_total", _total("prompt_tokens")),
    ("generation_tokens_total", _total("generation_tokens")),
    ("prefix_cache_queries_total", _total("prefix_query_tokens")),
    ("prefix_cache_hits_total", _total("prefix_hit_tokens")),
    ("spec_decode_num_draft_tokens_total", _total("proposed_tokens")),
    ("spec_decode_num_accepted_tokens_total", _total("confirmed_tokens")),
    ("spec_decode_num_drafts_total", _total("speculative_drafts")),
)


def render_fleet(fleet: Fleet) -> str:
    """The Prometheus text exposition of the fleet's last reports and the ingress's counters."""
    reports = [
        report for replica in range(fleet.size) if (report := fleet.report(replica)) is not None
    ]
    lines: list[str] = []
    for name, value in _FAMILIES:
        lines += metric_header(name)
        lines.append(f"loopserve:{name} {prometheus_number(value(reports))}")
        for report in reports:
            sample = prometheus_number(value([report]))
            lines.append(f'loopserve:{name}{{replica="{report.replica}"}} {sample}')
    lines += _finished(reports)
    lines += metric_header("replica_up")
    for replica in range(fleet.size):
        lines.append(f'loopserve:replica_up{{replica="{replica}"}} {int(fleet.is_up(replica))}')
    lines += metric_header("requests_in_flight")
    for replica in range(fleet.size):
        count = fleet.in_flight(replica)
        lines.append(f'loopserve:requests_in_flight{{replica="{replica}"}} {count}')
    lines += metric_header("router_requests_total")
    for (replica, reason), count in sorted(fleet.routed.items()):
        labels = f'replica="{replica}",reason="{reason}"'
        lines.append(f"loopserve:router_requests_total{{{labels}}} {count}")
    return "\n".join(lines) + "\n"


def _finished(reports: Sequence[ReplicaReport]) -> list[str]:
    name = "requests_finished_total"
    lines = metric_header(name)
    reasons = sorted({reason for report in reports for reason in report.finished})
    for reason in reasons:
        total = sum(report.finished.get(reason, 0) for report in reports)
        lines.append(f'loopserve:{name}{{finish_reason="{reason}"}} {total}')
        for report in reports:
            count = report.finished.get(reason, 0)
            labels = f'finish_reason="{reason}",replica="{report.replica}"'
            lines.append(f"loopserve:{name}{{{labels}}} {count}")
    return lines
