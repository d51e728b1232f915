"""Progress reporting for training runs: one readable line per record, and the record kept.

Owns: formatting progress records (loss, per-loop losses, tokens/s, ...) for the terminal and
keeping them for the training log. Must not: compute anything it reports.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from typing import Any, TextIO

Record = dict[str, Any]


def _format_value(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.4g}"
    if isinstance(value, list):
        return "[" + " ".join(_format_value(item) for item in value) + "]"
    return str(value)


class ProgressLog:
    """Prints `stage key=value ...` lines and keeps every record with its elapsed time."""

    def __init__(
        self, stream: TextIO | None = sys.stdout, clock: Callable[[], float] = time.monotonic
    ):
        self._stream = stream
        self._clock = clock
        self._start = clock()
        self.records: list[Record] = []

    def elapsed(self) -> float:
        return self._clock() - self._start

    def emit(self, stage: str, **values: Any) -> None:
        record = {"stage": stage, "elapsed_s": round(self.elapsed(), 2), **values}
        self.records.append(record)
        if self._stream is not None:
            fields = " ".join(f"{key}={_format_value(value)}" for key, value in values.items())
            print(
                f"[{record['elapsed_s']:8.1f}s] {stage:<8} {fields}", file=self._stream, flush=True
            )

    def message(self, text: str) -> None:
        self.emit("info", message=text)
