"""The Triton attention backend: KV write, paged decode and packed causal prefill on CUDA.

Owns: the tilings chosen for a spec, the per-metadata plan (decode workspace, programs per row,
prefill tile map) and the launches of one layer. Must not: import triton when this module is
imported (the kernel modules are imported when an instance is built), read host copies of the
lengths on the decode path (it is CUDA-graph captured), or fall back to another backend.

Rows with one query token always go through the decode kernels, prompt chunks through the
prefill kernel, so a decode row's bits depend only on its own length and pages, whether it runs
alone, in a larger decode batch, or next to prompt chunks. See docs/kernels.md.

Testing mode: with `TRITON_INTERPRET=1` in the environment (set before the kernels are first
imported), the backend also accepts device "cpu" and its kernels run in triton's CPU interpreter.
That is how tests/kernels checks the kernels without a GPU; it is far too slow for anything else,
and `auto` on a CPU machine without that variable still chooses the torch backend.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar

import torch

from loopserve.attention.base import AttentionSpec, OutBufferBackend
from loopserve.kernels.availability import interpreter_mode, triton_installed
from loopserve.kv.metadata import AttentionMetadata
from loopserve.kv.storage import FP8, KVStorage
from loopserve.kv.transfer import to_device

if TYPE_CHECKING:
    from loopserve.kernels.decode_plan import DecodeSchedule, DecodeTiling
    from loopserve.kernels.paged_decode import DecodeWorkspace


@dataclass(slots=True)
class _Plan:
    """What every layer of one pass shares; built once per metadata by `prepare`."""

    metadata: AttentionMetadata
    decode_only: bool  # every row has one query token: no host lists are read
    has_decode_rows: bool
    num_split_programs: int  # from the row count only (DecodeSchedule)
    prefill_tiles: torch.Tensor | None  # [tiles, 2] int32 (sequence, first query); None if none
    num_query_tokens: int | None  # query_start_host[-1]; None on the decode-only path
    padded: bool  # a padded prompt pass: the output is zeroed first (tokens of no sequence)


class TritonAttentionBackend(OutBufferBackend):
    name = "triton"
    devices: ClassVar[frozenset[str]] = frozenset({"cuda"})
    dtypes: ClassVar[frozenset[torch.dtype]] = frozenset(
        {torch.float32, torch.bfloat16, torch.float16}
    )
    # Any head size works (tiles pad it to a power of two); these are the ones tests cover.
    head_sizes: ClassVar[frozenset[int] | None] = frozenset({32, 64, 80, 96, 128, 256})
    block_size_multiple = 1  # pages are looked up per token, any block size works
    min_compute_capability = (8, 0)  # bf16 tensor-core dots
    kv_cache_dtypes: ClassVar[frozenset[torch.dtype] | None] = frozenset({FP8})
    supports_cuda_graphs = True
    supports_packed_prefill = True
    supports_prompt_graphs = True

    def __init__(
        self,
        spec: AttentionSpec,
        *,
        decode_tiling: DecodeTiling | None = None,
        decode_schedule: DecodeSchedule | None = None,
    ) -> None:
        """`decode_tiling` / `decode_schedule` override the defaults (the decode sweep does)."""
        super().__init__(spec)
        from loopserve.kernels.decode_plan import DecodeSchedule, DecodeTiling
        from loopserve.kernels.paged_prefill import PrefillTiling

        group = spec.num_heads // spec.num_kv_heads
        # Fixed per shape (a row's bits depend on it); the schedule only picks programs per row.
        self.decode_tiling = decode_tiling or DecodeTiling.for_shape(group, spec.head_size)
        self.decode_schedule = decode_schedule or DecodeSchedule()
        self.prefill_tiling = PrefillTiling.for_shape(spec.head_size, spec.dtype)
        self._plan: _Plan | None = None
        # Padded passes' tile maps, one static buffer per capacity (a prompt graph reads it).
        self._static_tiles: dict[int, torch.Tensor] = {}
        self._workspaces = _DecodeWorkspacePool(
            spec.num_heads, spec.head_size, self.decode_tiling.max_partitions
        )

    @classmethod
    def unsupported_reasons(cls, spec: AttentionSpec) -> list[str]:
        if spec.device_type == "cpu" and interpreter_mode():
            # Testing mode: judge everything else as on a GPU the backend supports.
            spec = dataclasses.replace(
                spec, device_type="cuda", compute_capability=cls.min_compute_capability
            )
        reasons = super().unsupported_reasons(spec)
        if spec.num_heads % spec.num_kv_heads:
            reasons.append(f"{spec.num_heads} heads are not a multiple of {spec.num_kv_heads}")
        return reasons

    @classmethod
    def environment_reasons(cls, spec: AttentionSpec) -> list[str]:
        if not triton_installed():
            return ["triton is not installed (pip install 'loopserve[triton]')"]
        return []

    def decode_split_programs(self, metadata: AttentionMetadata) -> int:
        """Programs per (row, head program) of the decode grid: from shapes and the row count."""
        partitions = self.decode_tiling.partitions_bound(
            metadata.page_table.shape[1] * self.spec.block_size
        )
        head_programs = self.decode_tiling.head_programs(
            self.spec.num_heads, self.spec.num_kv_heads
        )
        rows, device = metadata.seq_lens.shape[0], metadata.seq_lens.device
        return self.decode_schedule.num_split_programs(
            rows, head_programs, partitions, _sm_count(device)
        )

    def prepare(self, metadata: AttentionMetadata) -> None:
        rows = metadata.seq_lens.shape[0]
        device = metadata.seq_lens.device
        partitions = self.decode_tiling.partitions_bound(
            metadata.page_table.shape[1] * self.spec.block_size
        )
        self._workspaces.reserve(rows, partitions, device)
        splits = self.decode_split_programs(metadata)
        if metadata.is_decode and not metadata.padded:
            self._plan = _Plan(metadata, True, True, splits, None, None, False)
            return
        starts, seq_lens = metadata.query_start_host, metadata.seq_lens_host
        if starts is None or seq_lens is None:
            raise ValueError("a pass with prompt chunks needs the host query starts and lengths")
        has_decode_rows = any(starts[i + 1] - starts[i] == 1 for i in range(len(starts) - 1))
        if metadata.padded:
            if has_decode_rows:
                raise ValueError("a padded prompt pass cannot hold chunks of one token")
            tiles = self._padded_tiles(metadata, starts, seq_lens)
            self._plan = _Plan(metadata, False, False, splits, tiles, None, True)
            return
        tiles = self._prefill_tiles(starts, seq_lens, device)
        self._plan = _Plan(metadata, False, has_decode_rows, splits, tiles, starts[-1], False)

    def _prefill_tiles(
        self, starts: list[int], seq_lens: list[int], device: torch.device
    ) -> torch.Tensor:
        """[tiles, 2] int32 (sequence, first query) on `device`, copied without a host sync."""
        from loopserve.kernels.paged_prefill import build_tile_map

        tiles = build_tile_map(starts, seq_lens, self.prefill_tiling.block_m)
        return to_device(tiles, torch.int32, device).reshape(-1, 2)

    def _padded_tiles(
        self, metadata: AttentionMetadata, starts: list[int], seq_lens: list[int]
    ) -> torch.Tensor:
        """The static tile buffer of the pass's capacity, refilled with this pass's map."""
        from loopserve.kernels.paged_prefill import padded_tile_map, tile_capacity

        block_m = self.prefill_tiling.block_m
        capacity = tile_capacity(metadata.slot_mapping.shape[0], metadata.num_sequences, block_m)
        device = metadata.seq_lens.device
        buffer = self._static_tiles.get(capacity)
        if buffer is None:
            buffer = torch.empty((capacity, 2), dtype=torch.int32, device=device)
            self._static_tiles[capacity] = buffer
        tiles = padded_tile_map(starts, seq_lens, block_m, capacity)
        buffer.copy_(to_device(tiles, torch.int32, device).reshape(-1, 2))
        return buffer

    @property
    def decode_rotary(self) -> bool:
        """The decode kernel rotates q and k where it also writes the new K/V."""
        return self.decode_schedule.fuse_kv_write

    def forward_into(
        self,
        q: torch.Tensor,  # [T, Nq, D]
        k: torch.Tensor,  # [T, Nkv, D]
        v: torch.Tensor,  # [T, Nkv, D]
        kv: KVStorage,
        layer: int,
        metadata: AttentionMetadata,
        out: torch.Tensor,  # [T, Nq, D], last dim contiguous; every row is written
    ) -> None:
        """`forward` into a caller-owned output (a static buffer under CUDA graphs, say)."""
        from loopserve.kernels.kv_write import write_kv
        from loopserve.kernels.paged_decode import paged_decode_attention
        from loopserve.kernels.paged_prefill import paged_prefill_attention

        if self._plan is None or self._plan.metadata is not metadata:
            self.prepare(metadata)
        plan = self._plan
        assert plan is not None
        key_cache, value_cache = kv.key_cache(layer), kv.value_cache(layer)
        # A float8 cache's scales, read on the device (fixed once serving starts: graph-safe).
        scales, inverse_scales = kv.scales[layer], kv.inverse_scales[layer]
        if plan.padded:
            out.zero_()
        if plan.decode_only and q.shape[0] != metadata.seq_lens.shape[0]:
            raise ValueError(
                f"decode pass with {q.shape[0]} tokens for {metadata.num_sequences} rows"
            )
        fused_write = plan.decode_only and self.decode_schedule.fuse_kv_write
        if not fused_write:
            write_kv(k, v, key_cache, value_cache, metadata.slot_mapping, inverse_scales)
        if plan.has_decode_rows:
            workspace = self._workspaces.view(metadata.seq_lens.shape[0])
            paged_decode_attention(
                q, key_cache, value_cache, metadata, out, workspace,
                scale=self.scale, num_split_programs=plan.num_split_programs,
                tiling=self.decode_tiling, new_kv=(k, v) if fused_write else None,
                rope=metadata.rope,
                last_program_combines=self.decode_schedule.last_program_combines,
                kv_scales=(scales, inverse_scales),
                unit_scales=kv.scale_values(layer) == (1.0, 1.0),
                pdl=metadata.seq_lens.shape[0] <= self.spec.dependent_launch_rows,
            )  # fmt: skip
        if plan.prefill_tiles is not None:
            paged_prefill_attention(
                q, key_cache, value_cache, metadata, plan.prefill_tiles, out,
                scale=self.scale, tiling=self.prefill_tiling, kv_scales=scales,
            )  # fmt: skip
        if plan.num_query_tokens is not None and plan.num_query_tokens < q.shape[0]:
            out[plan.num_query_tokens :].zero_()  # tokens of no sequence, like the reference


class _DecodeWorkspacePool:
    """The decode partials buffer, grown by doubling and never freed while the backend lives.

    A CUDA graph captured with one buffer keeps pointing at it; retiring (not freeing) outgrown
    buffers keeps such graphs valid. Doubling bounds what is retained to ~4x the largest buffer.
    """

    def __init__(self, num_heads: int, head_dim: int, max_partitions: int) -> None:
        self.num_heads = num_heads
        self.head_dim = head_dim
        self.max_partitions = max_partitions
        self.rows = 0
        self.partitions = 0
        self._buffers: list[DecodeWorkspace] = []  # the last one is current

    def reserve(self, rows: int, partitions: int, device: torch.device) -> None:
        if rows <= self.rows and partitions <= self.partitions:
            return
        from loopserve.kernels.paged_decode import new_workspace

        self.rows = max(rows, 2 * self.rows)
        self.partitions = max(partitions, min(2 * self.partitions, self.max_partitions))
        self._buffers.append(
            new_workspace(self.rows, self.num_heads, self.head_dim, self.partitions, device)
        )

    def view(self, rows: int) -> DecodeWorkspace:
        """The current buffer's first `rows` rows (strides unchanged)."""
        from loopserve.kernels.paged_decode import DecodeWorkspace

        current = self._buffers[-1]
        return DecodeWorkspace(
            partial_out=current.partial_out[:rows],
            partial_max=current.partial_max[:rows],
            partial_sum=current.partial_sum[:rows],
            arrivals=current.arrivals[:rows],
        )


_SM_COUNTS: dict[int, int] = {}


def _sm_count(device: torch.device) -> int:
    """Streaming multiprocessors of a CUDA device; 1 in the interpreter (a few programs per row)."""
    if device.type != "cuda":
        return 1
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _SM_COUNTS:
        _SM_COUNTS[index] = torch.cuda.get_device_properties(index).multi_processor_count
    return _SM_COUNTS[index]
