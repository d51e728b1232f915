"""Device storage of the paged KV cache.

Owns: one tensor holding every page of every layer, whole-slot copies between pages (the
copy-on-exit of the `full` layout) and whole-page reads and writes (swapping a preempted request).
Must not: decide which page belongs to whom (that is the torch-free `KVCacheManager`), or know
about planes: a page is a page, whichever plane it serves.

Layout: `cache[layer, 0 = K | 1 = V, page, offset, kv_head, head_dim]`. A flat *slot* is
`page * block_size + offset`. Page 0 is the null page: padding entries of page tables point at it
and padding rows write their K/V into it; nothing real is ever stored there (`kv.pages`).
"""

from __future__ import annotations

import torch

FP8 = torch.float8_e4m3fn  # the `kv_cache_dtype="fp8"` storage
FP8_MAX = 448.0  # its largest finite value: K/V beyond it are stored as +-448


def to_cache_dtype(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """`x` as a cache of `dtype` stores it (float8 saturates at +-448, in every backend)."""
    if dtype == FP8:
        x = x.float().clamp(-FP8_MAX, FP8_MAX)
    return x.to(dtype)


def read_as_cached(x: torch.Tensor, dtype: torch.dtype | None) -> torch.Tensor:
    """`x` as a cache of `dtype` gives it back: stored, then read in x's own dtype (None: as is)."""
    return x if dtype is None else to_cache_dtype(x, dtype).to(x.dtype)


def special_cache_dtype(kv_cache_dtype: str) -> torch.dtype | None:
    """The storage dtype a `kv_cache_dtype` setting names; None for "auto" (the model's)."""
    return FP8 if kv_cache_dtype == "fp8" else None


class KVStorage:
    def __init__(
        self,
        *,
        num_layers: int,
        num_pages: int,
        block_size: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device | str,
    ) -> None:
        self.num_layers = num_layers
        self.num_pages = num_pages
        self.block_size = block_size
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        # [L, 2, pages, block, Nkv, D]
        shape = (num_layers, 2, num_pages, block_size, num_kv_heads, head_dim)
        # Nothing reads a slot before it is written (kernels mask by length; padding rows only
        # write the null page), so on the CPU the cache is left uninitialised: zero-filling
        # gigabytes commits every page at start-up. On a GPU, zeros cost nothing worth saving.
        on_cpu = torch.device(device).type == "cpu"
        allocate = torch.empty if on_cpu else torch.zeros
        self.cache = allocate(shape, dtype=dtype, device=device)
        # Whole-slot and whole-page moves copy bits: on a byte view for a float8 cache, whose
        # indexing ops not every torch build has.
        self._bits = self.cache.view(torch.uint8) if dtype == FP8 else self.cache

    @staticmethod
    def bytes_per_page(
        num_layers: int, block_size: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype
    ) -> int:
        element = torch.empty((), dtype=dtype).element_size()
        return 2 * num_layers * block_size * num_kv_heads * head_dim * element

    def key_cache(self, layer: int) -> torch.Tensor:
        """[pages, block, Nkv, D] view of one layer's keys."""
        return self.cache[layer, 0]

    def value_cache(self, layer: int) -> torch.Tensor:
        return self.cache[layer, 1]

    def copy_slots(
        self, source: torch.Tensor, destination: torch.Tensor, num_layers: int | None = None
    ) -> None:
        """Copy K and V of the first `num_layers` layers (default: every layer) from flat slots
        `source` [N] to `destination` [N]."""
        flat = self._bits.view(
            self.num_layers, 2, self.num_pages * self.block_size, self.num_kv_heads, self.head_dim
        )
        layers = self.num_layers if num_layers is None else num_layers
        flat[:layers, :, destination] = flat[:layers, :, source]

    def read_pages(self, pages: torch.Tensor) -> torch.Tensor:
        """K/V of every layer of `pages` [N] int64: [L, 2, N, block, Nkv, D]."""
        return self._bits.index_select(2, pages).view(self.cache.dtype)

    def write_pages(self, pages: torch.Tensor, data: torch.Tensor) -> None:
        """Store `data` ([L, 2, N, block, Nkv, D], `read_pages`'s shape) into `pages` [N]."""
        bits = data.view(torch.uint8) if self.cache.dtype == FP8 else data
        self._bits.index_copy_(2, pages, bits)
