"""Builds the device side of an engine: model, KV storage, attention backend, decode step.

Owns: resolving device and dtype (`auto`: bfloat16 on CUDA; on CPU the checkpoint's bfloat16 where
the CPU computes bfloat16 natively, else float32), loading weights (after the checks config.json
alone can answer: a max_model_len past the model's), sizing the KV cache and `max_model_len`
(`kv_budget`, which also refuses sizes the memory free cannot hold, before anything is
allocated), choosing the attention backend, and composing the `ModelRunner`.
Must not: write anything back into `EngineConfig`; what it resolves is reported as the runner's
`RunnerInfo`.
"""

from __future__ import annotations

import logging
from dataclasses import replace
from pathlib import Path

import torch

from loopserve.attention.base import AttentionSpec
from loopserve.attention.registry import select_backend
from loopserve.config import EngineConfig, KVAllocation, LoadFormat, PreemptionMode, option_name
from loopserve.depth.policy import ExitMode
from loopserve.depth.trace import resolve_distribution
from loopserve.engine.runner_api import RunnerInfo
from loopserve.kernels.availability import triton_installed
from loopserve.kv.pages import pages_for
from loopserve.kv.storage import KVScales, KVStorage, special_cache_dtype
from loopserve.models.builtin import resolve_model_dir
from loopserve.models.families import read_model_config
from loopserve.models.kv_scales import fp8_kv_scales
from loopserve.models.loader import dummy_model, load_checkpoint, resolve_dtype
from loopserve.models.looped import LoopedForCausalLM
from loopserve.models.model_config import LoopedConfig
from loopserve.models.ops import TritonOps
from loopserve.models.quant import quantization_of, quantize_model
from loopserve.runner.block_tables import BlockTables
from loopserve.runner.cuda_graphs import GraphedDecodeStep
from loopserve.runner.decode_slots import MAX_STOP_TOKEN_IDS
from loopserve.runner.decode_step import DecodeStep
from loopserve.runner.kv_budget import (
    check_max_model_len,
    check_slot_state,
    check_swap_space,
    num_kv_pages,
    resolve_max_model_len,
)
from loopserve.runner.model_runner import ModelRunner
from loopserve.runner.prefill import PromptRunner
from loopserve.runner.prompt_graphs import GraphedPromptLoop
from loopserve.runner.speculation import SpeculativeLanes
from loopserve.runner.swap import HostSwap

logger = logging.getLogger(__name__)


def resolve_device(name: str) -> torch.device:
    """The torch device `name` names ('auto': the current GPU when torch sees one, else the CPU);
    a ValueError (saying which device) when it is not there."""
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    device = torch.device(name)
    if device.type == "cuda":
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if count == 0 or (device.index is not None and device.index >= count):
            seen = (
                "no CUDA GPU" if count == 0 else f"only {count} CUDA GPU(s) (cuda:0..{count - 1})"
            )
            raise ValueError(
                f"device {name!r} was asked for but torch sees {seen}; choose another device "
                "(device='cpu' in Python, --device cpu on the command line)"
            )
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    return device


def auto_dtype(device: torch.device, weights_dtype: str | None) -> str:
    """What `dtype="auto"` runs in: bfloat16 on CUDA; on CPU bfloat16 only for a bfloat16
    checkpoint on a CPU with native bfloat16 arithmetic (elsewhere bfloat16 matmuls are emulated
    and far slower than float32), else float32."""
    if device.type == "cuda":
        return "bfloat16"
    if weights_dtype == "bfloat16" and _cpu_has_native_bfloat16():
        return "bfloat16"
    return "float32"


def _cpu_has_native_bfloat16() -> bool:
    try:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):
        return False


def load_model(config: EngineConfig, model_dir: Path, device: torch.device) -> LoopedForCausalLM:
    """Weights on the device, projections fused, and the layer ops chosen for the device."""
    use_triton = triton_installed()
    fused = device.type == "cuda" and config.fused_kernels and use_triton
    if config.batch_invariant and not fused:  # before the weights load: a mistake costs nothing
        raise ValueError(
            "batch_invariant needs a CUDA device, fused_kernels on and triton installed "
            f"(device {device.type}, fused_kernels {config.fused_kernels}, triton "
            f"{'installed' if use_triton else 'missing'}); leave batch_invariant off here"
        )
    model_config = read_checked_model_config(config, model_dir)
    dtype_name = config.dtype
    if dtype_name == "auto":
        dtype_name = auto_dtype(device, model_config.weights_dtype)
    dtype = resolve_dtype(dtype_name)
    if config.load_format is LoadFormat.DUMMY:
        model = dummy_model(model_config, dtype, device, seed=config.seed)
    else:
        model = load_checkpoint(model_dir, dtype, device)
    model.fuse_projections()
    if config.quantization == "fp8":
        quantized = quantize_model(model)
        logger.info("fp8 weights: %d projections quantized at load", quantized)
    if fused:
        from loopserve.kernels.pdl import pdl_supported

        fp8 = quantization_of(model) == "fp8"
        model.ops = TritonOps(
            batch_invariant=config.batch_invariant,
            quantize_inputs=fp8,
            dependent_launches=fp8 and pdl_supported(device),
        )
    invariant = " with batch-invariant matmuls" if config.batch_invariant else ""
    logger.info("layer ops: %s%s", type(model.ops).__name__, invariant)
    return model


def read_checked_model_config(config: EngineConfig, model_dir: Path) -> LoopedConfig:
    """The checkpoint's config.json, once `config` has passed the checks it alone can answer:
    the exit criterion, `speculative_config`, the trace distribution and `max_model_len`. Run
    before the weights load, and by `loopserve serve --replicas` before Ray starts (a replica
    that refuses its config would only fail, and be restarted, inside Ray)."""
    model_config = read_model_config(model_dir / "config.json")
    scheduler = config.scheduler
    model_config.resolve_exit_criterion(scheduler.exit_criterion, option_name("exit_criterion"))
    _check_speculation(config, model_config)
    if scheduler.exit_mode is ExitMode.TRACE:  # the engine says the same, after the weights
        resolve_distribution(
            scheduler.trace_distribution, model_config.family, model_config.num_loops
        )
    check_max_model_len(config, model_config)  # from config.json, before the weights load
    return model_config


def build_runner(config: EngineConfig, model: LoopedForCausalLM | None = None) -> ModelRunner:
    """The runner for `config`: the checkpoint loaded onto `config.device`, or `model` when one
    is given (already on that device; a test's fake model, say)."""
    device = resolve_device(config.device)
    config = replace(config, device=str(device))  # what the KV budget and its messages speak of
    check_swap_space(config, device)
    model_dir = None
    if model is None:
        model_dir = resolve_model_dir(config.model)
        model = load_model(config, model_dir, device)
    model_config = model.config
    scheduler = config.scheduler
    if scheduler.preemption_mode is PreemptionMode.RECOMPUTE and model.has_stage_layers:
        raise ValueError(
            f"{option_name('preemption_mode')} recompute is not served for {model_config.family} "
            "(its prelude and coda layers' K/V are not replayed); use preemption_mode swap"
        )
    _check_speculation(config, model_config)
    model.exit_criterion = model_config.resolve_exit_criterion(
        scheduler.exit_criterion, option_name("exit_criterion")
    )
    kv_dtype = special_cache_dtype(config.kv_cache_dtype) or model.dtype
    bytes_per_page = KVStorage.bytes_per_page(
        model.num_kv_layers,
        scheduler.block_size,
        model_config.num_key_value_heads,
        model_config.head_dim,
        kv_dtype,
    )
    check_slot_state(config, model, device)
    num_pages = num_kv_pages(config, model, bytes_per_page, device)
    max_model_len = resolve_max_model_len(config, model_config, num_pages)
    spec = _attention_spec(config, model, device, kv_dtype)
    choice = select_backend(config.attention_backend, spec)
    backend = choice.backend(spec)
    kv = KVStorage(
        num_layers=model.num_kv_layers,
        num_pages=num_pages,
        block_size=scheduler.block_size,
        num_kv_heads=model_config.num_key_value_heads,
        head_dim=model_config.head_dim,
        dtype=kv_dtype,
        device=device,
    )
    kv_scales = _kv_scales(config, model, model_dir)
    if kv_scales is not None:
        kv.set_scales(kv_scales)
    tables = BlockTables(
        scheduler.max_num_seqs,
        model_config.num_loops,
        pages_for(max_model_len, scheduler.block_size),
        scheduler.block_size,
        device,
        max_decode_rows=scheduler.max_decode_rows(model_config.num_loops),
    )
    traced = scheduler.exit_mode is ExitMode.TRACE
    trace_length = max_model_len if traced else 1
    fused = isinstance(model.ops, TritonOps)  # the step's bookkeeping is fused where layers are
    plain = replace(scheduler, speculative_config=None)
    decode = DecodeStep(model, kv, backend, tables, plain, trace_length, fused_kernels=fused)
    speculating = None
    if scheduler.speculative_config is not None:
        lanes = DecodeStep(model, kv, backend, tables, scheduler, trace_length, fused_kernels=fused)
        lanes.speculate(
            SpeculativeLanes(lanes, scheduler.speculative_config, scheduler.max_num_seqs)
        )
        speculating = lanes
    preempts = scheduler.kv_allocation is KVAllocation.INCREMENTAL
    swap = HostSwap(kv, int(config.swap_space_gb * 2**30) if preempts else 0)
    info = RunnerInfo(
        model_config=model_config,
        model_dir=None if model_dir is None else str(model_dir),
        num_kv_pages=num_pages,
        max_model_len=max_model_len,
        max_stop_token_ids=MAX_STOP_TOKEN_IDS,
        device=str(device),
        dtype=str(model.dtype).removeprefix("torch."),
        kv_cache_dtype=str(kv_dtype).removeprefix("torch."),
        kv_cache_scales=None if kv_scales is None else kv_scales.source,
        quantization=quantization_of(model),
        attention_backend=choice.backend.name,
        cuda_graphs=choice.cuda_graphs,
        kv_bytes_per_page=bytes_per_page,
        pinned_swap_pages=swap.pool.num_pages if device.type == "cuda" else None,
    )
    logger.info("runner: %s", info)
    graphs = GraphedDecodeStep(decode, scheduler.max_num_seqs) if choice.cuda_graphs else None
    speculating_graphs = None
    if speculating is not None and choice.cuda_graphs:
        speculating_graphs = GraphedDecodeStep(speculating, scheduler.max_num_seqs)
    prompt_graphs = None
    if choice.cuda_graphs and backend.supports_prompt_graphs:
        prompt_graphs = GraphedPromptLoop(
            model, kv, backend, tables, scheduler.max_num_batched_tokens, scheduler.max_num_seqs
        )
    prompts = PromptRunner(model, kv, backend, tables, prompt_graphs)
    return ModelRunner(
        model,
        tables,
        decode,
        prompts,
        swap,
        info,
        graphs,
        speculating=None if speculating is None else (speculating, speculating_graphs),
    )


def _kv_scales(
    config: EngineConfig, model: LoopedForCausalLM, model_dir: Path | None
) -> KVScales | None:
    """An fp8 cache's per-layer scales (`fp8_kv_scales`), before anything is served; None when
    K/V are not fp8."""
    if config.kv_cache_dtype != "fp8":
        return None
    checkpoint = model_dir if config.load_format is LoadFormat.AUTO else None
    scales = fp8_kv_scales(model, checkpoint, config.calculate_kv_scales)
    logger.info(
        "fp8 KV cache scales (%s; K, V per layer): %s", scales.source, scales.scale.tolist()
    )
    return scales


def _check_speculation(config: EngineConfig, model_config: LoopedConfig) -> None:
    speculative = config.scheduler.speculative_config
    if speculative is not None:
        speculative.check_model(
            model_config.num_loops, model_config.family, model_config.num_stage_layers
        )


def _attention_spec(
    config: EngineConfig, model: LoopedForCausalLM, device: torch.device, kv_dtype: torch.dtype
) -> AttentionSpec:
    model_config = model.config
    return AttentionSpec(
        device_type=device.type,
        compute_capability=(
            torch.cuda.get_device_capability(device) if device.type == "cuda" else None
        ),
        dtype=model.dtype,
        head_size=model_config.head_dim,
        num_heads=model_config.num_attention_heads,
        num_kv_heads=model_config.num_key_value_heads,
        block_size=config.scheduler.block_size,
        cuda_graphs=device.type == "cuda" and config.cuda_graphs,
        kv_dtype=kv_dtype,
        dependent_launch_rows=(
            model.ops.dependent_rows(model.dtype) if isinstance(model.ops, TritonOps) else 0
        ),
    )
