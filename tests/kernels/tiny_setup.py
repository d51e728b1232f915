"""A tiny Ouro model over a paged KV cache with shuffled pages: the setup the decode-step and
prompt-graph tests share (their runners are built on it)."""

from __future__ import annotations

import torch

from loopserve.attention.base import AttentionSpec
from loopserve.kv.storage import KVStorage
from loopserve.models.families import preset_config
from loopserve.models.loader import dummy_model
from loopserve.models.ouro import OuroForCausalLM
from loopserve.runner.block_tables import BlockTables


def tiny_model(device: torch.device, dtype: torch.dtype, seed: int) -> OuroForCausalLM:
    """Random weights, head dim 32 and two heads (the smallest the Triton kernels are tested at),
    projections fused."""
    config = preset_config("tiny", {"head_dim": 32, "num_attention_heads": 2})
    model = dummy_model(config, dtype, device, seed=seed)
    model.fuse_projections()
    return model


def attention_spec(model: OuroForCausalLM, device: torch.device, block_size: int) -> AttentionSpec:
    config = model.config
    return AttentionSpec(
        device_type=device.type,
        compute_capability=torch.cuda.get_device_capability() if device.type == "cuda" else None,
        dtype=model.dtype,
        head_size=config.head_dim,
        num_heads=config.num_attention_heads,
        num_kv_heads=config.num_key_value_heads,
        block_size=block_size,
        cuda_graphs=device.type == "cuda",
    )


def shuffled_pages(slots: int, planes: int, pages: int, generator: torch.Generator) -> torch.Tensor:
    """[slots, planes, pages] int32: every (slot, plane, index) its own page, none the null page."""
    return (
        (torch.randperm(slots * planes * pages, generator=generator) + 1)
        .int()
        .view(slots, planes, pages)
    )


def paged_kv(
    model: OuroForCausalLM,
    pages: torch.Tensor,  # shuffled_pages(...)
    block_size: int,
    device: torch.device,
    cache: torch.Generator,
    lanes: int = 1,
) -> tuple[KVStorage, BlockTables]:
    """KV storage for every page of `pages`, random values drawn from `cache`, and block tables
    holding `pages` (for `lanes` decode rows per slot)."""
    config, (slots, planes, per_slot) = model.config, pages.shape
    kv = KVStorage(
        num_layers=config.num_hidden_layers,
        num_pages=pages.numel() + 1,
        block_size=block_size,
        num_kv_heads=config.num_key_value_heads,
        head_dim=config.head_dim,
        dtype=model.dtype,
        device=device,
    )
    kv.cache.copy_(torch.randn(kv.cache.shape, generator=cache).to(model.dtype))
    tables = BlockTables(slots, planes, per_slot, block_size, device, slots * lanes)
    tables.tables.copy_(pages)
    return kv, tables
