"""`copy_kv_slots` (kernels/kv_copy.py) is `KVStorage.copy_slots` outside the null page."""

from __future__ import annotations

import pytest
import torch

from loopserve.kernels.kv_copy import copy_kv_slots
from loopserve.kv.pages import NULL_PAGE
from loopserve.kv.storage import KVStorage


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_copy_kv_slots_is_copy_slots(device: torch.device, dtype: torch.dtype) -> None:
    generator = torch.Generator().manual_seed(0)
    pages, block = 9, 4
    storages = [
        KVStorage(
            num_layers=3,
            num_pages=pages,
            block_size=block,
            num_kv_heads=2,
            head_dim=24,
            dtype=dtype,
            device=device,
        )
        for _ in range(2)
    ]
    cache = torch.randn(storages[0].cache.shape, generator=generator).to(dtype)
    for storage in storages:
        storage.cache.copy_(cache)
    # Sources anywhere outside the null page; distinct destinations, a third of them null.
    slots = torch.randperm((pages - 1) * block, generator=generator) + block
    source, destination = slots[:10], slots[10:20].clone()
    null = torch.arange(10) % 3 == 0
    destination[null] = NULL_PAGE * block + torch.arange(10)[null] % block
    storages[0].copy_slots(source.to(device), destination.to(device))
    copy_kv_slots(storages[1], source.to(device), destination.to(device))
    real = slice(block, None)  # flat slots past the null page
    expected = storages[0].cache.flatten(2, 3)[:, :, real]
    got = storages[1].cache.flatten(2, 3)[:, :, real]
    assert torch.equal(got, expected)
    assert not torch.equal(got, cache.to(device).flatten(2, 3)[:, :, real])  # something moved
