"""Device decode mode: the host side of the device-resident decoder.

Owns: which request each device slot holds, the slot starts and stops still to send, and the
`SlotSetup` that hands a request's in-flight token to the device. Must not: import torch, or decide
exits (the device does; the host learns of them a step later from `SlotStepResult`).

In this mode the scheduler schedules prompts as usual but no decode rows: every step the device
runs one loop for every active slot, exits tokens by the same rules as the host-driven scheduler,
samples, and starts their successors at loop 1 inside the same step. So building the next step
never waits for the gate, and the host can prepare step n + 1 while the device runs step n.
"""

from __future__ import annotations

from collections.abc import Sequence

from loopserve.engine.scheduler_output import (
    GATE_DELAYED,
    GATE_FIXED,
    GATE_OURO,
    GATE_TRACE,
    SamplingInfo,
    SchedulerOutput,
    SlotSetup,
)
from loopserve.engine.trace import resolved_trace_depth
from loopserve.request import Request

# Most end-of-sequence plus stop token ids one request may have on the device.
MAX_STOP_TOKEN_IDS = 16


def gate_mode(exit_mode: str, request: Request) -> int:
    if exit_mode == "trace":
        return GATE_TRACE
    if request.params.fixed_depth:
        return GATE_FIXED
    return GATE_DELAYED if exit_mode == "ouro_delayed" else GATE_OURO


def slot_setup(request: Request, exit_mode: str, distribution: Sequence[float]) -> SlotSetup:
    """The device state of a request whose first output token was just sampled."""
    params = request.params
    assert request.slot is not None
    mode = gate_mode(exit_mode, request)
    depths: tuple[int, ...] = ()
    if mode == GATE_TRACE:
        depths = tuple(
            resolved_trace_depth(params, index, distribution)
            for index in range(params.params.max_tokens - 1)
        )
    return SlotSetup(
        slot=request.slot,
        token=request.output_token_ids[-1],
        position=request.position,
        min_loops=params.min_loops,
        max_loops=params.max_loops,
        exit_threshold=params.exit_threshold,
        gate_mode=mode,
        max_tokens=params.params.max_tokens,
        stop_token_ids=tuple(sorted(params.eos_token_ids | set(params.params.stop_token_ids))),
        trace_depths=depths,
        sampling=SamplingInfo(params.params, params.seed, request.num_output_tokens),
    )


class DeviceSlots:
    def __init__(self, exit_mode: str, trace_distribution: Sequence[float]) -> None:
        self.exit_mode = exit_mode
        self.trace_distribution = tuple(trace_distribution)
        self._requests: dict[int, str] = {}  # slot -> request id, for slots live on the device
        self._setups: list[SlotSetup] = []
        self._stops: list[int] = []

    @property
    def num_active(self) -> int:
        return len(self._requests)

    def start(self, request: Request) -> None:
        """Queue the hand-over of a request whose prompt is done and which is not finished."""
        setup = slot_setup(request, self.exit_mode, self.trace_distribution)
        self._setups.append(setup)
        self._requests[setup.slot] = request.request_id

    def stop(self, request: Request) -> None:
        """Queue the end of a finished request's slot (idempotent on the device)."""
        slot = request.slot
        if slot is not None and self._requests.get(slot) == request.request_id:
            del self._requests[slot]
            self._setups = [setup for setup in self._setups if setup.slot != slot]
            self._stops.append(slot)

    def fill(self, output: SchedulerOutput) -> None:
        """Move queued starts and stops into this step's output (stops are applied first)."""
        output.slot_stops, self._stops = self._stops, []
        output.slot_setups, self._setups = self._setups, []
        output.slot_requests = dict(self._requests)
        output.run_slot_step = bool(self._requests)
