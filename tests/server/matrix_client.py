"""Sends cases of the bad-request matrix to a server, one after another at a steady rate, from a
process of its own (so its work shares no interpreter with the clients whose latency a test
measures). Prints `ready` once it starts, then, when done, one JSON line: the problems found.

Usage: python -m tests.server.matrix_client URL FIRST_CASE COUNT REQUESTS_PER_SECOND
"""

from __future__ import annotations

import json
import sys
import time

import httpx

from .bad_requests import bad_requests, problem, send


def main(url: str, first: int, count: int, rate: float) -> None:
    cases = bad_requests()[first : first + count]
    problems: dict[str, str] = {}
    print("ready", flush=True)
    start = time.perf_counter()
    with httpx.Client(base_url=url, timeout=60) as http:
        for index, case in enumerate(cases):
            time.sleep(max(0.0, start + index / rate - time.perf_counter()))
            found = problem(case, send(http, case))
            if found is not None:
                problems[case.name] = found
    print(json.dumps(problems), flush=True)


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), float(sys.argv[4]))
