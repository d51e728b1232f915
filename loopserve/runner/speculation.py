"""Self-speculative decoding in the decode step: a request's lanes, its proposals and their check.

Owns: the state of a speculating request's lanes and the step that runs them. A request holds
`lanes` decode rows (K + 1, or fewer where no more can be in flight: `SpeculativeConfig.lanes`);
the token at position p lives in lane p % lanes, so its successor is the next lane round the
ring and nothing ever moves. Each step:

1. every lane that holds a token still running goes through one loop, at its own depth, as any
   row does (`DecodeStep.forward`; a lane's K/V go where the token's position says, in its
   request's page tables);
2. a token the exit rule stops is *done*: its next token is sampled at its exit loop, as without
   speculation. A token that has run `draft_loops` loops and does not exit *proposes* its next
   token: the same sample (same seed, same noise counter) from that shallower loop;
3. down the ring from the request's oldest unfinished token: a lane whose predecessor is done
   with another token than the one it holds is dropped, with every lane after it (its K/V are
   rewritten by the token that replaces it before anything reads them);
4. done tokens at the front are final: they are reported in order, up to a stop token or
   `max_tokens`, and their lanes freed;
5. the first free position after the remaining lanes gets a lane when its predecessor is done
   (its token is then exact) or proposed this step (a proposal), if a lane is free.

Why outputs do not change: a token's computation reads only its own input token and the K/V of
earlier positions at the planes its loops read (the `full` layout: loop t reads plane t - 1, a
token that exited at e is copied into the planes past e when it exits). A lane runs d loops
behind the token before it, which has written those planes by then; a lane whose input is
confirmed has computed exactly what decoding without speculation computes. Sampling: the token a
done lane reports is the one decoding without speculation samples (same logits, same noise);
a proposal is kept only when it equals that token. So every token, exit depth and log-prob is
the same as without speculation, for greedy and seeded sampling alike (docs/speculation.md).

Where the decode step's bookkeeping is fused (CUDA), everything after the exit decision is one
launch, `kernels/lanes_state.py`'s coda, the twin of the torch rules here (which stay the
reference and the path everywhere else; tests/kernels/test_lanes_state.py holds them bit for
bit).

Must not: read anything from the host during `step`; it stays capturable in a CUDA graph.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from loopserve.depth import policy
from loopserve.engine.scheduler_output import SlotStart
from loopserve.kv.transfer import to_device
from loopserve.runner.decode_slots import SamplingKind
from loopserve.runner.decode_step import DecodeStep
from loopserve.runner.step_record import (
    EXTRA_COLUMNS,
    LOGPROB,
    MAX_TOP_LOGPROBS,
    RESULT_COLUMNS,
)
from loopserve.sample.noise import uniform_draws
from loopserve.speculative_config import SpeculativeConfig

if TYPE_CHECKING:
    from loopserve.kernels.lanes_state import LanesCoda

# Keeps `forced_acceptance` draws apart from the sampling noise of the same seed.
FORCED_SALT = 0x5EC0_1A7E


class SpeculativeLanes:
    def __init__(self, step: DecodeStep, config: SpeculativeConfig, slots: int) -> None:
        self.decode = step
        self.lanes = lanes = step.lanes
        self.draft_loops = config.draft_loops
        self.forced_acceptance = config.forced_acceptance
        device = step.device
        rows = slots * lanes
        self.done = torch.zeros(rows, dtype=torch.bool, device=device)
        self.proposal = torch.zeros(rows, dtype=torch.bool, device=device)  # input not yet final
        self.out_token = torch.zeros(rows, dtype=torch.int64, device=device)
        self.out_depth = torch.zeros(rows, dtype=torch.int64, device=device)
        # A done lane's record columns from LOGPROB on (its token's log-prob and the top
        # alternatives), kept until the token is reported.
        width = RESULT_COLUMNS - LOGPROB + 2 * MAX_TOP_LOGPROBS
        self.exit_logprobs = torch.zeros(rows, width, dtype=torch.float32, device=device)
        self.head = torch.zeros(slots, dtype=torch.int64, device=device)  # oldest unfinished
        self._slot_of_row = torch.arange(rows, device=device) // lanes
        self._first_lane = torch.arange(slots, device=device) * lanes  # each slot's lane 0 row
        self._offsets = torch.arange(lanes, device=device)
        # Where the decode step's bookkeeping is fused (CUDA), the lanes' is too.
        self.coda: LanesCoda | None = None
        if step.kernels is not None:
            from loopserve.kernels.lanes_state import LanesCoda, LanesSettings

            settings = LanesSettings(lanes, self.draft_loops, self.forced_acceptance, FORCED_SALT)
            self.coda = LanesCoda(step.kernels, settings)

    def _forced(self, order: torch.Tensor, outputs: torch.Tensor) -> torch.Tensor:
        """`forced_acceptance`: whether each lane's proposal is kept [rows, lanes], drawn from
        the request's seed and the lane's output index (the same draw every step)."""
        seeds = self.decode.seed[: order.numel()][order.reshape(-1)] ^ FORCED_SALT
        draws = uniform_draws(seeds, outputs.reshape(-1), 1).reshape(order.shape)
        assert self.forced_acceptance is not None
        return draws < self.forced_acceptance

    def state_tensors(self) -> list[torch.Tensor]:
        return [
            self.done,
            self.proposal,
            self.out_token,
            self.out_depth,
            self.exit_logprobs,
            self.head,
        ]

    def stop(self, rows: torch.Tensor) -> None:
        self.done[rows] = False
        self.proposal[rows] = False

    def start(self, rows: torch.Tensor, starts: list[SlotStart]) -> None:
        """`rows`: every lane of each start's slot, slot by slot. Only the lane of the token's
        position holds it."""
        step = self.decode
        lanes = self.lanes
        where = to_device(
            [[s.slot for s in starts], [s.position for s in starts]], torch.int64, step.device
        )
        slots, positions = where[0], where[1]
        self.head[slots] = positions
        self.stop(rows)
        step.active[rows] = False
        step.active[slots * lanes + positions % lanes] = True

    def step(self, rows: int, kind: SamplingKind) -> torch.Tensor:
        """One loop for every lane of slots [0, rows). Returns the result record
        [rows * lanes, columns]: each slot's lanes from its oldest unfinished token on, with the
        tokens that became final this step marked EXITED, in order."""
        if self.coda is not None:
            return self._fused_step(rows, kind, self.coda)
        step, lanes = self.decode, self.lanes
        count = rows * lanes
        table_rows = self._slot_of_row[:count]
        row = step.row_depth(count)
        active = step.active[:count]
        ran, waiting = policy.runs(
            active & ~self.done[:count], step.waiting[:count], step.scheduling
        )
        position = step.position[:count]
        hidden, out, _, _ = step.forward(ran, row, position, table_rows)
        hazard = step.model.exit_probability(out, hidden, step.threshold[:count])
        outcome = policy.after_loop(row, ran, hazard)
        exited = outcome.exited
        proposes = ran & ~exited & (row.loop == self.draft_loops)
        sampled = step.choose(count, kind, out, exited | proposes)
        step.copy_on_exit(exited, row, position, table_rows)
        logprobs_now = torch.cat(
            [sampled.logprobs[:, None], sampled.top_ids.float(), sampled.top_logprobs], dim=1
        )
        kept = self.exit_logprobs[:count, : logprobs_now.shape[1]]
        kept.copy_(torch.where(exited[:, None], logprobs_now, kept))
        done = self.done[:count] | exited
        out_token = torch.where(exited, sampled.tokens, self.out_token[:count])
        out_depth = torch.where(exited, row.loop, self.out_depth[:count])
        following = policy.advance(row, ran, waiting, outcome, step.scheduling)
        step.hidden[:count] = torch.where(ran[:, None], out, step.hidden[:count])

        # Down each slot's ring, from its oldest unfinished token: [rows, lanes] in that order.
        head = self.head[:rows]
        order = (head[:, None] + self._offsets[None, :]) % lanes
        order = order + self._first_lane[:rows, None]
        flat = order.reshape(-1)
        live = active[order]
        finished = done[order]
        held = step.token[:count][order]
        produced = out_token[order]
        proposal = self.proposal[:count][order]
        outputs = step.output_count[:count][order]  # output index of each lane's next token
        # A slot's settings are on each of its lanes: lane 0's serve the slot.
        limit = step.max_tokens[:count:lanes]
        stop_ids = step.stop_ids[:count:lanes]  # [rows, S]

        def before(values: torch.Tensor) -> torch.Tensor:
            """Each lane's predecessor's value (False / 0 for the first lane)."""
            return torch.cat([torch.zeros_like(values[:, :1]), values[:, :-1]], dim=1)

        # 3. Keep a lane while every lane before it is kept and agrees with a done predecessor.
        agrees = held == before(produced)
        if self.forced_acceptance is not None:  # benchmarks: the proposal stands for the token
            agrees = torch.where(proposal, self._forced(order, outputs), agrees)
        finished_before = before(finished)
        live = (live & (~finished_before | agrees)).long().cumprod(dim=1).bool()
        confirmed = live & before(exited[order]) & proposal
        if self.forced_acceptance is not None:
            taken = (live & finished_before & proposal)[:, 1:]
            produced[:, :-1] = torch.where(taken, held[:, 1:], produced[:, :-1])
        # 4. Final tokens: done ones at the front, up to one that ends the request.
        ends = (produced[:, :, None] == stop_ids[:, None, :]).any(-1) | (
            outputs + 1 >= limit[:, None]
        )
        reported = (live & finished & ~before(ends)).long().cumprod(dim=1).bool()
        stopped = reported & ends
        num_reported = reported.sum(1)
        slot_stopped = stopped.any(1)
        # 5. The next position's lane: after a done token (exact) or a proposal made now.
        num_live = live.sum(1)
        last = (num_live - 1).clamp(min=0)[:, None]

        def at_last(values: torch.Tensor) -> torch.Tensor:
            return values.gather(1, last).squeeze(1)

        any_live = num_live > 0
        last_done = at_last(finished) & any_live
        last_proposes = at_last(proposes[order]) & any_live
        token = torch.where(last_done, at_last(produced), at_last(sampled.tokens[order]))
        index = at_last(outputs)
        ends_next = (token[:, None] == stop_ids).any(-1) | (index + 1 >= limit)
        room = num_live - num_reported < lanes
        spawn = (last_done | last_proposes) & room & ~slot_stopped & ~ends_next
        target = order.gather(1, (num_live % lanes)[:, None]).squeeze(1)  # [rows] lane row

        # The record, in ring order (columns RAN, LOOP, EXITED, TOKEN, STOPPED, then the kept
        # exit's LOGPROB and top log-probs, then the extra ones): this step's loop per lane, the
        # reported tokens.
        proposed = torch.zeros_like(live).scatter(1, last, (spawn & last_proposes)[:, None])
        columns = [ran[order], row.loop[order], reported, produced, stopped]
        columns = [c.reshape(-1).float() for c in columns]
        extra = torch.stack([out_depth[order], proposed, confirmed], dim=2)
        record = torch.cat(
            [
                torch.stack(columns, 1),
                kept[flat],
                extra.reshape(count, EXTRA_COLUMNS).float(),
            ],
            dim=1,
        )

        # The lanes' new state.
        def by_lane(values: torch.Tensor) -> torch.Tensor:
            """[rows, lanes] in ring order -> [count] by lane row."""
            return torch.empty_like(values.reshape(-1)).scatter(0, flat, values.reshape(-1))

        remaining = live & ~reported & ~slot_stopped[:, None]
        is_new = torch.zeros_like(active).scatter(0, target, spawn)

        def spawned(values: torch.Tensor, current: torch.Tensor) -> torch.Tensor:
            return torch.where(
                is_new, torch.zeros_like(current).scatter(0, target, values), current
            )

        step.token[:count] = spawned(token, step.token[:count])
        step.position[:count] = spawned(head + num_live, position)
        step.output_count[:count] = spawned(index + 1, step.output_count[:count])
        self.proposal[:count] = spawned(~last_done, self.proposal[:count])
        step.loop[:count] = torch.where(is_new, 1, following.loop)
        step.survival[:count] = torch.where(is_new, 1.0, following.survival)
        step.stop_next[:count] = following.stop_next & ~is_new
        # Under no_refill an exact successor waits for its cohort; a proposal runs at once.
        waits = last_done & (step.scheduling is policy.Scheduling.NO_REFILL)
        step.waiting[:count] = spawned(waits, following.waiting)
        step.active[:count] = by_lane(remaining) | is_new
        self.done[:count] = by_lane(remaining & finished) & ~is_new
        self.out_token[:count] = by_lane(produced)
        self.out_depth[:count] = out_depth
        self.head[:rows] = head + num_reported
        return record

    def _fused_step(self, rows: int, kind: SamplingKind, coda: LanesCoda) -> torch.Tensor:
        """`step` in four launches around the loop, the prologue, the exit decision, the coda
        and the copy-on-exit (kernels/decode_state.py, kernels/lanes_state.py: twins of the
        torch path above, which is the reference they are tested against)."""
        from loopserve.kernels.kv_copy import copy_kv_slots

        step = self.decode
        count = rows * self.lanes
        start, out = step.fused_loop(coda.kernels, count, step.active[:count] & ~self.done[:count])
        hazard = step.model.exit_probability(out, start.hidden, step.threshold[:count])
        outcome, samples = coda.kernels.decide_and_propose(start, hazard, self.draft_loops)
        sampled = step.choose(count, kind, out, samples)
        width = RESULT_COLUMNS + 2 * sampled.top_ids.shape[1] + EXTRA_COLUMNS
        columns = (sampled.tokens, sampled.logprobs, sampled.top_ids, sampled.top_logprobs)
        record, copies = coda(tuple(self.state_tensors()), start, outcome, out, columns, width)
        copy_kv_slots(step.kv, *copies)
        return record
