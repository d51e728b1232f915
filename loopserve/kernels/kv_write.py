"""Triton kernel that stores one layer's new K/V into flat slots of the paged cache.

Owns: the scatter `cache[slot // block, slot % block] = k[token]` (and the same for V).
Must not: choose slots (the runner's `slot_mapping` does) or touch any slot it was not given.

Padding tokens carry slots of the null page; several of them may write the same null slot, which
is harmless because nothing ever reads the null page.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from loopserve.kernels.e4m3 import e4m3_value
from loopserve.kv.storage import FP8


@triton.jit
def cache_value(x, cache_ptr, inverse_scale=1.0):
    """`x` as the cache at `cache_ptr` stores it, bit for bit as `kv.storage.to_cache_dtype`
    does: a float8 e4m3 cache multiplies by the layer's fp32 `inverse_scale` (1 / scale, from
    the host), saturates at +-448 and rounds to nearest, ties to even."""
    if cache_ptr.dtype.element_ty == tl.float8e4nv:
        x = x.to(tl.float32)
        x = e4m3_value(x, inverse_scale)
    return x.to(cache_ptr.dtype.element_ty)


@triton.jit
def read_value(x, scale, dtype: tl.constexpr):
    """A tile loaded from the cache, as `kv.storage.from_cache` reads it into `dtype`: a float8
    tile times the layer's fp32 `scale` in fp32, then `dtype`; other caches are only converted."""
    if x.dtype == tl.float8e4nv:
        x = x.to(tl.float32) * scale
    return x.to(dtype)


@triton.jit
def read_wide(x, scale, dtype: tl.constexpr, UNIT_SCALE: tl.constexpr):
    """`read_value` widened to fp32. With `UNIT_SCALE` (the layer's scale is 1, as the host
    knows) a float8 tile is only widened: times 1 and rounded to a 16- or 32-bit float, an e4m3
    value comes back unchanged, so skipping both gives the same bits for less work."""
    if x.dtype == tl.float8e4nv and UNIT_SCALE:
        return x.to(tl.float32)
    return read_value(x, scale, dtype).to(tl.float32)


@triton.jit
def layer_scales(scales_ptr, cache_ptr):
    """(K, V) values of a layer's pair at `scales_ptr` ([2] fp32: its scales or their
    reciprocals) where the cache at `cache_ptr` is float8; (1, 1), nothing read, elsewhere."""
    k_scale = 1.0
    v_scale = 1.0
    if cache_ptr.dtype.element_ty == tl.float8e4nv:
        k_scale = tl.load(scales_ptr)
        v_scale = tl.load(scales_ptr + 1)
    return k_scale, v_scale


@triton.jit
def _write_kv_kernel(
    k_ptr,  # [T, Nkv, D]
    v_ptr,  # [T, Nkv, D]
    key_cache_ptr,  # [pages, block, Nkv, D]
    value_cache_ptr,  # [pages, block, Nkv, D], same strides as the key cache
    slot_ptr,  # [T] int64
    inverse_scales_ptr,  # [2] fp32: 1 / the layer's K and V scales (read for a float8 cache)
    stride_k_token,
    stride_k_head,
    stride_v_token,
    stride_v_head,
    stride_cache_page,
    stride_cache_offset,
    stride_cache_head,
    BLOCK_SIZE: tl.constexpr,
    NUM_KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_ptr + token).to(tl.int64)
    heads = tl.arange(0, BLOCK_H)
    dims = tl.arange(0, BLOCK_D)
    mask = (heads[:, None] < NUM_KV_HEADS) & (dims[None, :] < HEAD_DIM)  # [BLOCK_H, BLOCK_D]
    # slot = page * BLOCK_SIZE + offset, 0 <= offset < BLOCK_SIZE
    destination = (
        (slot // BLOCK_SIZE) * stride_cache_page
        + (slot % BLOCK_SIZE) * stride_cache_offset
        + heads[:, None] * stride_cache_head
        + dims[None, :]
    )
    k = tl.load(
        k_ptr + token * stride_k_token + heads[:, None] * stride_k_head + dims[None, :], mask
    )
    v = tl.load(
        v_ptr + token * stride_v_token + heads[:, None] * stride_v_head + dims[None, :], mask
    )
    k_inverse, v_inverse = layer_scales(inverse_scales_ptr, key_cache_ptr)
    tl.store(key_cache_ptr + destination, cache_value(k, key_cache_ptr, k_inverse), mask)
    tl.store(value_cache_ptr + destination, cache_value(v, value_cache_ptr, v_inverse), mask)


def write_kv(
    k: torch.Tensor,  # [T, Nkv, D]
    v: torch.Tensor,  # [T, Nkv, D]
    key_cache: torch.Tensor,  # [pages, block, Nkv, D]
    value_cache: torch.Tensor,  # [pages, block, Nkv, D]
    slot_mapping: torch.Tensor,  # [T] int64
    inverse_scales: torch.Tensor | None = None,  # [2] fp32 (float8 caches; None: scale 1)
) -> None:
    """Store k/v of every token into its flat slot of one layer's cache (one launch); a float8
    cache stores k * inverse_scales[0] and v * inverse_scales[1] (`KVStorage.inverse_scales`)."""
    if k.stride(-1) != 1:
        k = k.contiguous()
    if v.stride(-1) != 1:
        v = v.contiguous()
    if key_cache.stride() != value_cache.stride() or key_cache.stride(-1) != 1:
        raise ValueError("key and value caches must share strides with a contiguous head dim")
    tokens, num_kv_heads, head_dim = k.shape
    if tokens == 0:
        return
    _write_kv_kernel[(tokens,)](
        k,
        v,
        key_cache,
        value_cache,
        slot_mapping,
        scale_pair(inverse_scales, key_cache),
        k.stride(0),
        k.stride(1),
        v.stride(0),
        v.stride(1),
        key_cache.stride(0),
        key_cache.stride(1),
        key_cache.stride(2),
        BLOCK_SIZE=key_cache.shape[1],
        NUM_KV_HEADS=num_kv_heads,
        HEAD_DIM=head_dim,
        BLOCK_H=triton.next_power_of_2(num_kv_heads),
        BLOCK_D=triton.next_power_of_2(head_dim),
    )


def scale_pair(scales: torch.Tensor | None, key_cache: torch.Tensor) -> torch.Tensor | None:
    """A layer's [2] fp32 (K, V) scales or reciprocals for a kernel's `layer_scales`. None, what
    direct callers of the kernels may pass, is 1 for both (only a float8 cache reads them)."""
    if scales is None and key_cache.dtype == FP8:
        return torch.ones(2, dtype=torch.float32, device=key_cache.device)
    return scales
