"""The model's attention callable for one pass: a backend over paged KV with fixed metadata.

Owns: binding (backend, KV storage, metadata) and calling `prepare` once per metadata. Must not:
build metadata (the runner does) or choose a backend (the registry does).
"""

from __future__ import annotations

import torch

from loopserve.attention.base import AttentionBackend
from loopserve.kv.metadata import AttentionMetadata
from loopserve.kv.storage import KVStorage


class PagedAttention:
    def __init__(
        self, backend: AttentionBackend, kv: KVStorage, metadata: AttentionMetadata
    ) -> None:
        self.backend = backend
        self.kv = kv
        self.metadata = metadata
        if metadata.rope is not None and not (metadata.is_decode and backend.decode_rotary):
            raise ValueError(
                f"{type(backend).__name__} cannot apply RoPE in this pass: only decode passes of "
                "a backend with `decode_rotary` take metadata.rope"
            )
        backend.prepare(metadata)

    @property
    def rotates(self) -> bool:
        """Whether the backend applies RoPE to q and k (the model must not)."""
        return self.metadata.rope is not None

    def __call__(
        self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> torch.Tensor:
        return self.backend.forward(q, k, v, self.kv, layer, self.metadata)
