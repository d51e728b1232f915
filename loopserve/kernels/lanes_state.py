"""The coda of a speculating decode step in one launch: every lane's update and each ring's check.

Owns: `LanesCoda`, the Triton twin of everything `runner.speculation.SpeculativeLanes.step` does
after the exit decision and the sampling: `policy.advance` per lane, the kept exit log-probs,
the copy-on-exit slots, then down each slot's ring (from its oldest unfinished token) which
lanes stay, which tokens become final, whether the next position gets a lane, the result record
and every state update. Must not: define a rule of its own: the torch step is the reference and
the CPU path, and tests/kernels/test_lanes_state.py holds the two equal bit for bit (records,
states and KV cache, over many steps of random requests, with and without `forced_acceptance`,
both schedulings).

One program per slot: a slot's lanes are read and written by its program alone, so programs
never race. Vectors run over a slot's lanes in ring order (index j, lane row
slot * lanes + (head + j) % lanes); the torch step's shifts along the ring (`before`, and the
forced acceptance's look at the next lane) are one-hot sums over the ring index, and its
running products of booleans are cumulative sums of their negation.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from loopserve.depth.policy import LoopOutcome
from loopserve.kernels.decode_state import _DELAYED_GATE, DecodeKernels, Prologue, exit_copies
from loopserve.kernels.noise import row_bits, uniform
from loopserve.kv.pages import NULL_PAGE


@triton.jit
def _shifted(values, ring, by: tl.constexpr, BLOCK_LANES: tl.constexpr):
    """values[j - by] at ring index j (0 where that is outside the ring's block)."""
    other = tl.arange(0, BLOCK_LANES)
    pick = other[None, :] == (ring[:, None] - by)
    return tl.sum(tl.where(pick, values[None, :], 0), axis=1)


@triton.jit
def _all_so_far(flags):
    """Running product of booleans along the ring (torch: .long().cumprod(dim=1).bool())."""
    return tl.cumsum((~flags).to(tl.int32), axis=0) == 0


@triton.jit
def _at(values, ring, index):
    """values[index] of a ring vector."""
    return tl.sum(tl.where(ring == index, values, 0), axis=0)


@triton.jit
def _lanes_coda_kernel(
    ran_ptr, waiting_ptr, exited_ptr, new_survival_ptr, test_ptr, tokens_ptr, logprobs_ptr,
    top_ids_ptr, top_logprobs_ptr, out_ptr,
    active_ptr, state_waiting_ptr, loop_ptr, max_loops_ptr, rule_ptr, survival_ptr,
    stop_next_ptr, count_ptr, max_tokens_ptr, stop_ids_ptr, token_ptr, position_ptr, hidden_ptr,
    seed_ptr, tables_ptr, done_ptr, proposal_ptr, out_token_ptr, out_depth_ptr, kept_ptr,
    head_ptr,
    record_out, source_out, destination_out,
    num_planes, num_pages, block_size, null_slot, hidden_size, stride_out, stride_ids,
    stride_top, num_stop_ids, record_width, kept_stride, kept_width, forced_acceptance,
    forced_salt,
    LANES: tl.constexpr, DRAFT_LOOPS: tl.constexpr, NO_REFILL: tl.constexpr,
    FORCED: tl.constexpr, TOP: tl.constexpr, BLOCK_LANES: tl.constexpr,
    BLOCK_KEPT: tl.constexpr, BLOCK_STOPS: tl.constexpr, BLOCK_PLANES: tl.constexpr,
    BLOCK_HIDDEN: tl.constexpr,
):  # fmt: skip
    slot = tl.program_id(0).to(tl.int64)
    first = slot * LANES
    head = tl.load(head_ptr + slot)
    ring = tl.arange(0, BLOCK_LANES)
    in_ring = ring < LANES
    lane = first + (head + ring) % LANES  # each ring index's lane row

    # Each lane's own step (the torch step before its ring resolution).
    ran = tl.load(ran_ptr + lane, mask=in_ring, other=0) != 0
    exited = tl.load(exited_ptr + lane, mask=in_ring, other=0) != 0
    loop = tl.load(loop_ptr + lane, mask=in_ring, other=0)
    proposes = ran & ~exited & (loop == DRAFT_LOOPS)
    sampled = tl.load(tokens_ptr + lane, mask=in_ring, other=0)
    finished = (tl.load(done_ptr + lane, mask=in_ring, other=0) != 0) | exited
    produced = tl.where(exited, sampled, tl.load(out_token_ptr + lane, mask=in_ring, other=0))
    out_depth = tl.where(exited, loop, tl.load(out_depth_ptr + lane, mask=in_ring, other=0))
    # the exit's log-prob and top alternatives, kept until the token is reported
    columns = tl.arange(0, BLOCK_KEPT)
    in_kept = in_ring[:, None] & (columns < kept_width)[None, :]
    kept_at = kept_ptr + lane[:, None] * kept_stride + columns[None, :]
    now = tl.load(logprobs_ptr + lane[:, None] + 0 * columns[None, :], mask=in_kept, other=0.0)
    if TOP > 0:
        is_id = (columns >= 1) & (columns <= TOP)
        is_top = (columns > TOP) & (columns <= 2 * TOP)
        at_id = lane[:, None] * stride_ids + (columns[None, :] - 1)
        at_top = lane[:, None] * stride_top + (columns[None, :] - 1 - TOP)
        ids = tl.load(top_ids_ptr + at_id, mask=in_kept & is_id[None, :], other=0)
        tops = tl.load(top_logprobs_ptr + at_top, mask=in_kept & is_top[None, :], other=0.0)
        now = tl.where(is_id[None, :], ids.to(tl.float32), now)
        now = tl.where(is_top[None, :], tops, now)
    kept = tl.where(exited[:, None], now, tl.load(kept_at, mask=in_kept, other=0.0))
    tl.store(kept_at, kept, mask=in_kept)

    # Down the ring (runner/speculation.py, steps 3 to 5).
    live = (tl.load(active_ptr + lane, mask=in_ring, other=0) != 0) & in_ring
    held = tl.load(token_ptr + lane, mask=in_ring, other=0)
    proposal = tl.load(proposal_ptr + lane, mask=in_ring, other=0) != 0
    outputs = tl.load(count_ptr + lane, mask=in_ring, other=0)
    limit = tl.load(max_tokens_ptr + first)
    stops = tl.arange(0, BLOCK_STOPS)
    in_stops = stops < num_stop_ids
    stop_ids = tl.load(stop_ids_ptr + first * num_stop_ids + stops, mask=in_stops, other=-1)
    finished_before = _shifted(finished.to(tl.int32), ring, 1, BLOCK_LANES) != 0
    agrees = held == _shifted(produced, ring, 1, BLOCK_LANES)
    if FORCED:  # benchmarks: the proposal stands for the token
        seeds = tl.load(seed_ptr + lane, mask=in_ring, other=0) ^ forced_salt
        draws = uniform(row_bits(seeds, outputs), 0 * outputs)
        agrees = tl.where(proposal, draws < forced_acceptance, agrees)
    live = _all_so_far(live & (~finished_before | agrees)) & in_ring
    confirmed = live & (_shifted(exited.to(tl.int32), ring, 1, BLOCK_LANES) != 0) & proposal
    if FORCED:
        taken = live & finished_before & proposal
        taken_next = _shifted(taken.to(tl.int32), ring, -1, BLOCK_LANES) != 0
        produced = tl.where(taken_next, _shifted(held, ring, -1, BLOCK_LANES), produced)
    is_stop = (produced[:, None] == stop_ids[None, :]) & in_stops[None, :]
    ends = (tl.max(is_stop.to(tl.int32), axis=1) > 0) | (outputs + 1 >= limit)
    ends_before = _shifted(ends.to(tl.int32), ring, 1, BLOCK_LANES) != 0
    reported = _all_so_far(live & finished & ~ends_before) & in_ring
    stopped = reported & ends
    num_reported = tl.sum(reported.to(tl.int64), axis=0)
    slot_stopped = tl.max(stopped.to(tl.int32), axis=0) > 0
    num_live = tl.sum(live.to(tl.int64), axis=0)
    last = tl.maximum(num_live - 1, 0)
    any_live = num_live > 0
    last_done = (_at(finished.to(tl.int32), ring, last) != 0) & any_live
    last_proposes = (_at(proposes.to(tl.int32), ring, last) != 0) & any_live
    token = tl.where(last_done, _at(produced, ring, last), _at(sampled, ring, last))
    index = _at(outputs, ring, last)
    ends_next = tl.max(((token == stop_ids) & in_stops).to(tl.int32), axis=0) > 0
    ends_next = ends_next | (index + 1 >= limit)
    room = num_live - num_reported < LANES
    spawn = (last_done | last_proposes) & room & ~slot_stopped & ~ends_next
    is_new = spawn & (ring == num_live % LANES)

    # The record, in ring order: this step's loop per lane, the reported tokens.
    record = record_out + (first + ring) * record_width
    tl.store(record + 0, ran.to(tl.float32), mask=in_ring)
    tl.store(record + 1, loop.to(tl.float32), mask=in_ring)
    tl.store(record + 2, reported.to(tl.float32), mask=in_ring)
    tl.store(record + 3, produced.to(tl.float32), mask=in_ring)
    tl.store(record + 4, stopped.to(tl.float32), mask=in_ring)
    tl.store(record[:, None] + 5 + columns[None, :], kept, mask=in_kept)
    extra = record + 5 + kept_width
    proposed = spawn & last_proposes & (ring == last)
    tl.store(extra + 0, out_depth.to(tl.float32), mask=in_ring)
    tl.store(extra + 1, proposed.to(tl.float32), mask=in_ring)
    tl.store(extra + 2, confirmed.to(tl.float32), mask=in_ring)

    # Per lane (row order, before the state changes): the loop's output carried, and the
    # copy-on-exit slots.
    tables = tables_ptr + slot * num_planes * num_pages
    for j in range(LANES):
        row = first + j
        if tl.load(ran_ptr + row) != 0:
            for start in range(0, hidden_size, BLOCK_HIDDEN):
                cols = start + tl.arange(0, BLOCK_HIDDEN)
                in_hidden = cols < hidden_size
                values = tl.load(out_ptr + row * stride_out + cols, mask=in_hidden)
                tl.store(hidden_ptr + row * hidden_size + cols, values, mask=in_hidden)
        exit_copies(
            tables, source_out + row * num_planes, destination_out + row * num_planes,
            tl.load(position_ptr + row), tl.load(loop_ptr + row), tl.load(max_loops_ptr + row),
            tl.load(exited_ptr + row) != 0, num_planes, num_pages, block_size, null_slot,
            BLOCK_PLANES,
        )  # fmt: skip

    # policy.advance per lane, then the lanes' new state.
    test = tl.load(test_ptr + lane, mask=in_ring, other=0) != 0
    delayed = tl.load(rule_ptr + lane, mask=in_ring, other=0) == _DELAYED_GATE
    stop_next = ~exited & (
        (tl.load(stop_next_ptr + lane, mask=in_ring, other=0) != 0) | (test & delayed)
    )
    waiting = tl.load(waiting_ptr + lane, mask=in_ring, other=0) != 0
    if NO_REFILL:
        waiting = waiting | exited
        waiting = tl.where(is_new, last_done, waiting)  # an exact successor waits its cohort
    else:
        waiting = waiting & ~is_new
    survival = tl.where(exited, 1.0, tl.load(new_survival_ptr + lane, mask=in_ring, other=0))
    remaining = live & ~reported & ~slot_stopped
    tl.store(token_ptr + lane, tl.where(is_new, token, held), mask=in_ring)
    position = tl.load(position_ptr + lane, mask=in_ring, other=0)
    tl.store(position_ptr + lane, tl.where(is_new, head + num_live, position), mask=in_ring)
    tl.store(count_ptr + lane, tl.where(is_new, index + 1, outputs), mask=in_ring)
    tl.store(proposal_ptr + lane, tl.where(is_new, ~last_done, proposal), mask=in_ring)
    advanced = tl.where(exited, 1, loop + ran.to(tl.int64))
    tl.store(loop_ptr + lane, tl.where(is_new, 1, advanced), mask=in_ring)
    tl.store(survival_ptr + lane, tl.where(is_new, 1.0, survival), mask=in_ring)
    tl.store(stop_next_ptr + lane, stop_next & ~is_new, mask=in_ring)
    tl.store(state_waiting_ptr + lane, waiting, mask=in_ring)
    tl.store(active_ptr + lane, remaining | is_new, mask=in_ring)
    tl.store(done_ptr + lane, remaining & finished & ~is_new, mask=in_ring)
    tl.store(out_token_ptr + lane, produced, mask=in_ring)
    tl.store(out_depth_ptr + lane, out_depth, mask=in_ring)
    tl.store(head_ptr + slot, head + num_reported)


@dataclass(frozen=True, slots=True)
class LanesSettings:
    lanes: int
    draft_loops: int
    forced_acceptance: float | None
    forced_salt: int


class LanesCoda:
    """The coda launch of a speculating step over the state of `kernels` (its lanes' tables)."""

    def __init__(self, kernels: DecodeKernels, settings: LanesSettings) -> None:
        self.kernels = kernels
        self.settings = settings

    def __call__(
        self,
        lanes_state: tuple[torch.Tensor, ...],  # done, proposal, out_token, out_depth, kept, head
        start: Prologue,
        outcome: LoopOutcome,
        out: torch.Tensor,  # [rows, H] the loop's output
        sampled: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor],
        record_width: int,
    ) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
        """The result record [rows, record_width] and the copy-on-exit slots (source,
        destination), updating the state in place. `sampled` as `DecodeKernels.coda`'s."""
        kernels, settings = self.kernels, self.settings
        state, device = kernels.state, kernels.tables.device
        done, proposal, out_token, out_depth, kept, head = lanes_state
        tokens, logprobs, top_ids, top_logprobs = sampled
        rows, top = start.ran.shape[0], top_ids.shape[1]
        lanes = settings.lanes
        kept_width = 1 + 2 * top  # the exit's log-prob, then its top ids and log-probs
        record = torch.empty((rows, record_width), dtype=torch.float32, device=device)
        planes = kernels.num_planes
        source = torch.empty(rows * planes, dtype=torch.int64, device=device)
        destination = torch.empty(rows * planes, dtype=torch.int64, device=device)
        stop_ids = state.stop_ids
        forced = settings.forced_acceptance
        _lanes_coda_kernel[(rows // lanes,)](
            start.ran, start.waiting, outcome.exited, outcome.survival, outcome.test, tokens,
            logprobs, top_ids, top_logprobs, out,
            state.active, state.waiting, state.loop, state.max_loops, state.rule, state.survival,
            state.stop_next, state.output_count, state.max_tokens, stop_ids, state.token,
            state.position, state.hidden, state.seed, kernels.tables, done, proposal, out_token,
            out_depth, kept, head,
            record, source, destination,
            planes, kernels.num_pages, kernels.block_size, NULL_PAGE * kernels.block_size,
            kernels.hidden_size, out.stride(0), top_ids.stride(0), top_logprobs.stride(0),
            stop_ids.shape[1], record_width, kept.stride(0), kept_width,
            0.0 if forced is None else forced,
            settings.forced_salt,
            LANES=lanes, DRAFT_LOOPS=settings.draft_loops, NO_REFILL=kernels.no_refill,
            FORCED=forced is not None, TOP=top, BLOCK_LANES=triton.next_power_of_2(lanes),
            BLOCK_KEPT=triton.next_power_of_2(kept_width),
            BLOCK_STOPS=triton.next_power_of_2(stop_ids.shape[1]),
            BLOCK_PLANES=triton.next_power_of_2(planes), BLOCK_HIDDEN=kernels.block_hidden,
        )  # fmt: skip
        return record, (source, destination)
