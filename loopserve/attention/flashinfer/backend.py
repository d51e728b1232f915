"""What the FlashInfer backends share: capability declarations beyond the base class, the KV
write, and the split of a pass between the decode path and the prefill path.

Owns: `FlashInferBackend`, the base of `flashinfer_fa2` and `flashinfer_xqa`. Must not: import
flashinfer at module import time, read host lengths on the decode path (it is captured in CUDA
graphs and runs one step ahead of the host), or fall back to another backend.

A pass whose rows all have one query token (`metadata.is_decode`) goes through the subclass's
decode path, which reads only device tensors. Any other pass is a prompt pass: it has host
lengths and goes through `PagedPrefill`, every row included (loopserve never packs decode rows
with prompt chunks: the decode step is a pass of its own).

An fp8 cache (`kv_cache_dtypes` says which backend takes one): K/V are written by the rule of
`kv.storage` (times the layer's reciprocal scale, saturated, rounded to e4m3), and FlashInfer
reads them with the layer's scales as host floats (`KVStorage.scale_values`: the scores' scale
times the K scale, the output times the V scale, which is the rule's read, rounded elsewhere).
The scales are fixed before serving starts, so a CUDA graph may hold them as constants.
"""

from __future__ import annotations

from abc import abstractmethod
from typing import ClassVar

import torch

from loopserve.attention.base import AttentionSpec, OutBufferBackend
from loopserve.attention.flashinfer import library
from loopserve.attention.flashinfer.prefill import (
    FA3_HEAD_SIZES,
    KVReadScales,
    PagedPrefill,
    PrefillPlan,
    read_scales,
)
from loopserve.kernels.availability import compiled_for
from loopserve.kv.metadata import AttentionMetadata
from loopserve.kv.storage import FP8, KVStorage, to_cache_dtype


class FlashInferBackend(OutBufferBackend):
    devices: ClassVar[frozenset[str]] = frozenset({"cuda"})
    dtypes: ClassVar[frozenset[torch.dtype]] = frozenset({torch.bfloat16, torch.float16})
    # The head sizes the GPU tests cover (128 always, 64 in the extended run); FlashInfer builds
    # others, 256 included, on demand, but they are not declared until tested.
    head_sizes: ClassVar[frozenset[int] | None] = frozenset({64, 128})
    min_compute_capability = (8, 0)
    supports_cuda_graphs = True
    supports_packed_prefill = True
    # Declarations the base class does not have (checked by `unsupported_reasons` below).
    block_sizes: ClassVar[frozenset[int] | None] = None  # None: any page size
    compute_capability_majors: ClassVar[frozenset[int] | None] = None  # None: any >= minimum
    group_sizes: ClassVar[frozenset[int] | None] = None  # query heads per KV head; None: any
    # The KV cache holds the model dtype today; an FP8 cache is declared here when it exists.
    kv_cache_dtypes: ClassVar[frozenset[torch.dtype] | None] = frozenset(
        {torch.bfloat16, torch.float16}
    )
    # A decode row's bits depend only on its own length and pages, never on the rows beside it,
    # the plan's row count or its page-width bucket (no KV split, or a fixed one).
    batch_invariant_decode: ClassVar[bool] = True
    determinism: ClassVar[str] = ""  # how, in words (subclasses)

    def __init__(self, spec: AttentionSpec) -> None:
        super().__init__(spec)
        self._prefill = PagedPrefill(spec, self.prefill_kernel(spec), self.scale)
        self._metadata: AttentionMetadata | None = None  # what the current plan was made for
        self._prefill_plan: PrefillPlan | None = None

    @classmethod
    def prefill_kernel(cls, spec: AttentionSpec) -> str:
        """FlashInfer's prefill implementation for `spec`: FA3 on Hopper (SM90) for the head sizes
        it is built for, FA2 elsewhere. On the H200 FA3 took 24 µs for one 1024-token prompt of
        Ouro-1.4B's shape and 136 µs for eight, FA2 38 and 183 (docs/kernels.md). An fp8 cache
        takes FA2 (FlashInfer's FA3 reads fp8 K/V only with fp8 queries)."""
        hopper = spec.compute_capability is not None and spec.compute_capability[0] == 9
        same_dtype = spec.cache_dtype == spec.dtype
        return "fa3" if hopper and same_dtype and spec.head_size in FA3_HEAD_SIZES else "fa2"

    @classmethod
    def unsupported_reasons(cls, spec: AttentionSpec) -> list[str]:
        reasons = super().unsupported_reasons(spec)
        if spec.num_heads % spec.num_kv_heads:
            reasons.append(f"{spec.num_heads} heads are not a multiple of {spec.num_kv_heads}")
        elif cls.group_sizes is not None and spec.num_heads // spec.num_kv_heads not in (
            cls.group_sizes
        ):
            group = spec.num_heads // spec.num_kv_heads
            reasons.append(f"{group} query heads per KV head not in {sorted(cls.group_sizes)}")
        if cls.block_sizes is not None and spec.block_size not in cls.block_sizes:
            reasons.append(f"block size {spec.block_size} not in {sorted(cls.block_sizes)}")
        if spec.cache_dtype == spec.dtype and spec.dtype not in (cls.kv_cache_dtypes or ()):
            reasons.append(f"a {spec.dtype} KV cache is not supported")  # (else: the base says)
        majors, capability = cls.compute_capability_majors, spec.compute_capability
        if spec.device_type == "cuda" and majors and capability and capability[0] not in majors:
            names = "/SM".join(str(major) for major in sorted(majors))
            reasons.append(f"compute capability {capability} is not SM{names}x")
        return reasons

    @classmethod
    def environment_reasons(cls, spec: AttentionSpec) -> list[str]:
        if not library.flashinfer_installed():
            return [f"flashinfer is not installed ({library.INSTALL_HINT})"]
        if not library.jit_compiler_found():
            return [
                "flashinfer builds its kernels on first use and finds no nvcc (set CUDA_HOME) "
                "nor the flashinfer-jit-cache package"
            ]
        return []

    # ----- per metadata ----------------------------------------------------------------------

    def prepare(self, metadata: AttentionMetadata) -> None:
        if metadata.is_decode:
            self._prepare_decode(metadata)
            self._prefill_plan = None
        else:
            self._prefill_plan = self._prefill.plan(metadata)
        self._metadata = metadata

    @abstractmethod
    def _prepare_decode(self, metadata: AttentionMetadata) -> None:
        """Whatever the decode path needs per metadata, from device tensors only."""

    @abstractmethod
    def _decode(
        self,
        q: torch.Tensor,  # [S, Nq, D]
        key_cache: torch.Tensor,  # [pages, block, Nkv, D]
        value_cache: torch.Tensor,  # [pages, block, Nkv, D]
        metadata: AttentionMetadata,
        out: torch.Tensor,  # [S, Nq, D] contiguous
        scales: KVReadScales,
    ) -> None:
        """Decode attention of one query per row into `out`."""

    # ----- per layer -------------------------------------------------------------------------

    def forward_into(
        self,
        q: torch.Tensor,  # [T, Nq, D]
        k: torch.Tensor,  # [T, Nkv, D]
        v: torch.Tensor,  # [T, Nkv, D]
        kv: KVStorage,
        layer: int,
        metadata: AttentionMetadata,
        out: torch.Tensor,  # [T, Nq, D] contiguous; every row is written
    ) -> None:
        """`forward` into a caller-owned output (a static buffer under CUDA graphs, say)."""
        if self._metadata is not metadata:
            self.prepare(metadata)
        key_cache, value_cache = kv.key_cache(layer), kv.value_cache(layer)
        fp8 = key_cache.dtype == FP8
        inverse = kv.inverse_scales[layer] if fp8 else None
        write_kv(k, v, key_cache, value_cache, metadata.slot_mapping, inverse)
        scales = read_scales(kv.scale_values(layer)) if fp8 else KVReadScales()
        if self._prefill_plan is None:
            if q.shape[0] != metadata.num_sequences:
                raise ValueError(
                    f"decode pass with {q.shape[0]} tokens for {metadata.num_sequences} rows"
                )
            self._decode(q, key_cache, value_cache, metadata, out, scales)
        else:
            self._prefill.run(self._prefill_plan, q, key_cache, value_cache, out, scales)


def write_kv(
    k: torch.Tensor,  # [T, Nkv, D]
    v: torch.Tensor,  # [T, Nkv, D]
    key_cache: torch.Tensor,  # [pages, block, Nkv, D]
    value_cache: torch.Tensor,  # [pages, block, Nkv, D]
    slot_mapping: torch.Tensor,  # [T] int64
    inverse_scales: torch.Tensor | None = None,  # [2] fp32, an fp8 cache's (K, V) reciprocals
) -> None:
    """This pass's K/V into their slots: the Triton kernel (one launch) where it can run, else
    two index writes (padding tokens share null-page slots; nothing reads those); an fp8 cache
    stores them by `kv.storage.to_cache_dtype`'s rule either way."""
    if compiled_for(key_cache):
        from loopserve.kernels.kv_write import write_kv as triton_write_kv

        triton_write_kv(k, v, key_cache, value_cache, slot_mapping, inverse_scales)
        return
    if inverse_scales is not None:
        k = to_cache_dtype(k, key_cache.dtype, inverse_scales[0])
        v = to_cache_dtype(v, value_cache.dtype, inverse_scales[1])
    heads, dim = key_cache.shape[-2:]
    key_cache.view(-1, heads, dim)[slot_mapping] = k
    value_cache.view(-1, heads, dim)[slot_mapping] = v
