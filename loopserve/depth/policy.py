"""The depth policy: when a token exits, in every exit mode, and when a freed row is refilled.

Owns: the exit modes, the per-request rule the decode step applies, the decision after each loop,
the next loop of every row, and the `refill` / `no_refill` rule (docs/looped-models.md §4). Must
not: import torch. The decode step calls these functions with [rows] tensors on its device; they
use only arithmetic, comparisons and tensor methods, so the same code runs eagerly, inside a CUDA
graph, or on the CPU. Two deliberate second implementations: the serial reference, the oracle the
step is tested against, and the Triton twin the CUDA decode step runs (`kernels/decode_state.py`,
held to these functions bit for bit by tests/kernels/test_decode_state.py: change both).

A row is a slot holding one request's in-flight token. Each step runs one loop for every row that
runs; after the loop the policy says which rows exit (their next token starts at loop 1) and which
go one loop deeper.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any

from loopserve.depth.exit_test import next_survival, threshold_reached


class ExitMode(str, enum.Enum):
    """How the engine decides exits (a per-engine setting)."""

    OURO = "ouro"  # exact: exit after the first loop whose exit test holds
    OURO_DELAYED = "ouro_delayed"  # exit one loop after the test first holds (changes outputs)
    TRACE = "trace"  # exit depths given in advance; the gate is not evaluated


class Scheduling(str, enum.Enum):
    """What happens to a row whose token exited."""

    REFILL = "refill"  # its next token starts at loop 1 in the next step
    NO_REFILL = "no_refill"  # it waits until every row of its cohort has exited


class SlotRule(enum.IntEnum):
    """The rule one request's tokens follow (stored per row on the device)."""

    FIXED = 0  # every token runs max_loops loops
    GATE = 1  # ExitMode.OURO with exit_threshold < 1
    DELAYED_GATE = 2  # ExitMode.OURO_DELAYED with exit_threshold < 1
    TRACE = 3  # ExitMode.TRACE: depths given in advance


def slot_rule(exit_mode: ExitMode, exit_threshold: float) -> SlotRule:
    """The rule of a request: the engine's mode, fixed depth when its threshold is 1."""
    if exit_mode is ExitMode.TRACE:
        return SlotRule.TRACE
    if exit_threshold >= 1.0:
        return SlotRule.FIXED
    return SlotRule.DELAYED_GATE if exit_mode is ExitMode.OURO_DELAYED else SlotRule.GATE


@dataclass(slots=True)
class RowDepth:
    """What the policy reads of each row before a loop ([rows] tensors)."""

    loop: Any  # int64, the loop this step runs (1-based)
    min_loops: Any  # int64
    max_loops: Any  # int64
    rule: Any  # int64 SlotRule
    threshold: Any  # fp32
    survival: Any  # fp32, Π(1 − λ) over the token's earlier loops
    stop_next: Any  # bool, DELAYED_GATE: the test held earlier, this loop is the last
    trace_depth: Any  # int64, TRACE: the loop this token exits after


@dataclass(slots=True)
class LoopOutcome:
    exited: Any  # bool: the row ran and its token exits after this loop
    survival: Any  # fp32 after this loop (unchanged where the gate was not evaluated)
    test: Any  # bool: the exit test was evaluated and held


def runs(active: Any, waiting: Any, scheduling: Scheduling) -> tuple[Any, Any]:
    """(rows that run this step, rows still waiting). Under `no_refill` an exited row waits until
    no row of its cohort runs any more; then every waiting row starts together."""
    if scheduling is Scheduling.NO_REFILL:
        waiting = waiting & (active & ~waiting).any()
    return active & ~waiting, waiting


def after_loop(row: RowDepth, ran: Any, hazard: Any) -> LoopOutcome:
    """Whether each row that ran exits after this loop; `hazard` is λ of this loop (fp32)."""
    at_max = row.loop >= row.max_loops
    gate = row.rule == SlotRule.GATE
    delayed = row.rule == SlotRule.DELAYED_GATE
    evaluate = ran & (gate | (delayed & ~row.stop_next)) & ~at_max
    survival = next_survival(row.survival, hazard).where(evaluate, row.survival)
    test = evaluate & threshold_reached(survival, row.loop, row.min_loops, row.threshold)
    traced = (row.rule == SlotRule.TRACE) & (row.loop >= row.trace_depth)
    exits = at_max | traced | (gate & test) | (delayed & row.stop_next)
    return LoopOutcome(ran & exits, survival, test)


def may_exit(row: RowDepth) -> Any:
    """Whether each row's token could exit after the loop it runs next, before that loop runs
    (`after_loop` decides whether it does): at max_loops, a gate at or past min_loops, a delayed
    gate whose test held, a trace at its depth. Constrained decoding holds such a row until the
    bitmask of the token it would sample is on the device (`runner.token_masks`)."""
    at_max = row.loop >= row.max_loops
    gate = (row.rule == SlotRule.GATE) & (row.loop >= row.min_loops)
    delayed = (row.rule == SlotRule.DELAYED_GATE) & row.stop_next
    traced = (row.rule == SlotRule.TRACE) & (row.loop >= row.trace_depth)
    return at_max | gate | delayed | traced


@dataclass(slots=True)
class NextDepth:
    loop: Any  # int64, the loop each row runs next
    survival: Any  # fp32
    stop_next: Any  # bool
    waiting: Any  # bool


def advance(
    row: RowDepth, ran: Any, waiting: Any, outcome: LoopOutcome, scheduling: Scheduling
) -> NextDepth:
    """Each row's state for the next step: one loop deeper, or loop 1 of its next token."""
    exited = outcome.exited
    held = outcome.test & (row.rule == SlotRule.DELAYED_GATE)
    return NextDepth(
        loop=(row.loop + ran.long()).masked_fill(exited, 1),
        survival=outcome.survival.masked_fill(exited, 1.0),
        stop_next=~exited & (row.stop_next | held),
        waiting=waiting | (exited & (scheduling is Scheduling.NO_REFILL)),
    )
