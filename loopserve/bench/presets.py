"""Named sweeps: `--preset issue3` is the table GPU issue 3's resolving note needs.

Owns: the specs of each preset, their protocol (trials, warm-up) and time budget, and why they
were chosen. Must not: run anything.

issue3: 512/128 at C ∈ {1, 8, 32, 128} × {fixed, trace} × {refill, no_refill} × graphs {on, off},
plus 1024/128 at C = 1 (fixed, refill) for the TTFT of one 1024-token prompt. Designed to finish
in about 7 minutes on an H200:
- graphs on: 3 trials (2 at C = 128, the longest runs: ~1000 steps of 128 rows each);
- eager: 2 trials at C = 1 (the graphs/eager ratio is judged there), 1 trial at C >= 8 (eager is
  launch bound, ~1000 steps of ~8 ms per trial at every C; its spread is not measured there);
- every warm-up wave is C requests of 16 output tokens: it compiles the Triton kernels, captures
  the graphs and visits the batch sizes the closed loop reaches, at a fraction of a full wave;
- order: graphs on first (refill, then no_refill), eager last, C ascending inside each engine, so
  the 480 s budget, if it runs out, drops eager no_refill at large C first.
"""

from __future__ import annotations

from dataclasses import dataclass

from loopserve.bench.sweep_spec import EXITS, SCHEDULINGS, Point, RunSpec, Variant, Workload


@dataclass(frozen=True, slots=True)
class Preset:
    specs: list[RunSpec]
    time_budget_s: float  # default --time-budget of the preset
    description: str


ISSUE3_CONCURRENCY = (1, 8, 32, 128)
ISSUE3_WARMUP_OUTPUT_LEN = 16


def _issue3_trials(graphs: bool, concurrency: int) -> int:
    if graphs:
        return 2 if concurrency >= 128 else 3
    return 2 if concurrency == 1 else 1


def issue3(kv_layout: str = "full") -> Preset:
    short, ttft = Workload(512, 128), Workload(1024, 128)
    specs = []
    for graphs in (True, False):
        for scheduling in SCHEDULINGS:
            for concurrency in ISSUE3_CONCURRENCY:
                trials = _issue3_trials(graphs, concurrency)
                for exits in EXITS:
                    variant = Variant(exits, scheduling, graphs, kv_layout)
                    point = Point(short, concurrency)
                    specs.append(RunSpec(variant, point, trials, ISSUE3_WARMUP_OUTPUT_LEN))
                if concurrency == 1 and scheduling == "refill":
                    variant = Variant("fixed", "refill", graphs, kv_layout)
                    point = Point(ttft, 1)
                    specs.append(RunSpec(variant, point, trials, ISSUE3_WARMUP_OUTPUT_LEN))
    return Preset(specs, 480.0, "GPU issue 3 table (512/128) + 1024-token TTFT at C=1")


PRESETS = {"issue3": issue3}
