"""The decode step's bookkeeping in three launches: a prologue, an exit decision, a coda.

Owns: `prologue` (which rows run, the decode plane, the attention metadata's device tensors, the
RoPE rows of each position and the loop's input hidden state), `decide` (the exit decision) and
`coda` (the stop test, the result record, every slot-state update and the copy-on-exit slots).
Must not: define a rule of its own. Each line here is the Triton twin of a torch rule that stays the
reference and the CPU path: `depth.policy.runs` / `after_loop` / `advance`, `depth.exit_test`,
`kv.layout.KVLayout.decode_plane` / `copy_on_exit_target`, `BlockTables.decode_metadata`, the
embed-or-hidden select, stop test, record and state updates of `runner.decode_step`.
tests/kernels/test_decode_state.py holds the twins to each other bit for bit (random states,
every exit rule, both schedulings and both layouts); change a rule in both places.

fp32 survival math is the same sequence of operations as `exit_test`, compiled without FMA
contraction (the test's `1 - S` would otherwise fuse with the product that made S, which torch
rounds first), so exits agree bit for bit. RoPE angles are not
computed here: the prologue gathers rows of a table the model's own `rope` computed once for
every position (elementwise torch ops, so each row has the bits `rope` gives that position).

The exit decision (`decide`) is its own launch between the loop and the LM head, which computes
only the rows that exit. One program per row; only `no_refill`'s "does any row of the cohort
still run" reads other rows, and the prologue and `decide` write to fresh tensors, so programs
never race.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch
import triton
import triton.language as tl

from loopserve.depth.policy import LoopOutcome
from loopserve.kv.pages import NULL_PAGE

# SlotRule values (depth.policy; a test checks they agree). constexpr: triton reads no other
# globals inside a kernel.
_GATE, _DELAYED_GATE, _TRACE = tl.constexpr(1), tl.constexpr(2), tl.constexpr(3)


@triton.jit
def _prologue_kernel(
    active_ptr, waiting_ptr, loop_ptr, max_loops_ptr, position_ptr, token_ptr, hidden_ptr,
    tables_ptr, embed_ptr, rope_cos_ptr, rope_sin_ptr,
    ran_out, waiting_out, seq_lens_out, slot_mapping_out, page_table_out, cos_out, sin_out,
    hidden_out,
    rows, lanes, num_planes, num_pages, block_size, null_slot, hidden_size, head_dim, rope_rows,
    NO_REFILL: tl.constexpr, FULL: tl.constexpr, BLOCK_ROWS: tl.constexpr,
    BLOCK_PAGES: tl.constexpr, BLOCK_HIDDEN: tl.constexpr, BLOCK_HEAD: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0).to(tl.int64)
    # policy.runs
    active = tl.load(active_ptr + row) != 0
    waiting = tl.load(waiting_ptr + row) != 0
    if NO_REFILL:
        every = tl.arange(0, BLOCK_ROWS)
        in_rows = every < rows
        others_active = tl.load(active_ptr + every, mask=in_rows, other=0) != 0
        others_waiting = tl.load(waiting_ptr + every, mask=in_rows, other=0) != 0
        still_running = tl.max((others_active & ~others_waiting).to(tl.int32), axis=0) > 0
        waiting = waiting & still_running
    ran = active & ~waiting
    tl.store(ran_out + row, ran)
    tl.store(waiting_out + row, waiting)
    # KVLayout.decode_plane, then BlockTables.decode_metadata (a speculating request's lanes
    # share its slot's tables: row r is slot r // lanes)
    loop = tl.load(loop_ptr + row)
    plane = loop - 1 if FULL else tl.load(max_loops_ptr + row) - 1
    position = tl.load(position_ptr + row)
    table_row = tables_ptr + ((row // lanes) * num_planes + plane) * num_pages
    page = tl.load(table_row + position // block_size).to(tl.int64)
    slot = page * block_size + position % block_size
    tl.store(slot_mapping_out + row, tl.where(ran, slot, null_slot))
    tl.store(seq_lens_out + row, tl.where(ran, position + 1, 0).to(tl.int32))
    for start in range(0, num_pages, BLOCK_PAGES):
        pages = start + tl.arange(0, BLOCK_PAGES)
        in_table = pages < num_pages
        ids = tl.load(table_row + pages, mask=in_table)
        tl.store(page_table_out + row * num_pages + pages, ids, mask=in_table)
    # model.rope(position): a row of the table (clamped: rows past it do not run)
    dims = tl.arange(0, BLOCK_HEAD)
    in_head = dims < head_dim
    angle = tl.minimum(position, rope_rows - 1) * head_dim + dims
    tl.store(cos_out + row * head_dim + dims, tl.load(rope_cos_ptr + angle, mask=in_head), in_head)
    tl.store(sin_out + row * head_dim + dims, tl.load(rope_sin_ptr + angle, mask=in_head), in_head)
    # loop 1 starts from the token's embedding, deeper loops from the last loop's hidden state
    token = tl.load(token_ptr + row)
    source = tl.where(loop == 1, embed_ptr + token * hidden_size, hidden_ptr + row * hidden_size)
    for start in range(0, hidden_size, BLOCK_HIDDEN):
        cols = start + tl.arange(0, BLOCK_HIDDEN)
        in_hidden = cols < hidden_size
        values = tl.load(source + cols, mask=in_hidden)
        tl.store(hidden_out + row * hidden_size + cols, values, mask=in_hidden)


@triton.jit
def _decide_kernel(
    ran_ptr, hazard_ptr, loop_ptr, min_loops_ptr, max_loops_ptr, rule_ptr, threshold_ptr,
    survival_ptr, stop_next_ptr, trace_ptr, count_ptr, exited_out, survival_out, test_out,
    samples_out, trace_width, DRAFT_LOOPS: tl.constexpr,
):  # fmt: skip
    """policy.after_loop with exit_test's arithmetic: whether each row exits (before the LM head,
    which computes only exiting rows), its survival after this loop and whether the test held.
    DRAFT_LOOPS > 0 (speculating lanes, runner/speculation.py): also the rows that sample, those
    that exit and those that propose (ran DRAFT_LOOPS loops without exiting)."""
    row = tl.program_id(0).to(tl.int64)
    ran = tl.load(ran_ptr + row) != 0
    loop = tl.load(loop_ptr + row)
    rule = tl.load(rule_ptr + row)
    survival = tl.load(survival_ptr + row)
    stop_next = tl.load(stop_next_ptr + row) != 0
    count = tl.load(count_ptr + row)
    decode_index = tl.minimum(tl.maximum(count - 1, 0), trace_width - 1)
    trace_depth = tl.load(trace_ptr + row * trace_width + decode_index).to(tl.int64)
    at_max = loop >= tl.load(max_loops_ptr + row)
    gate = rule == _GATE
    delayed = rule == _DELAYED_GATE
    evaluate = ran & (gate | (delayed & ~stop_next)) & ~at_max
    hazard = tl.load(hazard_ptr + row)
    survival = tl.where(evaluate, survival * (1.0 - hazard), survival)
    threshold = tl.load(threshold_ptr + row)
    test = evaluate & ((1.0 - survival) >= threshold) & (loop >= tl.load(min_loops_ptr + row))
    traced = (rule == _TRACE) & (loop >= trace_depth)
    exited = ran & (at_max | traced | (gate & test) | (delayed & stop_next))
    tl.store(exited_out + row, exited)
    tl.store(survival_out + row, survival)
    tl.store(test_out + row, test)
    if DRAFT_LOOPS > 0:
        tl.store(samples_out + row, exited | (ran & (loop == DRAFT_LOOPS)))


@triton.jit
def exit_copies(
    tables, source_out, destination_out, position, loop, max_loops, exited, num_planes,
    num_pages, block_size, null_slot, BLOCK_PLANES: tl.constexpr,
):  # fmt: skip
    """`runner.decode_step.copy_on_exit` for one row of the `full` layout: the KV slot of each
    plane (`tables`: the row's [planes, P] page table) copies from the plane the exit loop wrote
    where KVLayout.copy_on_exit_target says, into the null slot elsewhere."""
    planes = tl.arange(0, BLOCK_PLANES)
    in_planes = planes < num_planes
    page_index = position // block_size
    offset = position % block_size
    tables += page_index
    pages = tl.load(tables + planes * num_pages, mask=in_planes).to(tl.int64)
    slots = pages * block_size + offset
    written = tl.load(tables + (loop - 1) * num_pages).to(tl.int64) * block_size + offset
    target = exited & (planes >= loop) & (planes < max_loops)
    tl.store(source_out + planes, written + 0 * planes, mask=in_planes)
    tl.store(destination_out + planes, tl.where(target, slots, null_slot), mask=in_planes)


@triton.jit
def _coda_kernel(
    ran_ptr, waiting_ptr, exited_ptr, new_survival_ptr, test_ptr, tokens_ptr, logprobs_ptr,
    top_ids_ptr, top_logprobs_ptr, out_ptr, active_ptr, state_waiting_ptr, loop_ptr,
    max_loops_ptr, rule_ptr, survival_ptr, stop_next_ptr, count_ptr, max_tokens_ptr,
    stop_ids_ptr, token_ptr, position_ptr, hidden_ptr, tables_ptr,
    record_out, source_out, destination_out,
    num_planes, num_pages, block_size, null_slot, hidden_size, stride_out, stride_ids, stride_top,
    num_stop_ids, record_width,
    NO_REFILL: tl.constexpr, COPIES: tl.constexpr, TOP: tl.constexpr,
    BLOCK_TOP: tl.constexpr, BLOCK_STOPS: tl.constexpr, BLOCK_PLANES: tl.constexpr,
    BLOCK_HIDDEN: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0).to(tl.int64)
    ran = tl.load(ran_ptr + row) != 0
    waiting = tl.load(waiting_ptr + row) != 0
    loop = tl.load(loop_ptr + row)
    max_loops = tl.load(max_loops_ptr + row)
    delayed = tl.load(rule_ptr + row) == _DELAYED_GATE
    stop_next = tl.load(stop_next_ptr + row) != 0
    count = tl.load(count_ptr + row)
    # policy.after_loop's outcome (the decide launch)
    exited = tl.load(exited_ptr + row) != 0
    survival = tl.load(new_survival_ptr + row)
    test = tl.load(test_ptr + row) != 0
    # the stop test
    token = tl.load(tokens_ptr + row)
    count += exited.to(tl.int64)
    stops = tl.arange(0, BLOCK_STOPS)
    stop_ids = tl.load(stop_ids_ptr + row * num_stop_ids + stops, mask=stops < num_stop_ids)
    is_stop = tl.max(((token == stop_ids) & (stops < num_stop_ids)).to(tl.int32), axis=0) > 0
    stopped = exited & (is_stop | (count >= tl.load(max_tokens_ptr + row)))
    # the result record: ran, loop, exited, token, stopped, logprob, top ids, top logprobs
    record = record_out + row * record_width
    tl.store(record + 0, ran.to(tl.float32))
    tl.store(record + 1, loop.to(tl.float32))
    tl.store(record + 2, exited.to(tl.float32))
    tl.store(record + 3, token.to(tl.float32))
    tl.store(record + 4, stopped.to(tl.float32))
    tl.store(record + 5, tl.load(logprobs_ptr + row))
    if TOP > 0:
        top = tl.arange(0, BLOCK_TOP)
        in_top = top < TOP
        top_ids = tl.load(top_ids_ptr + row * stride_ids + top, mask=in_top)
        tl.store(record + 6 + top, top_ids.to(tl.float32), mask=in_top)
        top_logprobs = tl.load(top_logprobs_ptr + row * stride_top + top, mask=in_top)
        tl.store(record + 6 + TOP + top, top_logprobs, mask=in_top)
    # copy-on-exit slots (KVLayout.copy_on_exit_target), from the position before the update
    position = tl.load(position_ptr + row)
    if COPIES:
        exit_copies(
            tables_ptr + row * num_planes * num_pages, source_out + row * num_planes,
            destination_out + row * num_planes, position, loop, max_loops, exited, num_planes,
            num_pages, block_size, null_slot, BLOCK_PLANES,
        )  # fmt: skip
    # policy.advance and the step's state updates
    held = test & delayed
    tl.store(loop_ptr + row, tl.where(exited, 1, loop + ran.to(tl.int64)))
    tl.store(survival_ptr + row, tl.where(exited, 1.0, survival))
    tl.store(stop_next_ptr + row, ~exited & (stop_next | held))
    if NO_REFILL:
        waiting = waiting | exited
    tl.store(state_waiting_ptr + row, waiting)
    tl.store(active_ptr + row, (tl.load(active_ptr + row) != 0) & ~stopped)
    tl.store(count_ptr + row, count)
    tl.store(position_ptr + row, position + exited.to(tl.int64))
    tl.store(token_ptr + row, tl.where(exited, token, tl.load(token_ptr + row)))
    if ran:
        for start in range(0, hidden_size, BLOCK_HIDDEN):
            cols = start + tl.arange(0, BLOCK_HIDDEN)
            in_hidden = cols < hidden_size
            values = tl.load(out_ptr + row * stride_out + cols, mask=in_hidden)
            tl.store(hidden_ptr + row * hidden_size + cols, values, mask=in_hidden)


class SlotState(Protocol):
    """The decode step's per-slot device state ([slots, ...] tensors) that the kernels read and
    update; `runner.decode_step.DecodeStep` is one."""

    active: torch.Tensor
    waiting: torch.Tensor
    stop_next: torch.Tensor
    loop: torch.Tensor
    position: torch.Tensor
    token: torch.Tensor
    output_count: torch.Tensor
    survival: torch.Tensor
    hidden: torch.Tensor
    min_loops: torch.Tensor
    max_loops: torch.Tensor
    rule: torch.Tensor
    max_tokens: torch.Tensor
    threshold: torch.Tensor
    stop_ids: torch.Tensor
    trace_depths: torch.Tensor
    seed: torch.Tensor  # read by the lanes' coda (kernels/lanes_state.py)


@dataclass(slots=True)
class Prologue:
    """What the loop of one step needs ([rows, ...] tensors, fresh each step)."""

    ran: torch.Tensor  # bool, policy.runs
    waiting: torch.Tensor  # bool, policy.runs
    seq_lens: torch.Tensor  # int32, AttentionMetadata.seq_lens
    slot_mapping: torch.Tensor  # int64, AttentionMetadata.slot_mapping
    page_table: torch.Tensor  # int32 [rows, P], AttentionMetadata.page_table
    cos: torch.Tensor  # [rows, D] model dtype, model.rope(position)
    sin: torch.Tensor
    hidden: torch.Tensor  # [rows, H] the loop's input


@dataclass(slots=True)
class Coda:
    record: torch.Tensor  # fp32 [rows, record_width]
    # int64 [rows * planes] flat KV slots, copy source -> destination; None: the layout copies none
    copies: tuple[torch.Tensor, torch.Tensor] | None


class DecodeKernels:
    """The two launches of a step over `state`'s slots."""

    def __init__(
        self,
        state: SlotState,
        tables: torch.Tensor,  # [slots, planes, P] int32 page tables
        block_size: int,
        embedding: torch.Tensor,  # [V, H] the token embedding's weight
        rope: tuple[torch.Tensor, torch.Tensor],  # cos, sin [positions, D]: model.rope(arange)
        no_refill: bool,
        full_layout: bool,
        lanes: int = 1,  # decode rows per slot (a speculating request's lanes)
    ) -> None:
        self.state = state
        self.lanes = lanes
        self.tables = tables
        self.block_size = block_size
        self.embedding = embedding
        self.rope_cos, self.rope_sin = rope
        self.no_refill = no_refill
        self.full_layout = full_layout
        slots, self.num_planes, self.num_pages = tables.shape
        self.hidden_size = state.hidden.shape[1]
        self.head_dim = self.rope_cos.shape[1]
        self.block_rows = triton.next_power_of_2(slots * lanes)
        self.block_pages = min(triton.next_power_of_2(self.num_pages), 1024)
        self.block_hidden = min(triton.next_power_of_2(self.hidden_size), 4096)

    def prologue(self, rows: int, active: torch.Tensor | None = None) -> Prologue:
        """`active` [rows] bool: the rows that may run (default: the state's active slots)."""
        state, device = self.state, self.tables.device
        rope = self.rope_cos
        start = Prologue(
            ran=torch.empty(rows, dtype=torch.bool, device=device),
            waiting=torch.empty(rows, dtype=torch.bool, device=device),
            seq_lens=torch.empty(rows, dtype=torch.int32, device=device),
            slot_mapping=torch.empty(rows, dtype=torch.int64, device=device),
            page_table=torch.empty((rows, self.num_pages), dtype=torch.int32, device=device),
            cos=torch.empty((rows, self.head_dim), dtype=rope.dtype, device=device),
            sin=torch.empty((rows, self.head_dim), dtype=rope.dtype, device=device),
            hidden=torch.empty((rows, self.hidden_size), dtype=state.hidden.dtype, device=device),
        )
        runnable = state.active if active is None else active
        _prologue_kernel[(rows,)](
            runnable, state.waiting, state.loop, state.max_loops, state.position, state.token,
            state.hidden, self.tables, self.embedding, self.rope_cos, self.rope_sin,
            start.ran, start.waiting, start.seq_lens, start.slot_mapping, start.page_table,
            start.cos, start.sin, start.hidden,
            rows, self.lanes, self.num_planes, self.num_pages, self.block_size,
            NULL_PAGE * self.block_size, self.hidden_size, self.head_dim, rope.shape[0],
            NO_REFILL=self.no_refill, FULL=self.full_layout, BLOCK_ROWS=self.block_rows,
            BLOCK_PAGES=self.block_pages, BLOCK_HIDDEN=self.block_hidden,
            BLOCK_HEAD=triton.next_power_of_2(self.head_dim),
        )  # fmt: skip
        return start

    def decide(self, start: Prologue, hazard: torch.Tensor) -> LoopOutcome:
        """policy.after_loop for rows [0, rows): [rows] tensors, fresh each step; `hazard` fp32."""
        return self._decide(start, hazard, draft_loops=0)[0]

    def decide_and_propose(
        self, start: Prologue, hazard: torch.Tensor, draft_loops: int
    ) -> tuple[LoopOutcome, torch.Tensor]:
        """`decide`, and [rows] bool: the rows that sample a token, those that exit and those
        that propose one (ran `draft_loops` loops without exiting; runner/speculation.py)."""
        outcome, samples = self._decide(start, hazard, draft_loops)
        assert samples is not None
        return outcome, samples

    def _decide(
        self, start: Prologue, hazard: torch.Tensor, draft_loops: int
    ) -> tuple[LoopOutcome, torch.Tensor | None]:
        state, device = self.state, self.tables.device
        rows = start.ran.shape[0]
        outcome = LoopOutcome(
            exited=torch.empty(rows, dtype=torch.bool, device=device),
            survival=torch.empty(rows, dtype=torch.float32, device=device),
            test=torch.empty(rows, dtype=torch.bool, device=device),
        )
        samples = torch.empty(rows, dtype=torch.bool, device=device) if draft_loops else None
        trace = state.trace_depths
        _decide_kernel[(rows,)](
            start.ran, hazard, state.loop, state.min_loops, state.max_loops, state.rule,
            state.threshold, state.survival, state.stop_next, trace, state.output_count,
            outcome.exited, outcome.survival, outcome.test,
            outcome.exited if samples is None else samples, trace.shape[1],
            DRAFT_LOOPS=draft_loops,
            enable_fp_fusion=False,  # 1 - S * (1 - λ): torch rounds S before the difference
        )  # fmt: skip
        return outcome, samples

    def coda(
        self,
        start: Prologue,
        outcome: LoopOutcome,  # `decide`'s
        out: torch.Tensor,  # [rows, H] the loop's output
        sampled: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor],
        record_width: int,
    ) -> Coda:
        """Update the state of slots [0, rows) in place. `sampled`: tokens [rows] int64, their
        logprobs [rows] fp32, top ids [rows, K] int64, top logprobs [rows, K] fp32."""
        state, device = self.state, self.tables.device
        tokens, logprobs, top_ids, top_logprobs = sampled
        rows, top = start.ran.shape[0], top_ids.shape[1]
        record = torch.empty((rows, record_width), dtype=torch.float32, device=device)
        planes = self.num_planes if self.full_layout else 0
        source = torch.empty(rows * planes, dtype=torch.int64, device=device)
        destination = torch.empty(rows * planes, dtype=torch.int64, device=device)
        stop_ids = state.stop_ids
        _coda_kernel[(rows,)](
            start.ran, start.waiting, outcome.exited, outcome.survival, outcome.test, tokens,
            logprobs, top_ids, top_logprobs, out, state.active, state.waiting, state.loop,
            state.max_loops, state.rule, state.survival, state.stop_next, state.output_count,
            state.max_tokens, stop_ids, state.token, state.position, state.hidden, self.tables,
            record, source, destination,
            self.num_planes, self.num_pages, self.block_size, NULL_PAGE * self.block_size,
            self.hidden_size, out.stride(0), top_ids.stride(0), top_logprobs.stride(0),
            stop_ids.shape[1], record_width,
            NO_REFILL=self.no_refill, COPIES=self.full_layout, TOP=top,
            BLOCK_TOP=triton.next_power_of_2(max(top, 1)),
            BLOCK_STOPS=triton.next_power_of_2(stop_ids.shape[1]),
            BLOCK_PLANES=triton.next_power_of_2(self.num_planes), BLOCK_HIDDEN=self.block_hidden,
        )  # fmt: skip
        return Coda(record, (source, destination) if self.full_layout else None)
