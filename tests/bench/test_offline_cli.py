"""`loopserve bench offline` end to end on the CPU with a tiny checkpoint: JSON lines with every
figure, the markdown summary, the plot, A B B A alternation and the time budget."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from loopserve.bench.figures import FIGURES
from loopserve.entrypoints.cli import main

CONFIG_KEYS = {
    "workload", "concurrency", "num_requests", "exits", "scheduling", "graphs", "kv_layout",
    "trials", "dtype", "attention_backend", "num_kv_pages", "cuda_graphs_active",
}  # fmt: skip


def _bench(checkpoint: Path, tmp_path: Path, *extra: str) -> tuple[int, list[dict]]:
    output = tmp_path / "out.jsonl"
    argv = [
        "bench", "offline", "--model", str(checkpoint), "--device", "cpu",
        "--workload", "6/4", "--warmup-output-len", "2", "--num-kv-pages", "200",
        "--output", str(output), *extra,
    ]  # fmt: skip
    code = main(argv)
    return code, [json.loads(line) for line in output.read_text().splitlines()]


def test_sweep_prints_every_figure_summary_and_plot(
    tiny_checkpoint: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    summary, plot = tmp_path / "summary.md", tmp_path / "plot.png"
    code, records = _bench(
        tiny_checkpoint, tmp_path,
        "--concurrency", "1,2", "--exits", "fixed,d2.6", "--scheduling", "refill",
        "--graphs", "on,off", "--trials", "2", "--summary", str(summary), "--plot", str(plot),
    )  # fmt: skip
    assert code == 0
    assert [r["record"] for r in records] == ["floor"] + ["offline"] * 4  # graphs: eager on CPU
    for record in records:
        assert record["git_sha"] and record["device"].startswith("cpu")
    results = records[1:]
    assert {(r["config"]["concurrency"], r["config"]["exits"]) for r in results} == {
        (1, "fixed"), (1, "trace"), (2, "fixed"), (2, "trace"),
    }  # fmt: skip
    for result in results:
        config, figures = result["config"], result["figures"]
        assert set(config) >= CONFIG_KEYS and config["graphs"] is False
        assert set(figures) == set(FIGURES) and set(result["spread"]) == set(FIGURES)
        assert figures["output_tokens"] == 2 * config["concurrency"] * 4
        assert figures["floor_ratio"] > 0 and figures["output_tok_s"] > 0
        assert len(result["trial_output_tok_s"]) == 2
        assert "method" in result["floor"] and result["engine_startup_s"] >= 0
    stdout_records = [line for line in capsys.readouterr().out.splitlines() if line[:1] == "{"]
    assert [json.loads(line) for line in stdout_records] == records
    text = summary.read_text()
    assert "| 6/4 | 2 | trace | refill | off |" in text
    assert "### trace / fixed depth" in text
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_ab_alternates_variants_on_the_same_requests(tiny_checkpoint: Path, tmp_path: Path) -> None:
    code, records = _bench(
        tiny_checkpoint, tmp_path,
        "--ab", "--concurrency", "2", "--exits", "trace", "--scheduling", "refill,no_refill",
        "--trials", "3",
    )  # fmt: skip
    assert code == 0
    results = [r for r in records if r["record"] == "offline"]
    assert [r["config"]["scheduling"] for r in results] == ["refill", "no_refill"]
    assert {r["ab_order"] for r in results} == {"ABBAAB"}
    # Same requests and seeds: the traced exit depths are identical in both variants.
    assert results[0]["spread"]["mean_exit_depth"] == results[1]["spread"]["mean_exit_depth"]


def test_time_budget_skips_what_it_cannot_start(tiny_checkpoint: Path, tmp_path: Path) -> None:
    code, records = _bench(tiny_checkpoint, tmp_path, "--concurrency", "1,2", "--time-budget", "0")
    assert code == 1  # nothing measured
    skipped = [r for r in records if r["record"] == "skipped"]
    assert len(skipped) == len(records) == 2 * 2 * 2  # C × exits × scheduling (eager on CPU)
    assert {r["reason"] for r in skipped} == {"time budget"}


def test_shared_prefixes_with_the_prefix_cache_on_and_off(
    tiny_checkpoint: Path, tmp_path: Path
) -> None:
    summary, output = tmp_path / "summary.md", tmp_path / "out.jsonl"
    code = main([
        "bench", "offline", "--model", str(tiny_checkpoint), "--device", "cpu",
        "--workload", "40/4", "--shared-prefix", "32", "--prefix-caching", "on,off",
        "--kv-allocation", "incremental,reserve", "--concurrency", "2", "--exits", "fixed",
        "--scheduling", "refill", "--trials", "1", "--warmup-output-len", "2",
        "--num-kv-pages", "200", "--output", str(output), "--summary", str(summary),
    ])  # fmt: skip
    assert code == 0
    records = [json.loads(line) for line in output.read_text().splitlines()]
    by_variant = {
        (r["config"]["prefix_caching"], r["config"]["kv_allocation"]): r["figures"]
        for r in records[1:]
    }
    assert set(by_variant) == {(c, a) for c in (True, False) for a in ("incremental", "reserve")}
    for (caching, _), figures in by_variant.items():
        # Each wave starts with an empty cache: the first C = 2 requests compute the shared
        # prefix, the other 2 find its 2 full pages (32 of their 40 tokens).
        expected = 2 * 32 / (4 * 40)
        assert (figures["prefix_hit_rate"] == expected) is caching, figures["prefix_hit_rate"]
        assert figures["preemptions"] == 0
    text = summary.read_text()
    assert (
        "| 40/4 (32 shared) | 2 | fixed | refill | off | full, no prefix cache, reserve |" in text
    )
    assert "### prefix cache on / off" in text and "### incremental pages / reserved" in text


def test_swap_and_recompute_preemption_side_by_side(tiny_checkpoint: Path, tmp_path: Path) -> None:
    summary, output = tmp_path / "summary.md", tmp_path / "out.jsonl"
    # 12 usable pages hold two 14-token prompts but only one request at full length (as in
    # tests/bench/test_step_timeline.py), so requests are preempted as they grow.
    code = main([
        "bench", "offline", "--model", str(tiny_checkpoint), "--device", "cpu",
        "--workload", "14/12", "--concurrency", "3", "--exits", "fixed", "--scheduling", "refill",
        "--preemption-mode", "swap,recompute", "--trials", "1", "--warmup-output-len", "0",
        "--kv-growth-estimate", "none",
        "--num-kv-pages", "13", "--output", str(output), "--summary", str(summary),
    ])  # fmt: skip
    assert code == 0
    records = [json.loads(line) for line in output.read_text().splitlines()]
    by_mode = {r["config"]["preemption_mode"]: r["figures"] for r in records[1:]}
    assert set(by_mode) == {"swap", "recompute"}
    assert all(figures["preemptions"] > 0 for figures in by_mode.values())
    text = summary.read_text()
    assert "full, recompute preemption |" in text and "### recompute / swap preemption" in text


def test_speculation_is_recorded_with_its_counts(tiny_checkpoint: Path, tmp_path: Path) -> None:
    spec = '{"num_speculative_tokens": 2, "draft_loops": 1, "forced_acceptance": 0.9}'
    code, records = _bench(
        tiny_checkpoint, tmp_path,
        "--concurrency", "1", "--exits", "fixed", "--scheduling", "refill", "--trials", "1",
        "--speculative-config", spec,
    )  # fmt: skip
    assert code == 0
    (run,) = [record for record in records if record["record"] == "offline"]
    assert run["config"]["speculative_config"]["forced_acceptance"] == 0.9
    assert run["figures"]["proposed_tokens"] > 0 and run["figures"]["proposal_acceptance"] > 0.5
    assert run["figures"]["mean_accepted_length"] > 1.0


def test_a_bad_speculative_config_is_refused_before_anything_runs(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    model = tmp_path / "never-written"
    argv = ["bench", "offline", "--model", str(model), "--speculative-config", "{bad"]
    assert main(argv) == 2
    assert "must be a JSON object" in capsys.readouterr().err
    assert not model.exists()


def test_fp8_kv_scales_are_recorded(tiny_checkpoint: Path, tmp_path: Path) -> None:
    code, records = _bench(
        tiny_checkpoint, tmp_path,
        "--concurrency", "1", "--exits", "fixed", "--scheduling", "refill", "--trials", "1",
        "--kv-cache-dtype", "fp8", "--calculate-kv-scales",
    )  # fmt: skip
    assert code == 0
    (run,) = [record for record in records if record["record"] == "offline"]
    assert run["config"]["kv_cache_dtype"] == "float8_e4m3fn"
    assert run["config"]["kv_cache_scales"] == "calculated"
