"""What an offline benchmark sweep measures: workloads, variants, points and their protocol.

Owns: the named values a sweep is made of (`Workload`, `Variant`, `Point`, `RunSpec`), parsing them
from command-line strings, and the order a plain sweep runs them in. Must not: import torch or
touch an engine; running them is `sweep.py`'s job.

A *variant* is what is compared (exit depths, scheduling, CUDA graphs, KV layout); a *point* is
where it is compared (workload and concurrency). A `RunSpec` is one variant at one point with its
protocol (trials, warm-up length); it becomes one JSON line and one `SpecResult`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from loopserve.bench.figures import Figure

EXITS = ("fixed", "trace")
# Old names of exits values, still accepted on the command line.
EXIT_ALIASES = {"d2.6": "trace"}
SCHEDULINGS = ("refill", "no_refill")
GRAPHS = ("on", "off")
KV_LAYOUTS = ("full", "shared")
ON_OFF = ("on", "off")
KV_ALLOCATIONS = ("incremental", "reserve")
PREEMPTION_MODES = ("swap", "recompute", "auto")


@dataclass(frozen=True, slots=True, order=True)
class Workload:
    """Random prompts of `prompt_len` tokens, `output_len` generated tokens each (EOS ignored);
    the first `shared_prefix` prompt tokens are the same in every request (a system prompt)."""

    prompt_len: int
    output_len: int
    shared_prefix: int = 0

    @classmethod
    def parse(cls, text: str) -> Workload:
        """'512/128' -> Workload(512, 128)."""
        parts = text.split("/")
        if len(parts) != 2 or not all(part.strip().isdigit() for part in parts):
            raise ValueError(f"a workload is 'PROMPT/OUTPUT' in tokens, e.g. 512/128; got {text!r}")
        prompt_len, output_len = (int(part) for part in parts)
        if prompt_len < 1 or output_len < 1:
            raise ValueError(f"workload {text!r}: both lengths must be at least 1")
        return cls(prompt_len, output_len)

    @property
    def name(self) -> str:
        shared = f" ({self.shared_prefix} shared)" if self.shared_prefix else ""
        return f"{self.prompt_len}/{self.output_len}{shared}"


@dataclass(frozen=True, slots=True)
class EngineKey:
    """The settings that need their own engine (the others are per request)."""

    graphs: bool
    kv_layout: str
    scheduling: str
    prefix_caching: bool = True
    kv_allocation: str = "incremental"
    preemption_mode: str = "swap"


@dataclass(frozen=True, slots=True)
class Variant:
    exits: str  # "fixed" (every token runs every loop) or "trace" (traced exits)
    scheduling: str  # "refill" or "no_refill"
    graphs: bool  # CUDA graphs on (only meaningful on CUDA)
    kv_layout: str  # "full" or "shared"
    prefix_caching: bool = True
    kv_allocation: str = "incremental"  # or "reserve"
    preemption_mode: str = "swap"  # or "recompute", "auto" (incremental allocation preempts)

    @property
    def engine_key(self) -> EngineKey:
        return EngineKey(
            self.graphs,
            self.kv_layout,
            self.scheduling,
            self.prefix_caching,
            self.kv_allocation,
            self.preemption_mode,
        )

    def label(self, with_layout: bool = False) -> str:
        parts = [self.exits, self.scheduling, "graphs" if self.graphs else "eager"]
        if with_layout:
            parts.append(self.kv_layout)
        if not self.prefix_caching:
            parts.append("no-prefix-cache")
        if self.kv_allocation != "incremental":
            parts.append(self.kv_allocation)
        if self.preemption_mode != "swap":
            parts.append(self.preemption_mode)
        return "/".join(parts)


@dataclass(frozen=True, slots=True, order=True)
class Point:
    workload: Workload
    concurrency: int  # requests kept in flight; a run has 2 × concurrency requests


@dataclass(frozen=True, slots=True)
class RunSpec:
    """One variant at one point with its protocol: one JSON line."""

    variant: Variant
    point: Point
    trials: int  # measured repetitions (medians and min/max are over these)
    warmup_output_len: int  # output tokens of the warm-up wave's requests (0: no warm-up)


@dataclass(frozen=True, slots=True)
class SpecResult:
    """A spec's figures: medians and [min, max] over its trials."""

    spec: RunSpec
    medians: dict[str, Figure]
    spread: dict[str, list[Figure]]
    num_loops: int  # the model's loop count (the bound of traced exits is num_loops / depth)


def parse_list(text: str, choices: tuple[str, ...], what: str) -> list[str]:
    """'a,b' -> ['a', 'b'], each checked against `choices`, duplicates dropped, order kept."""
    values = [value.strip() for value in text.split(",") if value.strip()]
    if choices == EXITS:
        values = [EXIT_ALIASES.get(value, value) for value in values]
    bad = [value for value in values if value not in choices]
    if bad or not values:
        raise ValueError(f"{what} must be a comma list of {choices}, got {text!r}")
    return list(dict.fromkeys(values))


def parse_concurrency(text: str) -> list[int]:
    values = [value.strip() for value in text.split(",") if value.strip()]
    if not values or not all(value.isdigit() and int(value) >= 1 for value in values):
        raise ValueError(f"--concurrency must be a comma list of positive integers, got {text!r}")
    return list(dict.fromkeys(int(value) for value in values))


def grid(
    workloads: list[Workload],
    concurrencies: list[int],
    variants: list[Variant],
    trials: int,
    warmup_output_len: int | None,
) -> list[RunSpec]:
    """Every variant at every point, ordered so that one engine serves a contiguous run.

    Engines are ordered graphs first, then refill, then by layout; inside an engine, by workload,
    concurrency and exits. `warmup_output_len` None means a full-length warm-up wave.
    """
    specs = []
    for variant in variants:
        for workload in workloads:
            for concurrency in concurrencies:
                warmup = workload.output_len if warmup_output_len is None else warmup_output_len
                point = Point(workload, concurrency)
                specs.append(RunSpec(variant, point, trials, min(warmup, workload.output_len)))
    return sorted(specs, key=run_order)


def run_order(spec: RunSpec) -> tuple[bool, bool, str, Workload, int, int]:
    variant = spec.variant
    return (
        not variant.graphs,
        variant.scheduling != "refill",
        variant.kv_layout,
        spec.point.workload,
        spec.point.concurrency,
        EXITS.index(variant.exits),
    )
