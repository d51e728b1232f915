"""The engine process's loop (`engine_process._ChildLoop`) sends a message after every step that
changed an output, and after other steps (a decode loop that exits no token) only the stats,
every `STATS_EVERY_S` or when the engine has just gone idle."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import pytest

from loopserve.entrypoints.openai import engine_process


@dataclass
class FakeOutput:
    request_id: str
    finished: bool = False


class FakeEngine:
    def __init__(self, steps: list[list[FakeOutput]]) -> None:
        self.steps = steps

    def has_unfinished_requests(self) -> bool:
        return bool(self.steps)

    def step(self) -> list[FakeOutput]:
        return self.steps.pop(0)

    def stats(self) -> str:
        return f"stats with {len(self.steps)} steps left"


class FakeConnection:
    def __init__(self) -> None:
        self.sent: list[tuple[Any, ...]] = []

    def poll(self, timeout: float | None) -> bool:
        return False  # no commands

    def send(self, message: tuple[Any, ...]) -> None:
        self.sent.append(message)


class PassThrough:  # outputs as their own deltas
    def encode(self, outputs: list[FakeOutput]) -> list[FakeOutput]:
        return list(outputs)


def test_steps_without_output_send_stats_only_now_and_then(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    every = engine_process.STATS_EVERY_S
    token, last = FakeOutput("a"), FakeOutput("a", finished=True)
    # (the step's outputs, the clock after it, whether a message goes out)
    script = [
        ([], 1.0, True),  # nothing sent yet
        ([], 1.0 + every / 5, False),
        ([token], 1.0 + 2 * every / 5, True),
        ([], 1.0 + 3 * every / 5, False),
        ([], 1.0 + 2 * every / 5 + every, True),  # STATS_EVERY_S after the last message
        ([], 1.0 + 2 * every / 5 + every * 1.1, False),
        ([last], 1.0 + 2 * every / 5 + every * 1.2, True),  # and the engine is idle after it
    ]
    clock = iter(now for _, now, _ in script)
    monkeypatch.setattr(engine_process, "DeltaEncoder", PassThrough)
    connection = FakeConnection()
    loop = engine_process._ChildLoop(
        FakeEngine([outputs for outputs, _, _ in script]),  # type: ignore[arg-type]
        connection,  # type: ignore[arg-type]
        clock=lambda: next(clock),
    )
    for outputs, _, sends in script:
        before = len(connection.sent)
        assert loop._iterate()
        assert len(connection.sent) == before + sends
        if sends:
            kind, deltas, stats = connection.sent[-1]
            assert kind == "outputs" and deltas == outputs and stats.startswith("stats with")
    assert connection.sent[-1][2] == "stats with 0 steps left"  # idle: the final stats went out
