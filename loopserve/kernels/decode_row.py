"""Per-row pieces of the decode kernel: which rows decode, how a row is cut into partitions and
shared among programs, and the new token's K/V (and RoPE) before the row is read.

Owns: the partition rule's arithmetic on the device (`decode_plan.py` states it), the split of a
row's partitions among its programs, the fused K/V write, the rotated-query scratch and which
program folds a row (`finishes_row`: the arrival count). Must not:
launch anything (kernels/paged_decode.py's kernels call these).
"""

from __future__ import annotations

import triton
import triton.language as tl

from loopserve.kernels.fused_ops import rotate_half
from loopserve.kernels.kv_write import cache_value


@triton.jit
def partition_doublings(seq_len, PARTITION_MIN: tl.constexpr, MAX_PARTITIONS: tl.constexpr):
    """k such that PARTITION_MIN << k, the row's partition size, is the smallest power-of-two
    multiple of PARTITION_MIN that cuts seq_len into at most MAX_PARTITIONS partitions."""
    doublings = seq_len * 0
    while (PARTITION_MIN * MAX_PARTITIONS << doublings) < seq_len:
        doublings += 1
    return doublings


@triton.jit
def decode_row(query_start_ptr, seq_lens_ptr, row):
    """(query token index, query length, decode length: 0 unless the row has one query token)."""
    token = tl.load(query_start_ptr + row)
    query_len = tl.load(query_start_ptr + row + 1) - token
    seq_len = tl.load(seq_lens_ptr + row)
    return token.to(tl.int64), query_len, tl.where(query_len == 1, seq_len, 0)


@triton.jit
def program_tiles(seq_len, split, num_split_programs, part_size, tile_shift, BLOCK_N: tl.constexpr):
    """(tiles this program reduces, 1 if its last one is partial else 0, partitions of the row,
    whether it owns the row's last partition).

    Program `split` owns partitions split, split + splits, ...; each has 1 << tile_shift tiles
    (part_size / BLOCK_N) but the row's last, which has the rest of its ceil(L / BLOCK_N) tiles.
    """
    num_parts = (seq_len + part_size - 1) // part_size
    owned = tl.maximum(num_parts - split + num_split_programs - 1, 0) // num_split_programs
    owns_last = (num_parts > 0) & ((num_parts - 1) % num_split_programs == split)
    missing = (num_parts << tile_shift) - (seq_len + BLOCK_N - 1) // BLOCK_N  # not in the last
    num_tiles = (owned << tile_shift) - tl.where(owns_last, missing, 0)
    tail = tl.where(owns_last & (seq_len % BLOCK_N != 0), 1, 0)
    return num_tiles, tail, num_parts, owns_last


@triton.jit
def write_new_kv(
    k_new_ptr,  # [T, Nkv, D]
    v_new_ptr,  # [T, Nkv, D]
    key_cache_ptr,
    value_cache_ptr,
    slot_mapping_ptr,  # [T] int64
    cos_ptr,  # [HEAD_DIM] the token's RoPE row (read only with ROTARY)
    sin_ptr,
    token,
    kv_head,
    write,  # scalar bool: this program reads the row's last token
    k_inverse,  # 1 / the layer's K and V scales (`kv_write.layer_scales`)
    v_inverse,
    stride_new_token,
    stride_new_head,
    stride_cache_page,
    stride_cache_offset,
    stride_cache_head,
    BLOCK_SIZE: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    ROTARY: tl.constexpr,  # rotate the key first (as `fused_ops.rotary_qk_` would have)
):
    """The row's new K/V into its slot (as `kv_write` does), visible to this program after."""
    dims = tl.arange(0, BLOCK_D)
    mask = dims < tl.where(write, HEAD_DIM, 0)
    source = token * stride_new_token + kv_head * stride_new_head
    if ROTARY:
        key = rotate_half(k_new_ptr + source, cos_ptr, sin_ptr, dims, mask, HEAD_DIM // 2)
    else:
        key = tl.load(k_new_ptr + source + dims, mask=mask)
    slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
    destination = (
        (slot // BLOCK_SIZE) * stride_cache_page
        + (slot % BLOCK_SIZE) * stride_cache_offset
        + kv_head * stride_cache_head
        + dims
    )
    tl.store(key_cache_ptr + destination, cache_value(key, key_cache_ptr, k_inverse), mask=mask)
    value = tl.load(v_new_ptr + source + dims, mask=mask)
    stored = cache_value(value, value_cache_ptr, v_inverse)
    tl.store(value_cache_ptr + destination, stored, mask=mask)
    tl.debug_barrier()  # the program's own stores are visible to all its threads' loads after


@triton.jit
def rotated_query(
    q_ptr, rotated_ptr, cos_ptr, sin_ptr, q_rows, head_valid,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
):  # fmt: skip
    """This program's query heads, rotated, into `rotated_ptr` (a scratch twin of q with q's
    strides: every program of a row writes the same bits there, so sharing it is safe), visible
    to the program's threads after."""
    dims = tl.arange(0, BLOCK_D)[None, :]
    mask = head_valid[:, None] & (dims < HEAD_DIM)
    rotated = rotate_half(q_ptr + q_rows[:, None], cos_ptr, sin_ptr, dims, mask, HEAD_DIM // 2)
    tl.store(rotated_ptr + q_rows[:, None] + dims, rotated, mask=mask)
    tl.debug_barrier()


@triton.jit
def finishes_row(
    arrivals_ptr, split, num_split_programs, num_parts, COMBINE: tl.constexpr,
    LAST_COMBINES: tl.constexpr,
):  # fmt: skip
    """Whether this program folds the row's partials (the same fold whichever program does).

    One program per row: it does. LAST_COMBINES: the last of the row's programs to arrive (an
    acq_rel atomic per program after a CTA barrier; the last one reads the others' partials
    past L1 and resets the count for the next launch). Otherwise split 0 finishes rows of one
    partition and the combine kernel the rest.
    """
    if COMBINE:
        return split == 0
    if LAST_COMBINES:
        tl.debug_barrier()  # every thread's partial stores precede the release below
        arrived = tl.atomic_add(arrivals_ptr, 1, sem="acq_rel", scope="gpu")
        last = arrived == num_split_programs - 1
        if last:
            tl.atomic_xchg(arrivals_ptr, 0, sem="relaxed", scope="gpu")
        return last
    return (split == 0) & (num_parts <= 1)
