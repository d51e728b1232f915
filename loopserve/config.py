"""Engine configuration: frozen intent, as the user gave it.

Owns: `EngineConfig` and the `SchedulerConfig` it holds, with one default and one help text per
setting (the command line is generated from them) and their validation, whose errors name both
the field and its flag (`num_kv_pages (--num-kv-pages)`). Must not: hold anything
resolved at run time (the number of KV pages, the chosen attention backend, the device dtype, eos
ids: the runner reports those in `RunnerInfo`), or import torch.
"""

from __future__ import annotations

import enum
import math
from dataclasses import MISSING, dataclass, field, fields
from typing import Any

from loopserve.depth.policy import ExitMode, Scheduling
from loopserve.depth.trace import check_distribution
from loopserve.kv.layout import KVLayout
from loopserve.speculative_config import SpeculativeConfig

DTYPES = ("auto", "float32", "bfloat16", "float16")
GENERATION_CONFIGS = ("auto", "none")
KV_CACHE_DTYPES = ("auto", "fp8")
QUANTIZATIONS = ("none", "fp8")


class LoadFormat(str, enum.Enum):
    AUTO = "auto"  # safetensors weights from the checkpoint
    DUMMY = "dummy"  # random weights from config.json alone


class KVAllocation(str, enum.Enum):
    INCREMENTAL = "incremental"  # pages as tokens arrive; preemption when short
    RESERVE = "reserve"  # every page a request can need, reserved at admission; never preempted


class PreemptionMode(str, enum.Enum):
    SWAP = "swap"  # a victim's K/V are copied to host memory and back, bit for bit
    RECOMPUTE = "recompute"  # its pages are dropped; admitted again, it recomputes them
    AUTO = "auto"  # swap while the victim fits the pinned swap space, else recompute


class GrowthEstimate(str, enum.Enum):
    LEARNED = "learned"  # admission counts running requests' expected growth (the share learned)
    NONE = "none"  # admission counts the first prompt chunk and the watermark only (vLLM's rule)


def setting(default: Any, help: str, *, flag: str | None = None, choices: Any = None) -> Any:
    """A config field with its help text (and, optionally, its command-line flag and choices)."""
    metadata = {"help": help, "flag": flag, "choices": choices}
    return field(default=default, metadata=metadata)


def flag_of(item: Any) -> str:
    """The command-line flag of a config field: its own `flag`, else `--the-field-name`."""
    return item.metadata.get("flag") or "--" + item.name.replace("_", "-")


def option_name(name: str) -> str:
    """How errors name a setting: the field and its flag (`num_kv_pages (--num-kv-pages)`), so
    Python and command-line users both recognise it."""
    for config_class in (EngineConfig, SchedulerConfig):
        for item in fields(config_class):
            if item.name == name:
                return f"{name} ({flag_of(item)})"
    raise KeyError(name)


@dataclass(frozen=True, slots=True)
class SchedulerConfig:
    """How requests are batched, how deep their tokens run, and how their K/V are laid out."""

    max_num_seqs: int = setting(64, "requests running at once (each holds one decode row)")
    max_num_batched_tokens: int = setting(
        2048, "prompt tokens per step (every decoding request's row runs besides them)"
    )
    prefill_chunk_size: int = setting(
        2048,
        "longest prompt chunk of one request per step; a chunk runs every loop, so larger "
        "chunks mean fewer launches, smaller ones shorter stalls for decoding rows",
    )
    scheduling: Scheduling = setting(
        Scheduling.REFILL,
        "refill: a row whose token exited starts the next token at once (continuous depth "
        "batching); no_refill: it waits until its whole cohort has exited",
    )
    exit_mode: ExitMode = setting(
        ExitMode.OURO,
        "ouro: exit after the first loop whose gate test holds (exact); ouro_delayed: one loop "
        "later; trace: depths given in advance (benchmarks)",
    )
    trace_distribution: tuple[float, ...] = setting(
        (),
        "trace mode: P(depth = 1, 2, ...) for requests that give no depths, at most one per "
        "loop of the model; on the command line they must sum to 1 (in Python they are weights, "
        "normalized); empty: the model family's default (Ouro: d2.6 = 0.1,0.4,0.3,0.2)",
    )
    exit_criterion: str = setting(
        "",
        "the family's exit rule in the ouro modes: Ouro gate; Huginn latent-diff, entropy-diff, "
        "kl or minp-kl (the request's exit_threshold is the criterion's threshold); empty: the "
        "family's default (gate, latent-diff)",
    )
    kv_layout: KVLayout = setting(
        KVLayout.FULL,
        "full: one KV plane per loop (at fixed depth exactly the HF model); shared: once a "
        "prompt is done, each token keeps only its final version (one plane of memory)",
    )
    block_size: int = setting(16, "tokens per KV page")
    kv_allocation: KVAllocation = setting(
        KVAllocation.INCREMENTAL,
        "incremental: requests take KV pages as their tokens arrive, and when pages run out the "
        "latest, lowest-priority request is preempted (preemption_mode); reserve: admission "
        "reserves every page a request can need (prompt + max_tokens), so nothing is ever "
        "preempted",
    )
    preemption_mode: PreemptionMode = setting(
        PreemptionMode.SWAP,
        "incremental: what happens to a preempted request's K/V. swap: copied to host memory "
        "and back; recompute: dropped, and when it is admitted again its prompt and generated "
        "tokens run again, each generated token to its own exit depth (vLLM's default; needs "
        "kv_layout full); auto: swap while the victim fits the pinned swap space "
        "(--swap-space-gb), recompute one that does not instead of pinning memory for it (swap "
        "where recompute cannot serve: the shared layout, prelude/coda families, a CPU)",
    )
    kv_watermark: float = setting(
        0.01, "incremental: fraction of KV pages admission keeps free for running requests to grow"
    )
    kv_growth_estimate: GrowthEstimate = setting(
        GrowthEstimate.LEARNED,
        "incremental: learned: admission also keeps free the most pages the running requests "
        "and the new one are expected to take at once, each expected to generate the share of "
        "max_tokens (at most 4096) that finished requests generated (SGLang's new-token ratio, "
        "measured; 0.7 until requests finish) and then free its pages, so workloads that run to "
        "max_tokens are not admitted into preemption; none: only the first prompt chunk and "
        "kv_watermark are counted (vLLM's rule)",
    )
    prefix_caching: bool = setting(
        True, "reuse the KV pages of prompt prefixes already computed (full pages, every plane)"
    )
    priority_bypass_limit: int = setting(
        64, "a waiting request lets at most this many later, higher-priority requests go first"
    )
    speculative_config: SpeculativeConfig | None = setting(
        None,
        'self-speculative decoding, a JSON object as in vLLM: {"method": "draft_loops", '
        '"num_speculative_tokens": K, "draft_loops": d}: a token that has run d loops '
        "without exiting proposes the next token from that depth, which starts at once; it is "
        "kept when the full-depth decision agrees, so outputs are unchanged (needs kv_layout "
        "full; docs/speculation.md)",
    )

    def lanes(self, num_loops: int) -> int:
        """Decode rows per request slot on a model of `num_loops` loops: one, or one per token
        a speculating request can have in flight (`SpeculativeConfig.lanes`)."""
        speculative = self.speculative_config
        return 1 if speculative is None else speculative.lanes(num_loops)

    def max_decode_rows(self, num_loops: int) -> int:
        return self.max_num_seqs * self.lanes(num_loops)

    def __post_init__(self) -> None:
        _coerce_enums(self)
        _check_finite(self)
        object.__setattr__(self, "trace_distribution", tuple(self.trace_distribution))
        object.__setattr__(
            self, "speculative_config", SpeculativeConfig.parse(self.speculative_config)
        )
        if self.speculative_config is not None and self.kv_layout is not KVLayout.FULL:
            raise ValueError(
                f"{option_name('speculative_config')} needs {option_name('kv_layout')} full: in "
                "the shared layout a proposed token's later loops would read the shallow K/V of "
                "the proposals before it, so its output would differ from decoding without "
                "speculation"
            )
        if self.trace_distribution:
            check_distribution(self.trace_distribution)
        for name in ("max_num_seqs", "max_num_batched_tokens", "prefill_chunk_size", "block_size"):
            if getattr(self, name) < 1:
                raise _invalid(name, "must be at least 1", getattr(self, name))
        if self.preemption_mode is PreemptionMode.RECOMPUTE and self.kv_layout is not KVLayout.FULL:
            raise ValueError(
                f"{option_name('preemption_mode')} recompute needs {option_name('kv_layout')} "
                "full: the shared layout keeps each generated token at its exit version in one "
                "plane, which a prompt-style replay cannot rebuild; use preemption_mode swap"
            )
        if not 0.0 <= self.kv_watermark < 1.0:
            raise _invalid("kv_watermark", "must be in [0, 1)", self.kv_watermark)
        if self.priority_bypass_limit < 0:
            raise _invalid("priority_bypass_limit", "must be >= 0", self.priority_bypass_limit)


@dataclass(frozen=True, slots=True)
class EngineConfig:
    model: str | None = setting(
        None,
        "checkpoint directory (HF layout), or ouro-tiny (the built-in model, the default)",
    )
    load_format: LoadFormat = setting(
        LoadFormat.AUTO, "auto: the checkpoint's safetensors; dummy: random weights"
    )
    device: str = setting("auto", "auto (the GPU when torch sees one, else cpu), cpu, cuda, cuda:N")
    dtype: str = setting(
        "auto",
        "weights and KV dtype; auto: bfloat16 on CUDA; on CPU bfloat16 for a bfloat16 checkpoint "
        "when the CPU has native bfloat16 support, else float32",
        choices=DTYPES,
    )
    attention_backend: str = setting(
        "auto",
        "auto (the first capable backend; the reasons for skipping the others are logged) or a "
        "registered name (torch, triton); an explicit choice never falls back",
    )
    kv_cache_dtype: str = setting(
        "auto",
        "how K/V are stored: auto (the model's dtype) or fp8 (float8 e4m3 with one K and one V "
        "scale per layer: 1, the checkpoint's k_scale/v_scale, or calculate_kv_scales; values "
        "beyond +-448 x scale saturate; half bf16's bytes, so the same memory holds twice the "
        "pages); fp8 is served by the torch and triton attention backends",
        choices=KV_CACHE_DTYPES,
    )
    calculate_kv_scales: bool = setting(
        False,
        "kv_cache_dtype fp8: at start-up, run fixed calibration prompts through the model at "
        "full depth and set each layer's K and V scale to its largest |K| and |V| over every "
        "loop x 2 / 448 (instead of 1 or the checkpoint's scales; docs/quantization.md)",
    )
    quantization: str = setting(
        "none",
        "weights: none (the model's dtype) or fp8 (each layer's projections quantized at load to "
        "float8 e4m3 with an fp32 scale per output channel, and their inputs per token as they "
        "are multiplied: dynamic W8A8, as vLLM's fp8; the LM head, embeddings and exit gate "
        "stay unquantized); half the weight bytes a decode loop reads, fp8 tensor cores for "
        "large batches",
        choices=QUANTIZATIONS,
    )
    num_kv_pages: int | None = setting(
        None, "exact number of KV pages (the null page included); default: sized from memory"
    )
    kv_cache_memory_gb: float | None = setting(
        None,
        "CPU: GiB for the KV cache; default: a quarter of the memory available after loading the "
        "weights, at most 4 GiB, and no more than max_num_seqs requests of the model's length use",
    )
    gpu_memory_utilization: float = setting(
        0.9,
        "CUDA: fraction of the GPU's memory this engine takes for weights, activations and the "
        "KV cache (engines sharing a GPU each take their own fraction)",
    )
    swap_space_gb: float = setting(
        4.0,
        "CUDA, incremental KV allocation: GiB of pinned host memory set aside at start for the "
        "K/V of preempted requests (pinning costs ~0.5 s per GiB, paid once here instead of at "
        "each preemption; beyond it, victims are pinned on the spot); 0: none set aside",
    )
    max_model_len: int | None = setting(
        None,
        "longest prompt + output; default: the model's max_position_embeddings, or less when the "
        "KV cache cannot hold one request that long (the start-up log says what was chosen)",
    )
    generation_config: str = setting(
        "auto",
        "auto: the sampling fields of the checkpoint's generation_config.json (temperature, top_p, "
        "top_k, min_p, max_new_tokens) are the defaults of requests that leave them unset, as in "
        "vLLM; none: loopserve's own defaults",
        choices=GENERATION_CONFIGS,
    )
    seed: int = setting(
        0, "seed of the engine (request seeds, dummy weights)", flag="--engine-seed"
    )
    cuda_graphs: bool = setting(
        True, "CUDA: replay the decode step and prompt loops from CUDA graphs"
    )
    async_scheduling: bool = setting(True, "launch step n + 1 before reading step n's results back")
    fused_kernels: bool = setting(
        True, "CUDA: fused Triton kernels for norms, RoPE and SiLU (when triton is installed)"
    )
    batch_invariant: bool = setting(
        False,
        "CUDA: a request's tokens never depend on its batch, at any batch size: the down "
        "projection runs as a Triton matmul with one reduction order (cuBLAS, the "
        "default, keeps that only up to some batch size per shape: 64 rows for Ouro-1.4B on an "
        "H200), and fp8 weights keep one kernel and tiling at every row count (by default "
        "they take a GEMV at up to 2 rows and cuBLAS's fp8 matmul past 16); needs "
        "fused_kernels and triton",
    )
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)

    def __post_init__(self) -> None:
        _coerce_enums(self)
        _check_finite(self)
        if self.dtype not in DTYPES:
            raise _invalid("dtype", f"must be one of {DTYPES}", self.dtype)
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise _invalid(
                "kv_cache_dtype", f"must be one of {KV_CACHE_DTYPES}", self.kv_cache_dtype
            )
        if self.calculate_kv_scales and self.kv_cache_dtype != "fp8":
            raise ValueError(
                f"{option_name('calculate_kv_scales')} needs {option_name('kv_cache_dtype')} fp8 "
                f"(scales apply to an fp8 KV cache only), got {self.kv_cache_dtype!r}"
            )
        if self.quantization not in QUANTIZATIONS:
            raise _invalid("quantization", f"must be one of {QUANTIZATIONS}", self.quantization)
        if not (self.device in ("auto", "cpu") or self.device.startswith("cuda")):
            raise _invalid("device", "must be 'auto', 'cpu', 'cuda' or 'cuda:N'", self.device)
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise _invalid(
                "gpu_memory_utilization", "must be in (0, 1]", self.gpu_memory_utilization
            )
        if self.swap_space_gb < 0:
            raise _invalid("swap_space_gb", "must be >= 0 (GiB)", self.swap_space_gb)
        if self.kv_cache_memory_gb is not None and self.kv_cache_memory_gb <= 0:
            raise _invalid("kv_cache_memory_gb", "must be positive (GiB)", self.kv_cache_memory_gb)
        if self.generation_config not in GENERATION_CONFIGS:
            raise _invalid(
                "generation_config", f"must be one of {GENERATION_CONFIGS}", self.generation_config
            )
        if self.num_kv_pages is not None and self.num_kv_pages < 2:
            raise _invalid(
                "num_kv_pages", "must be at least 2 (page 0 is the null page)", self.num_kv_pages
            )
        if self.max_model_len is not None and self.max_model_len < 2:
            raise _invalid("max_model_len", "must be at least 2", self.max_model_len)

    @classmethod
    def from_options(cls, **options: Any) -> EngineConfig:
        """An EngineConfig from flat keyword arguments: each name goes to the config that declares
        it (`EngineConfig(max_num_seqs=8)` is spelled `EngineConfig.from_options(max_num_seqs=8)`).
        """
        scheduler_names = {item.name for item in fields(SchedulerConfig)}
        engine_names = {item.name for item in fields(cls)} - {"scheduler"}
        unknown = sorted(set(options) - scheduler_names - engine_names)
        if unknown:
            known = ", ".join(sorted(scheduler_names | engine_names))
            raise TypeError(f"unknown engine option(s) {unknown}; known: {known}")
        scheduler = SchedulerConfig(**{k: v for k, v in options.items() if k in scheduler_names})
        engine = {k: v for k, v in options.items() if k in engine_names}
        return cls(**engine, scheduler=scheduler)


def _coerce_enums(config: Any) -> None:
    """Accept an enum's value (`kv_layout="shared"`) wherever a field is an enum."""
    for item in fields(config):
        default = item.default
        if isinstance(default, enum.Enum) and not isinstance(getattr(config, item.name), enum.Enum):
            kind = type(default)
            value = getattr(config, item.name)
            try:
                object.__setattr__(config, item.name, kind(value))
            except ValueError:
                choices = [member.value for member in kind]
                raise _invalid(item.name, f"must be one of {choices}", value) from None


def _check_finite(config: Any) -> None:
    """`nan` and `inf` mean nothing as a setting (and `int(inf)` would fail far from here)."""
    for item in fields(config):
        value = getattr(config, item.name)
        if isinstance(value, float) and not math.isfinite(value):
            raise _invalid(item.name, "must be a finite number", value)


def _invalid(name: str, problem: str, value: Any) -> ValueError:
    return ValueError(f"{option_name(name)} {problem}, got {value!r}")


def config_fields(config_class: type) -> list[Any]:
    """The settings of a config class that take a value (the nested `scheduler` excluded)."""
    return [item for item in fields(config_class) if item.default is not MISSING]
