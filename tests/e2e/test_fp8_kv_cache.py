"""`kv_cache_dtype="fp8"` on the CPU: K/V stored as float8 e4m3 (scale 1, or per-layer scales
from `calculate_kv_scales`; saturating at +-448 x scale). The engine equals the serial reference
that keeps K/V the same way, with the engine's scales (tokens and exit depths, both layouts, gate
exits, with preemption), the scales' source is reported, the same memory holds more pages, and
backends without an fp8 path say so."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from loopserve import LLM, SamplingParams
from loopserve.attention.base import AttentionSpec
from loopserve.attention.flashinfer.fa2 import FlashInferFA2Backend
from loopserve.attention.flashinfer.xqa import FlashInferXQABackend
from loopserve.attention.torch_backend import TorchAttentionBackend
from loopserve.engine.engine import Engine
from loopserve.kv.storage import FP8, KVScales
from loopserve.models.kv_scales import calculate_kv_scales
from loopserve.reference import SerialReference
from tests.pressure import PREEMPTING

PROMPTS = [[7, 3, 9, 120, 44, 2, 18, 99, 5, 61, 17], [200], list(range(30, 70)), [5, 5, 81]]


def engine_kv_scales(engine: Engine) -> KVScales | None:
    """The per-layer scales an engine's fp8 cache runs with (None: K/V are not fp8), for the
    serial reference."""
    source = engine.info.kv_cache_scales
    if source is None:
        return None
    return KVScales(engine.runner.decode.kv.scales, source)  # type: ignore[attr-defined]


def params(index: int) -> SamplingParams:
    return SamplingParams(
        max_tokens=10, temperature=0.0 if index % 2 else 1.0, seed=index, exit_threshold=0.6
    )


LAYOUTS = [("full", 256), ("shared", 256), ("full", 24)]


@pytest.mark.parametrize(
    ("kv_layout", "num_kv_pages", "calculate"),
    [(layout, pages, calculate) for calculate in (False, True) for layout, pages in LAYOUTS],
)
def test_fp8_engine_equals_the_fp8_reference(
    kv_layout: str, num_kv_pages: int, calculate: bool
) -> None:
    llm = LLM(
        dtype="float32", kv_cache_dtype="fp8", kv_layout=kv_layout, num_kv_pages=num_kv_pages,
        calculate_kv_scales=calculate, **PREEMPTING,
    )  # fmt: skip
    assert llm.engine.info.kv_cache_dtype == "float8_e4m3fn"
    assert llm.engine.info.kv_cache_scales == ("calculated" if calculate else "1.0")
    scales = engine_kv_scales(llm.engine)
    assert scales is not None and (scales.scale != 1).all() == calculate
    requests = [params(index) for index in range(len(PROMPTS))]
    outputs = llm.generate(PROMPTS, requests)
    reference = SerialReference(
        llm.engine.runner.model, kv_layout=kv_layout, exit_mode="ouro", kv_cache_dtype="fp8",
        kv_scales=scales,
    )  # fmt: skip
    exact = SerialReference(llm.engine.runner.model, kv_layout=kv_layout, exit_mode="ouro")
    differs = False
    for prompt, request, output in zip(PROMPTS, requests, outputs, strict=True):
        resolved = llm.engine.resolve(request)
        expected = reference.generate(prompt, resolved)
        sequence = output.outputs[0]
        assert (sequence.token_ids, sequence.exit_depths) == (
            expected.token_ids,
            expected.exit_depths,
        )
        differs |= exact.generate(prompt, resolved).token_ids != sequence.token_ids
    if kv_layout == "full" and num_kv_pages == 256:  # (the shared layout's tokens happen not to)
        assert differs, "fp8 K/V should change some token here (else the test tests nothing)"
    if num_kv_pages == 24:
        assert llm.engine.stats().num_preemptions > 0


def test_the_scales_come_from_calibration_only_with_an_fp8_cache() -> None:
    """`kv_cache_dtype` auto: no scales (reported null), and asking to calculate them is
    refused by name; fp8: the calculated scales are `calculate_kv_scales` of the model."""
    assert LLM(num_kv_pages=16).engine.info.kv_cache_scales is None
    with pytest.raises(ValueError, match=r"calculate_kv_scales \(--calculate-kv-scales\) needs"):
        LLM(calculate_kv_scales=True)
    llm = LLM(dtype="float32", kv_cache_dtype="fp8", calculate_kv_scales=True, num_kv_pages=16)
    scales = engine_kv_scales(llm.engine)
    assert scales is not None
    assert torch.equal(scales.scale, calculate_kv_scales(llm.engine.runner.model).scale)


def test_the_same_memory_holds_more_pages() -> None:
    sized = {
        dtype: LLM(dtype="bfloat16", kv_cache_dtype=dtype, kv_cache_memory_gb=0.01)
        for dtype in ("auto", "fp8")
    }
    pages = {dtype: llm.engine.info.num_kv_pages for dtype, llm in sized.items()}
    bytes_per_page = {dtype: llm.engine.info.kv_bytes_per_page for dtype, llm in sized.items()}
    assert bytes_per_page["auto"] == 2 * bytes_per_page["fp8"]
    assert pages["fp8"] >= 2 * pages["auto"] - 2  # the null page and rounding


def test_backends_declare_their_fp8_path() -> None:
    spec = AttentionSpec(
        device_type="cuda", compute_capability=(9, 0), dtype=torch.bfloat16, head_size=128,
        num_heads=16, num_kv_heads=16, block_size=16, cuda_graphs=True,
    )  # fmt: skip
    fp8 = dataclasses.replace(spec, kv_dtype=FP8)
    assert "KV cache is not supported" not in " ".join(
        TorchAttentionBackend.unsupported_reasons(fp8)
    )
    assert not any("KV cache" in r for r in FlashInferFA2Backend.unsupported_reasons(fp8))
    head_64 = dataclasses.replace(fp8, head_size=64)  # FlashInfer's FA2 fp8 loaders: not at 64
    assert any(
        "fp8 KV cache at head size 64" in r
        for r in FlashInferFA2Backend.unsupported_reasons(head_64)
    )
    reasons = FlashInferXQABackend.unsupported_reasons(fp8)  # one scale for K and V: not ours
    assert any("torch.float8_e4m3fn KV cache is not supported" in r for r in reasons), reasons
    for backend in (FlashInferFA2Backend, FlashInferXQABackend):
        assert not any("KV cache" in r for r in backend.unsupported_reasons(spec))


def test_an_unknown_kv_cache_dtype_is_refused() -> None:
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        LLM(kv_cache_dtype="int4")
