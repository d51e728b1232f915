"""The decode kernel's inner loops (how a program reduces its partitions of a row), and the combine.

Owns: the two tile reductions (CUDA-core lanes for one query head, tensor-core dots for a group
of query heads) and `combine_partials`, the single definition of how partials are folded. Must
not: choose partitions or programs (paged_decode.py does); everything here depends only on the
row's length, its pages and the constexpr tiling, never on the batch.

A program walks its tiles in one flat, software-pipelined loop (`tl.range(num_stages=...)`: the
page-table and K/V loads of later tiles are in flight while a tile is reduced, also across
partition boundaries). Tile t of the program is tile `t % 2**tile_shift` of partition `split +
(t >> tile_shift) * splits`; at a partition's last tile the program stores its partial and resets.

Arithmetic is fp32 with explicit `tl.fma` where a product is accumulated, so the compiler's
contraction choices cannot differ between kernels that share these functions.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _load_kv(
    k_ptr,  # this KV head of the key cache
    v_ptr,
    table_row_ptr,
    tokens,  # [BLOCK_N]
    valid,  # [BLOCK_N]
    stride_cache_page,
    stride_cache_offset,
    BLOCK_SIZE: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    """K and V [BLOCK_N, BLOCK_D] of the tile (input dtype); 0 outside the row and head dim."""
    dims = tl.arange(0, BLOCK_D)
    pages = tl.load(table_row_ptr + tokens // BLOCK_SIZE, mask=valid, other=0).to(tl.int64)
    rows = pages * stride_cache_page + (tokens % BLOCK_SIZE) * stride_cache_offset
    offsets = rows[:, None] + dims[None, :]
    mask = valid[:, None] & (dims < HEAD_DIM)[None, :]  # constant along dims if not padded
    k = tl.load(k_ptr + offsets, mask=mask, other=0.0)
    v = tl.load(v_ptr + offsets, mask=mask, other=0.0)
    return k, v


@triton.jit
def _store_partial(
    out_ptrs,  # [H] this program's heads' rows of partial_out
    max_ptrs,  # [H]
    sum_ptrs,  # [H]
    part,
    part_max,  # [H]
    part_sum,  # [H]
    part_out,  # [H, BLOCK_D]
    head_valid,  # [H]
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    dims = tl.arange(0, BLOCK_D)
    tl.store(max_ptrs + part, part_max, mask=head_valid)
    tl.store(sum_ptrs + part, part_sum, mask=head_valid)
    mask = head_valid[:, None] & (dims < HEAD_DIM)[None, :]
    tl.store(out_ptrs[:, None] + part * HEAD_DIM + dims[None, :], part_out, mask=mask)


@triton.jit
def _dot(a, b, INPUT_PRECISION: tl.constexpr, UPCAST: tl.constexpr):
    if UPCAST:  # the CPU interpreter multiplies bf16 bit patterns as integers; fp32 is exact
        a = a.to(tl.float32)
        b = b.to(tl.float32)
    return tl.dot(a, b, input_precision=INPUT_PRECISION)


@triton.jit
def lane_tiles(
    q_ptrs,  # [1] this program's query head
    k_ptr,  # this KV head of the key cache
    v_ptr,
    table_row_ptr,
    out_ptrs,  # [1] partial_out row of the head
    max_ptrs,  # [1]
    sum_ptrs,  # [1]
    scale_log2,
    seq_len,
    part_size,
    split,
    splits,
    num_tiles,
    tile_shift,  # a partition has 1 << tile_shift tiles
    stride_cache_page,
    stride_cache_offset,
    BLOCK_SIZE: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_N: tl.constexpr,
    NUM_STAGES: tl.constexpr,
):
    """One query head on CUDA cores: lane n of the tile keeps its own online softmax over tokens
    n, n + BLOCK_N, ... of the partition; lanes are merged once, at the partition's end, so the
    tile loop has no reduction over tokens (none across warps)."""
    dims = tl.arange(0, BLOCK_D)
    # q broadcast over the tile's lanes, loaded as a [BLOCK_N, BLOCK_D] tile so that it gets the
    # K tile's layout (each lane's dims within one warp): the q·k sums then need no shared memory.
    q_offsets = tl.zeros([BLOCK_N], tl.int32)[:, None] + dims[None, :]
    q_mask = q_offsets < HEAD_DIM
    q = tl.load(q_ptrs + q_offsets, mask=q_mask, other=0.0).to(tl.float32) * scale_log2
    lane_max = tl.full([BLOCK_N], float("-inf"), tl.float32)
    lane_sum = tl.zeros([BLOCK_N], tl.float32)
    acc = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)
    for t in tl.range(0, num_tiles, num_stages=NUM_STAGES):
        local = t & ((1 << tile_shift) - 1)  # tile t is tile `local` of partition `part`
        part = split + (t >> tile_shift) * splits
        start = part * part_size + local * BLOCK_N
        tokens = start + tl.arange(0, BLOCK_N)
        valid = tokens < seq_len
        k, v = _load_kv(
            k_ptr, v_ptr, table_row_ptr, tokens, valid, stride_cache_page, stride_cache_offset,
            BLOCK_SIZE, HEAD_DIM, BLOCK_D,
        )  # fmt: skip
        scores = tl.where(valid, tl.sum(k.to(tl.float32) * q, axis=1), float("-inf"))
        new_max = tl.maximum(lane_max, scores)
        reference = tl.where(new_max == float("-inf"), 0.0, new_max)  # lanes without tokens yet
        alpha = tl.exp2(lane_max - reference)
        p = tl.exp2(scores - reference)
        lane_sum = tl.fma(lane_sum, alpha, p)
        acc = tl.fma(acc, alpha[:, None], p[:, None] * v.to(tl.float32))
        lane_max = new_max
        if (local == (1 << tile_shift) - 1) | (start + BLOCK_N >= seq_len):  # partition ends
            part_max = tl.max(lane_max, axis=0)  # finite: a partition has a token
            weight = tl.exp2(lane_max - part_max)  # 0 for lanes without tokens
            one = tl.zeros([1], tl.float32)
            part_sum = one + tl.sum(lane_sum * weight, axis=0)
            part_out = tl.sum(acc * weight[:, None], axis=0)[None, :]
            _store_partial(
                out_ptrs, max_ptrs, sum_ptrs, part, one + part_max, part_sum, part_out,
                one == 0, HEAD_DIM, BLOCK_D,
            )  # fmt: skip
            lane_max = tl.full([BLOCK_N], float("-inf"), tl.float32)
            lane_sum = tl.zeros([BLOCK_N], tl.float32)
            acc = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)


@triton.jit
def dot_tiles(
    q_ptrs,  # [H] this program's query heads
    head_valid,  # [H] heads of the KV group (the rest pad the dot to 16 rows)
    k_ptr,  # this KV head of the key cache
    v_ptr,
    table_row_ptr,
    out_ptrs,  # [H] partial_out rows of the heads
    max_ptrs,  # [H]
    sum_ptrs,  # [H]
    scale_log2,
    seq_len,
    part_size,
    split,
    splits,
    num_tiles,
    tile_shift,  # a partition has 1 << tile_shift tiles
    stride_cache_page,
    stride_cache_offset,
    BLOCK_SIZE: tl.constexpr,
    HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_N: tl.constexpr,
    NUM_STAGES: tl.constexpr,
    INPUT_PRECISION: tl.constexpr,
    UPCAST: tl.constexpr,
):
    """HEADS query heads of one KV group on tensor cores: a FlashAttention-2 step per tile
    (q·kᵀ and p·v with `tl.dot`, fp32 accumulation, p rounded to the input dtype for p·v)."""
    dims = tl.arange(0, BLOCK_D)
    q_mask = head_valid[:, None] & (dims < HEAD_DIM)[None, :]
    q = tl.load(q_ptrs[:, None] + dims[None, :], mask=q_mask, other=0.0)  # [H, BLOCK_D]
    running_max = tl.full([HEADS], float("-inf"), tl.float32)
    running_sum = tl.zeros([HEADS], tl.float32)
    acc = tl.zeros([HEADS, BLOCK_D], tl.float32)
    for t in tl.range(0, num_tiles, num_stages=NUM_STAGES):
        local = t & ((1 << tile_shift) - 1)  # tile t is tile `local` of partition `part`
        part = split + (t >> tile_shift) * splits
        start = part * part_size + local * BLOCK_N
        tokens = start + tl.arange(0, BLOCK_N)
        valid = tokens < seq_len  # the tile's first token is valid
        k, v = _load_kv(
            k_ptr, v_ptr, table_row_ptr, tokens, valid, stride_cache_page, stride_cache_offset,
            BLOCK_SIZE, HEAD_DIM, BLOCK_D,
        )  # fmt: skip
        scores = _dot(q, tl.trans(k), INPUT_PRECISION, UPCAST) * scale_log2  # [H, BLOCK_N]
        scores = tl.where(valid[None, :], scores, float("-inf"))
        new_max = tl.maximum(running_max, tl.max(scores, axis=1))
        alpha = tl.exp2(running_max - new_max)
        p = tl.exp2(scores - new_max[:, None])
        running_sum = tl.fma(running_sum, alpha, tl.sum(p, axis=1))
        acc = tl.fma(acc, alpha[:, None], _dot(p.to(v.dtype), v, INPUT_PRECISION, UPCAST))
        running_max = new_max
        if (local == (1 << tile_shift) - 1) | (start + BLOCK_N >= seq_len):  # partition ends
            _store_partial(
                out_ptrs, max_ptrs, sum_ptrs, part, running_max, running_sum, acc, head_valid,
                HEAD_DIM, BLOCK_D,
            )  # fmt: skip
            running_max = tl.full([HEADS], float("-inf"), tl.float32)
            running_sum = tl.zeros([HEADS], tl.float32)
            acc = tl.zeros([HEADS, BLOCK_D], tl.float32)


@triton.jit
def combine_partials(
    out_ptrs,  # [H] rows of partial_out
    max_ptrs,  # [H]
    sum_ptrs,  # [H]
    num_parts,
    head_valid,  # [H]
    HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    """The normalised output [H, BLOCK_D] from partitions 0, 1, ..., num_parts - 1 in that order.

    The only definition of the fold: the decode kernel (one program per row, or a row with one
    partition) and the combine kernel both call it, so a row's bits do not depend on which ran.
    Element-wise arithmetic only: the result does not depend on the caller's layout or HEADS.
    Partitions are read UNROLL at a time (one memory round trip each); parts past num_parts get
    weight 0 and add exact zeros. Rows without partitions give zeros.
    """
    UNROLL: tl.constexpr = 8
    dims = tl.arange(0, BLOCK_D)
    zero_heads = tl.arange(0, HEADS) * 0
    global_max = tl.full([HEADS], float("-inf"), tl.float32)
    for base in range(0, num_parts, UNROLL):
        for offset in tl.static_range(UNROLL):
            valid = head_valid & (zero_heads + base + offset < num_parts)
            part_max = tl.load(max_ptrs + base + offset, mask=valid, other=float("-inf"))
            global_max = tl.maximum(global_max, part_max)
    total = tl.zeros([HEADS], tl.float32)
    acc = tl.zeros([HEADS, BLOCK_D], tl.float32)
    for base in range(0, num_parts, UNROLL):  # fixed order: partition 0, 1, 2, ...
        for offset in tl.static_range(UNROLL):
            part = base + offset
            valid = head_valid & (zero_heads + part < num_parts)
            part_max = tl.load(max_ptrs + part, mask=valid, other=0.0)
            weight = tl.where(valid, tl.exp2(part_max - global_max), 0.0)
            total = tl.fma(tl.load(sum_ptrs + part, mask=valid, other=0.0), weight, total)
            out_mask = valid[:, None] & (dims < HEAD_DIM)[None, :]
            offsets = out_ptrs[:, None] + part * HEAD_DIM + dims[None, :]
            acc = tl.fma(tl.load(offsets, mask=out_mask, other=0.0), weight[:, None], acc)
    return acc / tl.where(total > 0, total, 1.0)[:, None]  # a partition's sum is >= 1
