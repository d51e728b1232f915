"""Drive an OpenAI-compatible server with streaming requests (`loopserve bench serve`).

Owns: the workload (random token-id prompts of `--input-len` tokens, `--shared-prefix-fraction`
of them starting with the same `--shared-prefix-len` tokens, see `prompts.serve_prompts`, each
asking for `--output-len` tokens with EOS ignored), arrivals (closed loop with
`--max-concurrency`, Poisson at `--request-rate`, or both, as in `vllm bench serve`), timing each
request from its stream, and the summary: one JSON line with the config, the git SHA and the
figures in vLLM's units and key names (`*_ms` latencies with mean/median/std/p50/p90/p99,
requests/s and tokens/s, goodput; `serve_figures.py` computes them from the timed streams),
plus the server's prefix-cache hit rate over the timed requests when its `/metrics` has
loopserve's counters (else null). Must not: import torch or the engine; it
only speaks HTTP (aiohttp), so it can measure any server. (numpy loads inside functions:
`loopserve --help` imports this module.)"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from loopserve.bench.prompts import serve_prompts
from loopserve.bench.serve_figures import Goodput, RequestResult, summarize

# loopserve's prefix-cache counters in /metrics, in prompt tokens: (hits, lookups).
PREFIX_COUNTERS = ("loopserve:prefix_cache_hits_total", "loopserve:prefix_cache_queries_total")


class ServerUnusable(RuntimeError):
    """The server cannot be benchmarked: unreachable, it lists no model, or the warm-up failed."""


@dataclass(frozen=True, slots=True)
class BenchConfig:
    base_url: str
    model: str | None  # None: the first model the server lists
    api_key: str | None
    num_prompts: int
    input_len: int
    output_len: int
    shared_prefix_len: int  # 0: no shared prefix
    shared_prefix_fraction: float  # of the prompts that start with it
    max_concurrency: int | None  # None: no cap (open loop)
    request_rate: float  # requests/s of the Poisson arrivals; inf sends all at once
    seed: int
    percentiles: tuple[float, ...]
    extra_body: dict[str, Any]  # merged into every request (e.g. Ouro's max_loops)
    goodput: Goodput | None  # the latency targets a request must meet to count as good
    warmup_requests: int
    label: str | None  # free text recorded with the run (which server, which side of an A/B)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--base-url", default="http://127.0.0.1:8000")
    parser.add_argument("--model", default=None, help="default: the first model the server lists")
    parser.add_argument(
        "--api-key",
        default=os.environ.get("LOOPSERVE_API_KEY") or os.environ.get("OPENAI_API_KEY"),
        help="bearer key (default: $LOOPSERVE_API_KEY or $OPENAI_API_KEY)",
    )
    parser.add_argument(
        "--tokenizer", default=None, help="checkpoint dir with tokenizer.json (default: built-in)"
    )
    parser.add_argument("--num-prompts", type=int, default=100)
    parser.add_argument("--input-len", type=int, default=128, help="prompt tokens per request")
    parser.add_argument("--output-len", type=int, default=128, help="output tokens per request")
    parser.add_argument(
        "--shared-prefix-len",
        type=int,
        default=0,
        help="tokens of a prefix shared by --shared-prefix-fraction of the prompts (default: 0)",
    )
    parser.add_argument(
        "--shared-prefix-fraction",
        type=float,
        default=None,
        help="fraction of the prompts that start with the shared prefix, chosen by --seed "
        "(default: 1 with --shared-prefix-len)",
    )
    parser.add_argument(
        "--max-concurrency", type=int, default=None, help="requests in flight at most (closed loop)"
    )
    parser.add_argument(
        "--request-rate", type=float, default=float("inf"), help="Poisson arrivals per second"
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--percentiles", default="50,90,99", help="comma-separated, 0..100")
    parser.add_argument("--extra-body", default="{}", help="JSON merged into every request")
    parser.add_argument(
        "--goodput",
        nargs="+",
        default=None,
        metavar="METRIC:MS",
        help="latency targets (ttft, tpot, e2el in ms, e.g. ttft:500 tpot:50): also report the "
        "requests/s that met all of them, as vllm bench serve does",
    )
    parser.add_argument("--warmup-requests", type=int, default=1, help="sent first, not timed")
    parser.add_argument("--output", type=Path, default=None, help="also append the line here")
    parser.add_argument("--label", default=None, help="recorded in the config (tells runs apart)")


def run(args: argparse.Namespace) -> int:
    config = _config(args)
    prompts = serve_prompts(
        _vocabulary(args.tokenizer),
        config.num_prompts,
        config.input_len,
        config.seed,
        config.shared_prefix_len,
        config.shared_prefix_fraction,
    )
    try:
        summary = asyncio.run(benchmark(config, prompts))
    except ServerUnusable as error:
        print(f"loopserve bench serve: error: {error}", file=sys.stderr)
        return 1
    if summary["stream_warning"]:
        print(f"loopserve bench serve: warning: {summary['stream_warning']}", file=sys.stderr)
    line = json.dumps(summary)
    print(line)
    if args.output is not None:
        with args.output.open("a") as file:
            file.write(line + "\n")
    return 0 if summary["completed"] == config.num_prompts else 1


def _config(args: argparse.Namespace) -> BenchConfig:
    for name in ("num_prompts", "input_len", "output_len"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be at least 1")
    if args.max_concurrency is not None and args.max_concurrency < 1:
        raise ValueError("--max-concurrency must be at least 1")
    if not args.request_rate > 0:
        raise ValueError("--request-rate must be positive (inf sends everything at once)")
    if not 0 <= args.shared_prefix_len < args.input_len:
        raise ValueError("--shared-prefix-len must be at least 0 and shorter than --input-len")
    fraction = args.shared_prefix_fraction
    if fraction is None:  # all prompts share a given prefix, as in `bench offline`
        fraction = 1.0 if args.shared_prefix_len else 0.0
    elif not args.shared_prefix_len:
        raise ValueError("--shared-prefix-fraction needs --shared-prefix-len")
    if not 0.0 <= fraction <= 1.0:
        raise ValueError("--shared-prefix-fraction must be in [0, 1]")
    try:
        extra_body = json.loads(args.extra_body)
    except json.JSONDecodeError as error:
        raise ValueError(f"--extra-body is not valid JSON ({error})") from None
    if not isinstance(extra_body, dict):
        raise ValueError("--extra-body must be a JSON object")
    return BenchConfig(
        base_url=args.base_url.rstrip("/"),
        model=args.model,
        api_key=args.api_key,
        num_prompts=args.num_prompts,
        input_len=args.input_len,
        output_len=args.output_len,
        shared_prefix_len=args.shared_prefix_len,
        shared_prefix_fraction=fraction,
        max_concurrency=args.max_concurrency,
        request_rate=args.request_rate,
        seed=args.seed,
        percentiles=tuple(float(part) for part in args.percentiles.split(",")),
        extra_body=extra_body,
        goodput=Goodput.parse(args.goodput) if args.goodput else None,
        warmup_requests=args.warmup_requests,
        label=args.label,
    )


def _vocabulary(tokenizer_dir: str | None) -> list[int]:
    """Token ids a random prompt may use: the tokenizer's, minus its special tokens."""
    from loopserve.models.builtin import resolve_model_dir
    from loopserve.tokenizer import Tokenizer

    directory = resolve_model_dir(tokenizer_dir)
    tokenizer = Tokenizer.from_directory(directory)
    if tokenizer is None:  # a checkpoint without one: any id below its vocabulary size
        config = Path(directory) / "config.json"
        if not config.is_file():
            raise FileNotFoundError(
                f"{directory} has neither tokenizer.json nor config.json; pass --tokenizer DIR"
            )
        return list(range(int(json.loads(config.read_text())["vocab_size"])))
    return [index for index in range(tokenizer.vocab_size) if index not in tokenizer.special_ids]


async def benchmark(config: BenchConfig, prompts: list[list[int]]) -> dict[str, Any]:
    """Send every prompt as configured; the summary line of the run."""
    aiohttp = _import_aiohttp()
    timeout = aiohttp.ClientTimeout(total=6 * 3600)
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(timeout=timeout, connector=connector) as session:
        try:
            model = config.model or await _first_model(session, config)
        except (aiohttp.ClientError, OSError, asyncio.TimeoutError) as error:
            raise ServerUnusable(
                f"cannot reach {config.base_url} ({type(error).__name__}: {error}); is a server "
                "running there? (`loopserve serve`, or pass --base-url)"
            ) from None
        for prompt in prompts[: config.warmup_requests]:
            warmup = await send_request(session, config, model, prompt)
            if not warmup.success:
                raise ServerUnusable(f"the warm-up request failed: {warmup.error}")
        before = await _prefix_counters(session, config)
        start = time.perf_counter()
        results = await _send_all(session, config, model, prompts)
        duration = time.perf_counter() - start
        after = await _prefix_counters(session, config)
    summary = summarize(results, duration, config.percentiles, config.goodput)
    summary["prefix_cache_hit_rate"] = _hit_rate(before, after)
    return {"config": _config_record(config, model), **summary}


async def _send_all(
    session: Any, config: BenchConfig, model: str, prompts: list[list[int]]
) -> list[RequestResult]:
    import numpy as np

    limit = asyncio.Semaphore(config.max_concurrency or len(prompts))
    rng = np.random.default_rng(config.seed)

    async def limited(prompt: list[int]) -> RequestResult:
        async with limit:
            return await send_request(session, config, model, prompt)

    tasks = []
    for prompt in prompts:
        tasks.append(asyncio.create_task(limited(prompt)))
        if config.request_rate != float("inf"):
            await asyncio.sleep(float(rng.exponential(1.0 / config.request_rate)))
    return list(await asyncio.gather(*tasks))


async def send_request(
    session: Any, config: BenchConfig, model: str, prompt: list[int]
) -> RequestResult:
    """One streamed completion, timed."""
    body = {
        "model": model,
        "prompt": prompt,
        "max_tokens": config.output_len,
        "temperature": 0.0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
        **config.extra_body,
    }
    result = RequestResult(prompt_len=len(prompt))
    sent = time.perf_counter()
    try:
        async with session.post(
            f"{config.base_url}/v1/completions", json=body, headers=_headers(config)
        ) as response:
            if response.status != 200:
                result.error = f"HTTP {response.status}: {(await response.text())[:200]}"
                return result
            await _read_stream(response, result, sent)
    except Exception as error:  # a failed request is counted, not fatal to the run
        result.error = f"{type(error).__name__}: {error}"
    return result


async def _read_stream(response: Any, result: RequestResult, sent: float) -> None:
    last = sent
    async for raw in response.content:
        line = raw.decode().strip()
        if not line.startswith("data: ") or line == "data: [DONE]":
            continue
        data = json.loads(line.removeprefix("data: "))
        if "error" in data:
            result.error = str(data["error"].get("message"))
            return
        now = time.perf_counter()
        if data.get("usage"):
            result.output_tokens = int(data["usage"]["completion_tokens"])
        choices = data.get("choices") or []
        if choices and (choices[0].get("text") or choices[0].get("exit_depths")):
            result.token_events += 1
            if result.ttft == 0.0:
                result.ttft = now - sent
            else:
                result.itl.append(now - last)
            last = now
    result.latency = time.perf_counter() - sent
    result.success = result.ttft > 0.0


def _config_record(config: BenchConfig, model: str) -> dict[str, Any]:
    record = asdict(config)
    record.pop("api_key")
    record["model"] = model
    record["request_rate"] = (
        str(config.request_rate) if config.request_rate == float("inf") else config.request_rate
    )
    record["git_sha"] = _git_sha()
    record["mode"] = "serve"
    return record


async def _first_model(session: Any, config: BenchConfig) -> str:
    async with session.get(f"{config.base_url}/v1/models", headers=_headers(config)) as response:
        if response.status != 200:
            text = (await response.text())[:200]
            raise ServerUnusable(f"GET /v1/models: HTTP {response.status}: {text}")
        models = (await response.json())["data"]
    if not models:
        raise ServerUnusable("the server lists no models; pass --model")
    return str(models[0]["id"])


async def _prefix_counters(session: Any, config: BenchConfig) -> tuple[float, float] | None:
    """The server's (prefix-cache hit tokens, looked-up tokens) from `/metrics`: the samples
    without labels (a fleet's aggregate); None when it has no such counters or no `/metrics`."""
    try:
        async with session.get(f"{config.base_url}/metrics", headers=_headers(config)) as response:
            if response.status != 200:
                return None
            text = await response.text()
    except Exception:  # a server without usable metrics still gets benchmarked
        return None
    values = {}
    for line in text.splitlines():
        name, _, value = line.partition(" ")
        if name in PREFIX_COUNTERS:
            values[name] = float(value)
    if len(values) < len(PREFIX_COUNTERS):
        return None
    return values[PREFIX_COUNTERS[0]], values[PREFIX_COUNTERS[1]]


def _hit_rate(
    before: tuple[float, float] | None, after: tuple[float, float] | None
) -> float | None:
    """Hit tokens / looked-up tokens between two reads; None without both or without lookups."""
    if before is None or after is None or after[1] <= before[1]:
        return None
    return (after[0] - before[0]) / (after[1] - before[1])


def _headers(config: BenchConfig) -> dict[str, str]:
    return {"Authorization": f"Bearer {config.api_key}"} if config.api_key else {}


def _git_sha() -> str | None:
    try:
        completed = subprocess.run(
            ["git", "rev-parse", "HEAD"],
            cwd=Path(__file__).resolve().parent,
            capture_output=True,
            text=True,
            timeout=5,
            check=True,
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return completed.stdout.strip() or None


def _import_aiohttp() -> Any:
    try:
        import aiohttp
    except ImportError:
        raise ValueError("loopserve bench serve needs aiohttp: pip install aiohttp") from None
    return aiohttp
