"""Triton kernel that copies K/V between flat slots of the paged cache, every layer in one launch.

Owns: the copy `cache[layer, k|v, destination] = cache[layer, k|v, source]` for pairs of flat
slots, skipping pairs whose destination lies in the null page (nothing reads it). It is the CUDA
twin of `KVStorage.copy_slots` for the decode step's copy-on-exit, whose masked-out pairs all
point into the null page: on the GPU the torch copy costs two kernels per layer (96 for
Ouro-1.4B, ~0.2 ms a step), this one launch. Must not: choose slots (the coda kernel does).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from loopserve.kv.pages import NULL_PAGE
from loopserve.kv.storage import KVStorage


@triton.jit
def _copy_kv_slots_kernel(
    cache_ptr,  # [layers, 2, pages * block, Nkv * D] contiguous
    source_ptr,  # [N] int64 flat slots
    destination_ptr,  # [N] int64 flat slots
    stride_layer,
    stride_kv,
    BLOCK_SIZE: tl.constexpr,
    NULL: tl.constexpr,
    SLOT_ELEMENTS: tl.constexpr,  # Nkv * D
    BLOCK: tl.constexpr,  # next power of two of SLOT_ELEMENTS
):
    pair = tl.program_id(0)
    layer = tl.program_id(1).to(tl.int64)
    destination = tl.load(destination_ptr + pair)
    if destination // BLOCK_SIZE == NULL:
        return
    source = tl.load(source_ptr + pair)
    elements = tl.arange(0, BLOCK)
    mask = elements < SLOT_ELEMENTS
    key = cache_ptr + layer * stride_layer
    value = key + stride_kv
    tl.store(
        key + destination * SLOT_ELEMENTS + elements,
        tl.load(key + source * SLOT_ELEMENTS + elements, mask),
        mask,
    )
    tl.store(
        value + destination * SLOT_ELEMENTS + elements,
        tl.load(value + source * SLOT_ELEMENTS + elements, mask),
        mask,
    )


def copy_kv_slots(kv: KVStorage, source: torch.Tensor, destination: torch.Tensor) -> None:
    """`kv.copy_slots(source, destination)` in one launch, pairs into the null page left out."""
    cache = kv.cache
    if not cache.is_contiguous():
        raise ValueError("the KV cache must be contiguous")
    pairs = source.shape[0]
    if pairs == 0:
        return
    slot_elements = kv.num_kv_heads * kv.head_dim
    _copy_kv_slots_kernel[(pairs, kv.num_layers)](
        cache,
        source,
        destination,
        cache.stride(0),
        cache.stride(1),
        BLOCK_SIZE=kv.block_size,
        NULL=NULL_PAGE,
        SLOT_ELEMENTS=slot_elements,
        BLOCK=triton.next_power_of_2(slot_elements),
    )
