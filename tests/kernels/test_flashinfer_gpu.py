"""The FlashInfer backends on a CUDA GPU: against the float64 and torch references (permuted,
poisoned pages; MHA and GQA; empty and length-1 rows; one request at several loops), bitwise alone
vs inside a batch of 32 and under a wider plan, eager vs CUDA-graph replay with new lengths and
pages, and no host synchronisation in steady-state decode passes, across a bucket change too.

Run with `pytest -m gpu tests/kernels` where flashinfer is importable (scripts/gpu_flashinfer.sh).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import pytest
import torch

from loopserve.attention.base import AttentionSpec
from loopserve.attention.flashinfer.backend import FlashInferBackend
from loopserve.attention.flashinfer.fa2 import FlashInferFA2Backend
from loopserve.attention.flashinfer.library import flashinfer_installed
from loopserve.attention.flashinfer.xqa import FlashInferXQABackend
from loopserve.attention.torch_backend import TorchAttentionBackend
from loopserve.kv.metadata import AttentionMetadata
from loopserve.kv.pages import NULL_PAGE
from loopserve.kv.storage import FP8, KVScales

from .batch_specs import (
    DECODE_SPECS,
    PREFILL_SPECS,
    Batch,
    HeadShape,
    Row,
    build_batch,
    decode_subset,
    dense_reference,
    fp8_storage,
    replay_metadata,
    run_backend,
    tolerance,
)

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
    pytest.mark.skipif(
        not flashinfer_installed(),
        reason="flashinfer is not installed (pip install 'loopserve[flashinfer]')",
    ),
]
DEVICE = "cuda"
BLOCK = 16
OURO = HeadShape(16, 16, 128, torch.bfloat16)
SMALL = HeadShape(4, 2, 128, torch.bfloat16)  # the FlashInfer engine tests' model: GQA 2
VARIANTS: dict[str, Callable[[AttentionSpec], FlashInferBackend]] = {
    "fa2-cuda_core": lambda spec: FlashInferFA2Backend(spec, decode_kernel="cuda_core"),
    "fa2-tensor_core": lambda spec: FlashInferFA2Backend(spec, decode_kernel="tensor_core"),
    "xqa": FlashInferXQABackend,
}
CLASSES = {"fa2-cuda_core": FlashInferFA2Backend, "fa2-tensor_core": FlashInferFA2Backend}
DECODE_ROWS = [Row(n) for n in (8192, 1, 0, 4097, 16, 2500, 8000, 777, 4096, 33, 0, 6001)]
PREFILL_ROWS = [
    Row(1024, query_len=1024),  # a whole prompt
    Row(4608, query_len=512),  # a chunk after 4096 tokens already in pages
    Row(300),
    Row(7200, query_len=200),
    Row(17, query_len=17),
    Row(8000),
]
MODERATE_DECODE = [Row(n) for n in (700, 1, 0, 2049, 16, 333)]
MODERATE_PREFILL = [Row(700, query_len=300), Row(1500), Row(64, query_len=64), Row(2049)]


def _spec(shape: HeadShape) -> AttentionSpec:
    return AttentionSpec(
        device_type="cuda",
        compute_capability=torch.cuda.get_device_capability(),
        dtype=shape.dtype,
        head_size=shape.head_dim,
        num_heads=shape.num_heads,
        num_kv_heads=shape.num_kv_heads,
        block_size=BLOCK,
        cuda_graphs=True,
    )


def _backend(variant: str, shape: HeadShape) -> FlashInferBackend:
    spec = _spec(shape)
    reasons = CLASSES.get(variant, FlashInferXQABackend).unsupported_reasons(spec)
    if reasons:
        pytest.skip(f"{variant} declares it cannot serve {shape}: {'; '.join(reasons)}")
    return VARIANTS[variant](spec)


def _check(batch: Batch, out: torch.Tensor, shape: HeadShape) -> None:
    torch.testing.assert_close(out.double().cpu(), dense_reference(batch), **tolerance(shape.dtype))
    expected = TorchAttentionBackend(_spec(shape)).forward(
        batch.q, batch.k, batch.v, batch.kv, batch.layer, batch.metadata
    )
    torch.testing.assert_close(out, expected, **tolerance(shape.dtype))


@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize("rows", [DECODE_ROWS, PREFILL_ROWS], ids=["decode", "prefill"])
def test_ouro_shape(variant: str, rows: list[Row]) -> None:
    batch = build_batch(rows, OURO, DEVICE, block_size=BLOCK, seed=1)
    assert batch.kv.num_pages > 128
    _check(batch, run_backend(_backend(variant, OURO), batch), OURO)


def _fits(rows: list[Row]) -> bool:
    return all(
        row.prefix_pages * BLOCK <= row.seq_len - row.query_len for row in rows if row.prefix
    )


NAMED = {name: rows for name, rows in {**DECODE_SPECS, **PREFILL_SPECS}.items() if _fits(rows)}


@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize("spec", sorted(NAMED))
def test_named_batches(variant: str, spec: str) -> None:
    """Padding and length-1 rows, page boundaries, one request at several loops (planes)."""
    batch = build_batch(NAMED[spec], SMALL, DEVICE, block_size=BLOCK, seed=3)
    _check(batch, run_backend(_backend(variant, SMALL), batch), SMALL)


# More FlashInfer modules to build (about a minute of nvcc each on the H200): run when asked
# (scripts/gpu_flashinfer.sh with EXTENDED=1; `-k "not extended"` leaves them out).
EXTENDED_SHAPES = [
    HeadShape(32, 8, 128, torch.bfloat16),  # GQA 4
    HeadShape(32, 4, 128, torch.bfloat16),  # GQA 8 (FA2: tensor cores by default)
    HeadShape(8, 8, 64, torch.bfloat16),
    HeadShape(4, 2, 64, torch.bfloat16),
    HeadShape(16, 16, 128, torch.float16),  # FA2 only
]


@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize("shape", EXTENDED_SHAPES, ids=str)
@pytest.mark.parametrize("rows", [MODERATE_DECODE, MODERATE_PREFILL], ids=["decode", "prefill"])
def test_extended_shapes(variant: str, shape: HeadShape, rows: list[Row]) -> None:
    batch = build_batch(rows, shape, DEVICE, block_size=BLOCK, seed=2)
    _check(batch, run_backend(_backend(variant, shape), batch), shape)


def _wider(metadata: AttentionMetadata, width: int) -> AttentionMetadata:
    """The same pass with its page table padded (null page) to `width` columns."""
    table = metadata.page_table
    padded = torch.full((table.shape[0], width), NULL_PAGE, dtype=table.dtype, device=DEVICE)
    padded[:, : table.shape[1]] = table
    return dataclasses.replace(metadata, page_table=padded)


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_decode_is_bitwise_batch_and_plan_invariant(variant: str) -> None:
    """A row alone (its own plan, a narrow page table) and inside a batch of 32 (another plan,
    another width bucket) gives the same bits; so does the batch under a 4x wider plan."""
    lengths = torch.randint(1, 8193, (32,), generator=torch.Generator().manual_seed(0)).tolist()
    lengths[5], lengths[9] = 1, 0
    batch = build_batch([Row(n) for n in lengths], OURO, DEVICE, block_size=BLOCK, seed=3)
    backend = _backend(variant, OURO)
    together = run_backend(backend, batch)
    for index in (0, 5, 7, 9, 31):
        metadata, tokens = decode_subset(batch, [index])
        alone = run_backend(backend, batch, metadata, tokens)
        assert torch.equal(together[tokens], alone), f"row {index} ({lengths[index]} tokens)"
    wide = _wider(batch.metadata, 4 * batch.metadata.page_table.shape[1])
    assert torch.equal(run_backend(backend, batch, wide), together)
    torch.testing.assert_close(
        together.double().cpu(), dense_reference(batch), **tolerance(OURO.dtype)
    )


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_cuda_graph_replay_equals_eager(variant: str) -> None:
    """The step captures `prepare` (the page-list refill) and the layer; a replay over new
    lengths, permuted rows and new slots gives the eager bits."""
    rows = [Row(n) for n in (8000, 3000, 17, 0, 1, 4096, 640, 2)]
    batch = build_batch(rows, OURO, DEVICE, block_size=BLOCK, seed=4)
    backend = _backend(variant, OURO)
    static = replay_metadata(
        batch, list(range(len(rows))), [row.seq_len for row in rows], host_lengths=False
    )
    out = torch.empty_like(batch.q)

    def step() -> None:
        backend.prepare(static)
        backend.forward_into(batch.q, batch.k, batch.v, batch.kv, batch.layer, static, out)

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # the eager warm-up makes the plan, loads the kernels
        step()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    replay = replay_metadata(
        batch, [5, 0, 3, 1, 7, 2, 6, 4], [4000, 7999, 0, 2900, 1, 16, 600, 1], host_lengths=False
    )
    for name in ("seq_lens", "page_table", "slot_mapping"):
        getattr(static, name).copy_(getattr(replay, name))
    out.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    eager = run_backend(_backend(variant, OURO), batch, replay)
    assert torch.equal(out, eager)
    assert not out.isnan().any()


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_steady_state_decode_never_waits_for_the_device(variant: str) -> None:
    """After warm-up, decode passes (a new metadata each, as every step makes) do not
    synchronise: torch's sync debug mode raises on any torch-side sync, and the host finishes
    issuing them while the GPU is still busy with a long sleep queued before them (which also
    catches a sync inside FlashInfer). Alternating row counts change the plan bucket."""
    small = build_batch([Row(n) for n in (900, 1, 0, 77)], OURO, DEVICE, block_size=BLOCK)
    large = build_batch([Row(n) for n in range(1, 4000, 125)], OURO, DEVICE, block_size=BLOCK)
    backend = _backend(variant, OURO)
    passes = [small, large, small, large, small]
    metadata = [dataclasses.replace(batch.metadata, seq_lens_host=None) for batch in passes]
    outs = [torch.empty_like(batch.q) for batch in passes]
    expected = [
        run_backend(backend, small),
        run_backend(backend, large),
    ]  # warm-up: plans and kernels
    busy = torch.cuda.Event()
    torch.cuda._sleep(2_000_000_000)  # about a second of GPU time
    busy.record()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for batch, meta, out in zip(passes, metadata, outs, strict=True):
            backend.forward_into(batch.q, batch.k, batch.v, batch.kv, batch.layer, meta, out)
        host_ran_ahead = not busy.query()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()
    assert host_ran_ahead, "a decode pass waited for the GPU"
    for index, out in enumerate(outs):
        assert torch.equal(out, expected[index % 2])


@pytest.mark.parametrize("variant", ["fa2-cuda_core", "fa2-tensor_core"])
@pytest.mark.parametrize("rows", [MODERATE_DECODE, MODERATE_PREFILL], ids=["decode", "prefill"])
def test_fa2_fp8_cache_agrees_with_the_torch_backend(variant: str, rows: list[Row]) -> None:
    """An fp8 cache with per-layer K and V scales: FA2 stores the torch backend's bits, and reads
    them (FlashInfer's fp8 decode and prefill, the scales on the scores and the output) to within
    bf16 rounding of the torch backend's reading (stored times scale, rounded to bf16)."""
    batch = build_batch(rows, OURO, DEVICE, block_size=BLOCK, seed=5)
    scales = torch.tensor([[1.0, 1.0], [0.01, 0.02]])  # batch.layer is 1
    kv = fp8_storage(batch, KVScales(scales, "calculated"))
    before = kv.cache.clone()
    spec8 = dataclasses.replace(_spec(OURO), kv_dtype=FP8)
    assert not FlashInferFA2Backend.unsupported_reasons(spec8)
    fp8_batch = dataclasses.replace(batch, kv=kv)
    expected = TorchAttentionBackend(spec8).forward(
        batch.q, batch.k, batch.v, kv, batch.layer, batch.metadata
    )
    expected_cache = kv.cache.clone()
    kv.cache.copy_(before)
    out = run_backend(VARIANTS[variant](spec8), fp8_batch)
    torch.testing.assert_close(out, expected, **tolerance(OURO.dtype))
    keep = torch.ones(kv.num_pages, dtype=torch.bool)
    keep[NULL_PAGE] = False
    assert torch.equal(
        kv.cache[:, :, keep].view(torch.uint8), expected_cache[:, :, keep].view(torch.uint8)
    )
