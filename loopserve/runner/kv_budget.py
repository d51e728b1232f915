"""How many KV pages an engine gets, and the longest request they can hold.

Owns: the number of pages (explicit; on CPU from `kv_cache_memory_gb` or, by default, from the
memory available; on CUDA this engine's `gpu_memory_utilization` share of the GPU, less the
weights and the largest step's profiled activation peak (twice with CUDA graphs), never more than
is free), and `max_model_len` against that cache: by default the longest request whose
worst-case reservation (every plane of its layout) fits, never above the model's
`max_position_embeddings`, logged in one line; an explicit `max_model_len` that cannot fit is an
error saying what to change. With an exact `num_kv_pages` (tests, experiments) the model's length
stands and a request that cannot fit is refused when it is added. Before anything is allocated,
sizes the memory cannot hold are refused, naming the flag: an explicit `num_kv_pages` or
`kv_cache_memory_gb`, `max_num_seqs` request slots, or pinned `swap_space_gb`, larger than the
memory free (the GPU's on CUDA, the host's otherwise). Must not: allocate the cache (the runner's
setup does).
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

import torch

from loopserve.attention.torch_backend import causal_attention
from loopserve.config import EngineConfig, KVAllocation, SchedulerConfig, option_name
from loopserve.kv.pages import pages_for
from loopserve.models.layers import LoopContext
from loopserve.models.looped import LoopedForCausalLM
from loopserve.models.model_config import LoopedConfig
from loopserve.sample.sampler import SamplingBatch, mask_words, sample
from loopserve.sampling_params import SamplingInfo, SamplingParams

logger = logging.getLogger(__name__)

# Kept free on the GPU for CUDA graph pools, kernel workspaces and allocator fragmentation.
_GPU_MARGIN_BYTES = 1 << 30
# CPU default: this share of the memory available after the weights are loaded, at most the cap.
_CPU_MEMORY_SHARE = 0.25
_CPU_DEFAULT_CAP_BYTES = 4 << 30


@torch.inference_mode()
def profile_step_peak(model: LoopedForCausalLM, config: EngineConfig, device: torch.device) -> int:
    """Peak activation bytes of the largest step: a full prompt-token budget through one loop,
    and the coda (LM head + sampling with filters and token bitmasks) for every slot."""
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    base = torch.cuda.memory_allocated(device)
    tokens = config.scheduler.max_num_batched_tokens
    hidden = torch.randn(tokens, model.carried_size, dtype=model.dtype, device=device)
    cos, sin = model.rope(torch.arange(tokens, device=device))

    def attention(layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return causal_attention(q, k, v, q.shape[-1] ** -0.5)

    context = LoopContext(cos, sin, attention)
    hidden = model.run_loop(hidden, context)
    rows = min(config.scheduler.max_decode_rows(model.config.num_loops), tokens)
    params = SamplingParams(temperature=1.0, top_p=0.9, logprobs=20)
    infos = [SamplingInfo(params, 0, 0)] * rows
    every_token = b"\xff" * (4 * mask_words(model.config.vocab_size))
    batch = SamplingBatch.build(infos, model.config.vocab_size, device, [every_token] * rows)
    sample(model.compute_logits(hidden[:rows], ctx=context), batch)
    torch.cuda.synchronize(device)
    return int(torch.cuda.max_memory_allocated(device) - base)


def num_kv_pages(
    config: EngineConfig, model: LoopedForCausalLM, bytes_per_page: int, device: torch.device
) -> int:
    """Pages of the KV cache, the null page included."""
    if config.num_kv_pages is not None:
        _check_explicit_pages(config.num_kv_pages, bytes_per_page, device)
        return config.num_kv_pages
    if device.type == "cuda":
        budget = gpu_kv_budget(config, model, device)
    elif config.kv_cache_memory_gb is not None:
        budget = int(config.kv_cache_memory_gb * 2**30)
        if budget > _available_memory():
            raise ValueError(
                f"{option_name('kv_cache_memory_gb')} {config.kv_cache_memory_gb:g} GiB is more "
                f"than the {_available_memory() / 2**30:.1f} GiB of memory available; lower it, or "
                "leave it unset (the default takes a quarter of what is available, at most 4 GiB)"
            )
    else:
        budget = min(int(_available_memory() * _CPU_MEMORY_SHARE), _CPU_DEFAULT_CAP_BYTES)
        budget = min(budget, _useful_pages(config, model.config) * bytes_per_page)
        logger.info("CPU KV cache: %.2f GiB (--kv-cache-memory-gb to change)", budget / 2**30)
    pages = budget // bytes_per_page
    if pages < 2:
        raise ValueError(
            f"no memory is left for the KV cache (budget {budget / 2**30:.2f} GiB, "
            f"{bytes_per_page / 2**20:.2f} MiB per page); {_raise_memory_hint(config)}, or use "
            "a smaller model"
        )
    if config.scheduler.max_num_seqs > pages - 1:
        logger.warning(
            "max_num_seqs %d: the KV cache has only %d pages, so at most that many requests "
            "can run at once; lower --max-num-seqs, or %s",
            config.scheduler.max_num_seqs, pages - 1, _raise_memory_hint(config),
        )  # fmt: skip
    return int(pages)


def free_memory(device: torch.device) -> int:
    """Bytes `device` can still give: the GPU's free memory on CUDA, else the host's."""
    if device.type == "cuda":
        return int(torch.cuda.mem_get_info(device)[0])
    return _available_memory()


def _free_text(device: torch.device) -> str:
    where = f"free on {device}" if device.type == "cuda" else "of memory available"
    return f"{free_memory(device) / 2**30:.1f} GiB {where}"


def _check_explicit_pages(pages: int, bytes_per_page: int, device: torch.device) -> None:
    if pages * bytes_per_page > free_memory(device):
        raise ValueError(
            f"{option_name('num_kv_pages')} {pages} needs {pages * bytes_per_page / 2**30:.1f} "
            f"GiB of KV cache ({bytes_per_page / 2**20:.3f} MiB per page), more than the "
            f"{_free_text(device)}; lower --num-kv-pages (at most "
            f"{free_memory(device) // bytes_per_page}), or leave it unset to size the cache from "
            "memory"
        )


def slot_bytes(
    config: EngineConfig, model_config: LoopedConfig, element_size: int, carried_size: int
) -> int:
    """Rough bytes of one request slot besides its KV pages: its block-table rows (int32, every
    plane, the longest request), the decode step's per-slot state (what a loop carries,
    `carried_size` values; a few dozen scalars, stop ids, trace depths) and its row's float32
    logits and sampling buffers (an exit criterion's memory of a distribution is one more such
    row)."""
    length = config.max_model_len or model_config.max_position_embeddings
    table = 4 * model_config.num_loops * pages_for(length, config.scheduler.block_size)
    state = carried_size * element_size + 1024 + length
    return table + state + 4 * 4 * model_config.vocab_size


def check_slot_state(config: EngineConfig, model: LoopedForCausalLM, device: torch.device) -> None:
    """`max_num_seqs` request slots must fit in the memory free, before anything is allocated
    for them (or profiled with them)."""
    slots, default = config.scheduler.max_num_seqs, SchedulerConfig().max_num_seqs
    element = model.dtype.itemsize
    lanes = config.scheduler.lanes(
        model.config.num_loops
    )  # an upper bound: every lane as much as a slot
    needed = slots * lanes * slot_bytes(config, model.config, element, model.carried_size)
    if needed > free_memory(device):
        raise ValueError(
            f"{option_name('max_num_seqs')} {slots}: the state of that many request slots (block "
            f"tables, decode state, logits rows) needs {needed / 2**30:.1f} GiB, more than the "
            f"{_free_text(device)}; lower --max-num-seqs (default: {default})"
        )


def check_swap_space(config: EngineConfig, device: torch.device) -> None:
    """The pinned host memory of `swap_space_gb` (CUDA, incremental allocation) must exist."""
    if device.type != "cuda" or config.scheduler.kv_allocation is not KVAllocation.INCREMENTAL:
        return
    available = _available_memory()
    if config.swap_space_gb * 2**30 > available:
        raise ValueError(
            f"{option_name('swap_space_gb')} {config.swap_space_gb:g} GiB is more than the "
            f"{available / 2**30:.1f} GiB of host memory available; lower --swap-space-gb "
            "(0: none set aside; preempted requests are then pinned on the spot)"
        )


def gpu_kv_budget(config: EngineConfig, model: LoopedForCausalLM, device: torch.device) -> int:
    """This engine's share of the GPU (`gpu_memory_utilization` of its memory, as in vLLM: a
    per-engine budget, so engines that share a GPU each take their own fraction) less the
    weights, the step peak and a margin; never more than the GPU has free now. With CUDA graphs
    the step peak counts twice: prompt loops replayed from graphs keep their activations in the
    graphs' own memory pool (runner/prompt_graphs.py), which eager steps cannot borrow."""
    peak = profile_step_peak(model, config, device) * (2 if config.cuda_graphs else 1)
    torch.cuda.empty_cache()  # the profile's blocks: the free figure below must include them
    free, total = torch.cuda.mem_get_info(device)
    # This engine's own weights: other engines of the process (benchmarks keep two) have theirs.
    weights = sum(tensor.nbytes for tensor in (*model.parameters(), *model.buffers()))
    share = int(total * config.gpu_memory_utilization) - weights - peak - _GPU_MARGIN_BYTES
    fits = free - peak - _GPU_MARGIN_BYTES
    logger.info(
        "GPU memory: %.1f GiB total, %.1f GiB free, weights %.2f GiB, step peak %.2f GiB "
        "(held twice with CUDA graphs), "
        "KV budget %.1f GiB",
        total / 2**30, free / 2**30, weights / 2**30, peak / 2**30, min(share, fits) / 2**30,
    )  # fmt: skip
    if fits < share:
        logger.warning(
            "gpu_memory_utilization %.2f asks for %.1f GiB of KV cache but only %.1f GiB is free "
            "(other processes hold %.1f GiB of the GPU); the cache gets what is free",
            config.gpu_memory_utilization, share / 2**30, max(fits, 0) / 2**30,
            (total - free - torch.cuda.memory_reserved(device)) / 2**30,
        )  # fmt: skip
    return min(share, fits)


def _available_memory() -> int:
    """Bytes of memory the system can still give (MemAvailable), free pages where unknown."""
    meminfo = Path("/proc/meminfo")
    if meminfo.exists():
        for line in meminfo.read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def _useful_pages(config: EngineConfig, model_config: LoopedConfig) -> int:
    """Pages that max_num_seqs requests of the longest length can reserve at once, plus the null
    page: a larger CPU cache would never be used."""
    length = config.max_model_len or model_config.max_position_embeddings
    return config.scheduler.max_num_seqs * _pages_for_one_request(config, model_config, length) + 1


def _pages_for_one_request(config: EngineConfig, model_config: LoopedConfig, length: int) -> int:
    """Worst-case pages of one request of `length` tokens (whose prompt may be nearly all of them,
    so both layouts need every plane)."""
    block = config.scheduler.block_size
    return config.scheduler.kv_layout.pages_needed(model_config.num_loops, length, length, block)


def check_max_model_len(config: EngineConfig, model_config: LoopedConfig) -> None:
    """Refuse a configured max_model_len beyond the model's positions (setup checks it from
    config.json before the weights load; the budget again after)."""
    limit = model_config.max_position_embeddings
    if config.max_model_len is not None and config.max_model_len > limit:
        raise ValueError(
            f"{option_name('max_model_len')} {config.max_model_len} exceeds the model's "
            f"max_position_embeddings ({limit}); pass at most {limit}, or leave it unset"
        )


def resolve_max_model_len(config: EngineConfig, model_config: LoopedConfig, num_pages: int) -> int:
    """`max_model_len`: the configured one (checked against the cache) or the longest that fits.

    Raises:
        ValueError: the configured length exceeds the model's, or (with an auto-sized cache) one
            request of it cannot fit; or not even one page per plane fits.
    """
    model_limit = model_config.max_position_embeddings
    if config.max_model_len is not None:
        check_max_model_len(config, model_config)
        if config.num_kv_pages is None:
            check_one_request_fits(config, model_config, num_pages, config.max_model_len)
        return config.max_model_len
    if config.num_kv_pages is not None:
        return model_limit  # exact pages: the caller's choice; too long a request is refused
    fitting = _longest_fitting(config, model_config, num_pages - 1, model_limit)
    if fitting == model_limit:
        logger.info("max_model_len %d: the model's max_position_embeddings", fitting)
        return fitting
    if fitting < 2:
        raise ValueError(
            f"the KV cache ({num_pages - 1} pages of {config.scheduler.block_size} tokens) cannot "
            "hold one page per plane of a request; " + _raise_memory_hint(config)
        )
    logger.warning(  # shown by default: requests longer than this are refused
        "max_model_len %d (the model allows %d): the longest request whose KV (%d loops, %s "
        "layout) fits in the cache of %d pages of %d tokens; %s, or set --max-model-len",
        fitting, model_limit, model_config.num_loops, config.scheduler.kv_layout.value,
        num_pages - 1, config.scheduler.block_size, _raise_memory_hint(config),
    )  # fmt: skip
    return fitting


def _longest_fitting(
    config: EngineConfig, model_config: LoopedConfig, usable_pages: int, limit: int
) -> int:
    """The largest length <= limit whose worst case fits in usable_pages (0 if none does)."""
    low, high = 0, limit  # invariant: low fits (0 trivially), everything above high does not
    while low < high:
        middle = (low + high + 1) // 2
        if _pages_for_one_request(config, model_config, middle) <= usable_pages:
            low = middle
        else:
            high = middle - 1
    return low


def _raise_memory_hint(config: EngineConfig) -> str:
    if config.device.startswith("cuda"):
        return "raise --gpu-memory-utilization for more"
    return "raise --kv-cache-memory-gb for more"


def check_one_request_fits(
    config: EngineConfig, model_config: LoopedConfig, num_pages: int, max_model_len: int
) -> None:
    """Auto-sized caches must hold at least one request of max_model_len tokens."""
    block = config.scheduler.block_size
    needed = _pages_for_one_request(config, model_config, max_model_len)
    if needed > num_pages - 1:
        raise ValueError(
            f"the KV cache holds {num_pages - 1} pages of {block} tokens, but one request of "
            f"max_model_len={max_model_len} tokens needs {needed}; lower --max-model-len (or leave "
            f"it unset: the default is the longest that fits) or "
            + _raise_memory_hint(config).removesuffix(" for more")
        )
