"""Builds the device side of an engine: model, KV storage, attention backend, runner.

Owns: resolving device and dtype, loading weights, sizing the KV cache from memory, choosing the
attention backend. Must not: write anything back into `EngineConfig`; what it resolves is returned
as an `EngineRuntime`.
"""

from __future__ import annotations

import importlib.util
import logging
from dataclasses import dataclass
from pathlib import Path

import torch

from loopserve.attention.base import AttentionSpec
from loopserve.attention.registry import select_backend
from loopserve.attention.torch_backend import causal_attention
from loopserve.config import EngineConfig
from loopserve.engine.kv_manager import pages_for, pages_needed
from loopserve.engine.scheduler_output import SamplingInfo
from loopserve.models.loader import dummy_model, load_checkpoint, resolve_dtype
from loopserve.models.ops import TritonOps
from loopserve.models.ouro import LoopContext, OuroForCausalLM
from loopserve.models.ouro_config import OuroConfig
from loopserve.runner.block_tables import BlockTables
from loopserve.runner.kv_storage import KVStorage
from loopserve.runner.model_runner import ModelRunner
from loopserve.runner.slot_decoder import SlotDecoder
from loopserve.sample.sampler import SamplingBatch, sample
from loopserve.sampling_params import SamplingParams

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
    """Weights on the device, projections fused, and the layer ops chosen for the device."""
    dtype_name = config.dtype
    if dtype_name == "auto":
        dtype_name = "bfloat16" if device.type == "cuda" else "float32"
    dtype = resolve_dtype(dtype_name)
    if config.load_format == "dummy":
        model_config = OuroConfig.from_file(model_dir / "config.json")
        model = dummy_model(model_config, dtype, device, seed=config.seed)
    else:
        model = load_checkpoint(model_dir, dtype, device)
    model.fuse_projections()
    use_triton = importlib.util.find_spec("triton") is not None
    if device.type == "cuda" and config.fused_kernels and use_triton:
        model.ops = TritonOps()
    logger.info("layer ops: %s", type(model.ops).__name__)
    return model


# Kept free on the GPU for CUDA graph pools, kernel workspaces and allocator fragmentation.
_GPU_MARGIN_BYTES = 1 << 30


@torch.inference_mode()
def profile_step_peak(model: OuroForCausalLM, config: EngineConfig, device: torch.device) -> int:
    """Peak activation bytes of the largest step: a full token budget through one loop, and the
    coda (LM head + sampling with filters) for every slot."""
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    base = torch.cuda.memory_allocated(device)
    tokens = config.max_num_batched_tokens
    hidden = torch.randn(tokens, model.config.hidden_size, dtype=model.dtype, device=device)
    cos, sin = model.rope(torch.arange(tokens, device=device))

    def attention(layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return causal_attention(q, k, v, q.shape[-1] ** -0.5)

    hidden = model.run_loop(hidden, LoopContext(cos, sin, attention))
    rows = min(config.max_num_seqs, tokens)
    params = SamplingParams(temperature=1.0, top_p=0.9, logprobs=20)
    infos = [SamplingInfo(params, 0, 0)] * rows
    batch = SamplingBatch.build(infos, model.config.vocab_size, device)
    sample(model.compute_logits(hidden[:rows]), batch)
    torch.cuda.synchronize(device)
    return int(torch.cuda.max_memory_allocated(device) - base)


def _num_kv_pages(
    config: EngineConfig, model: OuroForCausalLM, bytes_per_page: int, device: torch.device
) -> int:
    if config.num_kv_pages is not None:
        return config.num_kv_pages
    if device.type == "cuda":
        peak = profile_step_peak(model, config, device)
        free, total = torch.cuda.mem_get_info(device)
        other_processes = total - free - torch.cuda.memory_reserved(device)
        weights = torch.cuda.memory_allocated(device)
        budget = (
            int(total * config.gpu_memory_utilization)
            - other_processes
            - weights
            - peak
            - _GPU_MARGIN_BYTES
        )
        logger.info(
            "GPU memory: %.1f GiB total, weights %.2f GiB, step peak %.2f GiB, KV budget %.1f GiB",
            total / 2**30, weights / 2**30, peak / 2**30, budget / 2**30,
        )  # fmt: skip
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


def _check_one_request_fits(
    config: EngineConfig, model_config: OuroConfig, num_pages: int, max_model_len: int
) -> None:
    """Auto-sized caches must hold at least one request of max_model_len tokens (whose prompt
    may be nearly all of them, so both layouts need every plane)."""
    block = config.block_size
    needed = pages_needed(
        config.kv_layout, model_config.num_loops, max_model_len, max_model_len, block
    )
    if needed > num_pages - 1:
        raise ValueError(
            f"the KV cache holds {num_pages - 1} pages of {block} tokens, but one request of "
            f"max_model_len={max_model_len} tokens needs {needed}; lower --max-model-len or raise "
            "--gpu-memory-utilization (or --kv-cache-memory-gb on CPU)"
        )


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
    num_pages = _num_kv_pages(config, model, bytes_per_page, device)
    if config.num_kv_pages is None:
        _check_one_request_fits(config, model_config, num_pages, max_model_len)
    graphs = config.decode_on_device() and device.type == "cuda" and config.cuda_graphs
    capability = torch.cuda.get_device_capability(device) if device.type == "cuda" else None
    spec = AttentionSpec(
        device_type=device.type,
        compute_capability=capability,
        dtype=model.dtype,
        head_size=model_config.head_dim,
        num_heads=model_config.num_attention_heads,
        num_kv_heads=model_config.num_key_value_heads,
        block_size=config.block_size,
        cuda_graphs=graphs,
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
    backend = backend_cls(spec)
    decoder = None
    if config.decode_on_device():
        decoder = SlotDecoder(
            model,
            kv,
            backend,
            tables,
            config.max_num_seqs,
            config.kv_layout,
            no_refill=config.scheduling == "no_refill",
            max_trace_length=max_model_len if config.exit_mode == "trace" else 1,
        )
    runner = ModelRunner(
        model, kv, backend, tables, config.max_num_seqs, decoder=decoder, cuda_graphs=graphs
    )
    runtime = EngineRuntime(
        device, model.dtype, backend_cls.name, num_pages, max_model_len, bytes_per_page
    )
    logger.info("engine runtime: %s", runtime)
    return runner, runtime
