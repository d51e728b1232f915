"""Engine configuration: frozen intent, as the user gave it.

Owns: `EngineConfig` and its validation. Must not: hold anything resolved at run time (the number of
KV pages, the chosen attention backend, the device dtype, eos ids): the engine keeps those in its
own `EngineRuntime`, and never writes them back here. Must not import torch.
"""

from __future__ import annotations

from dataclasses import dataclass

from loopserve.engine.scheduler_config import SchedulerConfig
from loopserve.engine.trace import D2_6

LOAD_FORMATS = ("auto", "dummy")
DECODE_MODES = ("auto", "host", "device")


@dataclass(frozen=True, slots=True)
class EngineConfig:
    # Checkpoint directory (HF layout); None runs the built-in tiny model shipped in the package.
    model: str | None = None
    # "auto": read safetensors weights; "dummy": random weights from config.json alone.
    load_format: str = "auto"
    # "cpu", "cuda" or "cuda:N".
    device: str = "cpu"
    # "auto" (bfloat16 on CUDA, float32 on CPU), "float32", "bfloat16" or "float16".
    dtype: str = "auto"
    # "full" (one KV plane per loop, exact) or "shared" (final versions only after prefill).
    kv_layout: str = "full"
    # "auto" or a registered backend name ("torch", "triton", ...).
    attention_backend: str = "auto"
    # Tokens per KV page.
    block_size: int = 16
    # Exact number of KV pages (including the null page); None sizes the cache from memory.
    num_kv_pages: int | None = None
    # CPU: memory given to KV pages when num_kv_pages is None.
    kv_cache_memory_gb: float = 1.0
    # CUDA: fraction of GPU memory the engine may use in total (weights, activations, KV).
    gpu_memory_utilization: float = 0.9
    # Longest prompt + output; None takes the model's max_position_embeddings.
    max_model_len: int | None = None
    # Requests admitted at once.
    max_num_seqs: int = 64
    # Decode rows plus prompt-chunk tokens per step.
    max_num_batched_tokens: int = 2048
    # Longest prompt chunk of one request per step (one chunk runs every loop; larger chunks
    # mean fewer launches per prompt token, smaller ones shorter stalls for decoding rows).
    prefill_chunk_size: int = 2048
    # "refill" (continuous depth batching) or "no_refill" (cohorts drain first).
    scheduling: str = "refill"
    # "ouro" (exact gate exits), "ouro_delayed" (stop one loop after the gate says so), "trace".
    exit_mode: str = "ouro"
    # P(depth = 1, 2, ...) for traced tokens without explicit depths (trace mode).
    trace_distribution: tuple[float, ...] = D2_6
    # Seed of the engine's generator (draws seeds for requests that give none, dummy weights).
    seed: int = 0
    # "host": the scheduler picks every decode row's loop (the reference-like path);
    # "device": per-slot decode state lives on the device and one step runs a loop for every
    # slot, exits and samples included, with no host round trip; "auto": device on CUDA.
    decode_mode: str = "auto"
    # Device decode on CUDA: replay the decode step from CUDA graphs (captured lazily per
    # padded batch size); False runs it eagerly.
    cuda_graphs: bool = True
    # Device decode: prepare and launch step n + 1 before reading step n's results.
    async_scheduling: bool = True
    # CUDA: run norms, RoPE and SiLU as fused Triton kernels when triton is installed (one launch
    # each instead of several torch ops); False keeps the torch ops everywhere.
    fused_kernels: bool = True

    def __post_init__(self) -> None:
        if self.decode_mode not in DECODE_MODES:
            raise ValueError(f"decode_mode must be one of {DECODE_MODES}, got {self.decode_mode!r}")
        if self.load_format not in LOAD_FORMATS:
            raise ValueError(f"load_format must be one of {LOAD_FORMATS}, got {self.load_format!r}")
        if not (self.device == "cpu" or self.device.startswith("cuda")):
            raise ValueError(f"device must be 'cpu', 'cuda' or 'cuda:N', got {self.device!r}")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError("gpu_memory_utilization must be in (0, 1]")
        if self.kv_cache_memory_gb <= 0:
            raise ValueError("kv_cache_memory_gb must be positive")
        if self.num_kv_pages is not None and self.num_kv_pages < 2:
            raise ValueError("num_kv_pages must be at least 2 (page 0 is the null page)")
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ValueError("max_model_len must be at least 2")
        self.scheduler_config()  # validates the scheduling fields

    def decode_on_device(self) -> bool:
        if self.decode_mode == "auto":
            return self.device.startswith("cuda")
        return self.decode_mode == "device"

    def scheduler_config(self) -> SchedulerConfig:
        return SchedulerConfig(
            max_num_seqs=self.max_num_seqs,
            max_num_batched_tokens=self.max_num_batched_tokens,
            prefill_chunk_size=self.prefill_chunk_size,
            scheduling=self.scheduling,
            exit_mode=self.exit_mode,
            kv_layout=self.kv_layout,
            block_size=self.block_size,
            trace_distribution=self.trace_distribution,
            decode_on_device=self.decode_on_device(),
        )
