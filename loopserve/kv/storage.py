"""Device storage of the paged KV cache.

Owns: one tensor holding every page of every layer, whole-slot copies between pages (the
copy-on-exit of the `full` layout), whole-page reads and writes (swapping a preempted request),
and how a float8 cache stores and reads K/V with its per-layer scales.
Must not: decide which page belongs to whom (that is the torch-free `KVCacheManager`), or know
about planes: a page is a page, whichever plane it serves.

Layout: `cache[layer, 0 = K | 1 = V, page, offset, kv_head, head_dim]`. A flat *slot* is
`page * block_size + offset`. Page 0 is the null page: padding entries of page tables point at it
and padding rows write their K/V into it; nothing real is ever stored there (`kv.pages`).

The rule of a float8 cache (`kv_cache_dtype="fp8"`) is here once: `to_cache_dtype` stores,
`from_cache` reads, each with the layer's scale (`KVScales`); `kernels/kv_write.py` holds the
Triton twins, tested bit for bit against these.
"""

from __future__ import annotations

import torch

FP8 = torch.float8_e4m3fn  # the `kv_cache_dtype="fp8"` storage
FP8_MAX = 448.0  # its largest finite value: K/V beyond it (after scaling) are stored as +-448
K, V = 0, 1  # a layer's two scales, in that order (`KVScales.scale[layer]`)
SCALE_SOURCES = ("1.0", "calculated", "checkpoint")


def to_cache_dtype(
    x: torch.Tensor, dtype: torch.dtype, inverse_scale: torch.Tensor | None = None
) -> torch.Tensor:
    """`x` as a cache of `dtype` stores it. float8, in every backend: x times the layer's fp32
    `inverse_scale` (1 / scale, computed once on the host; None: scale 1) in fp32, saturated
    at +-448, rounded to the nearest e4m3 value, ties to even."""
    if dtype == FP8:
        x = x.float()
        if inverse_scale is not None:
            x = x * inverse_scale
        x = x.clamp(-FP8_MAX, FP8_MAX)
    return x.to(dtype)


def from_cache(
    stored: torch.Tensor, dtype: torch.dtype, scale: torch.Tensor | None = None
) -> torch.Tensor:
    """What attention computes with from `stored` cache entries, in `dtype` (the query's): a
    float8 entry times the layer's fp32 `scale` (None: 1) in fp32, then rounded to `dtype`."""
    if stored.dtype == FP8 and scale is not None:
        return (stored.float() * scale).to(dtype)
    return stored.to(dtype)


def special_cache_dtype(kv_cache_dtype: str) -> torch.dtype | None:
    """The storage dtype a `kv_cache_dtype` setting names; None for "auto" (the model's)."""
    return FP8 if kv_cache_dtype == "fp8" else None


class KVScales:
    """One fp32 K scale and one V scale per KV layer of a float8 cache, shared by every loop and
    plane of the layer: K/V are stored as e4m3(saturate(x * (1 / scale))) and read as stored *
    scale. `scale` [L, 2] (K, V) on the host; `inverse` its reciprocals, divided once here so that
    every backend multiplies by the same fp32 values (no kernel divides). `source` says where
    they came from: "1.0" (the default), "calculated" (`calculate_kv_scales`) or "checkpoint"
    (vLLM's `k_scale` / `v_scale` tensors)."""

    def __init__(self, scale: torch.Tensor, source: str) -> None:
        scale = scale.detach().to("cpu", torch.float32)
        if scale.dim() != 2 or scale.shape[1] != 2:
            raise ValueError(f"KV scales must be [layers, 2] (K, V), got {list(scale.shape)}")
        if not bool(torch.isfinite(scale).all() and (scale > 0).all()):
            raise ValueError(f"KV scales must be finite and positive, got {scale.tolist()}")
        if source not in SCALE_SOURCES:
            raise ValueError(f"KV scale source must be one of {SCALE_SOURCES}, got {source!r}")
        self.scale = scale
        self.inverse = 1.0 / scale  # fp32 division on the host, correctly rounded
        self.source = source

    @classmethod
    def unit(cls, num_layers: int) -> KVScales:
        return cls(torch.ones(num_layers, 2), "1.0")


class KVFormat:
    """How a cache keeps K/V, for code that keeps them densely (the serial reference, the
    perplexity evaluator): as computed (`dtype` None), or as a cache of `dtype` stores and reads
    them back, with `scales` (None: 1) for float8."""

    def __init__(self, dtype: torch.dtype | None = None, scales: KVScales | None = None) -> None:
        if scales is not None and dtype != FP8:
            raise ValueError(f"KV scales apply to an fp8 cache only, not to {dtype or 'auto'}")
        self.dtype = dtype
        self.scales = scales

    def stored(self, x: torch.Tensor, layer: int, kind: int) -> torch.Tensor:
        """`x`, K (kind `K`) or V (`V`) of KV layer `layer`, as the cache gives it back: stored,
        then read in x's own dtype."""
        if self.dtype is None:
            return x
        scale = inverse = None
        if self.scales is not None:
            scale, inverse = self.scales.scale[layer, kind], self.scales.inverse[layer, kind]
        return from_cache(to_cache_dtype(x, self.dtype, inverse), x.dtype, scale)


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
        # A float8 cache's per-layer scales on the device, [L, 2] (K, V) each; the kernels read
        # them there, so CUDA graphs see what `set_scales` wrote before serving. 1 until then.
        self.scales = torch.ones((num_layers, 2), dtype=torch.float32, device=device)
        self.inverse_scales = torch.ones_like(self.scales)
        # The same scales on the host, for kernels that take them as arguments (FlashInfer's).
        self._host_scales: list[tuple[float, float]] = [(1.0, 1.0)] * num_layers

    def set_scales(self, scales: KVScales) -> None:
        """Take a float8 cache's per-layer scales (before any K/V are written, and before any
        CUDA graph is captured: the decode kernel is specialised on whether a layer's scales
        are 1, from `scale_values`)."""
        if self.cache.dtype != FP8:
            raise ValueError(f"KV scales apply to an fp8 cache only, not to {self.cache.dtype}")
        if scales.scale.shape != self.scales.shape:
            raise ValueError(
                f"{scales.scale.shape[0]} layers of KV scales for a cache of {self.num_layers}"
            )
        self.scales.copy_(scales.scale)
        self.inverse_scales.copy_(scales.inverse)
        self._host_scales = [(k, v) for k, v in scales.scale.tolist()]

    def scale_values(self, layer: int) -> tuple[float, float]:
        """A layer's (K, V) scales as host floats (1, 1 unless `set_scales` gave others)."""
        return self._host_scales[layer]

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
