"""`loopserve bench serve` against the shared server: it completes every request, counts the
tokens the server reports, and summarises latencies in vLLM's units and key names."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

from .server_testing import API_KEY, RunningServer, free_port

pytest.importorskip("aiohttp", reason="the serving benchmark client uses aiohttp")


def _args(server: RunningServer, tiny_model: Path, *extra: str) -> argparse.Namespace:
    from loopserve.bench.serve_client import add_arguments

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return parser.parse_args(
        [
            "--base-url", server.url, "--api-key", API_KEY, "--tokenizer", str(tiny_model),
            "--num-prompts", "6", "--input-len", "8", "--output-len", "5", *extra,
        ]
    )  # fmt: skip


@pytest.mark.parametrize(
    "arrivals", [("--max-concurrency", "3"), ("--request-rate", "40", "--max-concurrency", "4")]
)
def test_bench_serve_reports_vllm_figures(
    server: RunningServer,
    tiny_model: Path,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    arrivals: tuple[str, ...],
) -> None:
    from loopserve.bench.serve_client import run

    output = tmp_path / "bench.jsonl"
    args = _args(server, tiny_model, *arrivals, "--output", str(output))
    assert run(args) == 0
    printed = capsys.readouterr().out.strip().splitlines()
    assert len(printed) == 1
    summary = json.loads(printed[0])
    assert json.loads(output.read_text()) == summary
    assert summary["completed"] == 6 and summary["failed"] == 0
    assert summary["total_input_tokens"] == 6 * 8
    assert summary["total_output_tokens"] == 6 * 5
    assert summary["config"]["model"] == "tiny"
    assert "git_sha" in summary["config"]
    assert summary["output_throughput"] == pytest.approx(30 / summary["duration"])
    for metric in ("ttft", "tpot", "itl", "e2el"):
        median, p90, p99 = (summary[f"{key}_{metric}_ms"] for key in ("median", "p90", "p99"))
        assert 0 < median <= p90 <= p99
        assert summary[f"p50_{metric}_ms"] == pytest.approx(median)
        assert summary[f"mean_{metric}_ms"] > 0
    assert summary["median_ttft_ms"] < summary["median_e2el_ms"]
    assert 0.0 <= summary["prefix_cache_hit_rate"] <= 1.0  # read from the server's /metrics


def test_bench_serve_shares_a_prefix_and_reports_the_hit_rate(
    server: RunningServer, tiny_model: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from loopserve.bench.serve_client import run

    shared = ("--shared-prefix-len", "32", "--shared-prefix-fraction", "0.5", "--seed", "11")
    args = _args(server, tiny_model, "--max-concurrency", "1", *shared)
    args.input_len = 40
    assert run(args) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["completed"] == 6 and summary["total_input_tokens"] == 6 * 40
    assert summary["config"]["shared_prefix_len"] == 32
    assert summary["config"]["shared_prefix_fraction"] == 0.5
    # Three prompts share two full pages (block size 16); one at a time, the later ones hit them.
    assert 0.0 < summary["prefix_cache_hit_rate"] < 1.0


def test_bench_serve_counts_failures(
    server: RunningServer, tiny_model: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from loopserve.bench.serve_client import run

    args = _args(server, tiny_model, "--extra-body", '{"max_loops": 99}', "--warmup-requests", "0")
    assert run(args) == 1
    summary = json.loads(capsys.readouterr().out)
    assert summary["completed"] == 0 and summary["failed"] == 6
    assert summary["errors"] and "HTTP 400" in summary["errors"][0]


def test_bench_serve_without_a_server_is_one_line(
    tiny_model: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from loopserve.bench.serve_client import run

    nobody = RunningServer(f"http://127.0.0.1:{free_port()}", API_KEY)
    assert run(_args(nobody, tiny_model)) == 1
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err.startswith("loopserve bench serve: error: cannot reach http://127.0.0.1:")
    assert len(captured.err.strip().splitlines()) == 1


def test_bench_serve_with_a_failing_warm_up_is_one_line(
    server: RunningServer, tiny_model: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from loopserve.bench.serve_client import run

    assert run(_args(server, tiny_model, "--extra-body", '{"max_loops": 99}')) == 1
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err.startswith("loopserve bench serve: error: the warm-up request failed")
    assert "max_loops" in captured.err and len(captured.err.strip().splitlines()) == 1


def test_bench_serve_names_a_bad_extra_body(server: RunningServer, tiny_model: Path) -> None:
    from loopserve.bench.serve_client import run

    with pytest.raises(ValueError, match=r"--extra-body is not valid JSON"):
        run(_args(server, tiny_model, "--extra-body", "{bad"))
