"""What the ingress knows of its engine replicas: their latest reports, health and traffic.

Owns: `ReplicaReport` (what a replica sends back when polled: load, counters, exit depths),
`Fleet` (the latest report of each replica, whether it is up, the requests the ingress has in
flight on it and how many it routed there, by reason) and the `ReplicaLoad`s the routing policy
reads. Must not: import Ray, or decide routes (the policy does). Touched only on the ingress's
event loop, so it takes no lock.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

from loopserve.engine.stats import EngineStats
from loopserve.entrypoints.openai.metrics import MetricTotals
from loopserve.ray.routing import Decision, ReplicaLoad


@dataclass(frozen=True, slots=True)
class ReplicaReport:
    replica: int
    pid: int  # the replica's process
    healthy: bool  # its engine thread runs
    num_running: int
    num_waiting: int
    max_num_seqs: int
    kv_pages_used: int
    kv_pages_total: int
    prompt_tokens: int  # prompt tokens prefilled
    generation_tokens: int
    prefix_hit_tokens: int
    prefix_query_tokens: int
    proposed_tokens: int  # speculation: proposed tokens that got a decode row
    confirmed_tokens: int  # ... and those equal to the final token
    speculative_drafts: int  # ... chains of proposals (EngineStats.speculative_drafts)
    finished: dict[str, int]  # requests finished, by finish reason
    exit_depth_sum: float  # loops run by all generated tokens
    exit_depth_count: int  # generated tokens whose depth was recorded

    @classmethod
    def of(
        cls,
        replica: int,
        pid: int,
        healthy: bool,
        max_num_seqs: int,
        stats: EngineStats,
        totals: MetricTotals,
    ) -> ReplicaReport:
        return cls(
            replica=replica,
            pid=pid,
            healthy=healthy,
            num_running=stats.num_running,
            num_waiting=stats.num_waiting,
            max_num_seqs=max_num_seqs,
            kv_pages_used=stats.kv_pages_used,
            kv_pages_total=stats.kv_pages_total,
            prompt_tokens=stats.prefill_tokens,
            generation_tokens=stats.generated_tokens,
            prefix_hit_tokens=stats.prefix_hit_tokens,
            prefix_query_tokens=stats.prefix_query_tokens,
            proposed_tokens=stats.proposed_tokens,
            confirmed_tokens=stats.confirmed_tokens,
            speculative_drafts=stats.speculative_drafts,
            finished=dict(totals.finished),
            exit_depth_sum=totals.exit_depth_sum,
            exit_depth_count=totals.exit_depth_count,
        )


class Fleet:
    def __init__(self, size: int) -> None:
        self.size = size
        self._reports: list[ReplicaReport | None] = [None] * size
        self._up = [False] * size  # up until a call fails; up again once a poll answers
        self._in_flight = [0] * size
        self.routed: Counter[tuple[int, str]] = Counter()  # (replica, reason) -> requests

    def update(self, report: ReplicaReport) -> None:
        """A poll answered."""
        self._reports[report.replica] = report
        self._up[report.replica] = report.healthy

    def mark_down(self, replica: int) -> None:
        """A call to the replica failed: route around it until a poll answers again."""
        self._up[replica] = False

    def is_up(self, replica: int) -> bool:
        return self._up[replica]

    def report(self, replica: int) -> ReplicaReport | None:
        return self._reports[replica]

    def in_flight(self, replica: int) -> int:
        return self._in_flight[replica]

    def begin(self, decision: Decision) -> None:
        self._in_flight[decision.replica] += 1
        self.routed[decision.replica, decision.reason] += 1

    def end(self, replica: int) -> None:
        self._in_flight[replica] -= 1

    def loads(self) -> list[ReplicaLoad]:
        """Each replica's load. Rows are the larger of its last report and the requests in flight
        from here, so a burst between two polls does not all land on one replica."""
        loads = []
        for replica, report in enumerate(self._reports):
            if report is None:
                loads.append(ReplicaLoad(replica, False, 0, 0, 0, 0))
                continue
            rows = max(report.num_running + report.num_waiting, self._in_flight[replica])
            healthy = self._up[replica]
            pages = (report.kv_pages_used, report.kv_pages_total)
            loads.append(ReplicaLoad(replica, healthy, rows, report.max_num_seqs, *pages))
        return loads
