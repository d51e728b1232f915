"""Packed causal prefill over paged K/V through FlashInfer's `BatchPrefillWithPagedKVCacheWrapper`:
FA2, or FA3 (Hopper) where a backend asks for it.

Owns: one prefill wrapper per backend, planned once per prompt pass from its host lengths with the
KV split off, the check after the first plan that FlashInfer planned the kernel asked for, and
`KVReadScales` (an fp8 cache's layer scales as FlashInfer's `run` calls take them, decode's too).
Must not: serve the decode path (its plan reads host lengths) or be captured in a CUDA graph.

Determinism: with `disable_split_kv=True` (FA2) each query tile's reduction runs in one CTA over
the whole context, so a prompt's result depends on that prompt alone, not on what is packed beside
it. FA3 never splits the KV of a tile. A prompt's bits may differ between FA2 and FA3, and
between chunkings of the same prompt (close, not bitwise equal).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from loopserve.attention.base import AttentionSpec
from loopserve.attention.flashinfer.csr import gather_pages, prefill_layout
from loopserve.kv.metadata import AttentionMetadata

PREFILL_KERNELS = ("fa2", "fa3")
FA3_HEAD_SIZES = frozenset({64, 128, 256})  # what FlashInfer builds FA3 prefill for
WORKSPACE_BYTES = 32 * 2**20  # float workspace; unused while the KV split is off
# FlashInfer's FA2 plan info: 15 integers, the last one says whether the KV is split.
_FA2_PLAN_INFO_LENGTH = 15


class KernelMismatchError(RuntimeError):
    """FlashInfer planned a different kernel than the one asked for."""


@dataclass(frozen=True, slots=True)
class KVReadScales:
    """What FlashInfer's `run` is given for an fp8 cache: None where a scale is 1 (no work)."""

    k_scale: float | None = None
    v_scale: float | None = None


def read_scales(values: tuple[float, float]) -> KVReadScales:
    k_scale, v_scale = values
    return KVReadScales(None if k_scale == 1.0 else k_scale, None if v_scale == 1.0 else v_scale)


@dataclass(frozen=True, slots=True)
class PrefillPlan:
    """What the layers of one prompt pass share."""

    num_tokens: int  # query_start_host[-1]; later tokens belong to no row and are zeroed
    empty_tokens: torch.Tensor | None  # [E] int64 query tokens of rows with no context


class PagedPrefill:
    def __init__(self, spec: AttentionSpec, kernel: str, scale: float) -> None:
        if kernel not in PREFILL_KERNELS:
            raise ValueError(f"prefill kernel {kernel!r} is not one of {PREFILL_KERNELS}")
        self.spec = spec
        self.kernel = kernel
        self.scale = scale
        self._wrapper: Any = None
        self._plan_copied: torch.cuda.Event | None = None
        self._checked = False

    def plan(self, metadata: AttentionMetadata) -> PrefillPlan:
        """Plan one prompt pass (host work, one pinned copy; may wait for the previous plan)."""
        starts, lengths = metadata.query_start_host, metadata.seq_lens_host
        if starts is None or lengths is None:
            raise ValueError("a pass with prompt chunks needs the host query starts and lengths")
        spec = self.spec
        page_table = metadata.page_table  # [S, P]
        layout = prefill_layout(starts, lengths, page_table.shape[1], spec.block_size)
        indices = gather_pages(page_table, layout.table_positions)
        wrapper = self._wrapper_on(page_table.device)
        self._wait_for_previous_plan()

        def host(values: list[int]) -> torch.Tensor:
            return torch.tensor(values, dtype=torch.int32)

        wrapper.plan(
            host(layout.qo_indptr),
            host(layout.kv_indptr),
            indices,
            host(layout.last_page_len),
            spec.num_heads,
            spec.num_kv_heads,
            spec.head_size,
            spec.block_size,
            causal=True,
            sm_scale=self.scale,
            q_data_type=spec.dtype,
            kv_data_type=spec.cache_dtype,
            disable_split_kv=True,
        )
        if page_table.device.type == "cuda":
            self._plan_copied = torch.cuda.Event()
            self._plan_copied.record()
        if not self._checked:
            check_prefill_plan(wrapper, self.kernel)
            self._checked = True
        empty = None
        if layout.empty_tokens:
            empty = torch.tensor(layout.empty_tokens, dtype=torch.int64).to(page_table.device)
        return PrefillPlan(num_tokens=starts[-1], empty_tokens=empty)

    def run(
        self,
        plan: PrefillPlan,
        q: torch.Tensor,  # [T, Nq, D]
        key_cache: torch.Tensor,  # [pages, block, Nkv, D]
        value_cache: torch.Tensor,  # [pages, block, Nkv, D]
        out: torch.Tensor,  # [T, Nq, D] contiguous
        scales: KVReadScales,  # an fp8 cache's (None: 1)
    ) -> None:
        tokens = plan.num_tokens
        queries = q[:tokens]
        if self.kernel == "fa3" and not queries.is_contiguous():
            queries = queries.contiguous()
        self._wrapper.run(
            queries, (key_cache, value_cache), out=out[:tokens], k_scale=scales.k_scale,
            v_scale=scales.v_scale,
        )  # fmt: skip
        if plan.empty_tokens is not None:
            out.index_fill_(0, plan.empty_tokens, 0.0)
        if tokens < q.shape[0]:
            out[tokens:].zero_()  # tokens of no row, like the reference

    def _wrapper_on(self, device: torch.device) -> Any:
        if self._wrapper is None:
            from loopserve.attention.flashinfer.library import import_flashinfer

            workspace = torch.zeros(WORKSPACE_BYTES, dtype=torch.uint8, device=device)
            self._wrapper = import_flashinfer().BatchPrefillWithPagedKVCacheWrapper(
                workspace, "NHD", backend=self.kernel
            )
        return self._wrapper

    def _wait_for_previous_plan(self) -> None:
        """A plan writes the wrapper's pinned staging buffer and queues its copy to the device;
        the next plan may only overwrite that buffer once the copy has run (prompt passes may
        wait on the host; the decode path never comes here)."""
        if self._plan_copied is not None:
            self._plan_copied.synchronize()
            self._plan_copied = None


def check_prefill_plan(wrapper: Any, kernel: str) -> None:
    """Fail loudly unless FlashInfer planned `kernel` with the KV split off."""
    resolved = getattr(wrapper, "_backend", None)
    if resolved != kernel:
        raise KernelMismatchError(
            f"FlashInfer planned prefill kernel {resolved!r}, not the requested {kernel!r}"
        )
    if kernel == "fa2":
        info = list(getattr(wrapper, "_plan_info", None) or [])
        if len(info) != _FA2_PLAN_INFO_LENGTH or info[-1]:
            raise KernelMismatchError(
                f"FlashInfer's FA2 prefill plan {info} is not the unsplit plan that was asked "
                "for (the plan layout changed, or disable_split_kv was ignored)"
            )
