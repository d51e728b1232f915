"""Per-request generation settings: sampling, stopping, logprobs and loop depth.

Owns: `SamplingParams` and its validation at the API boundary, `ResolvedParams` (the same with the
engine's defaults filled in) and `SamplingInfo` (what the coda needs to sample one token). Must
not: import torch, or hold values resolved by the engine (the model's loop count, eos ids, a drawn
seed) in `SamplingParams`: those live in `ResolvedParams`, built once per request by the engine.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class SamplingParams:
    """How one request generates. Defaults follow vLLM: temperature 1, 16 tokens."""

    # Maximum number of generated tokens.
    max_tokens: int = 16
    # 0 means greedy; otherwise logits are divided by it before sampling.
    temperature: float = 1.0
    # Nucleus sampling: keep the smallest set of tokens whose probability reaches top_p.
    top_p: float = 1.0
    # Keep the top_k most likely tokens; 0 or -1 keeps all.
    top_k: int = 0
    # Drop tokens whose probability is below min_p times the most likely one.
    min_p: float = 0.0
    # Seed of this request's sampling noise; the same seed gives the same tokens whatever the
    # batch. None: the engine draws one from its own seeded generator.
    seed: int | None = None
    # Keep generating after an end-of-sequence token.
    ignore_eos: bool = False
    # Extra token ids that end generation (the token is kept in the output).
    stop_token_ids: tuple[int, ...] = ()
    # Strings that end generation (the string is cut from the text).
    stop: tuple[str, ...] = ()
    # Return the log-probability of each sampled token and this many alternatives (None: none).
    logprobs: int | None = None
    # Decode the text without special tokens.
    skip_special_tokens: bool = True
    # Loop depth: each generated token runs at least min_loops and at most max_loops loops
    # (None: the model's loop count). exit_threshold < 1 lets the exit gate stop earlier;
    # 1.0 means fixed depth; None takes the checkpoint's default.
    min_loops: int = 1
    max_loops: int | None = None
    exit_threshold: float | None = None
    # For the `trace` exit mode: the exit depth of each generated token after the first (the
    # first always runs max_loops). Missing entries run max_loops.
    trace_depths: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        # Accept lists from callers; store tuples so the object stays hashable and immutable.
        for name in ("stop_token_ids", "stop"):
            value = getattr(self, name)
            if isinstance(value, str):
                value = (value,)
            object.__setattr__(self, name, tuple(value))
        if self.trace_depths is not None:
            object.__setattr__(self, "trace_depths", tuple(self.trace_depths))
        self._validate()

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def _validate(self) -> None:
        problems = []
        if self.max_tokens < 1:
            problems.append(f"max_tokens must be at least 1, got {self.max_tokens}")
        if self.temperature < 0:
            problems.append(f"temperature must be >= 0, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            problems.append(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < -1:
            problems.append(f"top_k must be -1, 0 (all) or positive, got {self.top_k}")
        if not 0.0 <= self.min_p <= 1.0:
            problems.append(f"min_p must be in [0, 1], got {self.min_p}")
        if self.logprobs is not None and not 0 <= self.logprobs <= 20:
            problems.append(f"logprobs must be between 0 and 20, got {self.logprobs}")
        if self.min_loops < 1:
            problems.append(f"min_loops must be at least 1, got {self.min_loops}")
        if self.max_loops is not None and self.max_loops < self.min_loops:
            problems.append(f"max_loops ({self.max_loops}) must be >= min_loops ({self.min_loops})")
        if self.exit_threshold is not None and not 0.0 < self.exit_threshold <= 1.0:
            problems.append(f"exit_threshold must be in (0, 1], got {self.exit_threshold}")
        if self.trace_depths is not None and any(depth < 1 for depth in self.trace_depths):
            problems.append("trace_depths must all be at least 1")
        if any(not text for text in self.stop):
            problems.append("stop strings must not be empty")
        if self.seed is not None and not 0 <= self.seed < 2**63:
            problems.append(f"seed must be in [0, 2**63), got {self.seed}")
        if problems:
            raise ValueError("; ".join(problems))


@dataclass(frozen=True, slots=True)
class ResolvedParams:
    """A request's settings with every engine default filled in (never written back)."""

    params: SamplingParams
    seed: int
    min_loops: int
    max_loops: int
    exit_threshold: float
    eos_token_ids: frozenset[int]  # the model's end-of-sequence ids; empty with ignore_eos

    @property
    def fixed_depth(self) -> bool:
        return self.exit_threshold >= 1.0

    def trace_depth(self, decode_index: int) -> int | None:
        """Given depth of the decode_index-th decode computation (0-based), if traced."""
        depths = self.params.trace_depths
        if depths is None or decode_index >= len(depths):
            return None
        return depths[decode_index]


@dataclass(frozen=True, slots=True)
class SamplingInfo:
    """What the coda needs to sample a request's next token, batch-independently."""

    params: SamplingParams
    seed: int
    output_index: int  # index of the token being sampled among the request's outputs
