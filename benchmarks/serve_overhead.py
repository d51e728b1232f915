"""Where the server's host time goes: `loopserve serve` driven by `loopserve bench serve` against
the offline closed loop (`loopserve bench offline`'s `run_closed_loop`) on the same engine settings
and workload, alternated offline, serve, serve, offline per round.

    python -m benchmarks.serve_overhead [--model DIR] [--device cuda] [--workload 512/128]
        [--concurrency 128] [--exits fixed|trace] [--rounds 2] [--engine-thread]
        [--out FILE.jsonl]

CPU reproduction (docs/server.md, "Where the server's host time goes"):
    loopserve make-checkpoint /tmp/tiny --preset tiny
    python -m benchmarks.serve_overhead --model /tmp/tiny --device cpu --threads 1 \
        --workload 32/64 --concurrency 128 --rounds 2

A serve run is one closed-loop wave of 2 x C streamed requests (`bench serve --max-concurrency C`,
greedy, EOS ignored, after an untimed wave of C short requests the first time); an offline run is
the same wave handed to an engine in this process (greedy too). The server runs in a child
process with its defaults, so its engine runs in a process of its own (spawned by the server:
it imports this module as `__mp_main__`, which times its steps); `--engine-thread` serves with
`--no-engine-process` instead, the engine in a thread of the server. Either way the thread that
runs the engine times every `Engine.step` (wall and thread CPU time); the offline loop times its
steps the same way. Each run reports output tokens/s, the engine's steps, their mean wall and CPU
time, the share of step wall time the engine thread was off the CPU and the share it was
runnable but not running (its run-queue wait: other threads or processes held the cores); the
rest of the time off the CPU it slept, on the interpreter lock (or on a GPU, in both modes
alike). A serve run adds the CPU time per output token of the server's event-loop (main)
thread, of the engine's thread (in whichever process), of the server's other threads, of every
thread of the engine process (none with `--engine-thread`), and of the client (its start-up
included). The last line is the summary: medians, and served over offline tokens/s.

`--threads N` sets torch's intra-op threads (the child's OMP_NUM_THREADS too): on a small CPU
box, 1 keeps the compute on the engine thread and leaves the other cores to the event loop and
the client. Two engines are alive at once (the server's and this process's), so on a GPU each
takes `--gpu-memory-utilization` (default 0.4). Linux only (thread CPU times from /proc).
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

from benchmarks.jsonl import emit
from benchmarks.proc_times import (
    children_cpu_s,
    process_cpu_s,
    runqueue_wait_s,
    spawned_children,
    thread_cpu_s,
)

READY_TIMEOUT_S = 300
# Where a timed server's processes write their step totals (inherited by its engine process).
STEPS_ENV = "SERVE_OVERHEAD_STEPS"


class StepClock:
    """Totals of the engine's steps: count, wall and thread-CPU seconds, and the process id and
    native id of the thread that ran them."""

    def __init__(self) -> None:
        self.totals: dict[str, float] = {
            "steps": 0,
            "wall_s": 0.0,
            "cpu_s": 0.0,
            "pid": os.getpid(),
            "thread": 0,
        }

    def wrap(self, step: Callable[..., Any]) -> Callable[..., Any]:
        def timed(*args: Any) -> Any:
            wall = time.perf_counter()
            cpu = time.thread_time()
            result = step(*args)
            self.totals["cpu_s"] += time.thread_time() - cpu  # read inside the wall interval
            self.totals["wall_s"] += time.perf_counter() - wall
            self.totals["steps"] += 1
            self.totals["thread"] = threading.get_native_id()
            return result

        return timed


def steps_between(
    before: dict[str, float], after: dict[str, float], runqueue_s: float
) -> dict[str, Any]:
    """The steps run between two readings of a `StepClock`'s totals: how many, their mean wall
    and CPU time, the share of their wall time the thread was off the CPU, and the share it was
    runnable but not running (`runqueue_s`: its run-queue wait over the same span; the rest of
    the time off the CPU it slept: on the interpreter lock, or on the device)."""
    steps = int(after["steps"] - before["steps"])
    wall_s, cpu_s = after["wall_s"] - before["wall_s"], after["cpu_s"] - before["cpu_s"]
    return {
        "steps": steps,
        "step_wall_ms": round(wall_s / max(steps, 1) * 1e3, 3),
        "step_cpu_ms": round(cpu_s / max(steps, 1) * 1e3, 3),
        "engine_off_cpu": round(1 - cpu_s / wall_s, 4) if wall_s else None,
        "engine_runqueue": round(runqueue_s / wall_s, 4) if wall_s else None,
    }


def time_steps(stats_path: Path) -> None:
    """Time every Engine.step of this process; once one has run, the totals go to `stats_path`
    twice a second (of a server's two processes only the one running the engine steps)."""
    from loopserve.engine.engine import Engine

    clock = StepClock()
    Engine.step = clock.wrap(Engine.step)  # type: ignore[method-assign]

    def report() -> None:
        staged = stats_path.with_suffix(f".{os.getpid()}.tmp")
        while True:
            if clock.totals["steps"]:
                staged.write_text(json.dumps(clock.totals))
                staged.replace(stats_path)  # a reader never sees half a file
            time.sleep(0.5)

    threading.Thread(target=report, daemon=True).start()


def serve_child(stats_path: Path, serve_args: list[str]) -> int:
    """`loopserve serve` with every Engine.step timed, in this process or its engine process."""
    from loopserve.entrypoints.cli import main as cli_main

    os.environ[STEPS_ENV] = str(stats_path)
    time_steps(stats_path)
    return cli_main(["serve", *serve_args])


class Server:
    """The child server, its port, and its step totals."""

    def __init__(self, args: argparse.Namespace, workdir: Path) -> None:
        self.stats_path = workdir / "serve-steps.json"
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            self.port = probe.getsockname()[1]
        serve_args = [
            "--model", args.model, "--device", args.device, "--port", str(self.port),
            "--exit-mode", "trace", "--max-num-seqs", str(args.concurrency),
            "--max-concurrent-requests", "4096", "--uvicorn-log-level", "warning",
            "--gpu-memory-utilization", str(args.gpu_memory_utilization),
            *(["--no-engine-process"] if args.engine_thread else []),
        ]  # fmt: skip
        env = dict(os.environ)
        if args.threads is not None:
            env["OMP_NUM_THREADS"] = str(args.threads)
        command = [sys.executable, "-m", "benchmarks.serve_overhead", "--serve-child"]
        self.log = (workdir / "serve.log").open("w")
        self.process = subprocess.Popen(
            [*command, str(self.stats_path), "--", *serve_args],
            env=env,
            stdout=self.log,
            stderr=subprocess.STDOUT,
        )
        self._wait_ready()

    def _wait_ready(self) -> None:
        deadline = time.monotonic() + READY_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"the server exited (see {self.log.name})")
            try:
                urllib.request.urlopen(f"{self.url}/health", timeout=2)
                return
            except OSError:
                time.sleep(0.5)
        raise RuntimeError(f"the server was not ready after {READY_TIMEOUT_S} s")

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def steps(self) -> dict[str, float]:
        """The step totals of the engine's thread (after the untimed wave: it has stepped)."""
        totals: dict[str, float] = json.loads(self.stats_path.read_text())
        return totals

    def stop(self) -> None:
        self.process.terminate()
        self.process.wait(60)
        self.log.close()


def bench_serve(
    args: argparse.Namespace,
    url: str,
    prompts: int,
    output_len: int,
    seed: int,
    extra_body: dict[str, Any],
) -> dict[str, Any]:
    command = [
        sys.executable, "-m", "loopserve.entrypoints.cli", "bench", "serve", "--base-url", url,
        "--tokenizer", args.model, "--num-prompts", str(prompts), "--max-concurrency",
        str(args.concurrency), "--input-len", str(args.prompt_len), "--output-len",
        str(output_len), "--seed", str(seed), "--warmup-requests", "0",
        "--extra-body", json.dumps(extra_body),
    ]  # fmt: skip
    done = subprocess.run(command, capture_output=True, text=True, check=True)
    summary: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    return summary


def serve_run(
    args: argparse.Namespace, server: Server, extra: dict[str, Any], seed: int
) -> dict[str, Any]:
    pid = server.process.pid
    time.sleep(1.0)  # the step totals are rewritten twice a second
    steps_before = server.steps()
    # The engine's thread: the main thread of the engine process, or a thread of the server.
    engine_pid, engine_tid = int(steps_before["pid"]), int(steps_before["thread"])
    engine_processes = spawned_children(pid)  # none with --engine-thread
    threads_before = thread_cpu_s(pid)
    engine_before = thread_cpu_s(engine_pid)[engine_tid]
    engine_process_before = process_cpu_s(engine_processes)
    waited = runqueue_wait_s(engine_pid, engine_tid)
    client_before = children_cpu_s()
    summary = bench_serve(args, server.url, 2 * args.concurrency, args.output_len, seed, extra)
    client = children_cpu_s() - client_before
    waited = runqueue_wait_s(engine_pid, engine_tid) - waited
    engine = thread_cpu_s(engine_pid)[engine_tid] - engine_before
    engine_process = process_cpu_s(engine_processes) - engine_process_before
    threads = thread_cpu_s(pid)
    time.sleep(1.0)
    steps_after = server.steps()
    tokens = summary["total_output_tokens"]
    per_token = {
        tid: (cpu - threads_before.get(tid, 0.0)) / tokens * 1e6
        for tid, cpu in threads.items()
        if tid != engine_tid
    }
    loop = per_token.pop(pid, 0.0)
    return {
        "run": "serve",
        "engine": _engine_place(args),
        "output_tok_s": round(summary["output_throughput"], 2),
        "output_tokens": tokens,
        "failed": summary["failed"],
        **steps_between(steps_before, steps_after, waited),
        "loop_cpu_us_per_token": round(loop, 2),
        "engine_cpu_us_per_token": round(engine / tokens * 1e6, 2),
        "other_threads_cpu_us_per_token": round(sum(per_token.values()), 2),
        # every thread of the engine process; None with --engine-thread
        "engine_process_cpu_us_per_token": (
            round(engine_process / tokens * 1e6, 2) if engine_processes else None
        ),
        "client_cpu_us_per_token": round(client / tokens * 1e6, 2),
    }


def _engine_place(args: argparse.Namespace) -> str:
    return "thread" if args.engine_thread else "process"


class Offline:
    """An engine in this process, warmed up with one wave, running the offline closed loop."""

    def __init__(self, args: argparse.Namespace) -> None:
        import torch

        from loopserve.config import EngineConfig
        from loopserve.engine.engine import Engine

        if args.threads is not None:
            torch.set_num_threads(args.threads)
        self.args = args
        self.engine = Engine(
            EngineConfig.from_options(
                model=args.model,
                device=args.device,
                max_num_seqs=args.concurrency,
                exit_mode="trace",
                gpu_memory_utilization=args.gpu_memory_utilization,
            )
        )
        self.clock = StepClock()
        self._step = self.clock.wrap(self.engine.step)
        self.run(seed=0, count=args.concurrency)

    def run(self, seed: int, count: int) -> dict[str, Any]:
        from loopserve.bench.closed_loop import make_requests, run_closed_loop
        from loopserve.bench.sweep_spec import Workload

        config = self.engine.model_config
        requests = make_requests(
            Workload(self.args.prompt_len, self.args.output_len),
            count,
            seed=(seed,),
            vocab_size=config.vocab_size,
            num_loops=config.num_loops,
            exits=self.args.exits,
            temperature=0.0,
        )
        before = dict(self.clock.totals)
        thread = os.getpid(), threading.get_native_id()
        waited = runqueue_wait_s(*thread)
        concurrency = self.args.concurrency
        trial = run_closed_loop(self.engine, requests, concurrency, f"o{seed}", self._step)
        waited = runqueue_wait_s(*thread) - waited
        tokens = sum(len(request.exit_depths) for request in trial.requests)
        return {
            "run": "offline",
            "output_tok_s": round(tokens / trial.duration_s, 2),
            "output_tokens": tokens,
            **steps_between(before, self.clock.totals, waited),
        }


def summarize(records: list[dict[str, Any]]) -> dict[str, Any]:
    """Medians of the runs of each kind, and served over offline tokens/s."""

    def median(run: str, key: str) -> float | None:
        values = [r[key] for r in records if r["run"] == run and r[key] is not None]
        return round(statistics.median(values), 4) if values else None

    served = statistics.median(r["output_tok_s"] for r in records if r["run"] == "serve")
    offline = statistics.median(r["output_tok_s"] for r in records if r["run"] == "offline")
    return {
        "run": "summary",
        "engine": next(r["engine"] for r in records if r["run"] == "serve"),
        "offline_tok_s": round(offline, 4),
        "serve_tok_s": round(served, 4),
        "serve_over_offline": round(served / offline, 4),
        "offline_engine_off_cpu": median("offline", "engine_off_cpu"),
        "serve_engine_off_cpu": median("serve", "engine_off_cpu"),
        "offline_engine_runqueue": median("offline", "engine_runqueue"),
        "serve_engine_runqueue": median("serve", "engine_runqueue"),
        "loop_cpu_us_per_token": median("serve", "loop_cpu_us_per_token"),
        "engine_cpu_us_per_token": median("serve", "engine_cpu_us_per_token"),
        "engine_process_cpu_us_per_token": median("serve", "engine_process_cpu_us_per_token"),
        "client_cpu_us_per_token": median("serve", "client_cpu_us_per_token"),
    }


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="default: bench offline's Ouro-1.4B")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--workload", default="512/128", help="PROMPT/OUTPUT tokens")
    parser.add_argument("--concurrency", type=int, default=128, help="requests in flight")
    parser.add_argument("--exits", choices=("fixed", "trace"), default="fixed")
    parser.add_argument("--rounds", type=int, default=2, help="of offline, serve, serve, offline")
    parser.add_argument("--threads", type=int, default=None, help="torch intra-op threads")
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.4)
    parser.add_argument(
        "--engine-thread",
        action="store_true",
        help="serve with --no-engine-process: the engine in a thread of the server, not in a "
        "process of its own (the server's default)",
    )
    parser.add_argument("--out", type=Path, default=None, help="also append the lines here")
    args = parser.parse_args(argv)
    from loopserve.bench.sweep_spec import Workload

    workload = Workload.parse(args.workload)
    args.prompt_len, args.output_len = workload.prompt_len, workload.output_len
    if args.model is None:
        from loopserve.bench.checkpoint_cache import ensure_random_checkpoint

        args.model = str(ensure_random_checkpoint())
    return args


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--serve-child"]:  # the server's process: --serve-child STATS -- ARGS...
        return serve_child(Path(argv[1]), argv[3:])
    args = parse_args(argv)
    records: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory() as workdir:
        server = Server(args, Path(workdir))
        try:
            offline = Offline(args)
            num_loops = offline.engine.model_config.num_loops
            extra = {"min_loops": num_loops} if args.exits == "fixed" else {}
            bench_serve(args, server.url, args.concurrency, 4, 9999, extra)  # untimed wave
            for round_index in range(args.rounds):
                for run in ("offline", "serve", "serve", "offline"):
                    seed = len(records) + 1
                    if run == "offline":
                        record = offline.run(seed, 2 * args.concurrency)
                    else:
                        record = serve_run(args, server, extra, seed)
                    record |= {
                        "round": round_index,
                        "workload": args.workload,
                        "concurrency": args.concurrency,
                        "exits": args.exits,
                        "device": args.device,
                    }
                    emit(record, args.out)
                    records.append(record)
        finally:
            server.stop()
    emit(summarize(records), args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
elif __name__ == "__mp_main__" and STEPS_ENV in os.environ:
    # The engine process a timed server spawned (multiprocessing imports the main module of the
    # server's process, this one, under this name): its steps are the ones to time.
    time_steps(Path(os.environ[STEPS_ENV]))
