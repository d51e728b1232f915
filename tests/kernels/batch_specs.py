"""Named attention batches over randomly permuted, poisoned pages, and a float64 dense reference.

Owns: building a KV storage + metadata + new q/k/v for a list of rows, and the exact reference
output. Must not: use any backend code to build the reference (it reads the pages through plain
indexing of the cache as it was before the pass).

Poison: the null page, every unused page, the unused tail of every row's last page, the whole
other layer, and the slots the pass is about to write hold NaN, so a kernel that reads a slot it
should not, or fails to write one it should, produces NaN and fails the comparison.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from loopserve.kv.metadata import AttentionMetadata
from loopserve.kv.pages import NULL_PAGE
from loopserve.kv.storage import FP8, KVScales, KVStorage, to_cache_dtype


@dataclass(frozen=True, slots=True)
class Row:
    """One sequence of a pass: its context length after the pass and its new (query) tokens."""

    seq_len: int  # 0: a padding row (query_len 1, writes into the null page)
    query_len: int = 1
    prefix: str | None = None  # rows naming the same prefix share their first prefix_pages pages
    prefix_pages: int = 0


@dataclass(frozen=True, slots=True)
class HeadShape:
    num_heads: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype

    def __str__(self) -> str:
        dtype = str(self.dtype).removeprefix("torch.")
        return f"q{self.num_heads}kv{self.num_kv_heads}d{self.head_dim}-{dtype}"


# One query token per row. Block size 8 in the CPU tests.
DECODE_SPECS: dict[str, list[Row]] = {
    "single_row": [Row(37)],
    "mixed_lengths": [Row(1), Row(9), Row(64), Row(23), Row(130), Row(2)],
    "page_boundaries": [Row(7), Row(8), Row(9), Row(16), Row(17), Row(1)],
    "padding_rows": [Row(25), Row(0), Row(12), Row(0), Row(0)],
    # The same request at three loops: equal lengths, three planes (page tables) of other data.
    "planes": [Row(40), Row(40), Row(40), Row(13)],
    "shared_prefix": [Row(30, prefix="p", prefix_pages=2), Row(21, prefix="p", prefix_pages=2)],
    "long_rows": [Row(300), Row(77), Row(1), Row(0)],
}

# Prompt chunks (query_len > 1) packed with decode and padding rows.
PREFILL_SPECS: dict[str, list[Row]] = {
    "one_prompt": [Row(45, query_len=45)],
    "chunk_after_aligned_context": [Row(50, query_len=18)],
    "chunk_after_ragged_context": [Row(53, query_len=20)],
    "packed_mixed": [
        Row(40, query_len=40),
        Row(17),
        Row(0),
        Row(70, query_len=25),
        Row(5),
        Row(3, query_len=3),
    ],
    "tiny_segments": [Row(2, query_len=2), Row(1), Row(9, query_len=2), Row(33, query_len=33)],
    "shared_prefix_chunks": [
        Row(40, query_len=10, prefix="p", prefix_pages=3),
        Row(29, query_len=4, prefix="p", prefix_pages=3),
    ],
}


@dataclass(slots=True)
class Batch:
    rows: list[Row]
    kv: KVStorage
    layer: int
    metadata: AttentionMetadata
    q: torch.Tensor  # [T, Nq, D]
    k: torch.Tensor  # [T, Nkv, D] this pass's new keys
    v: torch.Tensor  # [T, Nkv, D]
    keys: list[torch.Tensor]  # per row, float64 [seq_len, Nkv, D] context after the pass,
    values: list[torch.Tensor]  # on the batch's device

    @property
    def starts(self) -> list[int]:
        """Host copy of query_start: row i's tokens are [starts[i], starts[i + 1])."""
        starts = [0]
        for row in self.rows:
            starts.append(starts[-1] + row.query_len)
        return starts


def _page_tables(
    rows: list[Row], block_size: int, extra_columns: int, generator: torch.Generator
) -> tuple[torch.Tensor, int]:
    """[S, P] int32 tables over a random permutation of pages 1.., and the number of pages."""
    needed = [-(-row.seq_len // block_size) for row in rows]
    total = sum(needed) + 3  # a few unused (poisoned) pages
    order = (torch.randperm(total, generator=generator) + 1).tolist()
    table = torch.full((len(rows), max(needed) + extra_columns), NULL_PAGE, dtype=torch.int32)
    shared: dict[str, list[int]] = {}
    for index, row in enumerate(rows):
        pages = [order.pop() for _ in range(needed[index])]
        if row.prefix is not None:
            assert row.prefix_pages * block_size <= row.seq_len - row.query_len
            prefix = shared.setdefault(row.prefix, pages[: row.prefix_pages])
            pages[: row.prefix_pages] = prefix
        table[index, : needed[index]] = torch.tensor(pages, dtype=torch.int32)
    return table, total + 1


def _poison(cache: torch.Tensor, table: torch.Tensor, rows: list[Row], layer: int) -> None:
    """cache [L, 2, pages, block, Nkv, D]: NaN everywhere no row may read before the pass."""
    block_size = cache.shape[3]
    used = torch.zeros(cache.shape[2], dtype=torch.bool)
    used[table.flatten().long()] = True
    used[NULL_PAGE] = False
    cache[:, :, (~used).to(cache.device)] = float("nan")
    cache[1 - layer] = float("nan")
    pages, offsets = [], []
    for index, row in enumerate(rows):
        end = -(-row.seq_len // block_size) * block_size  # the end of the row's last page
        for position in range(max(0, row.seq_len - row.query_len), end):
            pages.append(int(table[index, position // block_size]))
            offsets.append(position % block_size)
    page_index = torch.tensor(pages, dtype=torch.long, device=cache.device)
    offset_index = torch.tensor(offsets, dtype=torch.long, device=cache.device)
    cache[layer, :, page_index, offset_index] = float("nan")


def _slots(table: torch.Tensor, rows: list[Row], block_size: int) -> list[int]:
    slots = []
    for index, row in enumerate(rows):
        if row.seq_len == 0:  # padding: somewhere in the null page
            slots.append(NULL_PAGE * block_size + index % block_size)
            continue
        for position in range(row.seq_len - row.query_len, row.seq_len):
            page = int(table[index, position // block_size])
            slots.append(page * block_size + position % block_size)
    return slots


def _metadata(rows: list[Row], table: torch.Tensor, slots: list[int], device) -> AttentionMetadata:
    starts = [0]
    for row in rows:
        starts.append(starts[-1] + row.query_len)
    seq_lens = [row.seq_len for row in rows]
    return AttentionMetadata(
        query_start=torch.tensor(starts, dtype=torch.int32, device=device),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
        page_table=table.to(device),
        slot_mapping=torch.tensor(slots, dtype=torch.int64, device=device),
        max_query_len=max(row.query_len for row in rows),
        max_seq_len=max(seq_lens),
        query_start_host=starts,
        seq_lens_host=seq_lens,
    )


def build_batch(
    rows: list[Row],
    shape: HeadShape,
    device: torch.device | str,
    *,
    block_size: int = 8,
    seed: int = 0,
    extra_columns: int = 2,
) -> Batch:
    """A pass over `rows` on layer 1 of a two-layer storage, with poisoned pages (see module)."""
    device = torch.device(device)
    table, num_pages = _page_tables(
        rows, block_size, extra_columns, torch.Generator().manual_seed(seed)
    )
    generator = torch.Generator(device=device).manual_seed(seed)
    layer = 1
    kv = KVStorage(
        num_layers=2,
        num_pages=num_pages,
        block_size=block_size,
        num_kv_heads=shape.num_kv_heads,
        head_dim=shape.head_dim,
        dtype=shape.dtype,
        device=device,
    )
    kv.cache.normal_(generator=generator)
    _poison(kv.cache, table, rows, layer)
    slots = _slots(table, rows, block_size)

    def randn(heads: int) -> torch.Tensor:
        size = (len(slots), heads, shape.head_dim)
        return torch.randn(size, generator=generator, device=device, dtype=shape.dtype)

    q, k, v = randn(shape.num_heads), randn(shape.num_kv_heads), randn(shape.num_kv_heads)
    keys, values = _dense_contexts(kv, layer, table.to(device), rows, k, v)
    metadata = _metadata(rows, table, slots, device)
    return Batch(rows, kv, layer, metadata, q, k, v, keys, values)


def _dense_contexts(
    kv: KVStorage,
    layer: int,
    table: torch.Tensor,
    rows: list[Row],
    k: torch.Tensor,
    v: torch.Tensor,
) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Each row's float64 context after the pass: old pages, then this pass's new tokens."""
    keys, values = [], []
    start = 0
    for index, row in enumerate(rows):
        needed = -(-row.seq_len // kv.block_size)
        pages = table[index, :needed].long()
        context = row.seq_len - row.query_len
        row_keys = kv.key_cache(layer)[pages].flatten(0, 1)[: row.seq_len].double()
        row_values = kv.value_cache(layer)[pages].flatten(0, 1)[: row.seq_len].double()
        if row.seq_len:
            row_keys[context:] = k[start : start + row.query_len].double()
            row_values[context:] = v[start : start + row.query_len].double()
        keys.append(row_keys)
        values.append(row_values)
        start += row.query_len
    return keys, values


def fp8_storage(batch: Batch, scales: KVScales | None = None) -> KVStorage:
    """`batch`'s cache as a float8 cache stores it (the poisoned pages stay NaN), with the
    per-layer `scales` set first where given (None: scale 1)."""
    cache = batch.kv
    kv = KVStorage(
        num_layers=cache.num_layers, num_pages=cache.num_pages, block_size=cache.block_size,
        num_kv_heads=cache.num_kv_heads, head_dim=cache.head_dim, dtype=FP8,
        device=cache.cache.device,
    )  # fmt: skip
    if scales is not None:
        kv.set_scales(scales)
    kv.cache.copy_(to_cache_dtype(cache.cache, FP8))
    return kv


def decode_subset(batch: Batch, indices: list[int]) -> tuple[AttentionMetadata, list[int]]:
    """Metadata of the one-token rows `indices` alone (same pages), and their token indices."""
    metadata = batch.metadata
    assert all(batch.rows[i].query_len == 1 for i in indices)
    tokens = [batch.starts[i] for i in indices]
    seq_lens = [batch.rows[i].seq_len for i in indices]
    width = max(1, max(-(-length // batch.kv.block_size) for length in seq_lens))
    device = metadata.seq_lens.device
    subset = AttentionMetadata(
        query_start=torch.arange(len(indices) + 1, dtype=torch.int32, device=device),
        seq_lens=metadata.seq_lens[indices],
        page_table=metadata.page_table[indices, :width],
        slot_mapping=metadata.slot_mapping[tokens],
        max_query_len=1,
        max_seq_len=max(seq_lens),
        query_start_host=list(range(len(indices) + 1)),
        seq_lens_host=seq_lens,
    )
    return subset, tokens


def run_backend(
    backend: Any,
    batch: Batch,
    metadata: AttentionMetadata | None = None,
    tokens: list[int] | None = None,
) -> torch.Tensor:
    """A backend's `forward_into` output for the batch (or a subset's metadata and tokens), into
    an output poisoned with NaN first."""
    metadata = metadata or batch.metadata
    q, k, v = batch.q, batch.k, batch.v
    if tokens is not None:
        q, k, v = q[tokens], k[tokens], v[tokens]
    out = torch.full_like(q, float("nan"))
    backend.forward_into(q, k, v, batch.kv, batch.layer, metadata, out)
    if out.is_cuda:
        torch.cuda.synchronize()
    return out


def replay_metadata(
    batch: Batch, order: list[int], lengths: list[int], host_lengths: bool
) -> AttentionMetadata:
    """Decode metadata over `batch`'s pages with rows permuted (`order`) and lengths changed, as
    a CUDA graph replays it; `host_lengths`: with the host copies of the lengths (backends that
    plan from them) or without (the device-resident decode step's)."""
    table = batch.metadata.page_table[order]
    device = table.device
    block = batch.kv.block_size
    positions = torch.tensor([max(n, 1) - 1 for n in lengths], device=device)
    rows = torch.arange(len(order), device=device)
    pages = table[rows, positions // block].long()
    slots = torch.where(
        torch.tensor(lengths, device=device) > 0, pages * block + positions % block, 0
    )
    return AttentionMetadata(
        query_start=torch.arange(len(order) + 1, dtype=torch.int32, device=device),
        seq_lens=torch.tensor(lengths, dtype=torch.int32, device=device),
        page_table=table,
        slot_mapping=slots,
        max_query_len=1,
        max_seq_len=max(lengths),
        query_start_host=list(range(len(order) + 1)) if host_lengths else None,
        seq_lens_host=lengths if host_lengths else None,
    )


def dense_reference(batch: Batch) -> torch.Tensor:
    """float64 [T, Nq, D] on the CPU: causal softmax attention of every query over its context."""
    q = batch.q.double()
    out = torch.zeros_like(q)
    starts = batch.starts
    scale = q.shape[-1] ** -0.5
    for index, row in enumerate(batch.rows):
        if row.seq_len == 0:
            continue
        group = q.shape[1] // batch.keys[index].shape[1]
        keys = batch.keys[index].repeat_interleave(group, dim=1)  # [C, Nq, D]
        values = batch.values[index].repeat_interleave(group, dim=1)
        queries = q[starts[index] : starts[index + 1]]  # [Q, Nq, D]
        scores = torch.einsum("qhd,khd->hqk", queries, keys) * scale
        positions = torch.arange(row.seq_len - row.query_len, row.seq_len, device=q.device)
        hidden = torch.arange(row.seq_len, device=q.device)[None, :] > positions[:, None]  # [Q, C]
        weights = scores.masked_fill(hidden, float("-inf")).softmax(dim=-1)
        out[starts[index] : starts[index + 1]] = torch.einsum("hqk,khd->qhd", weights, values)
    return out.cpu()


def tolerance(dtype: torch.dtype) -> dict[str, Any]:
    """assert_close tolerances against the float64 reference."""
    if dtype == torch.float32:
        return {"rtol": 1e-5, "atol": 1e-5}
    return {"rtol": 1e-2, "atol": 1e-2}
