"""The step budget's CPU-side parts: the bytes a decode loop must move and the kernel categories
(profiling needs a GPU)."""

from __future__ import annotations

from benchmarks.step_budget import categorize, step_bytes
from loopserve.models.ouro_config import OuroConfig


def test_fp8_weights_and_cache_halve_their_categories_bytes() -> None:
    config = OuroConfig()  # Ouro-1.4B's shape
    bf16 = step_bytes(config, rows=8, context=640)
    fp8 = step_bytes(config, rows=8, context=640, weight_bytes=1, kv_bytes=1)
    assert round(bf16["matmul"] / 1e9, 2) == 2.47  # the layers' weights: 2.47 GB a loop
    assert fp8["matmul"] == bf16["matmul"] / 2 and fp8["attention"] == bf16["attention"] / 2
    assert fp8["lm_head"] == bf16["lm_head"]  # the LM head stays bf16
    assert bf16["attention"] == 2 * 2 * 24 * 16 * 128 * 640 * 8


def test_categories_of_the_fp8_kernels() -> None:
    assert categorize("_gemv_kernel") == "matmul"
    assert categorize("_add_norm_kernel") == "norms"
    assert categorize("_decode_kernel") == "attention"
