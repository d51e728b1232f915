"""Builds the device side of an engine: model, KV storage, attention backend, runner.

Owns: resolving device and dtype, loading weights, sizing the KV cache from memory, choosing the
attention backend. Must not: write anything back into `EngineConfig`; what it resolves is returned
as an `EngineRuntime`.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

import torch

from loopserve.attention.base import AttentionSpec
from loopserve.attention.registry import select_backend
from loopserve.config import EngineConfig
from loopserve.engine.kv_manager import pages_for
from loopserve.models.loader import dummy_model, load_checkpoint, resolve_dtype
from loopserve.models.ouro import OuroForCausalLM
from loopserve.models.ouro_config import OuroConfig
from loopserve.runner.block_tables import BlockTables
from loopserve.runner.kv_storage import KVStorage
from loopserve.runner.model_runner import ModelRunner

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class EngineRuntime:
    """What the engine resolved at start-up."""

    device: torch.device
    dtype: torch.dtype
    attention_backend: str
    num_kv_pages: int
    max_model_len: int
    kv_bytes_per_page: int


def resolve_device(name: str) -> torch.device:
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError("device 'cuda' was asked for but torch sees no CUDA GPU; use --device cpu")
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    return device


def load_model(config: EngineConfig, model_dir: Path, device: torch.device) -> OuroForCausalLM:
    dtype_name = config.dtype
    if dtype_name == "auto":
        dtype_name = "bfloat16" if device.type == "cuda" else "float32"
    dtype = resolve_dtype(dtype_name)
    if config.load_format == "dummy":
        model_config = OuroConfig.from_file(model_dir / "config.json")
        return dummy_model(model_config, dtype, device, seed=config.seed)
    return load_checkpoint(model_dir, dtype, device)


def _num_kv_pages(config: EngineConfig, bytes_per_page: int, device: torch.device) -> int:
    if config.num_kv_pages is not None:
        return config.num_kv_pages
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        used_elsewhere = total - free
        # Leave room for activations of the largest step; a conservative fixed margin.
        budget = int(total * config.gpu_memory_utilization) - used_elsewhere - (2 << 30)
    else:
        budget = int(config.kv_cache_memory_gb * 2**30)
    pages = budget // bytes_per_page
    if pages < 2:
        raise ValueError(
            f"no memory is left for the KV cache (budget {budget / 2**30:.2f} GiB, "
            f"{bytes_per_page / 2**20:.2f} MiB per page); raise gpu_memory_utilization or "
            "kv_cache_memory_gb, or use a smaller model"
        )
    return int(pages)


def build_runner(config: EngineConfig, model_dir: Path) -> tuple[ModelRunner, EngineRuntime]:
    device = resolve_device(config.device)
    model = load_model(config, model_dir, device)
    model_config = model.config
    max_model_len = config.max_model_len or model_config.max_position_embeddings
    if max_model_len > model_config.max_position_embeddings:
        raise ValueError(
            f"max_model_len {max_model_len} exceeds the model's max_position_embeddings "
            f"({model_config.max_position_embeddings})"
        )
    bytes_per_page = KVStorage.bytes_per_page(
        model_config.num_hidden_layers,
        config.block_size,
        model_config.num_key_value_heads,
        model_config.head_dim,
        model.dtype,
    )
    num_pages = _num_kv_pages(config, bytes_per_page, device)
    capability = torch.cuda.get_device_capability(device) if device.type == "cuda" else None
    spec = AttentionSpec(
        device_type=device.type,
        compute_capability=capability,
        dtype=model.dtype,
        head_size=model_config.head_dim,
        num_heads=model_config.num_attention_heads,
        num_kv_heads=model_config.num_key_value_heads,
        block_size=config.block_size,
        cuda_graphs=False,
    )
    backend_cls = select_backend(config.attention_backend, spec)
    kv = KVStorage(
        num_layers=model_config.num_hidden_layers,
        num_pages=num_pages,
        block_size=config.block_size,
        num_kv_heads=model_config.num_key_value_heads,
        head_dim=model_config.head_dim,
        dtype=model.dtype,
        device=device,
    )
    tables = BlockTables(
        config.max_num_seqs,
        model_config.num_loops,
        pages_for(max_model_len, config.block_size),
        config.block_size,
        device,
    )
    runner = ModelRunner(model, kv, backend_cls(spec), tables, config.max_num_seqs)
    runtime = EngineRuntime(
        device, model.dtype, backend_cls.name, num_pages, max_model_len, bytes_per_page
    )
    logger.info("engine runtime: %s", runtime)
    return runner, runtime
