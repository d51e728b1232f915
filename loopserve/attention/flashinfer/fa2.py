"""The `flashinfer_fa2` backend: FlashInfer's FA2 paged decode run from device-only lengths, and
FA2 packed causal prefill.

Owns: the decode plans (cached per rows and page-width bucket), refilling their page lists from
the device lengths every step, the choice between FlashInfer's CUDA-core and tensor-core decode
kernels, and the check that each plan is the unsplit kernel asked for. Must not: import flashinfer
at module import time, copy device lengths to the host, or make a plan inside a graph capture.

How decode runs without host lengths (the decode step keeps lengths on the device and runs ahead
of the host): with the KV split off, FlashInfer's decode plan does not depend on the lengths at
all. The CTA of (row b, KV head h) reads row b's length and pages from the device page lists
(`indptr`, `indices`, `last_page_len`) when it runs, and walks that whole row itself. So a plan is
made once per (rows, page-width bucket) from *dummy* host lists (one page per row, pinned memory,
no device-to-host copy), and each step only refills the device lists from `seq_lens` and the dense
page table (`DecodeCSR.fill`, a few small device ops, captured with the step). Which plan is
unsplit:
- tensor-core kernel: `disable_split_kv=True` in a CUDA-graph-mode wrapper that reads our buffers
  (FlashInfer documents this flag as the deterministic CUDA-graph mode);
- CUDA-core kernel: that flag is ignored there and a CUDA-graph-mode wrapper always splits small
  batches, by lengths known at plan time, which a device-length step cannot give. Its eager-mode
  plan does not split when every row fits in one chunk, which the one-page dummy rows guarantee;
  the wrapper then owns the page-list buffers (FlashInfer's private `_paged_kv_*_buf`), which we
  refill. `check_decode_plan` fails loudly if either ever resolves to a split or another kernel.

Determinism: no KV split, so a row's reduction depends only on its own length and pages: bitwise
the same alone, inside any batch, under any plan width, eagerly or replayed from a graph.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar, Literal

import torch

from loopserve.attention.base import AttentionSpec
from loopserve.attention.flashinfer.backend import FlashInferBackend
from loopserve.attention.flashinfer.csr import DecodeCSR
from loopserve.attention.flashinfer.library import import_flashinfer
from loopserve.attention.flashinfer.plan_cache import PlanCache, PlanKey, plan_key
from loopserve.attention.flashinfer.prefill import KernelMismatchError, KVReadScales
from loopserve.kv.metadata import AttentionMetadata
from loopserve.kv.storage import FP8

DecodeKernel = Literal["cuda_core", "tensor_core"]
# GQA group sizes FlashInfer's CUDA-core decode kernel is built for, and the ones it wins at. Larger
# groups (tensor cores fill their tiles better) go to the tensor-core kernel, as vLLM does; the
# H200 measurement behind it: the CUDA-core kernel won every Ouro (MHA) shape.
CUDA_CORE_GROUPS = frozenset({1, 2, 3, 4})
FLOAT_WORKSPACE_BYTES = 16 * 2**20  # shared by every decode plan; unused while unsplit
INT_WORKSPACE_BYTES = 2**20  # per plan (work lists of at most a few thousand CTAs)
PLAN_CACHE_CAPACITY = 64  # eager steps plan per exact row count (up to max_num_seqs)
# FlashInfer's plan info: the CUDA-core decode plan has 10 integers (padded batch size first,
# split flag last); the tensor-core (prefill-kernel) plan has 15 (split flag last).
_PLAN_INFO_LENGTH = {False: 10, True: 15}


@dataclass(slots=True)
class DecodePlan:
    wrapper: Any  # flashinfer.BatchDecodeWithPagedKVCacheWrapper, planned
    csr: DecodeCSR  # the device page lists its kernel reads


class FlashInferFA2Backend(FlashInferBackend):
    name = "flashinfer_fa2"
    # An fp8 cache: FlashInfer's FA2 decode and prefill read e4m3 K/V with bf16 / fp16 queries,
    # at head size 128 (FlashInfer 0.7.2's FA2 tile loaders say they do not work for fp8 at 64).
    kv_cache_dtypes: ClassVar[frozenset[torch.dtype] | None] = frozenset(
        {torch.bfloat16, torch.float16, FP8}
    )
    fp8_head_sizes: ClassVar[frozenset[int]] = frozenset({128})
    determinism: ClassVar[str] = (
        "decode: KV split off, bitwise batch- and plan-width-invariant; prefill: FA3 on SM90 "
        "(no KV split), else FA2 with the KV split off"
    )

    def __init__(self, spec: AttentionSpec, decode_kernel: DecodeKernel | None = None) -> None:
        super().__init__(spec)
        self.decode_kernel: DecodeKernel = decode_kernel or default_decode_kernel(spec)
        self.plans: PlanCache[DecodePlan] = PlanCache(PLAN_CACHE_CAPACITY)
        self._plan: DecodePlan | None = None
        self._float_workspace: torch.Tensor | None = None

    @classmethod
    def unsupported_reasons(cls, spec: AttentionSpec) -> list[str]:
        reasons = super().unsupported_reasons(spec)
        if spec.cache_dtype == FP8 and spec.head_size not in cls.fp8_head_sizes:
            reasons.append(
                f"an fp8 KV cache at head size {spec.head_size} (FlashInfer's FA2 reads fp8 K/V "
                f"at {sorted(cls.fp8_head_sizes)})"
            )
        return reasons

    def _prepare_decode(self, metadata: AttentionMetadata) -> None:
        rows, width = metadata.page_table.shape
        device = metadata.page_table.device
        capturing = device.type == "cuda" and torch.cuda.is_current_stream_capturing()
        key = plan_key(rows, width)
        plan = self.plans.get(key, lambda: self._new_plan(key, device), capturing=capturing)
        plan.csr.fill(metadata.seq_lens, metadata.page_table, self.spec.block_size)
        self._plan = plan

    def _decode(
        self,
        q: torch.Tensor,  # [S, Nq, D]
        key_cache: torch.Tensor,  # [pages, block, Nkv, D]
        value_cache: torch.Tensor,  # [pages, block, Nkv, D]
        metadata: AttentionMetadata,
        out: torch.Tensor,  # [S, Nq, D]
        scales: KVReadScales,
    ) -> None:
        assert self._plan is not None
        self._plan.wrapper.run(
            q, (key_cache, value_cache), out=out, k_scale=scales.k_scale, v_scale=scales.v_scale
        )

    def _new_plan(self, key: PlanKey, device: torch.device) -> DecodePlan:
        """A planned wrapper for `key`, from pinned dummy lists (no device-to-host copy)."""
        spec = self.spec
        tensor_cores = self.decode_kernel == "tensor_core"
        workspace = self._workspace(device)
        wrapper_class = import_flashinfer().BatchDecodeWithPagedKVCacheWrapper
        if tensor_cores:  # CUDA-graph mode: FlashInfer keeps reading our buffers
            csr = DecodeCSR.allocate(key.rows, key.width_bucket, device)
            wrapper = wrapper_class(
                workspace, "NHD", use_cuda_graph=True, use_tensor_cores=True,
                paged_kv_indptr_buffer=csr.indptr, paged_kv_indices_buffer=csr.indices,
                paged_kv_last_page_len_buffer=csr.last_page_len, backend="fa2",
            )  # fmt: skip
            indices = csr.indices[:0]  # nothing to copy; the step fills the list
        else:
            wrapper = wrapper_class(workspace, "NHD", use_tensor_cores=False, backend="fa2")
            # Zeros the size of the step's list, so the wrapper's device copy can hold it.
            size = DecodeCSR.indices_size(key.rows, key.width_bucket)
            indices = _pinned(torch.zeros(size, dtype=torch.int32), device)
        int_workspace = torch.zeros(INT_WORKSPACE_BYTES, dtype=torch.uint8, device=device)
        wrapper.reset_workspace_buffer(workspace, int_workspace)
        wrapper.plan(
            _pinned(torch.arange(key.rows + 1, dtype=torch.int32), device),  # one page per row
            indices,
            _pinned(torch.ones(key.rows, dtype=torch.int32), device),
            spec.num_heads,
            spec.num_kv_heads,
            spec.head_size,
            spec.block_size,
            q_data_type=spec.dtype,
            kv_data_type=spec.cache_dtype,
            sm_scale=self.scale,
            disable_split_kv=True,
            non_blocking=True,
        )
        check_decode_plan(wrapper, key.rows, tensor_cores)
        if not tensor_cores:  # eager mode: the wrapper copied the dummy lists to buffers it owns
            csr = adopt_page_lists(wrapper, key, device)
        return DecodePlan(wrapper, csr)

    def _workspace(self, device: torch.device) -> torch.Tensor:
        if self._float_workspace is None:
            self._float_workspace = torch.zeros(
                FLOAT_WORKSPACE_BYTES, dtype=torch.uint8, device=device
            )
        return self._float_workspace


def default_decode_kernel(spec: AttentionSpec) -> DecodeKernel:
    group = spec.num_heads // spec.num_kv_heads
    return "cuda_core" if group in CUDA_CORE_GROUPS else "tensor_core"


def check_decode_plan(wrapper: Any, rows: int, tensor_cores: bool) -> None:
    """Fail loudly unless FlashInfer planned the FA2 decode kernel asked for, unsplit."""
    resolved = getattr(wrapper, "resolved_backend", "fa2")
    if resolved != "fa2" or bool(wrapper.use_tensor_cores) != tensor_cores:
        kind = "tensor-core" if tensor_cores else "CUDA-core"
        raise KernelMismatchError(
            f"FlashInfer resolved decode to {resolved!r} (tensor cores: "
            f"{wrapper.use_tensor_cores}), not the requested FA2 {kind} kernel"
        )
    info = list(getattr(wrapper, "_plan_info", None) or [])
    unsplit = len(info) == _PLAN_INFO_LENGTH[tensor_cores] and not info[-1]
    if unsplit and not tensor_cores:
        unsplit = info[0] == rows  # one CTA row per row: no padding, no chunks
    if not unsplit:
        raise KernelMismatchError(
            f"FlashInfer's decode plan {info} for {rows} rows is not the unsplit plan asked for; "
            "a split plan would depend on lengths the device-resident step cannot give it"
        )


def adopt_page_lists(wrapper: Any, key: PlanKey, device: torch.device) -> DecodeCSR:
    """The device page lists an eager-mode wrapper reads (it made them when it planned)."""
    expected = {
        "indptr": key.rows + 1,
        "indices": DecodeCSR.indices_size(key.rows, key.width_bucket),
        "last_page_len": key.rows,
    }
    lists = {}
    for name, size in expected.items():
        buffer = getattr(wrapper, f"_paged_kv_{name}_buf", None)
        if not (
            isinstance(buffer, torch.Tensor)
            and buffer.dtype == torch.int32
            and buffer.device == device
            and tuple(buffer.shape) == (size,)
        ):
            raise KernelMismatchError(
                f"FlashInfer's decode wrapper has no int32 {name} buffer of {size} entries on "
                f"{device} (its internals changed): the CUDA-core decode path cannot refill it"
            )
        lists[name] = buffer
    columns = torch.arange(key.width_bucket, dtype=torch.int32, device=device)
    return DecodeCSR(columns=columns, **lists)


def _pinned(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A host tensor FlashInfer can copy to `device` asynchronously."""
    return host.pin_memory() if device.type == "cuda" else host
