"""The `flashinfer_xqa` backend: FlashInfer's XQA decode kernel (SM90, SM100, SM120) on a bf16 KV
cache, and paged prefill through FlashInfer's Hopper FA3 kernel on SM90 (FA2 elsewhere).

Owns: the XQA launch of a decode pass, its workspace, and keeping XQA from splitting rows. Must
not: import flashinfer at module import time or copy device lengths to the host.

XQA takes what the decode step has: device lengths [S] and the dense page table [S, P] (P pages
per row, padded with the null page), so decode needs no plan at all and is graph-safe as is.

Determinism: XQA may split each row's KV over several CTAs ("multi-block" mode), as many as
`round(3 * sm_count // (rows * kv_heads) * 0.25)` on SM90 (`sm_count // (rows * kv_heads)`
elsewhere): more CTAs per row in small batches, so a row's bits would depend on the rows beside
it. FlashInfer's launchers ignore the `XQA_NB_SUB_SEQ` override of the upstream kernel (an
earlier version of this backend relied on it, and the H200 tests caught the row-count
dependence), and `sm_count` is used for nothing but this choice, so the backend passes an SM
count of 1: one CTA per row and KV head at every batch size. The price is parallelism for small
batches (16 CTAs for one Ouro row).

Rows of no context: XQA leaves NaN in them (seen on the H200); the backend zeroes them, as the
other backends' rows of length 0 are.

FP8 KV: XQA reads an FP8 cache with bf16 queries, but with one `kv_scale` for K and V, where
loopserve's cache has a K and a V scale per layer; not declared (FA2 takes an fp8 cache).
"""

from __future__ import annotations

from typing import ClassVar

import torch

from loopserve.attention.base import AttentionSpec
from loopserve.attention.flashinfer.backend import FlashInferBackend
from loopserve.attention.flashinfer.library import import_flashinfer
from loopserve.attention.flashinfer.prefill import KVReadScales
from loopserve.kv.metadata import AttentionMetadata

# The SM count XQA's multi-block heuristic is given: 1 makes it choose one CTA per row and KV head.
SPLIT_FREE_SM_COUNT = 1
SEMAPHORE_BYTES = 8 * 2**20  # as FlashInfer's own XQA wrapper reserves
SCRATCH_BYTES = 64 * 2**20  # partial results of split rows (unused without a split)


class FlashInferXQABackend(FlashInferBackend):
    name = "flashinfer_xqa"
    dtypes: ClassVar[frozenset[torch.dtype]] = frozenset({torch.bfloat16})
    kv_cache_dtypes: ClassVar[frozenset[torch.dtype]] = frozenset({torch.bfloat16})
    block_sizes: ClassVar[frozenset[int] | None] = frozenset({16, 32, 64, 128})
    compute_capability_majors: ClassVar[frozenset[int] | None] = frozenset({9, 10, 12})
    min_compute_capability = (9, 0)
    group_sizes: ClassVar[frozenset[int] | None] = frozenset({1, 2, 4, 8, 16})
    determinism: ClassVar[str] = (
        "decode: no KV split (one CTA per row and KV head), bitwise batch-invariant; prefill: "
        "FA3 on SM90 (no KV split), else FA2 with the KV split off"
    )

    def __init__(self, spec: AttentionSpec) -> None:
        super().__init__(spec)
        self._semaphores: torch.Tensor | None = None
        self._scratch: torch.Tensor | None = None

    def _prepare_decode(self, metadata: AttentionMetadata) -> None:
        if self._semaphores is None:  # once; semaphores must start at zero
            device = metadata.seq_lens.device
            self._semaphores = torch.zeros(SEMAPHORE_BYTES, dtype=torch.uint8, device=device)
            self._scratch = torch.zeros(SCRATCH_BYTES, dtype=torch.uint8, device=device)

    def _decode(
        self,
        q: torch.Tensor,  # [S, Nq, D]
        key_cache: torch.Tensor,  # [pages, block, Nkv, D]
        value_cache: torch.Tensor,  # [pages, block, Nkv, D]
        metadata: AttentionMetadata,
        out: torch.Tensor,  # [S, Nq, D] contiguous
        scales: KVReadScales,  # always 1: no fp8 cache is declared here
    ) -> None:
        import_flashinfer().xqa(
            q.contiguous().unsqueeze(1),  # [S, beam 1, Nq, D]; XQA reads q densely
            key_cache,
            value_cache,
            metadata.page_table.contiguous(),  # [S, P] int32
            metadata.seq_lens.unsqueeze(1),  # [S, 1] int32 (read as uint32; never negative)
            out.unsqueeze(1),
            self._scratch,
            self._semaphores,
            self.spec.num_kv_heads,
            self.spec.block_size,
            # XQA scales q.k by q_scale / sqrt(D); ours is self.scale.
            q_scale=self.scale * self.spec.head_size**0.5,
            kv_layout="NHD",
            sm_count=SPLIT_FREE_SM_COUNT,
        )
        out.masked_fill_((metadata.seq_lens == 0)[:, None, None], 0.0)
