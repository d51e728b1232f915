"""The FlashInfer backends' host-side machinery on a CPU: the decode plan cache (bounds, keys,
pinning), the device page lists filled from device lengths, and the prompt pass's host lists."""

from __future__ import annotations

import pytest
import torch

from loopserve.attention.flashinfer.csr import DecodeCSR, gather_pages, prefill_layout
from loopserve.attention.flashinfer.plan_cache import (
    PlanCache,
    PlanCacheError,
    PlanKey,
    plan_key,
    width_bucket,
)
from loopserve.kv.pages import NULL_PAGE


def test_width_buckets_are_powers_of_two() -> None:
    assert [width_bucket(w) for w in (0, 1, 2, 3, 4, 5, 8, 9, 17, 512, 513)] == [
        1, 1, 2, 4, 4, 8, 8, 16, 32, 512, 1024,
    ]  # fmt: skip
    assert plan_key(32, 5) == plan_key(32, 8) == PlanKey(32, 8)
    assert plan_key(32, 9) != plan_key(32, 8) and plan_key(16, 8) != plan_key(32, 8)


def _cache(capacity: int) -> tuple[PlanCache[str], list[PlanKey]]:
    made: list[PlanKey] = []
    return PlanCache(capacity), made


def _get(cache: PlanCache[str], made: list[PlanKey], key: PlanKey, capturing: bool = False) -> str:
    def create() -> str:
        made.append(key)
        return f"plan{len(made)}"

    return cache.get(key, create, capturing=capturing)


def test_plans_are_made_once_per_key_and_evicted_least_recent_first() -> None:
    cache, made = _cache(capacity=2)
    a, b, c = PlanKey(1, 8), PlanKey(8, 8), PlanKey(32, 8)
    assert _get(cache, made, a) == _get(cache, made, a) == "plan1"
    _get(cache, made, b)
    _get(cache, made, a)  # a is now the most recent
    _get(cache, made, c)  # evicts b
    assert cache.keys == [a, c] and len(cache) == 2
    _get(cache, made, b)  # made again
    assert made == [a, b, c, b]
    assert cache.keys == [c, b]


def test_captured_plans_are_pinned_and_never_evicted() -> None:
    cache, made = _cache(capacity=2)
    keys = [PlanKey(rows, 8) for rows in (1, 2, 4, 8)]
    for key in keys[:2]:
        _get(cache, made, key)  # the eager warm-up makes the plan
        _get(cache, made, key, capturing=True)  # the capture finds and pins it
    assert cache.pinned == frozenset(keys[:2])
    _get(cache, made, keys[2])  # over capacity, but every other plan is pinned: the cache grows
    _get(cache, made, keys[3])  # evicts keys[2], the only unpinned plan
    assert cache.keys == [keys[0], keys[1], keys[3]]
    assert made == keys


def test_no_plan_is_made_inside_a_capture() -> None:
    cache, made = _cache(capacity=4)
    with pytest.raises(PlanCacheError, match="while capturing a CUDA graph"):
        _get(cache, made, PlanKey(8, 8), capturing=True)
    assert made == [] and len(cache) == 0
    with pytest.raises(ValueError):
        PlanCache(0)


def _expected_lists(lengths: list[int], table: torch.Tensor, block: int) -> tuple[list[int], ...]:
    indptr, indices, last = [0], [], []
    for row, length in enumerate(lengths):
        pages = -(-length // block)
        indptr.append(indptr[-1] + pages)
        indices += table[row, :pages].tolist()
        last.append(length - (pages - 1) * block)
    return indptr, indices, last


@pytest.mark.parametrize("block", [1, 8, 16])
def test_decode_page_lists_from_device_lengths(block: int) -> None:
    generator = torch.Generator().manual_seed(block)
    rows, width = 7, 6
    lengths = [0, 1, block, block + 1, width * block, 3, 0]
    table = torch.randint(1, 1000, (rows, width), generator=generator, dtype=torch.int32)
    csr = DecodeCSR.allocate(rows, 8, torch.device("cpu"))  # a wider bucket than the table
    csr.indices.fill_(-7)
    csr.fill(torch.tensor(lengths, dtype=torch.int32), table, block)
    indptr, indices, last = _expected_lists(lengths, table, block)
    assert csr.indptr.tolist() == indptr
    assert csr.indices[: indptr[-1]].tolist() == indices
    assert csr.indices[indptr[-1] : -1].eq(-7).all()  # nothing else written but the dump entry
    for row, length in enumerate(lengths):
        if length:  # empty rows' last_page_len is never read (no pages)
            assert csr.last_page_len[row] == last[row]
    # Refilled for shorter rows and a narrower table (the next step of the same plan).
    csr.fill(torch.ones(rows, dtype=torch.int32), table[:, :1], block)
    assert csr.indptr.tolist() == list(range(rows + 1))
    assert csr.indices[:rows].tolist() == table[:, 0].tolist()
    assert csr.last_page_len.tolist() == [1] * rows
    with pytest.raises(ValueError, match="does not fit"):
        csr.fill(torch.ones(rows, dtype=torch.int32), torch.ones(rows, 9, dtype=torch.int32), block)


def test_prefill_lists_from_host_lengths() -> None:
    # rows: a prompt of 20 (block 8), a padding row, a 2-token chunk after 14 tokens
    layout = prefill_layout([0, 20, 21, 23], [20, 0, 16], table_width=4, block_size=8)
    assert layout.qo_indptr == [0, 20, 21, 23]
    assert layout.kv_indptr == [0, 3, 4, 6]
    assert layout.last_page_len == [4, 1, 8]
    assert layout.table_positions == [0, 1, 2, -1, 8, 9]
    assert layout.empty_tokens == [20]
    table = torch.arange(12, dtype=torch.int32).reshape(3, 4) + 100
    pages = gather_pages(table, layout.table_positions)
    assert pages.tolist() == [100, 101, 102, NULL_PAGE, 108, 109]
    assert pages.dtype == torch.int32
