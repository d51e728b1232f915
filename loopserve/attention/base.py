"""The attention backend interface and its capability declarations.

Owns: `AttentionSpec` (what the engine needs), `AttentionBackend` (what a backend can do and how it
is called). Must not: import optional kernels (triton, flashinfer) at module import time.

A backend sees only `(q, k, v, kv_storage, layer, metadata)`: it writes this pass's K/V into the
slots of `metadata.slot_mapping`, then computes causal attention of each query over its sequence's
pages. Decode attention must be batch-invariant: a row's reduction order depends only on its own
length, never on which other rows share the batch.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import ClassVar

import torch

from loopserve.kv.metadata import AttentionMetadata
from loopserve.kv.storage import KVStorage


@dataclass(frozen=True, slots=True)
class AttentionSpec:
    """What the engine will ask of a backend."""

    device_type: str  # "cpu" or "cuda"
    compute_capability: tuple[int, int] | None  # None off CUDA
    dtype: torch.dtype
    head_size: int
    num_heads: int
    num_kv_heads: int
    block_size: int
    cuda_graphs: bool
    kv_dtype: torch.dtype | None = None  # how K/V are stored; None: as `dtype`
    # Decode passes of up to this many rows run between kernels launched as programmatic
    # dependents (`kernels.pdl`; fp8 GEMV rows): a backend whose kernels can be launched that
    # way does so there. 0: never.
    dependent_launch_rows: int = 0

    @property
    def cache_dtype(self) -> torch.dtype:
        return self.dtype if self.kv_dtype is None else self.kv_dtype


class AttentionBackend(ABC):
    """Base class of every backend; subclasses declare their capabilities as class attributes."""

    name: ClassVar[str]
    devices: ClassVar[frozenset[str]]
    dtypes: ClassVar[frozenset[torch.dtype]]
    head_sizes: ClassVar[frozenset[int] | None]  # None: any even head size
    block_size_multiple: ClassVar[int] = 1
    min_compute_capability: ClassVar[tuple[int, int] | None] = None
    supports_cuda_graphs: ClassVar[bool] = False
    supports_packed_prefill: ClassVar[bool] = True
    # Takes padded prompt passes (kv/metadata.py) whose launches a CUDA graph can replay.
    supports_prompt_graphs: ClassVar[bool] = False
    # KV cache dtypes besides the model's own (None: only the model's).
    kv_cache_dtypes: ClassVar[frozenset[torch.dtype] | None] = None

    def __init__(self, spec: AttentionSpec) -> None:
        self.spec = spec
        self.scale = spec.head_size**-0.5

    @property
    def decode_rotary(self) -> bool:
        """Takes decode passes with `metadata.rope` (unrotated q and k; kv/metadata.py)."""
        return False

    @classmethod
    def unsupported_reasons(cls, spec: AttentionSpec) -> list[str]:
        """Why this backend cannot serve `spec`; empty when it can."""
        reasons = []
        if spec.device_type not in cls.devices:
            reasons.append(f"runs on {sorted(cls.devices)}, not {spec.device_type}")
        if spec.dtype not in cls.dtypes:
            reasons.append(f"dtype {spec.dtype} not in {sorted(str(d) for d in cls.dtypes)}")
        if cls.head_sizes is not None and spec.head_size not in cls.head_sizes:
            reasons.append(f"head size {spec.head_size} not in {sorted(cls.head_sizes)}")
        if spec.block_size % cls.block_size_multiple:
            reasons.append(
                f"block size {spec.block_size} is not a multiple of {cls.block_size_multiple}"
            )
        minimum = cls.min_compute_capability
        too_old = spec.compute_capability is None or (
            minimum is not None and spec.compute_capability < minimum
        )
        if minimum is not None and spec.device_type == "cuda" and too_old:
            reasons.append(f"needs compute capability >= {minimum}")
        if spec.cuda_graphs and not cls.supports_cuda_graphs:
            reasons.append("does not support CUDA graphs")
        extra = cls.kv_cache_dtypes or frozenset()
        if spec.cache_dtype != spec.dtype and spec.cache_dtype not in extra:
            reasons.append(f"a {spec.cache_dtype} KV cache is not supported")
        return reasons + cls.environment_reasons(spec)

    @classmethod
    def environment_reasons(cls, spec: AttentionSpec) -> list[str]:
        """Reasons outside the declared capabilities (a missing package, say)."""
        return []

    def prepare(self, metadata: AttentionMetadata) -> None:  # noqa: B027 - optional hook
        """Called once per metadata (per loop of a step) before any layer uses it."""

    @abstractmethod
    def forward(
        self,
        q: torch.Tensor,  # [T, Nq, D]
        k: torch.Tensor,  # [T, Nkv, D]
        v: torch.Tensor,  # [T, Nkv, D]
        kv: KVStorage,
        layer: int,
        metadata: AttentionMetadata,
    ) -> torch.Tensor:
        """Write k/v into `metadata.slot_mapping`, then attend. Returns [T, Nq, D]."""


class OutBufferBackend(AttentionBackend):
    """A backend whose kernels write into a caller-owned output (`forward_into`: a static buffer
    under CUDA graphs, say); `forward` allocates that output."""

    def forward(
        self,
        q: torch.Tensor,  # [T, Nq, D]
        k: torch.Tensor,  # [T, Nkv, D]
        v: torch.Tensor,  # [T, Nkv, D]
        kv: KVStorage,
        layer: int,
        metadata: AttentionMetadata,
    ) -> torch.Tensor:
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)  # [T, Nq, D]
        self.forward_into(q, k, v, kv, layer, metadata, out)
        return out

    @abstractmethod
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
        """`forward` into `out`."""
