"""Request slots, and which of them the decode step runs.

Owns: the free slots (lowest first), which slot's token is live in the decode step and for which
request, and the slot starts, stops and table clears the next step carries to the runner
(`SchedulerOutput.slot_starts`, `slot_stops`, `cleared_slots`, `decode_slots`). Must not: decide
when a request starts, stops or leaves its slot (`engine.scheduler` does), or import torch.

A running request holds one slot, its row in the runner's per-slot state. Its token is in the
decode step from `start` (after its prompt, a resumption or a speculation switch) until it leaves
the slot; leaving stops the decode step's row and clears the slot's page tables.
"""

from __future__ import annotations

import heapq

from loopserve.engine.scheduler_output import SchedulerOutput, SlotStart
from loopserve.request import Request


class RequestSlots:
    def __init__(self, num_slots: int) -> None:
        self._free = list(range(num_slots))  # a heap: lowest slot first
        self._decoding: dict[int, str] = {}  # slot -> request id, for slots live in the step
        self._starts: list[SlotStart] = []
        self._stops: list[int] = []
        self.pending_clears: list[int] = []  # slots of requests that finished since the last step

    @property
    def any_free(self) -> bool:
        return bool(self._free)

    @property
    def decoding(self) -> dict[int, str]:
        """Slot -> request id of every request whose token is in the decode step."""
        return dict(self._decoding)

    def is_decoding(self, slot: int | None) -> bool:
        return slot is not None and slot in self._decoding

    def take(self) -> int:
        return heapq.heappop(self._free)

    def release(self, request: Request, clears: list[int]) -> None:
        """A request leaves its slot: its decode row stops (if live) and the slot's tables are
        cleared through `clears`."""
        slot = request.slot
        assert slot is not None
        if self._decoding.get(slot) == request.request_id:
            del self._decoding[slot]
            self._starts = [start for start in self._starts if start.slot != slot]
            self._stops.append(slot)
        heapq.heappush(self._free, slot)
        clears.append(slot)
        request.slot = None

    def start(self, request: Request) -> None:
        """Put the request's last token into the decode step (at loop 1)."""
        assert request.slot is not None
        self._starts.append(
            SlotStart(
                slot=request.slot,
                token=request.output_token_ids[-1],
                position=request.position,
                num_output_tokens=request.num_output_tokens,
                params=request.params,
            )
        )
        self._decoding[request.slot] = request.request_id

    def restart(self, requests: list[Request]) -> None:
        """The decode step switched (speculation on or off): the other one is emptied whole, and
        each of `requests` (those live in it) starts its token again in this one."""
        self._stops = []
        restarted = {request.slot for request in requests}
        self._starts = [start for start in self._starts if start.slot not in restarted]
        for request in requests:
            self.start(request)

    def hand_over(self, output: SchedulerOutput) -> None:
        """Move the starts and stops gathered since the last step into its output."""
        output.slot_stops, self._stops = self._stops, []
        output.slot_starts, self._starts = self._starts, []
        output.decode_slots = self.decoding
