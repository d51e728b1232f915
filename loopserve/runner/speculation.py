"""Self-speculative decoding in the decode step: a request's lanes, its proposals and their check.

Owns: the state of a speculating request's lanes and the step that runs them. A request holds
`lanes` = K + 1 decode rows; the token at position p lives in lane p % lanes, so its successor is
the next lane round the ring and nothing ever moves. Each step:

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

Must not: read anything from the host during `step`; it stays capturable in a CUDA graph.
"""

from __future__ import annotations

import torch

from loopserve.config import SpeculativeConfig
from loopserve.depth import policy
from loopserve.engine.scheduler_output import SlotStart
from loopserve.kv.transfer import to_device
from loopserve.runner.decode_step import (
    EXITED,
    LOOP,
    RAN,
    RESULT_COLUMNS,
    STOPPED,
    TOKEN,
    DecodeStep,
    SamplingKind,
)
from loopserve.sample.noise import uniform_noise

# Columns the speculative record adds after the standard ones (decode_step.RESULT_COLUMNS and
# the top log-probs): the exit loop of the token a row reports, whether its lane proposed a
# token that got a lane this step, and whether the row's token was a proposal confirmed now.
DEPTH, PROPOSED, CONFIRMED = range(3)
EXTRA_COLUMNS = 3
# Keeps `forced_acceptance` draws apart from the sampling noise of the same seed.
FORCED_SALT = 0x5EC0_1A7E
# Top log-prob alternatives a done lane keeps until it is reported (sampler's limit).
MAX_TOP_LOGPROBS = 20


class SpeculativeLanes:
    def __init__(self, step: DecodeStep, config: SpeculativeConfig, slots: int) -> None:
        self.decode = step
        self.lanes = lanes = config.lanes
        self.draft_loops = config.draft_loops
        self.forced_acceptance = config.forced_acceptance
        device = step.device
        rows = slots * lanes
        self.done = torch.zeros(rows, dtype=torch.bool, device=device)
        self.proposal = torch.zeros(rows, dtype=torch.bool, device=device)  # input not yet final
        self.out_token = torch.zeros(rows, dtype=torch.int64, device=device)
        self.out_depth = torch.zeros(rows, dtype=torch.int64, device=device)
        # A done lane's result-record row (decode_step's columns), kept until it is reported.
        width = RESULT_COLUMNS + 2 * MAX_TOP_LOGPROBS
        self.exit_record = torch.zeros(rows, width, dtype=torch.float32, device=device)
        self.head = torch.zeros(slots, dtype=torch.int64, device=device)  # oldest unfinished
        self._slot_of_row = torch.arange(rows, device=device) // lanes
        self._offsets = torch.arange(lanes, device=device)

    def _forced(self, order: torch.Tensor, outputs: torch.Tensor) -> torch.Tensor:
        """`forced_acceptance`: whether each lane's proposal is kept [rows, lanes], drawn from
        the request's seed and the lane's output index (the same draw every step)."""
        seeds = self.decode.seed[: order.numel()][order.reshape(-1)] ^ FORCED_SALT
        draws = uniform_noise(seeds, outputs.reshape(-1), 1).reshape(order.shape)
        return draws < self.forced_acceptance

    def state_tensors(self) -> list[torch.Tensor]:
        return [
            self.done,
            self.proposal,
            self.out_token,
            self.out_depth,
            self.exit_record,
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
        top = sampled.top_ids.shape[1]
        width = RESULT_COLUMNS + 2 * top
        record_now = torch.cat(
            [
                torch.stack(
                    [
                        ran,
                        row.loop,
                        exited,
                        sampled.tokens,
                        torch.zeros_like(ran),
                        sampled.logprobs,
                    ],
                    1,
                ).float(),
                sampled.top_ids.float(),
                sampled.top_logprobs,
            ],
            dim=1,
        )
        kept = self.exit_record[:count, :width]
        kept.copy_(torch.where(exited[:, None], record_now, kept))
        done = self.done[:count] | exited
        out_token = torch.where(exited, sampled.tokens, self.out_token[:count])
        out_depth = torch.where(exited, row.loop, self.out_depth[:count])
        following = policy.advance(row, ran, waiting, outcome, step.scheduling)
        step.hidden[:count] = torch.where(ran[:, None], out, step.hidden[:count])

        # Down each slot's ring, from its oldest unfinished token: [rows, lanes] in that order.
        head = self.head[:rows]
        order = (head[:, None] + self._offsets[None, :]) % lanes
        order = order + torch.arange(0, count, lanes, device=order.device)[:, None]
        live = active[order]
        finished = done[order]
        held = step.token[:count][order]
        produced = out_token[order]
        proposal = self.proposal[:count][order]
        exited_now = exited[order]
        outputs = step.output_count[:count][order]  # output index of each lane's next token
        limit = step.max_tokens[:count][order]
        stop_ids = step.stop_ids[:count][order]  # [rows, lanes, S], each slot's on every lane
        # 3. Drop lanes that follow a dropped lane or a done token they disagree with.
        forced = self._forced(order, outputs) if self.forced_acceptance is not None else None
        confirmed = torch.zeros_like(live)
        for lane in range(1, lanes):
            before = lane - 1
            agrees = held[:, lane] == produced[:, before]
            if forced is not None:  # benchmarks: the proposal stands for the token
                agrees = torch.where(proposal[:, lane], forced[:, lane], agrees)
                taken = agrees & finished[:, before] & live[:, lane]
                produced[:, before] = torch.where(taken, held[:, lane], produced[:, before])
            keep = live[:, lane] & live[:, before] & (~finished[:, before] | agrees)
            confirmed[:, lane] = keep & exited_now[:, before] & proposal[:, lane]
            live[:, lane] = keep
        # 4. Final tokens: done ones at the front, up to one that ends the request.
        ends = (produced[:, :, None] == stop_ids).any(-1) | (outputs + 1 >= limit)
        reported = torch.zeros_like(live)
        stopped = torch.zeros_like(live)
        going = torch.ones_like(live[:, 0])
        for lane in range(lanes):
            reported[:, lane] = going & live[:, lane] & finished[:, lane]
            stopped[:, lane] = reported[:, lane] & ends[:, lane]
            going = reported[:, lane] & ~ends[:, lane]
        num_reported = reported.sum(1)
        slot_stopped = stopped.any(1)
        # 5. The next position's lane: after a done token (exact) or a proposal made now.
        num_live = live.sum(1)
        last = (num_live - 1).clamp(min=0)[:, None]
        last_done = finished.gather(1, last).squeeze(1) & (num_live > 0)
        last_proposes = proposes[order].gather(1, last).squeeze(1) & (num_live > 0)
        last_proposes &= live.gather(1, last).squeeze(1)
        drafted = sampled.tokens[order].gather(1, last).squeeze(1)
        token = torch.where(last_done, produced.gather(1, last).squeeze(1), drafted)
        index = outputs.gather(1, last).squeeze(1)
        ends_next = (token[:, None] == stop_ids[:, 0]).any(-1) | (index + 1 >= limit[:, 0])
        room = num_live - num_reported < lanes
        spawn = (last_done | last_proposes) & room & ~slot_stopped & ~ends_next
        target = order.gather(1, (num_live % lanes)[:, None]).squeeze(1)  # [rows] lane row

        # Record (in ring order), then the lanes' new state.
        record = kept[order.reshape(-1)].clone()
        record[:, RAN] = ran[order].reshape(-1).float()
        record[:, LOOP] = row.loop[order].reshape(-1).float()
        record[:, EXITED] = reported.reshape(-1).float()
        record[:, TOKEN] = produced.reshape(-1).float()
        record[:, STOPPED] = stopped.reshape(-1).float()
        extra = torch.stack(
            [
                out_depth[order],
                torch.zeros_like(live).scatter(1, last, (spawn & last_proposes)[:, None]),
                confirmed,
            ],
            dim=2,
        ).reshape(count, EXTRA_COLUMNS)
        record = torch.cat([record, extra.float()], dim=1)

        remaining = live & ~reported & ~slot_stopped[:, None]
        lane_live = torch.zeros_like(active).scatter(0, order.reshape(-1), remaining.reshape(-1))
        lane_done = torch.zeros_like(active).scatter(
            0, order.reshape(-1), (remaining & finished).reshape(-1)
        )
        is_new = torch.zeros_like(active).scatter(0, target, spawn)
        new_value = torch.zeros_like(position)

        def spawned(values: torch.Tensor, current: torch.Tensor) -> torch.Tensor:
            return torch.where(is_new, new_value.scatter(0, target, values), current)

        step.token[:count] = spawned(token, step.token[:count])
        step.position[:count] = spawned(head + num_live, position)
        step.output_count[:count] = spawned(index + 1, step.output_count[:count])
        self.proposal[:count] = torch.where(
            is_new, torch.zeros_like(active).scatter(0, target, ~last_done), self.proposal[:count]
        )
        step.loop[:count] = torch.where(is_new, 1, following.loop)
        step.survival[:count] = torch.where(is_new, 1.0, following.survival)
        step.stop_next[:count] = following.stop_next & ~is_new
        no_refill = step.scheduling is policy.Scheduling.NO_REFILL
        # Under no_refill an exact successor waits for its cohort; a proposal runs at once.
        new_waits = torch.zeros_like(active).scatter(0, target, last_done) & no_refill
        step.waiting[:count] = torch.where(is_new, new_waits, following.waiting)
        step.active[:count] = lane_live | is_new
        self.done[:count] = lane_done & ~is_new
        self.out_token[:count] = torch.zeros_like(out_token).scatter(
            0, order.reshape(-1), produced.reshape(-1)
        )
        self.out_depth[:count] = out_depth
        self.head[:rows] = head + num_reported
        return record
