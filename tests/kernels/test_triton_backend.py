"""The Triton backend end to end (write + attend) against the torch backend, and its selection."""

from __future__ import annotations

import dataclasses
import importlib.util
import subprocess
import sys
from typing import Any

import pytest
import torch

from loopserve.attention.base import AttentionSpec
from loopserve.attention.registry import (
    ATTENTION_BACKENDS,
    AUTO_ORDER,
    BackendUnavailableError,
    select_backend,
)
from loopserve.attention.torch_backend import TorchAttentionBackend
from loopserve.attention.triton_backend import TritonAttentionBackend
from loopserve.kernels import paged_prefill
from loopserve.kv.pages import NULL_PAGE
from loopserve.kv.storage import FP8, KVScales

from .batch_specs import (
    DECODE_SPECS,
    PREFILL_SPECS,
    Batch,
    HeadShape,
    build_batch,
    decode_subset,
    dense_reference,
    fp8_storage,
    tolerance,
)

SHAPES = [HeadShape(4, 2, 32, torch.float32), HeadShape(2, 2, 64, torch.bfloat16)]
SPECS = {**DECODE_SPECS, **PREFILL_SPECS}


def _spec(shape: HeadShape, device_type: str, block_size: int = 8) -> AttentionSpec:
    return AttentionSpec(
        device_type=device_type,
        compute_capability=(9, 0) if device_type == "cuda" else None,
        dtype=shape.dtype,
        head_size=shape.head_dim,
        num_heads=shape.num_heads,
        num_kv_heads=shape.num_kv_heads,
        block_size=block_size,
        cuda_graphs=device_type == "cuda",
    )


def _run_triton(batch: Batch, backend: TritonAttentionBackend) -> torch.Tensor:
    out = torch.full_like(batch.q, float("nan"))  # every row must be written
    backend.forward_into(batch.q, batch.k, batch.v, batch.kv, batch.layer, batch.metadata, out)
    return out


def _without_null_page(cache: torch.Tensor) -> torch.Tensor:
    keep = torch.ones(cache.shape[2], dtype=torch.bool, device=cache.device)
    keep[NULL_PAGE] = False
    return cache[:, :, keep]


# Every spec in fp32; in bf16 the specs that mix decode, padding and prompt rows.
BF16_SPECS = ("padding_rows", "planes", "packed_mixed", "shared_prefix_chunks", "tiny_segments")
CASES = [(spec, SHAPES[0]) for spec in sorted(SPECS)] + [(spec, SHAPES[1]) for spec in BF16_SPECS]


@pytest.mark.parametrize(("spec", "shape"), CASES, ids=[f"{s}-{h}" for s, h in CASES])
def test_backend_matches_torch_backend(spec: str, shape: HeadShape, device: torch.device) -> None:
    batch = build_batch(SPECS[spec], shape, device, seed=3)
    before = batch.kv.cache.clone()
    attention_spec = _spec(shape, device.type)
    expected = TorchAttentionBackend(attention_spec).forward(
        batch.q, batch.k, batch.v, batch.kv, batch.layer, batch.metadata
    )
    expected_cache = batch.kv.cache.clone()
    batch.kv.cache.copy_(before)
    out = _run_triton(batch, TritonAttentionBackend(attention_spec))
    torch.testing.assert_close(out, expected, **tolerance(shape.dtype))
    torch.testing.assert_close(out.double().cpu(), dense_reference(batch), **tolerance(shape.dtype))
    torch.testing.assert_close(
        _without_null_page(batch.kv.cache),
        _without_null_page(expected_cache),
        rtol=0,
        atol=0,
        equal_nan=True,
    )


FP8_CASES = [
    (spec, shape)
    for spec in ("mixed_lengths", "padding_rows", "planes", "packed_mixed", "tiny_segments")
    for shape in SHAPES
]


@pytest.mark.parametrize(("spec", "shape"), FP8_CASES, ids=[f"{s}-{h}" for s, h in FP8_CASES])
def test_fp8_cache_matches_torch_backend(spec: str, shape: HeadShape, device: torch.device) -> None:
    """An fp8 KV cache (`kv_cache_dtype="fp8"`): the new K/V are stored with the same bits as
    the torch backend stores them (saturating at +-448; some of this batch's values are scaled
    past it), and attention over the fp8 cache agrees with the torch backend's."""
    batch = build_batch(SPECS[spec], shape, device, seed=3)
    batch.k[0] *= 1000.0  # beyond fp8's range: stored as +-448 by both
    kv = fp8_storage(batch)
    before = kv.cache.clone()
    attention_spec = dataclasses.replace(_spec(shape, device.type), kv_dtype=FP8)
    fp8_batch = dataclasses.replace(batch, kv=kv)
    expected = TorchAttentionBackend(attention_spec).forward(
        batch.q, batch.k, batch.v, kv, batch.layer, batch.metadata
    )
    expected_cache = kv.cache.clone()
    kv.cache.copy_(before)
    out = _run_triton(fp8_batch, TritonAttentionBackend(attention_spec))
    # fp32: a little looser than against float64, as the saturated key's scores are in the
    # hundreds, which magnifies the two kernels' different summation orders.
    close = {"rtol": 1e-4, "atol": 1e-4} if shape.dtype == torch.float32 else tolerance(shape.dtype)
    torch.testing.assert_close(out, expected, **close)
    assert torch.equal(  # bit for bit, NaN poison included
        _without_null_page(kv.cache).view(torch.uint8),
        _without_null_page(expected_cache).view(torch.uint8),
    )
    assert (expected_cache.float().abs() == 448.0).any()


SCALED_CASES = [
    (spec, shape) for spec in ("mixed_lengths", "packed_mixed", "tiny_segments") for shape in SHAPES
]


@pytest.mark.parametrize(("spec", "shape"), SCALED_CASES, ids=[f"{s}-{h}" for s, h in SCALED_CASES])
def test_scaled_fp8_cache_matches_torch_backend(
    spec: str, shape: HeadShape, device: torch.device
) -> None:
    """An fp8 cache with per-layer K and V scales (`calculate_kv_scales` or a checkpoint's):
    the KV write (fused into decode passes too) stores the torch backend's bits, the decode and
    prefill kernels read K/V times the layer's scales as the torch backend does, and the scales
    matter (the layer's K is stored saturated past 448 x its scale, and another layer's scales
    give another output). Both decode tile paths: dots (fp32 GQA) and lanes (bf16 MHA)."""
    batch = build_batch(SPECS[spec], shape, device, seed=4)
    scales = torch.tensor([[1.0, 1.0], [0.004, 0.0123]])  # batch.layer is 1
    kv = fp8_storage(batch, KVScales(scales, "calculated"))
    before = kv.cache.clone()
    attention_spec = dataclasses.replace(_spec(shape, device.type), kv_dtype=FP8)
    fp8_batch = dataclasses.replace(batch, kv=kv)
    expected = TorchAttentionBackend(attention_spec).forward(
        batch.q, batch.k, batch.v, kv, batch.layer, batch.metadata
    )
    expected_cache = kv.cache.clone()
    kv.cache.copy_(before)
    out = _run_triton(fp8_batch, TritonAttentionBackend(attention_spec))
    close = tolerance(shape.dtype)
    if shape.dtype == torch.bfloat16 and device.type == "cpu":
        # The interpreter truncates K/V * scale to bf16 where the torch backend (and a GPU)
        # rounds to nearest (tests/kernels/test_kv_write.py): a bias of up to a bf16 step.
        close = {"rtol": 3e-2, "atol": 3e-2}
    torch.testing.assert_close(out, expected, **close)
    assert torch.equal(
        _without_null_page(kv.cache).view(torch.uint8),
        _without_null_page(expected_cache).view(torch.uint8),
    )
    assert (expected_cache[batch.layer, 0].float().abs() == 448.0).any()
    kv.cache.copy_(before)
    kv.set_scales(KVScales(scales.flip(0), "calculated"))  # layer 0's scales on layer 1
    other = _run_triton(fp8_batch, TritonAttentionBackend(attention_spec))
    assert not torch.allclose(other.float(), out.float(), **close)


def test_unit_scales_are_read_without_the_multiply_and_give_the_same_bits(
    device: torch.device, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With both layer scales 1 (the default), which the backend knows from the host's copy,
    the decode lanes only widen fp8 K/V (`kernels.kv_write.read_wide`); told otherwise (the
    device's scales still 1), they multiply by 1 and round to bf16 first: the same bits."""
    shape = SHAPES[1]  # bf16 MHA: the lanes path
    batch = build_batch(SPECS["mixed_lengths"], shape, device, seed=5)
    kv = fp8_storage(batch)
    before = kv.cache.clone()
    attention_spec = dataclasses.replace(_spec(shape, device.type), kv_dtype=FP8)
    fp8_batch = dataclasses.replace(batch, kv=kv)
    unit = _run_triton(fp8_batch, TritonAttentionBackend(attention_spec))
    kv.cache.copy_(before)
    monkeypatch.setattr(kv, "scale_values", lambda layer: (1.0, 1.0 + 2**-20))
    scaled = _run_triton(fp8_batch, TritonAttentionBackend(attention_spec))
    assert not unit.isnan().any() and torch.equal(unit, scaled)


def test_decode_row_is_the_same_next_to_prompt_chunks(device: torch.device) -> None:
    """Decode rows give the same bits in a mixed pass and in a decode-only pass."""
    shape = SHAPES[1]
    batch = build_batch(PREFILL_SPECS["packed_mixed"], shape, device, seed=5)
    backend = TritonAttentionBackend(_spec(shape, device.type))
    out_mixed = _run_triton(batch, backend)
    indices = [i for i, row in enumerate(batch.rows) if row.query_len == 1]
    metadata, tokens = decode_subset(batch, indices)
    out_alone = torch.full_like(batch.q[tokens], float("nan"))
    q, k, v = batch.q[tokens], batch.k[tokens], batch.v[tokens]
    backend.forward_into(q, k, v, batch.kv, batch.layer, metadata, out_alone)
    assert torch.equal(out_mixed[tokens], out_alone)
    assert not out_alone.isnan().any()


@pytest.mark.parametrize("spec", ["decode", "mixed"])
def test_forward_allocates_its_output(spec: str, device: torch.device) -> None:
    shape = SHAPES[0]
    rows = DECODE_SPECS["padding_rows"] if spec == "decode" else PREFILL_SPECS["packed_mixed"]
    batch = build_batch(rows, shape, device)
    backend = TritonAttentionBackend(_spec(shape, device.type))
    out = backend.forward(batch.q, batch.k, batch.v, batch.kv, batch.layer, batch.metadata)
    torch.testing.assert_close(out.double().cpu(), dense_reference(batch), **tolerance(shape.dtype))


def test_decode_needs_no_host_lengths(device: torch.device) -> None:
    """The device-resident (graph-captured) decode step passes no host copies."""
    shape = SHAPES[0]
    batch = build_batch(DECODE_SPECS["padding_rows"], shape, device)
    batch.metadata.query_start_host = None
    batch.metadata.seq_lens_host = None
    out = _run_triton(batch, TritonAttentionBackend(_spec(shape, device.type)))
    torch.testing.assert_close(out.double().cpu(), dense_reference(batch), **tolerance(shape.dtype))
    prompt = build_batch(PREFILL_SPECS["packed_mixed"], shape, device)
    prompt.metadata.seq_lens_host = None
    with pytest.raises(ValueError, match="host"):
        _run_triton(prompt, TritonAttentionBackend(_spec(shape, device.type)))


def test_prepare_builds_the_tile_map_once_per_metadata(
    device: torch.device, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls = []
    original = paged_prefill.build_tile_map

    def counting(*args: Any) -> list[tuple[int, int]]:
        calls.append(args)
        return original(*args)

    monkeypatch.setattr(paged_prefill, "build_tile_map", counting)
    shape = SHAPES[0]
    batch = build_batch(PREFILL_SPECS["packed_mixed"], shape, device)
    backend = TritonAttentionBackend(_spec(shape, device.type))
    backend.prepare(batch.metadata)
    for _ in range(3):  # three layers of one pass
        _run_triton(batch, backend)
    assert len(calls) == 1


def test_registered_before_torch() -> None:
    assert "triton" in ATTENTION_BACKENDS
    assert AUTO_ORDER.index("triton") < AUTO_ORDER.index("torch")


def test_auto_on_cpu_picks_torch_unless_interpreting(monkeypatch: pytest.MonkeyPatch) -> None:
    spec = _spec(SHAPES[0], "cpu")
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    assert select_backend("auto", spec).backend is TorchAttentionBackend
    with pytest.raises(BackendUnavailableError, match="runs on"):
        select_backend("triton", spec)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert select_backend("auto", spec).backend is TritonAttentionBackend


def test_capability_reasons(monkeypatch: pytest.MonkeyPatch) -> None:
    spec = _spec(SHAPES[1], "cuda")
    assert TritonAttentionBackend.unsupported_reasons(spec) == []
    odd = dataclasses.replace(spec, head_size=48, num_heads=6, num_kv_heads=4)
    reasons = " ".join(TritonAttentionBackend.unsupported_reasons(odd))
    assert "head size 48" in reasons and "not a multiple of 4" in reasons
    old = dataclasses.replace(spec, compute_capability=(7, 5))
    assert TritonAttentionBackend.unsupported_reasons(old) != []
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name: None if name == "triton" else find_spec(name)
    )
    assert "triton is not installed" in " ".join(TritonAttentionBackend.unsupported_reasons(spec))


def test_importing_the_backend_does_not_import_triton() -> None:
    code = (
        "import sys, loopserve, loopserve.attention.registry, loopserve.kernels\n"
        "import loopserve.attention.triton_backend\n"
        "assert 'triton' not in sys.modules, 'triton was imported'\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
