"""Figures and the bandwidth floor on hand-made trials, where every number is worked out by hand."""

from __future__ import annotations

from pathlib import Path

import pytest

from loopserve.bench.engine_pool import model_bytes
from loopserve.bench.figures import FIGURES, aggregate, percentile, trial_figures
from loopserve.bench.floor import (
    Ceilings,
    ModelBytes,
    floor_estimate,
    per_token_floor_s,
    work_counts,
)
from loopserve.bench.trial import EngineCounters, RequestRecord, TrialRecord
from loopserve.config import EngineConfig
from loopserve.runner.setup import build_runner
from tests.conftest import TINY_CONFIG

MODEL = ModelBytes(core_weight_bytes=1000, lm_head_bytes=100, kv_bytes_per_token_plane=10,
                   core_params=50)  # fmt: skip
CEILINGS = Ceilings(copy_bytes_per_s=1e4, matmul_flops_per_s=1e3)


def _trial() -> TrialRecord:
    # Request a: prompt 4, three tokens at depths 4 (prefill), 2, 3.
    # Request b: prompt 2, two tokens at depths 4 (prefill), 1; its first token shares a step
    # (the time stamp 0.3) with a's second.
    requests = [
        RequestRecord("a", 4, (4, 2, 3), 0.0, 0.1, (0.1, 0.3, 0.4), 0.4),
        RequestRecord("b", 2, (4, 1), 0.2, 0.3, (0.3, 0.5), 0.5),
    ]
    counters = EngineCounters(decode_steps=4, row_loops=6, prefill_tokens=6, generated_tokens=5)
    return TrialRecord(requests, 10.0, counters, peak_kv_pages=7, kv_pages_total=99,
                       peak_running=2, min_in_flight_while_queued=2)  # fmt: skip


def test_percentiles_interpolate_linearly() -> None:
    assert percentile([4.0, 1.0, 3.0, 2.0], 50) == pytest.approx(2.5)
    assert percentile([1.0, 2.0, 3.0, 4.0], 99) == pytest.approx(3.97)
    assert percentile([5.0], 99) == 5.0
    assert percentile([], 50) is None


def test_trial_figures_by_hand() -> None:
    figures = trial_figures(_trial(), MODEL, CEILINGS)
    assert set(figures) == set(FIGURES)
    assert figures["output_tok_s"] == pytest.approx(0.5)  # 5 tokens in 10 s
    assert figures["total_tok_s"] == pytest.approx(1.1)  # (5 + 6) / 10
    assert figures["ttft_p50_ms"] == pytest.approx(100.0)
    # TPOT: a (0.4 - 0.1) / 2 = 150 ms, b (0.5 - 0.3) / 1 = 200 ms.
    assert figures["tpot_p50_ms"] == pytest.approx(175.0)
    assert figures["tpot_p99_ms"] == pytest.approx(199.5)
    # ITL: a 200, 100; b 200.
    assert figures["itl_p50_ms"] == pytest.approx(200.0)
    assert figures["e2e_p50_ms"] == pytest.approx(350.0)
    assert figures["mean_exit_depth"] == pytest.approx(2.0)  # decode tokens 2, 3, 1
    assert figures["occupancy"] == pytest.approx(1.5)  # 6 row-loops in 4 decode steps
    assert figures["lm_head_steps"] == 4  # stamps 0.1, 0.3, 0.4, 0.5
    assert figures["floor_ratio"] == pytest.approx(2.871 / 10.0)
    assert figures["decode_floor_ms_per_token"] == pytest.approx(1000 * 0.471 / 3)
    assert figures["peak_gpu_memory_gib"] is None


def test_floor_arithmetic_by_hand() -> None:
    work = work_counts(_trial())
    assert work.row_loops == 6
    # a: 2 loops over 4 + 1 tokens, 3 loops over 4 + 2; b: 1 loop over 2 + 1.
    assert work.kv_token_reads == 2 * 5 + 3 * 6 + 1 * 3
    assert work.prefill_token_loops == 4 * 4 + 2 * 4
    floor = floor_estimate(MODEL, CEILINGS, work)
    assert (floor.weight_bytes, floor.lm_head_bytes, floor.kv_bytes) == (4000, 400, 310)
    assert floor.decode_s == pytest.approx(0.471)
    assert floor.prefill_flops == 2 * 50 * 24
    assert floor.prefill_s == pytest.approx(2.4)
    assert floor.total_s == pytest.approx(2.871)


def test_ouro_1_4b_batch_1_floor_is_2_35_ms_on_an_h200() -> None:
    hidden, layers, inner, vocab = 2048, 24, 5632, 49152
    per_layer = 4 * hidden * hidden + 3 * hidden * inner + 4 * hidden
    core_params = layers * per_layer + hidden
    ouro = ModelBytes(
        core_weight_bytes=2 * core_params,
        lm_head_bytes=2 * vocab * hidden,
        kv_bytes_per_token_plane=2 * layers * 16 * 128 * 2,
        core_params=core_params,
    )
    assert (
        ouro.kv_bytes_per_token_plane == 192 * 1024
    )  # 2 (K, V) x 24 layers x 16 heads x 128 x 2 bytes
    h200 = Ceilings(copy_bytes_per_s=4.28e12, matmul_flops_per_s=790e12)
    assert 1000 * per_token_floor_s(ouro, h200, depth=4, context=0) == pytest.approx(2.35, abs=0.01)


def test_model_bytes_counts_layers_and_final_norm(tiny_checkpoint: Path) -> None:
    runner = build_runner(EngineConfig.from_options(model=str(tiny_checkpoint), num_kv_pages=20))
    c = TINY_CONFIG
    q_size, kv_size = c.num_attention_heads * c.head_dim, c.num_key_value_heads * c.head_dim
    per_layer = (
        2 * c.hidden_size * q_size + 2 * c.hidden_size * kv_size
        + 3 * c.hidden_size * c.intermediate_size + 4 * c.hidden_size
    )  # fmt: skip
    core_params = c.num_hidden_layers * per_layer + c.hidden_size
    sizes = model_bytes(runner)
    assert sizes.core_params == core_params
    assert sizes.core_weight_bytes == 4 * core_params  # float32 on the CPU
    assert sizes.lm_head_bytes == 4 * c.vocab_size * c.hidden_size
    assert sizes.kv_bytes_per_token_plane == 2 * c.num_hidden_layers * kv_size * 4


def test_aggregate_gives_medians_and_spread() -> None:
    trials = [trial_figures(_trial(), MODEL, CEILINGS) for _ in range(2)]
    trials.append(trials[0] | {"output_tok_s": 2.0, "decode_steps": 7})
    medians, spread = aggregate(trials)
    assert medians["output_tok_s"] == pytest.approx(0.5)
    assert spread["output_tok_s"] == [pytest.approx(0.5), 2.0]
    assert medians["decode_steps"] == 4 and isinstance(medians["decode_steps"], int)
    assert medians["peak_gpu_memory_gib"] is None and spread["peak_gpu_memory_gib"] == [None, None]
