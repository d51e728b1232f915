"""Triton paged decode attention: one query token per row over that row's own page table.

Owns: the decode kernel (a program streams its partitions of a row; it can store the row's new
K/V first, rotating q and k on the way, and it combines the row itself when it is the row's only
program), the combine kernel for rows whose partitions were shared out, and the workspace they
share. The tiling, partition and split rules are `decode_plan.py`; a row's partitions, its K/V
write and its rotated query are `decode_row.py`; the tile loops and the fold are
`decode_tiles.py`. Must not:
read host copies of lengths or sync with the device; the launch grid depends only on the number
of rows and on shapes, so a decode step can be captured in a CUDA graph for a fixed padded row
count.

Batch invariance. A row of length L is cut into partitions whose size depends on L alone. Each
partition is reduced in a fixed tile order (online softmax, fp32) into a partial (max, sum,
unnormalised output), and partials are folded in partition order by one function,
`combine_partials`, whichever program runs it. How many programs share a row
(`num_split_programs`, chosen from the row count) only changes *which* program reduces a
partition and whether the fold runs in the decode program or in the combine kernel, never the
arithmetic, so a row's bits do not depend on the batch it is in. `DecodeTiling` (tile shape and
math) is fixed per model shape; it must never be chosen from the row count.

Rows whose query length is not 1 (prompt chunks of a mixed batch) are skipped and their outputs
left alone; rows of length 0 (padding) produce zeros.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from loopserve.kernels.decode_plan import DecodeTiling
from loopserve.kernels.decode_row import (
    decode_row,
    finishes_row,
    partition_doublings,
    program_tiles,
    rotated_query,
    write_new_kv,
)
from loopserve.kernels.decode_tiles import combine_partials, dot_tiles, lane_tiles
from loopserve.kernels.kv_write import layer_scales, scale_pair
from loopserve.kernels.pdl import launch_dependents, launch_options, wait_for_inputs
from loopserve.kv.metadata import AttentionMetadata

LOG2_E = 1.4426950408889634


@dataclass(slots=True)
class DecodeWorkspace:
    """fp32 partials of every (row, query head, partition); shared by all layers of a pass."""

    partial_out: torch.Tensor  # [S, Nq, parts, D] unnormalised sum of p * v
    partial_max: torch.Tensor  # [S, Nq, parts] max of the log2-scaled scores
    partial_sum: torch.Tensor  # [S, Nq, parts] sum of p
    arrivals: torch.Tensor  # [S, Nq] int32 programs of a (row, head program) done; 0 at rest


def new_workspace(
    rows: int, num_heads: int, head_dim: int, partitions: int, device: torch.device
) -> DecodeWorkspace:
    """Contiguous partials: partial_out's part stride is head_dim, the scalars' part stride is 1.
    Arrival counts start at 0 (the kernel leaves them at 0)."""
    return DecodeWorkspace(
        partial_out=torch.empty(rows, num_heads, partitions, head_dim, device=device),
        partial_max=torch.empty(rows, num_heads, partitions, device=device),
        partial_sum=torch.empty(rows, num_heads, partitions, device=device),
        arrivals=torch.zeros(rows, num_heads, dtype=torch.int32, device=device),
    )


@triton.jit(do_not_specialize=["num_split_programs", "stride_table_row"])
def _decode_kernel(
    q_ptr,  # [T, Nq, D]
    k_new_ptr,  # [T, Nkv, D] this pass's keys (read only with WRITE_KV)
    v_new_ptr,  # [T, Nkv, D]
    key_cache_ptr,  # [pages, block, Nkv, D]
    value_cache_ptr,  # [pages, block, Nkv, D], same strides as the key cache
    query_start_ptr,  # [S + 1] int32
    seq_lens_ptr,  # [S] int32
    page_table_ptr,  # [S, P] int32
    slot_mapping_ptr,  # [T] int64
    kv_scales_ptr,  # [2] fp32: the layer's K and V scales (read for a float8 cache)
    kv_inverse_ptr,  # [2] fp32: their reciprocals (read for a float8 cache, with WRITE_KV)
    cos_ptr,  # [T, D] RoPE rows of the pass's tokens (read only with ROTARY)
    sin_ptr,
    rotated_ptr,  # [T, Nq, D] scratch for the rotated queries (ROTARY), q's strides
    out_ptr,  # [T, Nq, D]
    partial_out_ptr,  # [S, Nq, parts, D] fp32
    partial_max_ptr,  # [S, Nq, parts] fp32
    partial_sum_ptr,  # [S, Nq, parts] fp32
    arrivals_ptr,  # [S, head programs] int32, 0 between launches (read only with LAST_COMBINES)
    scale_log2,
    num_split_programs,
    stride_q_token,
    stride_q_head,
    stride_new_token,  # k_new and v_new strides (the launcher checks they agree)
    stride_new_head,
    stride_out_token,
    stride_out_head,
    stride_angle,
    stride_cache_page,
    stride_cache_offset,
    stride_cache_head,
    stride_table_row,
    stride_partial_row,  # partial_out strides; its part stride is HEAD_DIM
    stride_partial_head,
    stride_scalar_row,  # partial_max / partial_sum strides; their part stride is 1
    stride_scalar_head,
    stride_arrivals_row,
    BLOCK_SIZE: tl.constexpr,
    GROUP: tl.constexpr,  # query heads per KV head
    HEADS: tl.constexpr,  # query heads per program (a power of two)
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_N: tl.constexpr,
    NUM_STAGES: tl.constexpr,
    PARTITION_MIN: tl.constexpr,
    MAX_PARTITIONS: tl.constexpr,
    PART_TILES_LOG2: tl.constexpr,  # log2(PARTITION_MIN / BLOCK_N)
    TENSOR_CORES: tl.constexpr,
    INPUT_PRECISION: tl.constexpr,
    UPCAST: tl.constexpr,  # dots in fp32 (only under the CPU interpreter)
    WRITE_KV: tl.constexpr,  # store the row's new K/V before reading (instead of kv_write)
    ROTARY: tl.constexpr,  # q and the new k are unrotated: apply RoPE here (needs WRITE_KV)
    COMBINE: tl.constexpr,  # one program per row: combine here (num_split_programs == 1)
    LAST_COMBINES: tl.constexpr,  # the last of a row's programs to finish combines it
    PARTIALS_CACHE: tl.constexpr,  # ".cg" with LAST_COMBINES (other programs' partials)
    UNIT_SCALES: tl.constexpr,  # the layer's K and V scales are both 1 (fp8: widen only)
    PDL: tl.constexpr,  # launched as a programmatic dependent (`kernels.pdl`)
):
    launch_dependents(PDL)
    wait_for_inputs(PDL)
    row = tl.program_id(0)
    split = tl.program_id(2)
    programs_per_kv_head: tl.constexpr = (GROUP + HEADS - 1) // HEADS
    kv_head = tl.program_id(1) // programs_per_kv_head
    in_group = (tl.program_id(1) % programs_per_kv_head) * HEADS + tl.arange(0, HEADS)  # [H]
    heads = kv_head * GROUP + in_group  # query heads of this program, [H]
    dims = tl.arange(0, BLOCK_D)
    token, query_len, seq_len = decode_row(query_start_ptr, seq_lens_ptr, row)
    doublings = partition_doublings(seq_len, PARTITION_MIN, MAX_PARTITIONS)
    part_size = PARTITION_MIN << doublings
    tile_shift = PART_TILES_LOG2 + doublings  # a partition has 1 << tile_shift tiles
    num_tiles, tail, num_parts, owns_last = program_tiles(
        seq_len, split, num_split_programs, part_size, tile_shift, BLOCK_N
    )
    angles = token * stride_angle
    if WRITE_KV:
        k_inverse, v_inverse = layer_scales(kv_inverse_ptr, key_cache_ptr)
        write_new_kv(
            k_new_ptr, v_new_ptr, key_cache_ptr, value_cache_ptr, slot_mapping_ptr,
            cos_ptr + angles, sin_ptr + angles, token, kv_head, owns_last, k_inverse, v_inverse,
            stride_new_token, stride_new_head, stride_cache_page, stride_cache_offset,
            stride_cache_head, BLOCK_SIZE, HEAD_DIM, BLOCK_D, ROTARY,
        )  # fmt: skip
    q_rows = token * stride_q_token + heads * stride_q_head  # [H]
    if ROTARY:
        rotated_query(
            q_ptr, rotated_ptr, cos_ptr + angles, sin_ptr + angles, q_rows,
            in_group < tl.where(query_len == 1, GROUP, 0), HEAD_DIM, BLOCK_D,
        )  # fmt: skip
        q_ptr = rotated_ptr
    partial_rows = row.to(tl.int64) * stride_partial_row + heads * stride_partial_head  # [H]
    scalar_rows = row.to(tl.int64) * stride_scalar_row + heads * stride_scalar_head  # [H]
    table_row_ptr = page_table_ptr + row.to(tl.int64) * stride_table_row
    kv_head_offset = kv_head * stride_cache_head
    k_scale, v_scale = layer_scales(kv_scales_ptr, key_cache_ptr)
    if TENSOR_CORES:
        dot_tiles(
            q_ptr + q_rows, in_group < GROUP, key_cache_ptr + kv_head_offset,
            value_cache_ptr + kv_head_offset, table_row_ptr, partial_out_ptr + partial_rows,
            partial_max_ptr + scalar_rows, partial_sum_ptr + scalar_rows, scale_log2, k_scale,
            v_scale, seq_len, part_size, split, num_split_programs, num_tiles, tile_shift,
            stride_cache_page, stride_cache_offset, BLOCK_SIZE, HEADS, HEAD_DIM, BLOCK_D, BLOCK_N,
            NUM_STAGES, INPUT_PRECISION, UPCAST,
        )  # fmt: skip
    else:  # HEADS == 1
        lane_tiles(
            q_ptr + q_rows, key_cache_ptr + kv_head_offset, value_cache_ptr + kv_head_offset,
            table_row_ptr, partial_out_ptr + partial_rows, partial_max_ptr + scalar_rows,
            partial_sum_ptr + scalar_rows, scale_log2, k_scale, v_scale, seq_len, part_size,
            split, num_split_programs, num_tiles, tail, tile_shift, stride_cache_page,
            stride_cache_offset, BLOCK_SIZE, HEAD_DIM, BLOCK_D, BLOCK_N, NUM_STAGES, UNIT_SCALES,
        )  # fmt: skip
    finish = finishes_row(
        arrivals_ptr + row.to(tl.int64) * stride_arrivals_row + tl.program_id(1), split,
        num_split_programs, num_parts, COMBINE, LAST_COMBINES,
    )  # fmt: skip
    if finish:
        tl.debug_barrier()  # partials stored by other threads of this program are visible
        out = combine_partials(
            partial_out_ptr + partial_rows, partial_max_ptr + scalar_rows,
            partial_sum_ptr + scalar_rows, num_parts, in_group < GROUP, HEADS, HEAD_DIM, BLOCK_D,
            PARTIALS_CACHE,
        )  # fmt: skip
        stored_heads = tl.where(query_len == 1, GROUP, 0)  # rows of other query lengths: none
        mask = (in_group < stored_heads)[:, None] & (dims < HEAD_DIM)[None, :]
        out_offsets = token * stride_out_token + heads[:, None] * stride_out_head + dims[None, :]
        tl.store(out_ptr + out_offsets, out.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _combine_kernel(
    out_ptr,  # [T, Nq, D]
    query_start_ptr,  # [S + 1] int32
    seq_lens_ptr,  # [S] int32
    partial_out_ptr,  # [S, Nq, parts, D] fp32
    partial_max_ptr,  # [S, Nq, parts] fp32
    partial_sum_ptr,  # [S, Nq, parts] fp32
    stride_out_token,
    stride_out_head,
    stride_partial_row,
    stride_partial_head,
    stride_scalar_row,
    stride_scalar_head,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    PARTITION_MIN: tl.constexpr,
    MAX_PARTITIONS: tl.constexpr,
):
    """Rows of two or more partitions (the decode kernel finished the others), one head each."""
    row = tl.program_id(0)
    head = tl.program_id(1)
    token, _, seq_len = decode_row(query_start_ptr, seq_lens_ptr, row)  # 0 unless one query
    part_size = PARTITION_MIN << partition_doublings(seq_len, PARTITION_MIN, MAX_PARTITIONS)
    num_parts = (seq_len + part_size - 1) // part_size
    if num_parts > 1:
        partial_row = row.to(tl.int64) * stride_partial_row + head * stride_partial_head
        scalar_row = row.to(tl.int64) * stride_scalar_row + head * stride_scalar_head
        one = tl.arange(0, 1)
        out = combine_partials(
            partial_out_ptr + partial_row + one, partial_max_ptr + scalar_row + one,
            partial_sum_ptr + scalar_row + one, num_parts, one == 0, 1, HEAD_DIM, BLOCK_D, "",
        )  # fmt: skip
        dims = tl.arange(0, BLOCK_D)
        out_offsets = (
            token * stride_out_token + head * stride_out_head + dims[None, :] + one[:, None]
        )
        tl.store(
            out_ptr + out_offsets, out.to(out_ptr.dtype.element_ty), mask=dims[None, :] < HEAD_DIM
        )


def paged_decode_attention(
    q: torch.Tensor,  # [T, Nq, D]; T == S
    key_cache: torch.Tensor,  # [pages, block, Nkv, D]
    value_cache: torch.Tensor,  # [pages, block, Nkv, D]
    metadata: AttentionMetadata,
    out: torch.Tensor,  # [T, Nq, D], last dim contiguous
    workspace: DecodeWorkspace,
    *,
    scale: float,
    num_split_programs: int,
    tiling: DecodeTiling,
    new_kv: tuple[torch.Tensor, torch.Tensor] | None = None,
    rope: tuple[torch.Tensor, torch.Tensor] | None = None,
    last_program_combines: bool = False,
    kv_scales: tuple[torch.Tensor, torch.Tensor] | None = None,
    unit_scales: bool = False,
    pdl: bool = False,
) -> None:
    """Attention of every one-token row over its pages into `out`; other rows are left alone.

    `new_kv` ([T, Nkv, D] keys and values of this pass): the kernel stores each decode row's new
    K/V into its slot itself (no separate `kv_write`); only for passes where every row has one
    query token. `rope` ([T, D] cos and sin rows of the tokens, with `new_kv`): q and the new k
    are unrotated and the kernel applies RoPE as `fused_ops.rotary_qk_` does, bit for bit (no
    separate launch; q and k are left as they are). `last_program_combines`: when rows are
    shared by several programs, the last one to finish folds the row (no combine launch).
    `kv_scales`: a float8 cache's ([2] scales, [2] reciprocals) of the layer's K and V
    (`KVStorage.scales`, `inverse_scales`; None: 1); `unit_scales`: the caller knows both are 1
    (`KVStorage.scale_values`), so the lanes path uses the e4m3 values as they are (the same
    bits, less work; implied by `kv_scales` None); `pdl`: launched as a programmatic dependent
    (`kernels.pdl`). Reads only device tensors of `metadata`
    (never its host lists), so it can be graph-captured.
    """
    if new_kv is not None and metadata.max_query_len != 1:
        raise ValueError("the decode kernel writes new K/V only in passes of one-token rows")
    if rope is not None and new_kv is None:
        raise ValueError("the decode kernel applies RoPE only where it writes the new K/V")
    rows = metadata.seq_lens.shape[0]
    needed = tiling.partitions_bound(metadata.page_table.shape[1] * key_cache.shape[1])
    if workspace.partial_max.shape[2] < needed or workspace.partial_max.shape[0] < rows:
        raise ValueError(f"decode workspace too small: {needed} partitions x {rows} rows needed")
    if rows == 0:
        return
    if q.stride(-1) != 1:
        q = q.contiguous()
    last_combines = last_program_combines and num_split_programs > 1
    _launch_decode(
        q, key_cache, value_cache, metadata, out, workspace, scale, num_split_programs, tiling,
        new_kv, rope, last_combines, kv_scales, unit_scales or kv_scales is None, pdl,
    )  # fmt: skip
    if num_split_programs > 1 and not last_combines:
        _launch_combine(out, metadata, workspace, tiling)


def _launch_decode(
    q: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    metadata: AttentionMetadata,
    out: torch.Tensor,
    workspace: DecodeWorkspace,
    scale: float,
    num_split_programs: int,
    tiling: DecodeTiling,
    new_kv: tuple[torch.Tensor, torch.Tensor] | None,
    rope: tuple[torch.Tensor, torch.Tensor] | None,
    last_combines: bool,
    kv_scales: tuple[torch.Tensor, torch.Tensor] | None,
    unit_scales: bool,
    pdl: bool,
) -> None:
    num_heads, head_dim = q.shape[1], q.shape[2]
    scales, inverse_scales = kv_scales if kv_scales is not None else (None, None)
    cos, sin = rope if rope is not None else (q, q)  # q: a placeholder, not read
    if cos.stride() != sin.stride() or cos.stride(-1) != 1:
        cos, sin = cos.contiguous(), sin.contiguous()
    rotated = q  # with rope: a scratch with q's strides for the rotated queries (decode_row.py)
    if rope is not None:
        rotated = torch.empty_strided(q.shape, q.stride(), dtype=q.dtype, device=q.device)
    num_kv_heads = key_cache.shape[2]
    k_new, v_new = new_kv if new_kv is not None else (q, q)  # q: a placeholder, not read
    if k_new.stride() != v_new.stride() or k_new.stride(-1) != 1:
        k_new, v_new = k_new.contiguous(), v_new.contiguous()
    grid = (
        metadata.seq_lens.shape[0],
        tiling.head_programs(num_heads, num_kv_heads),
        num_split_programs,
    )
    partial_out, partial_max = workspace.partial_out, workspace.partial_max
    _decode_kernel[grid](
        q, k_new, v_new, key_cache, value_cache,
        metadata.query_start, metadata.seq_lens, metadata.page_table, metadata.slot_mapping,
        scale_pair(scales, key_cache), scale_pair(inverse_scales, key_cache),
        cos, sin, rotated, out, partial_out, partial_max, workspace.partial_sum, workspace.arrivals,
        scale * LOG2_E, num_split_programs,
        q.stride(0), q.stride(1), k_new.stride(0), k_new.stride(1), out.stride(0), out.stride(1),
        cos.stride(0), key_cache.stride(0), key_cache.stride(1), key_cache.stride(2),
        metadata.page_table.stride(0),
        partial_out.stride(0), partial_out.stride(1), partial_max.stride(0), partial_max.stride(1),
        workspace.arrivals.stride(0),
        BLOCK_SIZE=key_cache.shape[1],
        GROUP=num_heads // num_kv_heads,
        HEADS=tiling.heads_per_program,
        HEAD_DIM=head_dim,
        BLOCK_D=triton.next_power_of_2(head_dim),
        BLOCK_N=tiling.block_n,
        NUM_STAGES=tiling.num_stages,
        PARTITION_MIN=tiling.partition_min,
        MAX_PARTITIONS=tiling.max_partitions,
        PART_TILES_LOG2=(tiling.partition_min // tiling.block_n).bit_length() - 1,
        TENSOR_CORES=tiling.tensor_cores,
        INPUT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        UPCAST=q.device.type == "cpu",
        WRITE_KV=new_kv is not None,
        ROTARY=rope is not None,
        COMBINE=num_split_programs == 1,
        LAST_COMBINES=last_combines,
        PARTIALS_CACHE=".cg" if last_combines else "",
        UNIT_SCALES=unit_scales,
        PDL=pdl,
        num_warps=tiling.num_warps,
        num_stages=tiling.num_stages,
        **launch_options(pdl),
    )  # fmt: skip


def _launch_combine(
    out: torch.Tensor, metadata: AttentionMetadata, workspace: DecodeWorkspace, tiling: DecodeTiling
) -> None:
    num_heads, head_dim = out.shape[1], out.shape[2]
    partial_out, partial_max = workspace.partial_out, workspace.partial_max
    _combine_kernel[(metadata.seq_lens.shape[0], num_heads)](
        out, metadata.query_start, metadata.seq_lens,
        partial_out, partial_max, workspace.partial_sum,
        out.stride(0), out.stride(1),
        partial_out.stride(0), partial_out.stride(1), partial_max.stride(0), partial_max.stride(1),
        HEAD_DIM=head_dim,
        BLOCK_D=triton.next_power_of_2(head_dim),
        PARTITION_MIN=tiling.partition_min,
        MAX_PARTITIONS=tiling.max_partitions,
    )  # fmt: skip
