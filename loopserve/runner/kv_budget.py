"""How many KV pages an engine gets: explicit, from a CPU budget, or from what the GPU has left.

Owns: profiling the largest step's activation peak, turning free device memory into pages, and
the start-up check that one request of max_model_len tokens fits. Must not: allocate the cache
(the runner's setup does).
"""

from __future__ import annotations

import logging

import torch

from loopserve.attention.torch_backend import causal_attention
from loopserve.config import EngineConfig
from loopserve.models.ouro import LoopContext, OuroForCausalLM
from loopserve.models.ouro_config import OuroConfig
from loopserve.sample.sampler import SamplingBatch, sample
from loopserve.sampling_params import SamplingInfo, SamplingParams

logger = logging.getLogger(__name__)

# Kept free on the GPU for CUDA graph pools, kernel workspaces and allocator fragmentation.
_GPU_MARGIN_BYTES = 1 << 30


@torch.inference_mode()
def profile_step_peak(model: OuroForCausalLM, config: EngineConfig, device: torch.device) -> int:
    """Peak activation bytes of the largest step: a full prompt-token budget through one loop,
    and the coda (LM head + sampling with filters) for every slot."""
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    base = torch.cuda.memory_allocated(device)
    tokens = config.scheduler.max_num_batched_tokens
    hidden = torch.randn(tokens, model.config.hidden_size, dtype=model.dtype, device=device)
    cos, sin = model.rope(torch.arange(tokens, device=device))

    def attention(layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return causal_attention(q, k, v, q.shape[-1] ** -0.5)

    hidden = model.run_loop(hidden, LoopContext(cos, sin, attention))
    rows = config.scheduler.max_num_seqs
    params = SamplingParams(temperature=1.0, top_p=0.9, logprobs=20)
    infos = [SamplingInfo(params, 0, 0)] * rows
    batch = SamplingBatch.build(infos, model.config.vocab_size, device)
    sample(model.compute_logits(hidden[:rows]), batch)
    torch.cuda.synchronize(device)
    return int(torch.cuda.max_memory_allocated(device) - base)


def num_kv_pages(
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


def check_one_request_fits(
    config: EngineConfig, model_config: OuroConfig, num_pages: int, max_model_len: int
) -> None:
    """Auto-sized caches must hold at least one request of max_model_len tokens (whose prompt
    may be nearly all of them, so both layouts need every plane)."""
    block = config.scheduler.block_size
    needed = config.scheduler.kv_layout.pages_needed(
        model_config.num_loops, max_model_len, max_model_len, block
    )
    if needed > num_pages - 1:
        raise ValueError(
            f"the KV cache holds {num_pages - 1} pages of {block} tokens, but one request of "
            f"max_model_len={max_model_len} tokens needs {needed}; lower --max-model-len or raise "
            "--gpu-memory-utilization (or --kv-cache-memory-gb on CPU)"
        )
