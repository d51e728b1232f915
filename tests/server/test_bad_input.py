"""The bad-input matrix against a real `loopserve serve` process: every malformed request (see
`bad_requests.py`, every endpoint) gets a 4xx in the OpenAI error shape that names what is wrong,
never a 5xx; and while the matrix runs, a stream of well-formed requests keeps its p99 latency
within 2x of an idle run (no request can starve the others).

What is measured is what requests contain, not how fast they come: the matrix is sent by one
client (a process of its own) at a steady 50 requests/s. On the 2-core CI machine, clients and
server share the cores, and at twice that rate even trivial requests (a 405 on /health) slow the
stream by 2x whatever the server does with them; a request that starved the others (a prompt
tokenized for seconds, 128 choices checked against 10,000 stop strings) stalls it far longer.
For the same reason the server runs torch on one thread: torch's intra-op threads slow down
several-fold whenever another process takes a core. The server runs with its defaults, its engine
in a process of its own."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from loopserve.entrypoints.openai.gc_freeze import objects_frozen

from .bad_requests import (
    COMPLETIONS,
    MAX_REQUEST_BYTES,
    Case,
    bad_requests,
    problem,
    send,
    unknown_field_requests,
)
from .server_testing import API_KEY, free_port, start_serve_process, write_tiny_model

# The well-formed stream: clients sending one request after another.
NUM_CLIENTS = 2
# The matrix is sent in this many windows, each followed by an idle window as long (in requests),
# so drift in the machine's load affects both alike.
NUM_ROUNDS = 4
# Other processes on a shared machine can disturb one measurement; the claim holds if one of
# these attempts shows it. A server that starves others fails them all (with the limits lifted,
# `--max-stop-strings` and `--max-prompt-bytes` above all, p99 goes from ~0.2 s to ~1.4 s).
MAX_ATTEMPTS = 3
MATRIX_THREADS = 4  # clients sending the matrix when checking the answers
MATRIX_RATE = 50  # requests per second of the matrix client beside the stream
WELL_FORMED = {"model": "tiny", "prompt": "Hello there", "max_tokens": 4, "temperature": 0}
REPO_ROOT = Path(__file__).resolve().parents[2]


@dataclass(frozen=True)
class Served:
    url: str
    process: subprocess.Popen[bytes]


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    model = write_tiny_model(tmp_path_factory.mktemp("bad-input-model"))
    port = free_port()
    flags = ["--api-key", API_KEY, "--max-request-bytes", str(MAX_REQUEST_BYTES)]
    flags += ["--num-kv-pages", "2048"]
    process = start_serve_process(model, port, *flags, env={"OMP_NUM_THREADS": "1"})
    try:
        yield Served(f"http://127.0.0.1:{port}", process)
    finally:
        process.terminate()
        _, stderr = process.communicate(timeout=60)
    assert b"Traceback" not in stderr, stderr.decode()[-3000:]


def _run_matrix(url: str, cases: list[Case]) -> dict[str, str]:
    """Send every case from a few clients at once; the problems found, by case name."""
    problems: dict[str, str] = {}

    def run(chunk: list[Case]) -> None:
        with httpx.Client(base_url=url, timeout=60) as http:
            for case in chunk:
                found = problem(case, send(http, case))
                if found is not None:
                    problems[case.name] = found

    chunks = [cases[index::MATRIX_THREADS] for index in range(MATRIX_THREADS)]
    with ThreadPoolExecutor(MATRIX_THREADS) as pool:
        list(pool.map(run, chunks))
    return problems


def test_the_matrix_has_what_the_issue_asks_for() -> None:
    cases = bad_requests()
    assert len(cases) >= 150
    assert len({case.name for case in cases}) == len(cases)
    paths = {case.path for case in cases}
    assert paths >= {COMPLETIONS, "/v1/chat/completions", "/v1/models", "/metrics", "/health"}


def test_every_malformed_request_gets_a_4xx_naming_the_problem(served: Served) -> None:
    problems = _run_matrix(served.url, bad_requests() + unknown_field_requests())
    assert not problems, "\n".join(f"{name}: {found}" for name, found in problems.items())
    assert httpx.get(f"{served.url}/health", timeout=10).status_code == 200


def _stream_latencies(url: str, keep_going: Callable[[int], bool]) -> list[float]:
    """Seconds each well-formed request took, over NUM_CLIENTS clients that each send one after
    another while `keep_going(number sent so far)`."""

    def client(_: int) -> list[float]:
        seconds: list[float] = []
        headers = {"Authorization": f"Bearer {API_KEY}"}
        with httpx.Client(base_url=url, timeout=60, headers=headers) as http:
            while keep_going(len(seconds)):
                start = time.perf_counter()
                response = http.post("/v1/completions", json=WELL_FORMED)
                seconds.append(time.perf_counter() - start)
                assert response.status_code == 200, response.text
        return seconds

    with ThreadPoolExecutor(NUM_CLIENTS) as pool:
        return [value for values in pool.map(client, range(NUM_CLIENTS)) for value in values]


def _loaded_window(url: str, first: int, count: int) -> tuple[list[float], dict[str, str]]:
    """The stream's latencies while a matrix client (another process) sends `count` cases from
    `first` on; and the problems it found."""
    module = "tests.server.matrix_client"
    command = [sys.executable, "-m", module, url, str(first), str(count), str(MATRIX_RATE)]
    sender = subprocess.Popen(command, cwd=REPO_ROOT, stdout=subprocess.PIPE, text=True)
    assert sender.stdout is not None
    try:
        assert sender.stdout.readline().strip() == "ready"
        latencies = _stream_latencies(url, lambda sent: sent == 0 or sender.poll() is None)
    finally:
        report, _ = sender.communicate(timeout=120)
    return latencies, json.loads(report)


def _p99(values: list[float]) -> float:
    ordered = sorted(values)
    return ordered[round(0.99 * (len(ordered) - 1))]


def _measure(url: str, cases: list[Case]) -> tuple[float, float]:
    """(p99 under the matrix, p99 idle) of the stream, over NUM_ROUNDS pairs of windows."""
    window = -(-len(cases) // NUM_ROUNDS)
    idle: list[float] = []
    loaded: list[float] = []
    for first in range(0, len(cases), window):
        latencies, problems = _loaded_window(url, first, window)
        assert not problems, problems
        loaded += latencies
        per_client = len(latencies) // NUM_CLIENTS
        idle += _stream_latencies(url, lambda sent, count=per_client: sent < count)
    assert len(loaded) >= 50 and len(idle) >= 50
    return _p99(loaded), _p99(idle)


def test_malformed_requests_do_not_slow_down_well_formed_ones(served: Served) -> None:
    cases = bad_requests()
    _run_matrix(served.url, cases)  # warm-up: the first of a kind runs lazy set-up code
    _stream_latencies(served.url, lambda sent: sent < 5)
    attempts = []
    # The stream's clients are threads of this process. After other tests (tests/ray above all)
    # it holds half a million objects, and a full collection of them stalls every client for
    # 0.3 s: after tests/ray the first attempt's p99 came out at 2.5x the idle one, twice. Frozen,
    # the collector skips them; the server, another process, is measured as before.
    with objects_frozen():
        for _ in range(MAX_ATTEMPTS):
            loaded, idle = _measure(served.url, cases)
            attempts.append(f"p99 {loaded * 1e3:.0f} ms under the matrix, {idle * 1e3:.0f} ms idle")
            if loaded <= 2 * idle:
                return
    pytest.fail("; ".join(attempts))
