"""How the decode kernel cuts and launches work: the tiling, the partition rule, the schedule.

Owns: `DecodeTiling` (tile shape and math, fixed per model shape: it can change a row's bits),
`DecodeSchedule` (programs per row from the row count: it cannot) and the split rule. Must not:
import triton or torch (the decode sweep and the backend read these without the kernels).

Partition rule: a row of length L is cut into partitions of the smallest `partition_min * 2**k`
tokens that gives at most `max_partitions` partitions (L alone decides). Split rule: program
`split` of a row's `num_split_programs` reduces partitions split, split + splits, ...
"""

from __future__ import annotations

from dataclasses import dataclass

# Partition sizes start here and double until a row has at most MAX_PARTITIONS partitions.
PARTITION_MIN = 128
MAX_PARTITIONS = 32


@dataclass(frozen=True, slots=True)
class DecodeTiling:
    """The decode kernel's tile shape and math: fixed per model shape, never per batch.

    Every field may change a row's bits (the reduction order or the layout of a reduction), so a
    deployment uses one tiling for every row count; only `num_split_programs` varies with it.

    tensor_cores: q·k and p·v with `tl.dot` over `heads_per_program` (>= 16, padded) query heads
        of one KV group, K/V read once per group; False: CUDA-core FMAs, one query head per
        program, an online softmax per lane of the tile (merged at each partition's end).
    block_n: tokens per tile (a power of two, at most `partition_min`).
    num_warps, num_stages: warps per program; tiles in flight (`tl.range` software pipelining
        of the page-table and K/V loads through shared memory; 1: none).
    partition_min, max_partitions: the partition rule (module docstring).
    """

    tensor_cores: bool
    heads_per_program: int
    block_n: int
    num_warps: int = 4
    num_stages: int = 3
    partition_min: int = PARTITION_MIN
    max_partitions: int = MAX_PARTITIONS

    def __post_init__(self) -> None:
        powers = (self.heads_per_program, self.block_n, self.partition_min, self.num_warps)
        if any(value < 1 or value & (value - 1) for value in powers):
            raise ValueError(f"{self}: heads, block_n, partition_min, warps must be powers of 2")
        if self.block_n > self.partition_min or self.num_stages < 1 or self.max_partitions < 1:
            raise ValueError(f"{self}: needs block_n <= partition_min, stages and partitions >= 1")
        if self.tensor_cores != (self.heads_per_program >= 16):
            raise ValueError(f"{self}: tensor cores take >= 16 heads per program, FMAs take 1")
        if not self.tensor_cores and self.heads_per_program != 1:
            raise ValueError(f"{self}: the FMA path takes one head per program")

    @staticmethod
    def for_shape(group: int, head_dim: int) -> DecodeTiling:
        """The default for `group` query heads per KV head: FMAs for MHA, tensor cores for GQA."""
        block_d = _next_power_of_2(head_dim)
        if group == 1:
            block_n = max(16, min(64, 4096 // block_d))  # 32 fp32 accumulators per thread at D 128
            return DecodeTiling(tensor_cores=False, heads_per_program=1, block_n=block_n)
        heads = max(16, min(64, _next_power_of_2(group)))
        block_n = 64 if block_d <= 128 else 32
        return DecodeTiling(tensor_cores=True, heads_per_program=heads, block_n=block_n)

    def head_programs(self, num_heads: int, num_kv_heads: int) -> int:
        """Programs per row on the head axis; each covers `heads_per_program` heads of a group."""
        group = num_heads // num_kv_heads
        return num_kv_heads * -(-group // self.heads_per_program)

    def partitions_bound(self, max_context: int) -> int:
        """Most partitions a row of at most `max_context` tokens can have (>= 1)."""
        return max(1, min(self.max_partitions, -(-max_context // self.partition_min)))


def split_programs(rows: int, head_programs: int, partitions: int, target_programs: int) -> int:
    """Programs per (row, head program): enough to reach `target_programs`, at most `partitions`.

    `target_programs <= 0` gives one program per row (it streams the whole row and combines it).
    """
    wanted = -(-target_programs // max(1, rows * head_programs))
    return max(1, min(partitions, wanted))


@dataclass(frozen=True, slots=True)
class DecodeSchedule:
    """How a decode step is launched, from the row count alone; never changes a row's bits.

    programs_per_sm: ((max_rows, programs per SM), ...) in ascending max_rows; the first entry
        whose max_rows >= the row count applies (the last one beyond). The decode grid aims at
        that many programs per SM by letting `num_split_programs` programs share a row; 0 means
        one program per row, which then also combines the row (no combine launch).
    fuse_kv_write: in passes where every row has one query token, the decode kernel stores the
        rows' new K/V itself (no `kv_write` launch). The K/V a row reads are the same bytes.
    last_program_combines: when several programs share a row, the last one to finish (an
        atomic count per row and head program) folds the row instead of a combine launch (on by
        default: 8.0 vs 9.3 µs at 1 × 640 on the H200, docs/kernels.md).
    """

    programs_per_sm: tuple[tuple[int, float], ...] = ((1, 4.0), (8, 4.0), (32, 2.0), (128, 2.0))
    fuse_kv_write: bool = True
    last_program_combines: bool = True

    def target_programs(self, rows: int, num_sms: int) -> int:
        per_sm = self.programs_per_sm[-1][1]
        for max_rows, value in self.programs_per_sm:
            if rows <= max_rows:
                per_sm = value
                break
        return int(per_sm * num_sms)

    def num_split_programs(
        self, rows: int, head_programs: int, partitions: int, num_sms: int
    ) -> int:
        target = self.target_programs(rows, num_sms)
        return split_programs(rows, head_programs, partitions, target)


def _next_power_of_2(value: int) -> int:
    return 1 << max(0, value - 1).bit_length()
