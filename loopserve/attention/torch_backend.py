"""The torch reference attention backend: gathers each sequence's pages and runs SDPA.

Owns: a clear, obviously-correct paged attention for CPU and for checking every other backend.
Must not: be clever; it loops over sequences on the host and is slow by design.
"""

from __future__ import annotations

from typing import ClassVar

import torch
import torch.nn.functional as F

from loopserve.attention.base import AttentionBackend
from loopserve.kv.metadata import AttentionMetadata
from loopserve.kv.storage import FP8, K, KVStorage, V, from_cache, to_cache_dtype


def write_kv(
    kv: KVStorage, layer: int, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor
) -> None:
    """Store k/v [T, Nkv, D] into flat slots [T] of one layer (as the cache's dtype stores them)."""
    dtype, inverse = kv.cache.dtype, kv.inverse_scales[layer]
    keys = kv.key_cache(layer).view(-1, kv.num_kv_heads, kv.head_dim)
    values = kv.value_cache(layer).view(-1, kv.num_kv_heads, kv.head_dim)
    keys[slots] = to_cache_dtype(k, dtype, inverse[K])
    values[slots] = to_cache_dtype(v, dtype, inverse[V])


def gather_context(cache: torch.Tensor, pages: torch.Tensor, length: int) -> torch.Tensor:
    """cache [pages, block, Nkv, D], page ids [P] -> the first `length` positions [len, Nkv, D]."""
    block = cache.shape[1]
    needed = -(-length // block)
    return cache[pages[:needed]].flatten(0, 1)[:length]


def causal_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float
) -> torch.Tensor:
    """q [Q, Nq, D] are the last Q positions of a context k/v [C, Nkv, D]; returns [Q, Nq, D]."""
    num_queries, context = q.shape[0], k.shape[0]
    groups = q.shape[1] // k.shape[1]
    k = k.float().repeat_interleave(groups, dim=1)
    v = v.float().repeat_interleave(groups, dim=1)
    query_positions = torch.arange(context - num_queries, context, device=q.device)
    mask = torch.arange(context, device=q.device)[None, :] <= query_positions[:, None]
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1).float(),
        k.transpose(0, 1).float(),
        v.transpose(0, 1).float(),
        attn_mask=mask,
        scale=scale,
    )
    return out.transpose(0, 1).to(q.dtype)


class TorchAttentionBackend(AttentionBackend):
    name = "torch"
    devices: ClassVar[frozenset[str]] = frozenset({"cpu", "cuda"})
    dtypes: ClassVar[frozenset[torch.dtype]] = frozenset(
        {torch.float32, torch.bfloat16, torch.float16}
    )
    head_sizes = None
    kv_cache_dtypes: ClassVar[frozenset[torch.dtype] | None] = frozenset({FP8})
    supports_cuda_graphs = False
    supports_packed_prefill = True

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv: KVStorage,
        layer: int,
        metadata: AttentionMetadata,
    ) -> torch.Tensor:
        write_kv(kv, layer, k, v, metadata.slot_mapping)
        out = torch.zeros_like(q)
        starts, lengths = metadata.query_start_host, metadata.seq_lens_host
        assert starts is not None and lengths is not None, "the torch backend needs host lengths"
        for index, length in enumerate(lengths):
            begin, end = starts[index], starts[index + 1]
            if length == 0 or begin == end:
                continue
            pages = metadata.page_table[index]
            scales = kv.scales[layer]
            keys = from_cache(
                gather_context(kv.key_cache(layer), pages, length), q.dtype, scales[K]
            )
            values = from_cache(
                gather_context(kv.value_cache(layer), pages, length), q.dtype, scales[V]
            )
            out[begin:end] = causal_attention(q[begin:end], keys, values, self.scale)
        return out
