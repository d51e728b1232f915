"""Realistic sizes on a CUDA GPU: Ouro's shape (16 heads, 16 KV heads, head dim 128, bf16), block
16, contexts up to 8K tokens over thousands of permuted pages; other head sizes, GQA and dtypes;
batch invariance across programs-per-row; CUDA graph replay with new lengths and page tables;
every decode tiling the sweep launches, compiled (warps and stages matter here), against the
reference and bitwise across schedules, fused/separate KV write and a row alone vs in a batch.

Run with `pytest -m gpu tests/kernels` on a GPU machine (deselected by default).
"""

from __future__ import annotations

import pytest
import torch

from loopserve.attention.base import AttentionSpec
from loopserve.attention.torch_backend import TorchAttentionBackend
from loopserve.attention.triton_backend import TritonAttentionBackend
from loopserve.kernels.decode_plan import DecodeSchedule, DecodeTiling

from .batch_specs import (
    Batch,
    HeadShape,
    Row,
    build_batch,
    decode_subset,
    dense_reference,
    replay_metadata,
    run_backend,
    tolerance,
)

pytestmark = pytest.mark.gpu
DEVICE = "cuda"

OURO = HeadShape(16, 16, 128, torch.bfloat16)
NANBEIGE = HeadShape(48, 8, 128, torch.bfloat16)  # Nanbeige4.2-3B: GQA 6:1
BLOCK = 16
DECODE_ROWS = [Row(n) for n in (8192, 1, 0, 4097, 16, 2500, 8000, 777, 4096, 33, 0, 6001)]
PREFILL_ROWS = [
    Row(1024, query_len=1024),  # a whole prompt
    Row(4608, query_len=512),  # a chunk after 4096 tokens already in pages
    Row(300),
    Row(7200, query_len=200),
    Row(0),
    Row(17, query_len=17),
    Row(8000),
]
MODERATE_ROWS = [Row(700, query_len=300), Row(1500), Row(0), Row(64, query_len=64), Row(2049)]


def _backend(
    shape: HeadShape,
    tiling: DecodeTiling | None = None,
    schedule: DecodeSchedule | None = None,
) -> TritonAttentionBackend:
    spec = AttentionSpec(
        device_type="cuda",
        compute_capability=torch.cuda.get_device_capability(),
        dtype=shape.dtype,
        head_size=shape.head_dim,
        num_heads=shape.num_heads,
        num_kv_heads=shape.num_kv_heads,
        block_size=BLOCK,
        cuda_graphs=True,
    )
    assert TritonAttentionBackend.unsupported_reasons(spec) == []
    return TritonAttentionBackend(spec, decode_tiling=tiling, decode_schedule=schedule)


def _check_against_references(batch: Batch, out: torch.Tensor, shape: HeadShape) -> None:
    torch.testing.assert_close(out.double().cpu(), dense_reference(batch), **tolerance(shape.dtype))
    spec = _backend(shape).spec
    expected = TorchAttentionBackend(spec).forward(
        batch.q, batch.k, batch.v, batch.kv, batch.layer, batch.metadata
    )
    torch.testing.assert_close(out, expected, **tolerance(shape.dtype))


# Nanbeige's prompts are moderate: the CPU float64 reference of PREFILL_ROWS with 48 heads would
# take minutes.
FAMILY_CASES = [
    (DECODE_ROWS, OURO), (PREFILL_ROWS, OURO), (DECODE_ROWS, NANBEIGE), (MODERATE_ROWS, NANBEIGE),
]  # fmt: skip


@pytest.mark.parametrize(
    ("rows", "shape"),
    FAMILY_CASES,
    ids=["ouro-decode", "ouro-prefill", "nanbeige-decode", "nanbeige-prefill"],
)
def test_family_shapes(rows: list[Row], shape: HeadShape) -> None:
    batch = build_batch(rows, shape, DEVICE, block_size=BLOCK, seed=1)
    assert batch.kv.num_pages > 128
    out = run_backend(_backend(shape), batch)
    _check_against_references(batch, out, shape)


@pytest.mark.parametrize(
    "shape",
    [
        HeadShape(8, 8, 64, torch.bfloat16),
        HeadShape(8, 8, 80, torch.bfloat16),
        HeadShape(8, 8, 96, torch.bfloat16),
        HeadShape(8, 8, 256, torch.bfloat16),
        HeadShape(4, 4, 32, torch.bfloat16),
        HeadShape(32, 8, 128, torch.bfloat16),  # GQA, group 4
        HeadShape(12, 2, 128, torch.bfloat16),  # GQA, group 6 (padded heads per program)
        HeadShape(16, 16, 128, torch.float16),
        HeadShape(16, 16, 128, torch.float32),
    ],
    ids=str,
)
def test_other_shapes(shape: HeadShape) -> None:
    batch = build_batch(MODERATE_ROWS, shape, DEVICE, block_size=BLOCK, seed=2)
    out = run_backend(_backend(shape), batch)
    _check_against_references(batch, out, shape)


def test_decode_is_batch_invariant_at_scale() -> None:
    """Rows alone (many programs per row) and in a 48-row batch (one) give the same bits."""
    lengths = torch.randint(1, 8193, (48,), generator=torch.Generator().manual_seed(0)).tolist()
    batch = build_batch([Row(n) for n in lengths], OURO, DEVICE, block_size=BLOCK, seed=3)
    backend = _backend(OURO)
    together = run_backend(backend, batch)
    for index in (0, 7, 31, 47):
        metadata, tokens = decode_subset(batch, [index])
        alone = run_backend(backend, batch, metadata, tokens)
        assert torch.equal(together[tokens], alone), f"row {index} ({lengths[index]} tokens)"
    torch.testing.assert_close(
        together.double().cpu(), dense_reference(batch), **tolerance(OURO.dtype)
    )


def test_cuda_graph_replay_reads_new_lengths_and_pages() -> None:
    rows = [Row(n) for n in (8000, 3000, 17, 0, 1, 4096, 640, 2)]
    batch = build_batch(rows, OURO, DEVICE, block_size=BLOCK, seed=4)
    backend = _backend(OURO)
    static = replay_metadata(
        batch, list(range(len(rows))), [row.seq_len for row in rows], host_lengths=True
    )
    out = torch.empty_like(batch.q)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # warm up (compiles the kernels) outside the capture
        backend.forward_into(batch.q, batch.k, batch.v, batch.kv, batch.layer, static, out)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        backend.forward_into(batch.q, batch.k, batch.v, batch.kv, batch.layer, static, out)
    replay = replay_metadata(
        batch, [5, 0, 3, 1, 7, 2, 6, 4], [4000, 7999, 0, 2900, 1, 16, 600, 1], host_lengths=True
    )
    for name in ("seq_lens", "page_table", "slot_mapping"):
        getattr(static, name).copy_(getattr(replay, name))
    out.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    eager = run_backend(_backend(OURO), batch, replay)
    assert torch.equal(out, eager)
    assert not out.isnan().any()


SWEEP_ROWS = [Row(n) for n in (8192, 1, 0, 640, 4097, 129, 2048, 33, 16, 512)]
GQA = HeadShape(32, 8, 128, torch.bfloat16)
GQA_TILINGS = {
    "dots-default": DecodeTiling.for_shape(4, 128),
    "lanes-n32": DecodeTiling(tensor_cores=False, heads_per_program=1, block_n=32),
}


@pytest.fixture(scope="module")
def ouro_decode_batch() -> tuple[Batch, torch.Tensor]:
    batch = build_batch(SWEEP_ROWS, OURO, DEVICE, block_size=BLOCK, seed=6)
    return batch, dense_reference(batch)


def check_tiling(
    batch: Batch, expected: torch.Tensor, shape: HeadShape, tiling, separate_write: bool = True
) -> None:
    """Correct, and one row's bits the same under every schedule, write mode, and alone.

    The first run writes this pass's K/V itself (the slots hold NaN until then)."""
    outs = []
    schedules = [(0.0, True, False), (8.0, True, False), (4.0, True, True)]
    schedules += [(2.0, False, False)] * separate_write
    for per_sm, fused_write, last in schedules:
        backend = _backend(shape, tiling, DecodeSchedule(((1 << 30, per_sm),), fused_write, last))
        outs.append(run_backend(backend, batch))
    torch.testing.assert_close(outs[0].double().cpu(), expected, **tolerance(shape.dtype))
    for out in outs[1:]:
        assert torch.equal(out, outs[0])
    for index in (0, 3, 5):
        metadata, tokens = decode_subset(batch, [index])
        alone = run_backend(_backend(shape, tiling), batch, metadata, tokens)
        assert torch.equal(outs[0][tokens], alone), f"row {index} alone"


@pytest.mark.parametrize("name", sorted(GQA_TILINGS))
def test_gqa_tilings(name: str) -> None:
    batch = build_batch(SWEEP_ROWS[:6], GQA, DEVICE, block_size=BLOCK, seed=7)
    check_tiling(batch, dense_reference(batch), GQA, GQA_TILINGS[name])
