"""The decode kernels as they were before issue 9, kept only so the decode sweep can time them.

Owns: a verbatim copy of the previous `loopserve/kernels/paged_decode.py` kernels (256-token
partitions, one [heads, tokens, dims] broadcast product per tile, loads not pipelined, always a
combine launch) and `baseline_decode`, the step the backend used to run per layer (`kv_write`,
partitions, combine; 4 programs per SM). Must not: be used by the engine. Delete it once the
sweep's before/after is recorded.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from loopserve.kv.metadata import AttentionMetadata

PARTITION_MIN = 256
MAX_PARTITIONS = 32
LOG2_E = 1.4426950408889634


@dataclass(slots=True)
class DecodeWorkspace:
    """fp32 partials of every (row, query head, partition); shared by all layers of a pass."""

    partial_out: torch.Tensor  # [S, Nq, parts, D] unnormalised sum of p * v
    partial_max: torch.Tensor  # [S, Nq, parts] running max of the log2-scaled scores
    partial_sum: torch.Tensor  # [S, Nq, parts] sum of p


@dataclass(frozen=True, slots=True)
class DecodeTiling:
    """How the KV axis is cut (which changes results) and how programs are shaped (which does not).

    `partition_min` / `max_partitions` fix every row's partitions; tests shrink them to reach many
    partitions on tiny contexts. `heads_per_program`, `block_n`, `num_warps` shape the programs.
    """

    heads_per_program: int
    block_n: int
    num_warps: int = 4
    partition_min: int = PARTITION_MIN
    max_partitions: int = MAX_PARTITIONS

    @staticmethod
    def for_shape(group: int, head_dim: int) -> DecodeTiling:
        heads = min(8, triton.next_power_of_2(group))
        block_d = triton.next_power_of_2(head_dim)
        # Keep the [heads, tokens, dims] product tile near 64 fp32 values per thread.
        block_n = max(16, min(64, 8192 // (heads * block_d)))
        num_warps = 4 if heads * block_n * block_d <= 8192 else 8
        return DecodeTiling(heads_per_program=heads, block_n=block_n, num_warps=num_warps)

    def head_programs(self, num_heads: int, num_kv_heads: int) -> int:
        """Programs per row on the head axis; each covers `heads_per_program` heads of a group."""
        group = num_heads // num_kv_heads
        return num_kv_heads * -(-group // self.heads_per_program)

    def partitions_bound(self, max_context: int) -> int:
        """Most partitions a row of at most `max_context` tokens can have (>= 1)."""
        return max(1, min(self.max_partitions, -(-max_context // self.partition_min)))


def new_workspace(
    rows: int, num_heads: int, head_dim: int, partitions: int, device: torch.device
) -> DecodeWorkspace:
    """Contiguous partials: partial_out's part stride is head_dim, the scalars' part stride is 1."""
    return DecodeWorkspace(
        partial_out=torch.empty(rows, num_heads, partitions, head_dim, device=device),
        partial_max=torch.empty(rows, num_heads, partitions, device=device),
        partial_sum=torch.empty(rows, num_heads, partitions, device=device),
    )


def split_programs(rows: int, head_programs: int, partitions: int, target_programs: int) -> int:
    """Programs per (row, head program): enough to reach `target_programs`, at most `partitions`."""
    wanted = -(-target_programs // max(1, rows * head_programs))
    return max(1, min(partitions, wanted))


@triton.jit
def _partition_size(seq_len, PARTITION_MIN: tl.constexpr, MAX_PARTITIONS: tl.constexpr):
    size = seq_len * 0 + PARTITION_MIN
    for _ in tl.static_range(20):
        size = tl.where(tl.cdiv(seq_len, size) > MAX_PARTITIONS, size * 2, size)
    return size


@triton.jit
def _decode_row(query_start_ptr, seq_lens_ptr, row):
    """(query token index, decode length): the length is 0 unless the row has one query token."""
    token = tl.load(query_start_ptr + row)
    query_len = tl.load(query_start_ptr + row + 1) - token
    seq_len = tl.load(seq_lens_ptr + row)
    return token.to(tl.int64), tl.where(query_len == 1, seq_len, 0)


@triton.jit
def _attend_partition(
    q,  # [H, BLOCK_D] fp32, already multiplied by scale * log2(e)
    k_ptr,
    v_ptr,
    table_row_ptr,
    begin,
    end,
    kv_head_offset,
    dims,
    dim_valid,
    stride_cache_page,
    stride_cache_offset,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    HEADS: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    """Online softmax over tokens [begin, end) in tiles of BLOCK_N; begin < end."""
    running_max = tl.full([HEADS], float("-inf"), tl.float32)
    running_sum = tl.zeros([HEADS], tl.float32)
    acc = tl.zeros([HEADS, BLOCK_D], tl.float32)
    for start in range(begin, end, BLOCK_N):
        tokens = start + tl.arange(0, BLOCK_N)
        valid = tokens < end  # the first token of every tile is valid
        pages = tl.load(table_row_ptr + tokens // BLOCK_SIZE, mask=valid, other=0).to(tl.int64)
        rows = pages * stride_cache_page + (tokens % BLOCK_SIZE) * stride_cache_offset
        offsets = kv_head_offset + rows[:, None] + dims[None, :]  # [BLOCK_N, BLOCK_D]
        mask = valid[:, None] & dim_valid[None, :]
        k = tl.load(k_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
        v = tl.load(v_ptr + offsets, mask=mask, other=0.0).to(tl.float32)  # in flight with k
        scores = tl.sum(q[:, None, :] * k[None, :, :], axis=2)  # [H, BLOCK_N]
        scores = tl.where(valid[None, :], scores, float("-inf"))
        new_max = tl.maximum(running_max, tl.max(scores, axis=1))
        alpha = tl.exp2(running_max - new_max)
        p = tl.exp2(scores - new_max[:, None])  # [H, BLOCK_N]
        running_sum = running_sum * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.sum(p[:, :, None] * v[None, :, :], axis=1)
        running_max = new_max
    return running_max, running_sum, acc


@triton.jit(do_not_specialize=["num_split_programs"])
def _decode_partitions_kernel(
    q_ptr,  # [T, Nq, D]
    k_ptr,  # [pages, block, Nkv, D]
    v_ptr,  # [pages, block, Nkv, D]
    query_start_ptr,  # [S + 1] int32
    seq_lens_ptr,  # [S] int32
    page_table_ptr,  # [S, P] int32
    partial_out_ptr,  # [S, Nq, parts, D] fp32
    partial_max_ptr,  # [S, Nq, parts] fp32
    partial_sum_ptr,  # [S, Nq, parts] fp32
    scale_log2,
    num_split_programs,
    stride_q_token,
    stride_q_head,
    stride_cache_page,
    stride_cache_offset,
    stride_cache_head,
    stride_table_row,
    stride_out_row,  # partial_out strides; its part stride is HEAD_DIM
    stride_out_head,
    stride_scalar_row,  # partial_max / partial_sum strides; their part stride is 1
    stride_scalar_head,
    BLOCK_SIZE: tl.constexpr,
    GROUP: tl.constexpr,  # query heads per KV head
    HEADS: tl.constexpr,  # query heads per program (a power of two)
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_N: tl.constexpr,
    PARTITION_MIN: tl.constexpr,
    MAX_PARTITIONS: tl.constexpr,
):
    row = tl.program_id(0)
    programs_per_kv_head: tl.constexpr = (GROUP + HEADS - 1) // HEADS
    kv_head = tl.program_id(1) // programs_per_kv_head
    in_group = (tl.program_id(1) % programs_per_kv_head) * HEADS + tl.arange(0, HEADS)  # [H]
    head_valid = in_group < GROUP
    heads = kv_head * GROUP + in_group  # query heads of this program, [H]
    dims = tl.arange(0, BLOCK_D)
    dim_valid = dims < HEAD_DIM
    token, seq_len = _decode_row(query_start_ptr, seq_lens_ptr, row)
    part_size = _partition_size(seq_len, PARTITION_MIN, MAX_PARTITIONS)
    q_offsets = token * stride_q_token + heads[:, None] * stride_q_head + dims[None, :]
    q_mask = head_valid[:, None] & dim_valid[None, :]
    q = tl.load(q_ptr + q_offsets, mask=q_mask, other=0.0).to(tl.float32) * scale_log2
    out_heads = row.to(tl.int64) * stride_out_row + heads * stride_out_head  # [H]
    scalar_heads = row.to(tl.int64) * stride_scalar_row + heads * stride_scalar_head  # [H]
    table_row_ptr = page_table_ptr + row.to(tl.int64) * stride_table_row
    for part in range(tl.program_id(2), tl.cdiv(seq_len, part_size), num_split_programs):
        begin = part * part_size
        end = tl.minimum(seq_len, begin + part_size)
        part_max, part_sum, part_out = _attend_partition(
            q,
            k_ptr,
            v_ptr,
            table_row_ptr,
            begin,
            end,
            kv_head * stride_cache_head,
            dims,
            dim_valid,
            stride_cache_page,
            stride_cache_offset,
            BLOCK_SIZE,
            BLOCK_N,
            HEADS,
            BLOCK_D,
        )
        tl.store(partial_max_ptr + scalar_heads + part, part_max, mask=head_valid)
        tl.store(partial_sum_ptr + scalar_heads + part, part_sum, mask=head_valid)
        out_offsets = out_heads[:, None] + part * HEAD_DIM + dims[None, :]
        tl.store(partial_out_ptr + out_offsets, part_out, mask=q_mask)


@triton.jit
def _decode_combine_kernel(
    out_ptr,  # [T, Nq, D]
    query_start_ptr,  # [S + 1] int32
    seq_lens_ptr,  # [S] int32
    partial_out_ptr,  # [S, Nq, parts, D] fp32
    partial_max_ptr,  # [S, Nq, parts] fp32
    partial_sum_ptr,  # [S, Nq, parts] fp32
    stride_out_token,
    stride_out_head,
    stride_partial_row,  # partial_out strides; its part stride is HEAD_DIM
    stride_partial_head,
    stride_scalar_row,  # partial_max / partial_sum strides; their part stride is 1
    stride_scalar_head,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    PARTITION_MIN: tl.constexpr,
    MAX_PARTITIONS: tl.constexpr,
):
    row = tl.program_id(0)
    head = tl.program_id(1)
    token, seq_len = _decode_row(query_start_ptr, seq_lens_ptr, row)
    query_len = tl.load(query_start_ptr + row + 1) - tl.load(query_start_ptr + row)
    num_parts = tl.cdiv(seq_len, _partition_size(seq_len, PARTITION_MIN, MAX_PARTITIONS))
    dims = tl.arange(0, BLOCK_D)
    dim_valid = dims < HEAD_DIM
    base = row.to(tl.int64) * stride_partial_row + head * stride_partial_head
    scalar_base = row.to(tl.int64) * stride_scalar_row + head * stride_scalar_head
    global_max = tl.full([], float("-inf"), tl.float32)
    for part in range(0, num_parts):
        global_max = tl.maximum(global_max, tl.load(partial_max_ptr + scalar_base + part))
    total = tl.zeros([], tl.float32)
    acc = tl.zeros([BLOCK_D], tl.float32)
    for part in range(0, num_parts):  # fixed order: partition 0, 1, 2, ...
        weight = tl.exp2(tl.load(partial_max_ptr + scalar_base + part) - global_max)
        total += tl.load(partial_sum_ptr + scalar_base + part) * weight
        part_out = tl.load(partial_out_ptr + base + part * HEAD_DIM + dims, mask=dim_valid)
        acc += part_out * weight
    out = acc / tl.where(num_parts > 0, total, 1.0)  # zeros for empty rows
    out_offsets = token * stride_out_token + head * stride_out_head + dims
    stored_dims = tl.where(query_len == 1, HEAD_DIM, 0)  # rows of other query lengths: none
    tl.store(out_ptr + out_offsets, out.to(out_ptr.dtype.element_ty), dims < stored_dims)


def baseline_decode(
    q: torch.Tensor,  # [T, Nq, D]; T == S
    k: torch.Tensor,  # [T, Nkv, D]
    v: torch.Tensor,  # [T, Nkv, D]
    key_cache: torch.Tensor,  # [pages, block, Nkv, D]
    value_cache: torch.Tensor,  # [pages, block, Nkv, D]
    metadata: AttentionMetadata,
    out: torch.Tensor,  # [T, Nq, D]
    workspace: DecodeWorkspace,
    *,
    scale: float,
    num_sms: int,
) -> None:
    """One layer of a decode-only pass the old way: kv_write, partitions, combine."""
    from loopserve.kernels.kv_write import write_kv

    tiling = DecodeTiling.for_shape(q.shape[1] // key_cache.shape[2], q.shape[2])
    rows = metadata.seq_lens.shape[0]
    partitions = tiling.partitions_bound(metadata.page_table.shape[1] * key_cache.shape[1])
    head_programs = tiling.head_programs(q.shape[1], key_cache.shape[2])
    splits = split_programs(rows, head_programs, partitions, 4 * num_sms)
    write_kv(k, v, key_cache, value_cache, metadata.slot_mapping)
    _launch_partitions(q, key_cache, value_cache, metadata, workspace, scale, splits, tiling)
    _launch_combine(out, metadata, workspace, tiling)


def _launch_partitions(
    q: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    metadata: AttentionMetadata,
    workspace: DecodeWorkspace,
    scale: float,
    num_split_programs: int,
    tiling: DecodeTiling,
) -> None:
    num_heads, head_dim = q.shape[1], q.shape[2]
    num_kv_heads = key_cache.shape[2]
    grid = (
        metadata.seq_lens.shape[0],
        tiling.head_programs(num_heads, num_kv_heads),
        num_split_programs,
    )
    _decode_partitions_kernel[grid](
        q,
        key_cache,
        value_cache,
        metadata.query_start,
        metadata.seq_lens,
        metadata.page_table,
        workspace.partial_out,
        workspace.partial_max,
        workspace.partial_sum,
        scale * LOG2_E,
        num_split_programs,
        q.stride(0),
        q.stride(1),
        key_cache.stride(0),
        key_cache.stride(1),
        key_cache.stride(2),
        metadata.page_table.stride(0),
        workspace.partial_out.stride(0),
        workspace.partial_out.stride(1),
        workspace.partial_max.stride(0),
        workspace.partial_max.stride(1),
        BLOCK_SIZE=key_cache.shape[1],
        GROUP=num_heads // num_kv_heads,
        HEADS=tiling.heads_per_program,
        HEAD_DIM=head_dim,
        BLOCK_D=triton.next_power_of_2(head_dim),
        BLOCK_N=tiling.block_n,
        PARTITION_MIN=tiling.partition_min,
        MAX_PARTITIONS=tiling.max_partitions,
        num_warps=tiling.num_warps,
    )


def _launch_combine(
    out: torch.Tensor, metadata: AttentionMetadata, workspace: DecodeWorkspace, tiling: DecodeTiling
) -> None:
    num_heads, head_dim = out.shape[1], out.shape[2]
    _decode_combine_kernel[(metadata.seq_lens.shape[0], num_heads)](
        out,
        metadata.query_start,
        metadata.seq_lens,
        workspace.partial_out,
        workspace.partial_max,
        workspace.partial_sum,
        out.stride(0),
        out.stride(1),
        workspace.partial_out.stride(0),
        workspace.partial_out.stride(1),
        workspace.partial_max.stride(0),
        workspace.partial_max.stride(1),
        HEAD_DIM=head_dim,
        BLOCK_D=triton.next_power_of_2(head_dim),
        PARTITION_MIN=tiling.partition_min,
        MAX_PARTITIONS=tiling.max_partitions,
    )
