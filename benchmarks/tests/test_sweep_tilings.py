"""Every tiling the decode sweep can launch is correct and batch-invariant, so whichever it picks
can become a default: on the CPU at small shapes (the interpreter ignores warps and stages, so
tilings differing only in those, or only in partitions longer than every test row, run once), and
on a GPU at Ouro's shape (`-m gpu`)."""

from __future__ import annotations

import pytest
import torch

from benchmarks.decode_sweep import TILING_CANDIDATES
from loopserve.kernels.decode_plan import DecodeTiling
from tests.kernels.batch_specs import Row, build_batch
from tests.kernels.test_kernels_gpu import OURO, check_tiling, ouro_decode_batch
from tests.kernels.test_paged_decode import GQA, MHA_FP32, assert_matches, decode

__all__ = ["ouro_decode_batch"]  # the GPU test's fixture


def _partition_sizes(tiling: DecodeTiling, seq_len: int) -> tuple[int, ...]:
    """The sizes of a row's partitions under `tiling` (the kernel's `partition_doublings`)."""
    doublings = 0
    while (tiling.partition_min * tiling.max_partitions << doublings) < seq_len:
        doublings += 1
    size = tiling.partition_min << doublings
    return tuple(min(size, seq_len - start) for start in range(0, seq_len, size))


def _result_tilings() -> list[DecodeTiling]:
    """The sweep's tilings, deduplicated on what the interpreter runs: not warps or stages, and
    not partition sizes beyond the rows (p512 and p1024 both leave every row of SWEEP_ROWS one
    partition, its tiles and workspace alike: p1024 ran p512's work again, 3.5 s)."""
    seen: dict[tuple, DecodeTiling] = {}
    for tiling in TILING_CANDIDATES.values():
        key = (tiling.tensor_cores, tiling.heads_per_program, tiling.block_n)
        key += tuple(_partition_sizes(tiling, row.seq_len) for row in SWEEP_ROWS)
        key += (tiling.partitions_bound(_SWEEP_CONTEXT),)
        seen.setdefault(key, tiling)
    return list(seen.values())


SWEEP_ROWS = [Row(300), Row(129), Row(1), Row(0), Row(64)]
_SWEEP_CONTEXT = 320  # build_batch's page table: 38 pages of 8 for 300 tokens, 2 spare columns


@pytest.mark.parametrize("tiling", _result_tilings(), ids=str)
def test_sweep_tilings(tiling: DecodeTiling, device: torch.device) -> None:
    """Every tiling the sweep launches (its Ouro head count scaled to a CPU shape): correct with
    the fold in the kernel, separate, or by the last program, bitwise equal across them."""
    shape = GQA if tiling.tensor_cores else MHA_FP32
    batch = build_batch(SWEEP_ROWS, shape, device, seed=11)
    fused = decode(batch, tiling, splits=1, fused_write=True)
    assert_matches(fused, batch, shape.dtype)
    split = decode(batch, tiling, splits=2)  # the K/V are in the cache now
    assert torch.equal(fused, split)
    assert torch.equal(fused, decode(batch, tiling, splits=3, last_combines=True))


@pytest.mark.parametrize("name", sorted(TILING_CANDIDATES))
@pytest.mark.gpu
def test_sweep_tiling_at_ouro_shape(name: str, ouro_decode_batch) -> None:
    """The separate-write kernel variant only for the two paths' defaults (compile time)."""
    batch, expected = ouro_decode_batch
    separate_write = name in ("lanes-n32-w4-s3", "dots-n64-w4-s3")
    check_tiling(batch, expected, OURO, TILING_CANDIDATES[name], separate_write)
