"""The FlashInfer backends' glue on a CPU, against the float64 reference over the named batch specs:
the fake flashinfer module (tests/fake_flashinfer.py) computes attention from exactly what the
real kernels would read (the page lists, dense tables and lengths the backends hand over), so a
wrong page list, length, scale, KV write or token range fails here. Also: decode passes read no
device tensor on the host, plan once per (rows, width bucket), and reject a split or substituted
kernel. FlashInfer's numerics are tested on a GPU (test_flashinfer_gpu.py)."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
import torch

from loopserve.attention.base import AttentionSpec
from loopserve.attention.flashinfer.backend import FlashInferBackend
from loopserve.attention.flashinfer.fa2 import FlashInferFA2Backend
from loopserve.attention.flashinfer.plan_cache import PlanKey
from loopserve.attention.flashinfer.prefill import KernelMismatchError
from loopserve.attention.flashinfer.xqa import FlashInferXQABackend
from loopserve.attention.torch_backend import TorchAttentionBackend
from loopserve.kv.metadata import AttentionMetadata
from loopserve.kv.pages import NULL_PAGE
from loopserve.kv.storage import FP8, KVScales
from tests import fake_flashinfer
from tests.fake_flashinfer import DeviceOnly

from .batch_specs import (
    DECODE_SPECS,
    PREFILL_SPECS,
    Batch,
    HeadShape,
    Row,
    build_batch,
    dense_reference,
    fp8_storage,
    tolerance,
)

SPECS = {**DECODE_SPECS, **PREFILL_SPECS}
GQA = HeadShape(4, 2, 32, torch.float32)
MHA = HeadShape(2, 2, 32, torch.float32)
# (backend, FA2 decode kernel, page size)
VARIANTS = [
    ("fa2-cuda_core", 8),
    ("fa2-tensor_core", 8),
    ("xqa", 16),
]


@pytest.fixture
def calls(monkeypatch: pytest.MonkeyPatch) -> fake_flashinfer.Calls:
    return fake_flashinfer.install(monkeypatch)


def _spec(shape: HeadShape, block_size: int) -> AttentionSpec:
    return AttentionSpec(
        device_type="cpu",
        compute_capability=None,
        dtype=shape.dtype,
        head_size=shape.head_dim,
        num_heads=shape.num_heads,
        num_kv_heads=shape.num_kv_heads,
        block_size=block_size,
        cuda_graphs=False,
    )


def _backend(variant: str, shape: HeadShape, block_size: int) -> FlashInferBackend:
    spec = _spec(shape, block_size)
    if variant == "xqa":
        return FlashInferXQABackend(spec)
    return FlashInferFA2Backend(spec, decode_kernel=variant.removeprefix("fa2-"))  # type: ignore[arg-type]


def _run(
    backend: FlashInferBackend, batch: Batch, metadata: AttentionMetadata | None = None
) -> torch.Tensor:
    out = torch.full_like(batch.q, float("nan"))  # every row must be written
    metadata = metadata or batch.metadata
    backend.forward_into(batch.q, batch.k, batch.v, batch.kv, batch.layer, metadata, out)
    return out


def _without_null_page(cache: torch.Tensor) -> torch.Tensor:
    keep = torch.ones(cache.shape[2], dtype=torch.bool)
    keep[NULL_PAGE] = False
    return cache[:, :, keep]


def _fits(rows: list[Row], block: int) -> bool:
    """The specs' shared prefixes are whole pages of block 8; some do not fit block 16."""
    shared = [row for row in rows if row.prefix is not None]
    return all(row.prefix_pages * block <= row.seq_len - row.query_len for row in shared)


CASES = [
    (variant, block, spec, shape)
    for variant, block in VARIANTS
    for spec in sorted(SPECS)
    for shape in (GQA, MHA)
    if _fits(SPECS[spec], block)
]


@pytest.mark.parametrize(
    ("variant", "block", "spec", "shape"),
    CASES,
    ids=[f"{v}-{s}-{h}" for v, _, s, h in CASES],
)
def test_matches_the_reference(
    calls: fake_flashinfer.Calls, variant: str, block: int, spec: str, shape: HeadShape
) -> None:
    batch = build_batch(SPECS[spec], shape, "cpu", block_size=block, seed=3)
    before = batch.kv.cache.clone()
    torch_spec = _spec(shape, block)
    TorchAttentionBackend(torch_spec).forward(
        batch.q, batch.k, batch.v, batch.kv, batch.layer, batch.metadata
    )
    expected_cache = batch.kv.cache.clone()
    batch.kv.cache.copy_(before)
    out = _run(_backend(variant, shape, block), batch)
    torch.testing.assert_close(out.double(), dense_reference(batch), **tolerance(shape.dtype))
    torch.testing.assert_close(
        _without_null_page(batch.kv.cache),
        _without_null_page(expected_cache),
        rtol=0,
        atol=0,
        equal_nan=True,
    )
    decode = batch.metadata.is_decode
    kernels = {entry for entry, _ in calls.log}
    assert ("prefill_run" in kernels) != decode
    assert ("xqa" in kernels or "decode_run" in kernels) == decode


def _device_only(metadata: AttentionMetadata) -> AttentionMetadata:
    """The decode step's metadata: no host lists, and any host read of its tensors fails."""
    return dataclasses.replace(
        metadata,
        query_start=metadata.query_start.as_subclass(DeviceOnly),
        seq_lens=metadata.seq_lens.as_subclass(DeviceOnly),
        page_table=metadata.page_table.as_subclass(DeviceOnly),
        slot_mapping=metadata.slot_mapping.as_subclass(DeviceOnly),
        query_start_host=None,
        seq_lens_host=None,
    )


@pytest.mark.parametrize(("variant", "block"), VARIANTS, ids=[v for v, _ in VARIANTS])
def test_decode_reads_nothing_on_the_host(
    calls: fake_flashinfer.Calls, variant: str, block: int
) -> None:
    batch = build_batch(DECODE_SPECS["padding_rows"], GQA, "cpu", block_size=block)
    out = _run(_backend(variant, GQA, block), batch, _device_only(batch.metadata))
    torch.testing.assert_close(out.double(), dense_reference(batch), **tolerance(GQA.dtype))
    for plan in calls.named("decode_plan"):  # made from host dummies, never from the lengths
        assert plan["devices"]["indptr"] == plan["devices"]["last_page_len"] == "cpu"
        assert plan["disable_split_kv"] is True and plan["non_blocking"] is True


def test_the_host_read_guard_can_fail(calls: fake_flashinfer.Calls) -> None:
    metadata = _device_only(build_batch([Row(5)], GQA, "cpu").metadata)
    with pytest.raises(AssertionError, match="host read"):
        metadata.seq_lens.tolist()
    with pytest.raises(AssertionError, match="host read"):
        (metadata.seq_lens + 1).max().item()
    with pytest.raises(AssertionError, match="host read"):
        metadata.page_table.to("cpu")


def _decode_metadata(batch: Batch, width: int) -> AttentionMetadata:
    """The batch's decode metadata with its page table padded (null page) to `width` columns."""
    table = batch.metadata.page_table
    padded = torch.full((table.shape[0], width), NULL_PAGE, dtype=torch.int32)
    padded[:, : table.shape[1]] = table
    return dataclasses.replace(batch.metadata, page_table=padded)


def test_fa2_plans_once_per_rows_and_width_bucket(calls: fake_flashinfer.Calls) -> None:
    batch = build_batch(DECODE_SPECS["mixed_lengths"], GQA, "cpu")  # 6 rows, 19 table columns
    backend = FlashInferFA2Backend(_spec(GQA, 8))
    reference = dense_reference(batch).to(torch.float32)
    assert batch.metadata.page_table.shape[1] == 19
    for width in (19, 20, 32, 32, 33):  # buckets 32, 32, 32, 32, 64
        metadata = _decode_metadata(batch, width)
        for _ in range(2):  # every layer of a pass, and the next step
            out = _run(backend, batch, metadata)
            torch.testing.assert_close(out, reference, **tolerance(GQA.dtype))
            metadata = dataclasses.replace(metadata)  # a new pass, equal contents
    assert backend.plans.keys == [PlanKey(6, 32), PlanKey(6, 64)]
    assert len(calls.named("decode_plan")) == 2
    assert len(calls.named("decode_run")) == 10


@pytest.mark.parametrize("change", ["split", "cudnn", "tensor_cores"])
def test_fa2_rejects_a_plan_other_than_the_one_asked_for(
    calls: fake_flashinfer.Calls, monkeypatch: pytest.MonkeyPatch, change: str
) -> None:
    import flashinfer  # the fake

    wrapper = flashinfer.BatchDecodeWithPagedKVCacheWrapper
    if change == "split":
        monkeypatch.setattr(wrapper, "split", True)
    elif change == "cudnn":
        monkeypatch.setattr(wrapper, "resolves_to", "cudnn")
    else:
        monkeypatch.setattr(wrapper, "use_tensor_cores", property(lambda self: True))
    batch = build_batch(DECODE_SPECS["single_row"], GQA, "cpu")
    with pytest.raises(KernelMismatchError):
        _run(FlashInferFA2Backend(_spec(GQA, 8), decode_kernel="cuda_core"), batch)


def test_fa2_cuda_core_refuses_a_wrapper_without_its_page_lists(
    calls: fake_flashinfer.Calls, monkeypatch: pytest.MonkeyPatch
) -> None:
    import flashinfer  # the fake

    wrapper = flashinfer.BatchDecodeWithPagedKVCacheWrapper
    original = wrapper.plan

    def plan_elsewhere(self: Any, *args: Any, **kwargs: Any) -> None:
        original(self, *args, **kwargs)
        self._paged_kv_indices_buf = self._paged_kv_indices_buf[:1]  # internals changed

    monkeypatch.setattr(wrapper, "plan", plan_elsewhere)
    batch = build_batch(DECODE_SPECS["single_row"], GQA, "cpu")
    with pytest.raises(KernelMismatchError, match="indices buffer"):
        _run(FlashInferFA2Backend(_spec(GQA, 8), decode_kernel="cuda_core"), batch)


def test_prefill_plans_once_per_pass_unsplit_and_checks_the_kernel(
    calls: fake_flashinfer.Calls, monkeypatch: pytest.MonkeyPatch
) -> None:
    batch = build_batch(PREFILL_SPECS["packed_mixed"], GQA, "cpu")
    backend = FlashInferXQABackend(_spec(GQA, 16))
    backend.prepare(batch.metadata)
    for _ in range(3):  # three layers
        _run(backend, batch)
    plans = calls.named("prefill_plan")
    assert len(plans) == 1 and plans[0]["disable_split_kv"] is True
    assert calls.named("prefill_init") == [{"backend": "fa2"}]  # no compute capability: FA2
    no_host = dataclasses.replace(batch.metadata, seq_lens_host=None)
    with pytest.raises(ValueError, match="host"):
        _run(backend, batch, no_host)
    import flashinfer  # the fake

    original = flashinfer.BatchPrefillWithPagedKVCacheWrapper.plan

    def substituted(self: Any, *args: Any, **kwargs: Any) -> None:
        original(self, *args, **kwargs)
        self._backend = "cudnn"

    monkeypatch.setattr(flashinfer.BatchPrefillWithPagedKVCacheWrapper, "plan", substituted)
    with pytest.raises(KernelMismatchError, match="'cudnn', not the requested 'fa2'"):
        _run(FlashInferFA2Backend(_spec(GQA, 8)), batch)


def test_xqa_gets_no_split_and_dense_inputs_and_zeroes_empty_rows(
    calls: fake_flashinfer.Calls,
) -> None:
    """One CTA per row whatever the batch (an SM count of 1 for XQA's split heuristic), and the
    NaN the kernel leaves in rows of no context (long_rows has one) replaced by zeros."""
    batch = build_batch(DECODE_SPECS["long_rows"], GQA, "cpu", block_size=16)
    backend = FlashInferXQABackend(_spec(GQA, 16))
    strided_q = torch.cat([batch.q, batch.q], dim=-1)[..., : GQA.head_dim]  # like a qkv view
    out = torch.empty_like(batch.q)
    backend.forward_into(strided_q, batch.k, batch.v, batch.kv, batch.layer, batch.metadata, out)
    torch.testing.assert_close(out.double(), dense_reference(batch), **tolerance(GQA.dtype))
    assert [call["sm_count"] for call in calls.named("xqa")] == [1]
    assert not out.isnan().any()


FP8_CASES = [
    (variant, spec)
    for variant in ("fa2-cuda_core", "fa2-tensor_core")
    for spec in ("mixed_lengths", "padding_rows", "packed_mixed", "tiny_segments")
]


@pytest.mark.parametrize(("variant", "spec"), FP8_CASES, ids=[f"{v}-{s}" for v, s in FP8_CASES])
def test_fa2_writes_and_reads_an_fp8_cache_as_the_torch_backend(
    calls: fake_flashinfer.Calls, variant: str, spec: str
) -> None:
    """An fp8 cache with per-layer K and V scales: FA2 stores the torch backend's bits, plans
    with an fp8 KV dtype, and runs (decode and prefill) with the layer's scales, None where 1;
    its output agrees with the torch backend's reading of the same cache."""
    batch = build_batch(SPECS[spec], GQA, "cpu", block_size=8, seed=4)
    scales = torch.tensor([[1.0, 1.0], [0.004, 0.0123]])  # batch.layer is 1
    kv = fp8_storage(batch, KVScales(scales, "calculated"))
    before = kv.cache.clone()
    spec8 = dataclasses.replace(_spec(GQA, 8), kv_dtype=FP8)
    fp8_batch = dataclasses.replace(batch, kv=kv)
    expected = TorchAttentionBackend(spec8).forward(
        batch.q, batch.k, batch.v, kv, batch.layer, batch.metadata
    )
    expected_cache = kv.cache.clone()
    kv.cache.copy_(before)
    backend = FlashInferFA2Backend(spec8, decode_kernel=variant.removeprefix("fa2-"))  # type: ignore[arg-type]
    out = _run(backend, fp8_batch)
    torch.testing.assert_close(out, expected, rtol=1e-4, atol=1e-4)
    assert torch.equal(
        _without_null_page(kv.cache).view(torch.uint8),
        _without_null_page(expected_cache).view(torch.uint8),
    )
    plans = calls.named("decode_plan") + calls.named("prefill_plan")
    assert plans and all(plan["kv_data_type"] == FP8 for plan in plans)
    runs = calls.named("decode_run") + calls.named("prefill_run")
    assert runs and all(
        run["k_scale"] == pytest.approx(0.004) and run["v_scale"] == pytest.approx(0.0123)
        for run in runs
    )
    kv.cache.copy_(before)
    calls.log.clear()
    kv.set_scales(KVScales.unit(2))
    _run(FlashInferFA2Backend(spec8), fp8_batch)
    runs = calls.named("decode_run") + calls.named("prefill_run")
    assert all(run["k_scale"] is None and run["v_scale"] is None for run in runs)


def test_an_fp8_cache_prefills_through_fa2_on_hopper() -> None:
    """FlashInfer's FA3 reads fp8 K/V only with fp8 queries: an fp8 cache takes FA2 on SM90."""
    shape = HeadShape(4, 2, 128, torch.bfloat16)
    hopper = dataclasses.replace(_spec(shape, 16), device_type="cuda", compute_capability=(9, 0))
    assert FlashInferBackend.prefill_kernel(hopper) == "fa3"
    assert FlashInferBackend.prefill_kernel(dataclasses.replace(hopper, kv_dtype=FP8)) == "fa2"


def test_prebuild_shapes_name_an_fp8_cache() -> None:
    from loopserve.attention.flashinfer.prebuild import parse_shape

    plain = parse_shape("16,16,128,bfloat16,16", (9, 0))
    fp8 = parse_shape("16,16,128,bfloat16,16,float8_e4m3fn", (9, 0))
    assert plain.cache_dtype == torch.bfloat16 and fp8.cache_dtype == FP8
    assert dataclasses.replace(fp8, kv_dtype=None) == plain
