"""The attention table's CPU-side parts: argument parsing, layer counts, backends that cannot
serve the shape reported with their reasons, and the markdown table (timing needs a GPU)."""

from __future__ import annotations

import torch

from benchmarks.attention_table import (
    MAX_LAYERS,
    MIN_WORKING_SET,
    layers_for,
    make_backend,
    markdown,
    parse_list,
    parse_prompts,
)
from benchmarks.kernel_bench import KernelShape, kv_bytes_per_layer, paged_pass
from loopserve.attention.base import AttentionSpec
from loopserve.kv.storage import FP8


def test_parsing_and_layer_counts() -> None:
    assert parse_list("1,8,32,128") == [1, 8, 32, 128]
    assert parse_prompts("1x1024,8x512") == [(1, 1024), (8, 512)]
    assert layers_for(MIN_WORKING_SET) == 1
    assert layers_for(MIN_WORKING_SET // 4) == 4
    assert layers_for(MIN_WORKING_SET // 4 - 1) == 5
    assert layers_for(1) == MAX_LAYERS
    assert layers_for(10 * MIN_WORKING_SET) == 1


def test_a_backend_that_cannot_serve_the_shape_gives_reasons() -> None:
    spec = AttentionSpec(
        device_type="cpu", compute_capability=None, dtype=torch.float32, head_size=64,
        num_heads=4, num_kv_heads=2, block_size=16, cuda_graphs=False,
    )  # fmt: skip
    reasons = make_backend("flashinfer_xqa", spec)
    assert isinstance(reasons, list) and any("runs on ['cuda']" in r for r in reasons)
    assert not isinstance(make_backend("torch", spec), list)


def test_markdown_table() -> None:
    records = [
        {"kind": "decode", "rows": 1, "context": 640, "backend": "a", "layer_us": 6.71,
         "tb_per_s": 0.78},
        {"kind": "decode", "rows": 1, "context": 640, "backend": "b", "unsupported": ["x"]},
        {"kind": "prefill", "rows": 8, "context": 1024, "backend": "a", "layer_us": 120.0},
        {"kind": "prefill", "rows": 8, "context": 1024, "backend": "b", "error": "boom"},
    ]  # fmt: skip
    assert markdown(records).splitlines() == [
        "| kind | rows | context | a | b |",
        "|---|---|---|---|---|",
        "| decode | 1 | 640 | 6.7 (0.78) | n/a |",
        "| prefill | 8 | 1024 | 120.0 | error |",
    ]


def test_an_fp8_workload_stores_and_counts_float8() -> None:
    shape = KernelShape(num_heads=2, num_kv_heads=2, head_dim=32, block_size=8, kv_dtype=FP8)
    kv, _, q, k, _ = paged_pass([20, 9], [1, 1], shape, torch.device("cpu"), 2, False)
    assert kv.cache.dtype == FP8 and q.dtype == k.dtype == torch.bfloat16
    assert kv.cache.float().std() > 0.5  # normal values, not the zeros of a fresh cache
    assert kv_bytes_per_layer([20, 9], shape) == 2 * 29 * 2 * 32  # one byte an element
    assert kv_bytes_per_layer([20, 9], KernelShape(num_heads=2, num_kv_heads=2, head_dim=32)) == (
        2 * 29 * 2 * 32 * 2
    )
