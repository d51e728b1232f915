"""Graceful shutdown: on SIGTERM (or Ctrl-C), drain, then abort what is left, cleanly.

Owns: chaining a hook in front of the server's own signal handlers (uvicorn's, which stop
accepting connections and wait for open ones). The hook schedules `EngineThread.request_stop`
after the drain timeout: every request still running is then aborted and its client gets a
final chunk with `finish_reason: "abort"` and `data: [DONE]` (a non-streaming one a 503), so
connections close and the server can exit. Must not: replace uvicorn's handling (the chained
handler still runs), or act off the main thread, where signals cannot be handled.
"""

from __future__ import annotations

import asyncio
import signal
import threading
from collections.abc import Callable
from types import FrameType
from typing import Any

from loopserve.entrypoints.openai.engine_thread import EngineThread

SIGNALS = (signal.SIGTERM, signal.SIGINT)


def abort_after_drain(
    loop: asyncio.AbstractEventLoop, engine: EngineThread, timeout_s: float
) -> Callable[[], None]:
    """Install the hook; returns a function that restores the previous handlers.

    Does nothing off the main thread (a server started in a thread handles no signals).
    """
    if threading.current_thread() is not threading.main_thread():
        return lambda: None
    previous: dict[int, Any] = {}

    def on_signal(number: int, frame: FrameType | None) -> None:
        # Runs on the main thread between bytecodes: only the thread-safe call is allowed here.
        loop.call_soon_threadsafe(loop.call_later, timeout_s, engine.request_stop)
        handler = previous.get(number)
        if callable(handler):
            handler(number, frame)
        elif number == signal.SIGINT:
            raise KeyboardInterrupt

    for number in SIGNALS:
        previous[number] = signal.signal(number, on_signal)

    def restore() -> None:
        for number, handler in previous.items():
            signal.signal(number, handler)

    return restore
