"""The decode kernel's inner loops (how a program reduces its partitions of a row), and the combine.

Owns: the two tile reductions (CUDA-core lanes for one query head, tensor-core dots for a group
of query heads) and `combine_partials`, the single definition of how partials are folded. Must
not: choose partitions or programs (paged_decode.py does); everything here depends only on the
row's length, its pages and the constexpr tiling, never on the batch.

A program walks its full tiles in one flat, software-pipelined loop (`tl.range(num_stages=...)`:
the page-table and K/V loads of later tiles are in flight while a tile is reduced, also across
partition boundaries) without masks; a row's last tile, if partial, is reduced after the loop
with masks (the same arithmetic). Tile t of the program is tile `t % 2**tile_shift` of
partition `split + (t >> tile_shift) * splits`; at a partition's last tile the program stores
its partial and resets.

Arithmetic is fp32 with explicit `tl.fma` where a product is accumulated, so the compiler's
contraction choices cannot differ between kernels that share these functions.
"""

from __future__ import annotations

import triton
import triton.language as tl

from loopserve.kernels.kv_write import read_value, read_wide


@triton.jit
def _load_kv(
    k_ptr,  # this KV head of the key cache
    v_ptr,
    table_row_ptr,
    start,  # the tile's first token, a multiple of BLOCK_N
    seq_len,
    stride_cache_page,
    stride_cache_offset,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    MASKED: tl.constexpr,  # the tile reaches past the row's end (only a row's last tile)
):
    """(K, V [BLOCK_N, BLOCK_D] of the tile in the input dtype, 0 outside the row and the head
    dim; valid [BLOCK_N]: the token is in the row). Unmasked tiles issue no predicates."""
    dims = tl.arange(0, BLOCK_D)
    lanes = tl.arange(0, BLOCK_N)
    if BLOCK_N % BLOCK_SIZE == 0:  # the tile starts a page: per-lane page and offset are constants
        page_index = start // BLOCK_SIZE + lanes // BLOCK_SIZE
        in_page = lanes % BLOCK_SIZE
    elif BLOCK_SIZE % BLOCK_N == 0:  # the tile lies within one page
        page_index = start // BLOCK_SIZE + lanes * 0
        in_page = start % BLOCK_SIZE + lanes
    else:
        page_index = (start + lanes) // BLOCK_SIZE
        in_page = (start + lanes) % BLOCK_SIZE
    valid = start + lanes < seq_len
    if MASKED:
        pages = tl.load(table_row_ptr + page_index, mask=valid, other=0)
    else:
        pages = tl.load(table_row_ptr + page_index)
    rows = pages.to(tl.int64) * stride_cache_page + in_page * stride_cache_offset
    offsets = rows[:, None] + dims[None, :]
    if MASKED:
        mask = valid[:, None] & (dims < HEAD_DIM)[None, :]
        k = tl.load(k_ptr + offsets, mask=mask, other=0.0)
        v = tl.load(v_ptr + offsets, mask=mask, other=0.0)
    elif HEAD_DIM < BLOCK_D:
        mask = (lanes >= 0)[:, None] & (dims < HEAD_DIM)[None, :]
        k = tl.load(k_ptr + offsets, mask=mask, other=0.0)
        v = tl.load(v_ptr + offsets, mask=mask, other=0.0)
    else:
        k = tl.load(k_ptr + offsets)
        v = tl.load(v_ptr + offsets)
    return k, v, valid


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
def tile_dot(a, b, INPUT_PRECISION: tl.constexpr, UPCAST: tl.constexpr):
    """tl.dot of two tiles (also the prefill kernel's)."""
    if UPCAST:  # the CPU interpreter multiplies bf16 bit patterns as integers; fp32 is exact
        a = a.to(tl.float32)
        b = b.to(tl.float32)
    return tl.dot(a, b, input_precision=INPUT_PRECISION)


@triton.jit
def _lane_step(
    lane_max, lane_sum, acc, q, k, v, valid, k_scale, v_scale, dtype: tl.constexpr,
    MASKED: tl.constexpr, UNIT_SCALES: tl.constexpr,
):  # fmt: skip
    """One tile into the lanes' online softmax: (max [N], sum [N], acc [N, D]) -> updated. K/V
    are read as the query's `dtype` (`read_wide`: an fp8 cache's scales), then widened."""
    k = read_wide(k, k_scale, dtype, UNIT_SCALES)
    v = read_wide(v, v_scale, dtype, UNIT_SCALES)
    scores = tl.sum(k * q, axis=1)  # [BLOCK_N], log2 units (q is pre-scaled)
    if MASKED:
        scores = tl.where(valid, scores, float("-inf"))
    new_max = tl.maximum(lane_max, scores)
    reference = tl.where(new_max == float("-inf"), 0.0, new_max)  # lanes without tokens yet
    alpha = tl.exp2(lane_max - reference)
    p = tl.exp2(scores - reference)
    lane_sum = tl.fma(lane_sum, alpha, p)
    acc = tl.fma(acc, alpha[:, None], p[:, None] * v)
    return new_max, lane_sum, acc


@triton.jit
def _lane_flush(
    lane_max, lane_sum, acc, out_ptrs, max_ptrs, sum_ptrs, part, HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
):  # fmt: skip
    """Merge the lanes (the only reduction over tokens) and store partition `part`'s partial."""
    part_max = tl.max(lane_max, axis=0)  # finite: a partition has a token
    weight = tl.exp2(lane_max - part_max)  # 0 for lanes without tokens
    one = tl.zeros([1], tl.float32)
    part_sum = one + tl.sum(lane_sum * weight, axis=0)
    part_out = tl.sum(acc * weight[:, None], axis=0)[None, :]
    _store_partial(
        out_ptrs, max_ptrs, sum_ptrs, part, one + part_max, part_sum, part_out, one == 0,
        HEAD_DIM, BLOCK_D,
    )  # fmt: skip


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
    k_scale,  # the layer's K and V scales (`kv_write.layer_scales`; read for an fp8 cache only)
    v_scale,
    seq_len,
    part_size,
    split,
    splits,
    num_tiles,  # this program's tiles; the last one is partial when `tail`
    tail,
    tile_shift,  # a partition has 1 << tile_shift tiles
    stride_cache_page,
    stride_cache_offset,
    BLOCK_SIZE: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_N: tl.constexpr,
    NUM_STAGES: tl.constexpr,
    UNIT_SCALES: tl.constexpr,  # an fp8 cache whose layer scales are 1 (`kv_write.read_wide`)
):
    """One query head on CUDA cores: lane n of the tile keeps its own online softmax over tokens
    n, n + BLOCK_N, ... of the partition; lanes are merged once, at the partition's end, so the
    tile loop has no reduction over tokens (none across warps). Full tiles run in the pipelined
    loop without masks; a row's partial last tile runs after it."""
    dims = tl.arange(0, BLOCK_D)
    # q broadcast over the tile's lanes, loaded as a [BLOCK_N, BLOCK_D] tile so that it gets the
    # K tile's layout (each lane's dims within one warp): the q·k sums then need no shared memory.
    q_offsets = tl.zeros([BLOCK_N], tl.int32)[:, None] + dims[None, :]
    q_mask = q_offsets < HEAD_DIM
    dtype = q_ptrs.dtype.element_ty  # the model's: what K/V are read as
    q = tl.load(q_ptrs + q_offsets, mask=q_mask, other=0.0).to(tl.float32) * scale_log2
    lane_max = tl.full([BLOCK_N], float("-inf"), tl.float32)
    lane_sum = tl.zeros([BLOCK_N], tl.float32)
    acc = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)
    for t in tl.range(0, num_tiles - tail, num_stages=NUM_STAGES):
        local = t & ((1 << tile_shift) - 1)  # tile t is tile `local` of partition `part`
        part = split + (t >> tile_shift) * splits
        start = part * part_size + local * BLOCK_N
        k, v, valid = _load_kv(
            k_ptr, v_ptr, table_row_ptr, start, seq_len, stride_cache_page, stride_cache_offset,
            BLOCK_SIZE, BLOCK_N, HEAD_DIM, BLOCK_D, False,
        )  # fmt: skip
        lane_max, lane_sum, acc = _lane_step(
            lane_max, lane_sum, acc, q, k, v, valid, k_scale, v_scale, dtype, False, UNIT_SCALES
        )
        if (local == (1 << tile_shift) - 1) | (start + BLOCK_N >= seq_len):  # partition ends
            _lane_flush(
                lane_max, lane_sum, acc, out_ptrs, max_ptrs, sum_ptrs, part, HEAD_DIM, BLOCK_D
            )
            lane_max = tl.full([BLOCK_N], float("-inf"), tl.float32)
            lane_sum = tl.zeros([BLOCK_N], tl.float32)
            acc = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)
    if tail:  # the row's last tile, partial; it ends the row's last partition
        t = num_tiles - 1
        part = split + (t >> tile_shift) * splits
        start = part * part_size + (t & ((1 << tile_shift) - 1)) * BLOCK_N
        k, v, valid = _load_kv(
            k_ptr, v_ptr, table_row_ptr, start, seq_len, stride_cache_page, stride_cache_offset,
            BLOCK_SIZE, BLOCK_N, HEAD_DIM, BLOCK_D, True,
        )  # fmt: skip
        lane_max, lane_sum, acc = _lane_step(
            lane_max, lane_sum, acc, q, k, v, valid, k_scale, v_scale, dtype, True, UNIT_SCALES
        )
        _lane_flush(lane_max, lane_sum, acc, out_ptrs, max_ptrs, sum_ptrs, part, HEAD_DIM, BLOCK_D)


@triton.jit
def _dot_step(
    running_max, running_sum, acc, q, k, v, valid, scale_log2, k_scale, v_scale,
    INPUT_PRECISION: tl.constexpr, UPCAST: tl.constexpr, MASKED: tl.constexpr,
):  # fmt: skip
    """One tile of a FlashAttention-2 step for the heads: (max [H], sum [H], acc [H, D]). K/V
    are read as q's dtype first (`read_value`: a no-op unless the cache is fp8)."""
    k, v = read_value(k, k_scale, q.dtype), read_value(v, v_scale, q.dtype)
    scores = tile_dot(q, tl.trans(k), INPUT_PRECISION, UPCAST) * scale_log2  # [H, BLOCK_N]
    if MASKED:
        scores = tl.where(valid[None, :], scores, float("-inf"))  # the first token is valid
    new_max = tl.maximum(running_max, tl.max(scores, axis=1))
    alpha = tl.exp2(running_max - new_max)
    p = tl.exp2(scores - new_max[:, None])
    running_sum = tl.fma(running_sum, alpha, tl.sum(p, axis=1))
    acc = tl.fma(acc, alpha[:, None], tile_dot(p.to(v.dtype), v, INPUT_PRECISION, UPCAST))
    return new_max, running_sum, acc


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
    k_scale,  # the layer's K and V scales (`kv_write.layer_scales`; read for an fp8 cache only)
    v_scale,
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
    (q·kᵀ and p·v with `tl.dot`, fp32 accumulation, p rounded to the input dtype for p·v).
    Every tile is masked (a separate partial-tile step would cost registers: 206 vs 124)."""
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
        k, v, valid = _load_kv(
            k_ptr, v_ptr, table_row_ptr, start, seq_len, stride_cache_page, stride_cache_offset,
            BLOCK_SIZE, BLOCK_N, HEAD_DIM, BLOCK_D, True,
        )  # fmt: skip
        running_max, running_sum, acc = _dot_step(
            running_max, running_sum, acc, q, k, v, valid, scale_log2, k_scale, v_scale,
            INPUT_PRECISION, UPCAST, True,
        )  # fmt: skip
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
    CACHE: tl.constexpr,  # ".cg" when other programs of this launch wrote the partials
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
            part_max = tl.load(
                max_ptrs + base + offset, mask=valid, other=float("-inf"), cache_modifier=CACHE
            )
            global_max = tl.maximum(global_max, part_max)
    total = tl.zeros([HEADS], tl.float32)
    acc = tl.zeros([HEADS, BLOCK_D], tl.float32)
    for base in range(0, num_parts, UNROLL):  # fixed order: partition 0, 1, 2, ...
        for offset in tl.static_range(UNROLL):
            part = base + offset
            valid = head_valid & (zero_heads + part < num_parts)
            part_max = tl.load(max_ptrs + part, mask=valid, other=0.0, cache_modifier=CACHE)
            part_sum = tl.load(sum_ptrs + part, mask=valid, other=0.0, cache_modifier=CACHE)
            weight = tl.where(valid, tl.exp2(part_max - global_max), 0.0)
            total = tl.fma(part_sum, weight, total)
            out_mask = valid[:, None] & (dims < HEAD_DIM)[None, :]
            offsets = out_ptrs[:, None] + part * HEAD_DIM + dims[None, :]
            part_out = tl.load(offsets, mask=out_mask, other=0.0, cache_modifier=CACHE)
            acc = tl.fma(part_out, weight[:, None], acc)
    return acc / tl.where(total > 0, total, 1.0)[:, None]  # a partition's sum is >= 1
