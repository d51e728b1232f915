"""Triton packed variable-length causal prefill over paged KV (one launch per layer).

Owns: the prefill kernel, its launch tiling and the host-built tile map (which query tile of which
sequence each program handles). Must not: touch rows of query length 1 (the decode kernel owns
them, so a decode row gives the same bits alone or next to a prompt chunk) or sync with the device
per layer: the tile map is built from host lists once per metadata.

Sequence s's queries are the last `query_len` positions of its `seq_len`-token context (earlier
chunks' K/V already sit in its pages); query i sits at position `seq_len - query_len + i` and sees
positions <= its own. A program handles BLOCK_M queries of one sequence and one query head:
first the KV tiles wholly below its first query's position, without masks, then the tiles that
reach the causal diagonal, masked. Results depend only on the sequence itself.

A padded pass (a CUDA graph's fixed grid) fills its map up to `tile_capacity` with `PADDING_TILE`,
whose programs return at once.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from loopserve.kernels.decode_tiles import tile_dot
from loopserve.kernels.kv_write import layer_scales, read_value, scale_pair
from loopserve.kernels.paged_decode import LOG2_E
from loopserve.kv.metadata import AttentionMetadata


@dataclass(frozen=True, slots=True)
class PrefillTiling:
    """Query tile (block_m), KV tile (block_n) and launch shape of the prefill kernel."""

    block_m: int
    block_n: int
    num_warps: int = 4
    num_stages: int = 2

    @staticmethod
    def for_shape(head_dim: int, dtype: torch.dtype) -> PrefillTiling:
        if triton.next_power_of_2(head_dim) > 128:
            return PrefillTiling(block_m=64, block_n=32, num_warps=8, num_stages=1)
        if dtype == torch.float32:  # exact fp32 dots run on FMA units and need many registers
            return PrefillTiling(block_m=32, block_n=32, num_warps=4, num_stages=2)
        return PrefillTiling(block_m=64, block_n=64, num_warps=4, num_stages=2)


def build_tile_map(
    query_start: list[int], seq_lens: list[int], block_m: int
) -> list[tuple[int, int]]:
    """(sequence, first query of the tile) for every BLOCK_M query tile of every prefill sequence.

    Sequences of query length 0 or 1 get no tiles. Tiles are ordered by decreasing causal extent
    (the most KV first) so long tiles do not trail at the end of the launch.
    """
    tiles = []
    for sequence, seq_len in enumerate(seq_lens):
        query_len = query_start[sequence + 1] - query_start[sequence]
        if query_len <= 1:
            continue
        context_start = seq_len - query_len  # position of the sequence's first query
        for first in range(0, query_len, block_m):
            extent = min(seq_len, context_start + first + block_m)
            tiles.append((extent, sequence, first))
    tiles.sort(key=lambda tile: -tile[0])
    return [(sequence, first) for _, sequence, first in tiles]


# A tile of no sequence: its programs return at once (fills a padded pass's fixed-size map).
PADDING_TILE = (-1, 0)


def tile_capacity(num_tokens: int, num_sequences: int, block_m: int) -> int:
    """The most tiles `build_tile_map` gives for any split of `num_tokens` query tokens into at
    most `num_sequences` sequences: each sequence's ceil(len / block_m) is at most
    floor(len / block_m) + 1."""
    return num_tokens // block_m + num_sequences


def padded_tile_map(
    query_start: list[int], seq_lens: list[int], block_m: int, capacity: int
) -> list[tuple[int, int]]:
    """`build_tile_map` filled up to `capacity` tiles with `PADDING_TILE` (the grid of a prefill
    launch replayed from a CUDA graph is fixed; the map in its static buffer changes)."""
    tiles = build_tile_map(query_start, seq_lens, block_m)
    if len(tiles) > capacity:
        raise ValueError(f"{len(tiles)} prefill tiles do not fit a map of {capacity}")
    return tiles + [PADDING_TILE] * (capacity - len(tiles))


@triton.jit
def _attend_tiles(
    running_max,  # [BLOCK_M] fp32
    running_sum,  # [BLOCK_M] fp32
    acc,  # [BLOCK_M, BLOCK_D] fp32
    q,  # [BLOCK_M, BLOCK_D] input dtype
    positions,  # [BLOCK_M] position of each query
    k_ptr,  # this program's KV head of the key cache
    v_ptr,
    table_row_ptr,  # this sequence's page-table row
    begin,
    end,
    scale_log2,
    k_scale,  # the layer's K and V scales (`kv_write.layer_scales`; read for an fp8 cache only)
    v_scale,
    stride_cache_page,
    stride_cache_offset,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    MASKED: tl.constexpr,  # False: every token of [begin, end) is visible to every query
    INPUT_PRECISION: tl.constexpr,
    UPCAST: tl.constexpr,
):
    dims = tl.arange(0, BLOCK_D)
    for start in range(begin, end, BLOCK_N):
        tokens = start + tl.arange(0, BLOCK_N)
        token_valid = tokens < end
        pages = tl.load(table_row_ptr + tokens // BLOCK_SIZE, mask=token_valid, other=0)
        rows = pages.to(tl.int64) * stride_cache_page + (tokens % BLOCK_SIZE) * stride_cache_offset
        offsets = rows[:, None] + dims[None, :]  # [BLOCK_N, BLOCK_D]
        load_mask = token_valid[:, None] & (dims < HEAD_DIM)[None, :]
        k = read_value(tl.load(k_ptr + offsets, mask=load_mask, other=0.0), k_scale, q.dtype)
        scores = tile_dot(q, tl.trans(k), INPUT_PRECISION, UPCAST) * scale_log2  # [M, N]
        if MASKED:
            visible = (tokens[None, :] <= positions[:, None]) & token_valid[None, :]
            scores = tl.where(visible, scores, float("-inf"))
        new_max = tl.maximum(running_max, tl.max(scores, axis=1))
        alpha = tl.exp2(running_max - new_max)
        p = tl.exp2(scores - new_max[:, None])
        running_sum = running_sum * alpha + tl.sum(p, axis=1)
        v = read_value(tl.load(v_ptr + offsets, mask=load_mask, other=0.0), v_scale, q.dtype)
        acc = acc * alpha[:, None] + tile_dot(p.to(v.dtype), v, INPUT_PRECISION, UPCAST)
        running_max = new_max
    return running_max, running_sum, acc


@triton.jit
def _prefill_kernel(
    q_ptr,  # [T, Nq, D]
    k_ptr,  # [pages, block, Nkv, D]
    v_ptr,  # [pages, block, Nkv, D]
    out_ptr,  # [T, Nq, D]
    query_start_ptr,  # [S + 1] int32
    seq_lens_ptr,  # [S] int32
    page_table_ptr,  # [S, P] int32
    tiles_ptr,  # [tiles, 2] int32: (sequence, first query of the tile)
    kv_scales_ptr,  # [2] fp32: the layer's K and V scales (read for a float8 cache)
    scale_log2,
    stride_q_token,
    stride_q_head,
    stride_out_token,
    stride_out_head,
    stride_cache_page,
    stride_cache_offset,
    stride_cache_head,
    stride_table_row,
    BLOCK_SIZE: tl.constexpr,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    INPUT_PRECISION: tl.constexpr,
    UPCAST: tl.constexpr,  # dot in fp32 (only under the CPU interpreter)
):
    head = tl.program_id(1)
    sequence = tl.load(tiles_ptr + 2 * tl.program_id(0))
    if sequence < 0:  # PADDING_TILE
        return
    first = tl.load(tiles_ptr + 2 * tl.program_id(0) + 1)
    q_begin = tl.load(query_start_ptr + sequence)
    query_len = tl.load(query_start_ptr + sequence + 1) - q_begin
    seq_len = tl.load(seq_lens_ptr + sequence)
    context_start = seq_len - query_len  # position of the sequence's first query
    queries = first + tl.arange(0, BLOCK_M)  # [BLOCK_M] index within the sequence
    tokens = (q_begin + queries).to(tl.int64)
    dims = tl.arange(0, BLOCK_D)
    io_mask = (queries < query_len)[:, None] & (dims < HEAD_DIM)[None, :]
    q_offsets = tokens[:, None] * stride_q_token + head * stride_q_head + dims[None, :]
    q = tl.load(q_ptr + q_offsets, mask=io_mask, other=0.0)  # [BLOCK_M, BLOCK_D]
    table_row_ptr = page_table_ptr + sequence.to(tl.int64) * stride_table_row
    k_head_ptr = k_ptr + (head // GROUP) * stride_cache_head
    v_head_ptr = v_ptr + (head // GROUP) * stride_cache_head
    # Tokens below `unmasked_end` precede every query of the tile; `causal_end` bounds the last.
    unmasked_end = (context_start + first) // BLOCK_N * BLOCK_N
    causal_end = tl.minimum(seq_len, context_start + first + BLOCK_M)
    running_max = tl.full([BLOCK_M], float("-inf"), tl.float32)
    running_sum = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    k_scale, v_scale = layer_scales(kv_scales_ptr, k_ptr)
    running_max, running_sum, acc = _attend_tiles(
        running_max, running_sum, acc, q, context_start + queries, k_head_ptr, v_head_ptr,
        table_row_ptr, 0, unmasked_end, scale_log2, k_scale, v_scale, stride_cache_page,
        stride_cache_offset, BLOCK_SIZE, BLOCK_N, HEAD_DIM, BLOCK_D, False, INPUT_PRECISION, UPCAST,
    )  # fmt: skip
    running_max, running_sum, acc = _attend_tiles(
        running_max, running_sum, acc, q, context_start + queries, k_head_ptr, v_head_ptr,
        table_row_ptr, unmasked_end, causal_end, scale_log2, k_scale, v_scale, stride_cache_page,
        stride_cache_offset, BLOCK_SIZE, BLOCK_N, HEAD_DIM, BLOCK_D, True, INPUT_PRECISION, UPCAST,
    )  # fmt: skip
    out = acc / running_sum[:, None]
    out_offsets = tokens[:, None] * stride_out_token + head * stride_out_head + dims[None, :]
    tl.store(out_ptr + out_offsets, out.to(out_ptr.dtype.element_ty), mask=io_mask)


def paged_prefill_attention(
    q: torch.Tensor,  # [T, Nq, D]
    key_cache: torch.Tensor,  # [pages, block, Nkv, D]
    value_cache: torch.Tensor,  # [pages, block, Nkv, D]
    metadata: AttentionMetadata,
    tiles: torch.Tensor,  # [tiles, 2] int32 from `build_tile_map`, on q's device
    out: torch.Tensor,  # [T, Nq, D], last dim contiguous
    *,
    scale: float,
    tiling: PrefillTiling,
    kv_scales: torch.Tensor | None = None,
) -> None:
    """Causal attention of the queries of every tiled sequence into `out` (one launch);
    `kv_scales`: a float8 cache's [2] fp32 K and V scales of the layer (None: 1)."""
    if tiles.shape[0] == 0:
        return
    if q.stride(-1) != 1:
        q = q.contiguous()
    num_heads, head_dim = q.shape[1], q.shape[2]
    fp32 = q.dtype == torch.float32
    _prefill_kernel[(tiles.shape[0], num_heads)](
        q, key_cache, value_cache, out, metadata.query_start, metadata.seq_lens,
        metadata.page_table, tiles, scale_pair(kv_scales, key_cache), scale * LOG2_E,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        key_cache.stride(0), key_cache.stride(1), key_cache.stride(2),
        metadata.page_table.stride(0),
        BLOCK_SIZE=key_cache.shape[1],
        GROUP=num_heads // key_cache.shape[2],
        HEAD_DIM=head_dim,
        BLOCK_D=triton.next_power_of_2(head_dim),
        BLOCK_M=tiling.block_m,
        BLOCK_N=tiling.block_n,
        INPUT_PRECISION="ieee" if fp32 else "tf32",  # fp32 must not round through tf32
        UPCAST=q.device.type == "cpu",
        num_warps=tiling.num_warps,
        num_stages=tiling.num_stages,
    )  # fmt: skip
