"""Small host values (page ids, slots, index lists) to the device without a host synchronisation.

Owns: `to_device`, the one way such values reach the device: through pinned memory on CUDA, so
the copy is asynchronous and a step that makes it does not wait for the GPU. Must not: move
K/V (the swap copies whole pages itself).
"""

from __future__ import annotations

from typing import Any

import torch


def to_device(values: Any, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """`torch.tensor(values, dtype=dtype)` on `device`, copied asynchronously from pinned memory
    when `device` is a GPU."""
    return host_to_device(torch.tensor(values, dtype=dtype), device)


def host_to_device(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A host tensor on `device`, copied asynchronously from pinned memory when it is a GPU."""
    if device.type == "cuda":
        host = host.pin_memory()
    return host.to(device, non_blocking=True)
