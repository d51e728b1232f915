"""The engine in a process of its own (`loopserve serve`'s default; `--no-engine-process` keeps it
in a thread instead): `EngineThread`'s part played across a pipe, so the HTTP event loop and the
engine no longer share an interpreter lock.

Owns: starting the child (`EngineChild.spawn`: it builds the `Engine` and answers with the model's
facts, or with the error that stopped it; it logs as the server's process does) and ending it when
no server runs it (`EngineChild.close`), the child's loop (`_ChildLoop`: commands in; after a
step that changed outputs one message out with what they added, `output_deltas`, and a stats
snapshot, and after other steps the stats alone every `STATS_EVERY_S`), and the
server's side (`EngineProcess`: sends commands; a reader thread turns deltas back into outputs
and hands them to the requests' queues through `engine_thread.OutputRouter`). Must not: touch the
`Engine` from the server's process, or serve Ray replicas (they keep the engine in process).

Why: in one process the engine thread and the event loop take turns on one interpreter lock. On
an H100 at C=128 (512/128, fixed depth) served throughput was 0.891 of offline with the engine
thread and 0.959 with this process (docs/server.md). Here the engine's process does the engine's
work and pickles a few items per request and step.

Messages, child to server: ("ready", ModelInfo, EngineStats) | ("refused", class name, text) (a
ValueError or FileNotFoundError while building: a bad setting or checkpoint) | ("failed", text) |
("added", add id, None or (text, is_value_error)) | ("outputs", [OutputDelta], EngineStats).
Server to child: ("add", add id, [EngineRequest]) | ("abort", request ids) | ("stop",). The pipe
keeps their order, so a request's "added" always comes before its first outputs. The child
ignores SIGINT and SIGTERM from its start (the server drains, then stops it by message) and exits
when the pipe closes (the server died, or never served).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import itertools
import logging
import multiprocessing
import signal
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess
from typing import Any

from loopserve.config import EngineConfig
from loopserve.engine.engine import Engine, EngineStats
from loopserve.entrypoints.openai.context import ModelInfo
from loopserve.entrypoints.openai.engine_thread import (
    EngineDeadError,
    EngineRequest,
    OutputQueue,
    OutputRouter,
    abort_all,
    add_together,
)
from loopserve.entrypoints.openai.gc_freeze import objects_frozen
from loopserve.entrypoints.openai.metrics import ServerMetrics
from loopserve.entrypoints.openai.output_deltas import DeltaDecoder, DeltaEncoder
from loopserve.outputs import RequestOutput

logger = logging.getLogger(__name__)

# Seconds `stop` waits for the child to end after its reader has, before terminating it.
EXIT_GRACE_S = 10.0
# What building the engine raises for a setting or checkpoint the user must fix (`loopserve`
# reports them in one line); they cross the pipe by name and text and are raised again as such.
REFUSALS: dict[str, type[Exception]] = {
    "FileNotFoundError": FileNotFoundError,
    "ValueError": ValueError,
}
# Signals the child ignores: Ctrl-C and SIGTERM to the process group are the server's to handle.
CHILD_IGNORES = (signal.SIGINT, signal.SIGTERM)
# A step that changed no output sends its stats only if the last were sent this long ago (a
# decode loop that exits no token changes none: three steps of four at fixed depth 4).
STATS_EVERY_S = 0.05


@dataclass(frozen=True, slots=True)
class EngineChild:
    """A started engine process whose engine is built: its facts and first stats."""

    process: BaseProcess
    connection: Connection
    model: ModelInfo
    stats: EngineStats

    @classmethod
    def spawn(cls, config: EngineConfig) -> EngineChild:
        """Start the process and wait until its engine is built (the model loaded).

        Raises:
            ValueError, FileNotFoundError: the engine refused `config` (the message says why, as
                in process).
            RuntimeError: the process failed or died before its engine was ready.
        """
        context = multiprocessing.get_context("spawn")  # no fork: torch and threads are live
        connection, child_end = context.Pipe()
        process = context.Process(
            target=_run_child, args=(config, child_end, _log_setup()), name="loopserve-engine"
        )
        with _ignored_by_children():
            process.start()
        child_end.close()
        try:
            message = connection.recv()
        except EOFError:
            process.join()
            raise RuntimeError(
                f"the engine process exited (code {process.exitcode}) before its engine was built"
            ) from None
        except BaseException:  # Ctrl-C while the model loads: stop loading it
            connection.close()
            _reap(process, grace_s=0.0)
            raise
        if message[0] == "ready":
            return cls(process, connection, message[1], message[2])
        process.join()
        connection.close()
        if message[0] == "refused":
            raise REFUSALS[message[1]](message[2])
        raise RuntimeError(f"the engine process failed to start: {message[1]}")

    def close(self) -> None:
        """End the process if no server stopped it (one that failed to start, say): its loop
        ends when the pipe closes; killed after `EXIT_GRACE_S`. Harmless once it has ended."""
        self.connection.close()
        _reap(self.process, EXIT_GRACE_S)


class EngineProcess:
    """`engine_thread.EngineLink` over an `EngineChild`."""

    def __init__(self, child: EngineChild, metrics: ServerMetrics) -> None:
        self._child = child
        self._router = OutputRouter(metrics)
        self._decoder = DeltaDecoder()
        self._lock = threading.Lock()  # the pipe's sending end, `_pending` and `_closed`
        self._pending: dict[int, tuple[list[str], OutputQueue, concurrent.futures.Future[None]]]
        self._pending = {}
        self._add_ids = itertools.count()
        self._closed = False
        self._stopping = False
        self._stats = child.stats
        self._reader: threading.Thread | None = None
        self.error: BaseException | None = None

    # ----- event loop side -------------------------------------------------------------------

    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        self._router.loop = loop
        self._reader = threading.Thread(target=self._read, name="loopserve-engine-reader")
        self._reader.start()

    @property
    def alive(self) -> bool:
        return self._reader is not None and self._reader.is_alive() and self.error is None

    def stats(self) -> EngineStats:
        return self._stats

    async def add(self, requests: Sequence[EngineRequest], queue: OutputQueue) -> None:
        accepted: concurrent.futures.Future[None] = concurrent.futures.Future()
        with self._lock:
            if self._closed:
                raise EngineDeadError("the engine is not running (the server is shutting down)")
            add_id = next(self._add_ids)
            try:
                self._child.connection.send(("add", add_id, list(requests)))
            except OSError:  # the child is gone; the reader is about to say so
                raise EngineDeadError("the engine is not running (its process ended)") from None
            self._pending[add_id] = ([request.request_id for request in requests], queue, accepted)
        await asyncio.wrap_future(accepted)

    def abort(self, request_ids: Sequence[str]) -> None:
        if request_ids:
            self._send(("abort", tuple(request_ids)))

    def request_stop(self) -> None:
        self._stopping = True
        self._send(("stop",))

    def stop(self, timeout: float | None = None) -> None:
        self.request_stop()
        if self._reader is not None:
            self._reader.join(timeout)
        _reap(self._child.process, EXIT_GRACE_S if timeout is None else min(timeout, EXIT_GRACE_S))

    def _send(self, message: tuple[Any, ...]) -> None:
        with self._lock:
            if self._closed:
                return  # the child is gone: nothing runs that a command could change
            with contextlib.suppress(OSError):  # the reader sees the child's end too
                self._child.connection.send(message)

    # ----- reader thread ---------------------------------------------------------------------

    def _read(self) -> None:
        reason = EngineDeadError("the server is shutting down")
        try:
            while True:
                message = self._child.connection.recv()
                if message[0] == "outputs":
                    self._stats = message[2]
                    self._router.deliver(self._decoder.decode(message[1]))
                elif message[0] == "added":
                    self._added(message[1], message[2])
                else:  # "failed"
                    self.error = RuntimeError(f"the engine failed: {message[1]}")
                    reason = EngineDeadError(str(self.error))
                    logger.error("%s; the server stops serving requests", self.error)
                    break
        except (EOFError, OSError):
            if not self._stopping:
                code = self._child.process.exitcode
                self.error = RuntimeError(f"the engine process exited unexpectedly (code {code})")
                reason = EngineDeadError(str(self.error))
                logger.error("%s; the server stops serving requests", self.error)
        except Exception as error:  # a message this side cannot take: nothing more can be trusted
            logger.exception("reading the engine process failed; the server stops serving")
            self.error = error
            reason = EngineDeadError(f"the engine failed: {error!r}")
        finally:
            self._shut_down(reason)  # closes the pipe: the child's next send fails and it ends

    def _added(self, add_id: int, refusal: tuple[str, bool] | None) -> None:
        with self._lock:
            request_ids, queue, accepted = self._pending.pop(add_id)
        if not accepted.set_running_or_notify_cancel():
            if refusal is None:  # the client left while the engine added them
                self.abort(request_ids)
            return
        if refusal is not None:
            text, is_value_error = refusal
            accepted.set_exception(ValueError(text) if is_value_error else RuntimeError(text))
            return
        self._router.register(request_ids, queue)
        accepted.set_result(None)

    def _shut_down(self, reason: EngineDeadError) -> None:
        with self._lock:
            self._closed = True
            pending = list(self._pending.values())
            self._pending.clear()
        for _, _, accepted in pending:
            if accepted.set_running_or_notify_cancel():
                accepted.set_exception(reason)

        def forget(request_ids: list[str]) -> list[RequestOutput]:
            self._decoder.forget(request_ids)
            return []  # the child aborted them (stop) or is gone; no final outputs come

        self._router.shut_down(reason, forget)
        self._child.connection.close()


def _reap(process: BaseProcess, grace_s: float) -> None:
    """Wait up to `grace_s` for `process` to end, then kill it (it ignores SIGTERM)."""
    process.join(grace_s)
    if process.is_alive():
        if grace_s:
            logger.warning("the engine process did not end; killing it")
        process.kill()
        process.join()


@contextlib.contextmanager
def _ignored_by_children() -> Iterator[None]:
    """`CHILD_IGNORES` ignored while the block runs, so a process started in it ignores them
    from its first instruction (an ignored signal stays ignored across exec, and Python leaves
    it so): a Ctrl-C while the child's interpreter starts would otherwise end it with a
    traceback. Main thread only (elsewhere signals cannot be changed, and nothing is)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = {number: signal.signal(number, signal.SIG_IGN) for number in CHILD_IGNORES}
    try:
        yield
    finally:
        for number, handler in previous.items():
            signal.signal(number, handler)


# The server's root logging, as the child repeats it: level, then the format and date format of
# its first handler (None: it has none, and records go where Python's last resort sends them).
_LogSetup = tuple[int, tuple[str, str | None] | None]


def _log_setup() -> _LogSetup:
    root = logging.getLogger()
    if not root.handlers:
        return root.level, None
    formatter = root.handlers[0].formatter or logging.Formatter()
    return root.level, (formatter._fmt or "%(message)s", formatter.datefmt)


# ----- the child -------------------------------------------------------------------------------


def _run_child(config: EngineConfig, connection: Connection, log_setup: _LogSetup) -> None:
    # Ctrl-C and SIGTERM to the process group are the server's: it drains its requests, which
    # needs the engine, then stops it by message. Should the server die, the pipe closes and the
    # loop ends. (Ignored from the start already when the server started it on its main thread.)
    for number in CHILD_IGNORES:
        signal.signal(number, signal.SIG_IGN)
    # Spawned, this process has no logging set up: the engine's records (the checkpoint loaded,
    # the attention backend, the model's defaults) go to the server's stderr as its own do.
    level, handler_format = log_setup
    logging.getLogger().setLevel(level)
    if handler_format is not None:
        try:
            logging.basicConfig(format=handler_format[0], datefmt=handler_format[1])
        except ValueError:  # a format of another style (`{`, `$`): the default format then
            logging.basicConfig()
    try:
        engine = Engine(config)
        model = ModelInfo.of(engine)
    except tuple(REFUSALS.values()) as error:
        kind = next(name for name, refusal in REFUSALS.items() if isinstance(error, refusal))
        connection.send(("refused", kind, str(error)))
        return
    except BaseException as error:
        connection.send(("failed", repr(error)))
        raise
    connection.send(("ready", model, engine.stats()))
    with objects_frozen():  # a full collection would stall the engine, as in the server
        _ChildLoop(engine, connection).run()


class _ChildLoop:
    def __init__(
        self, engine: Engine, connection: Connection, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self._engine = engine
        self._connection = connection
        self._clock = clock
        self._encoder = DeltaEncoder()
        self._live: set[str] = set()  # added and not finished
        self._stats_sent_at = -STATS_EVERY_S  # the first step's stats go out

    def run(self) -> None:
        try:
            while self._iterate():
                pass
        except (EOFError, OSError):
            return  # the server is gone
        except BaseException as error:
            logger.exception("the engine failed")
            with contextlib.suppress(Exception):
                self._connection.send(("failed", repr(error)))
            if not isinstance(error, Exception):
                raise

    def _iterate(self) -> bool:
        """Apply the commands that came, run one step; False after a stop (everything left
        aborted and its final outputs sent)."""
        outputs: list[RequestOutput] = []
        stopping = False
        wait = None if not self._engine.has_unfinished_requests() else 0.0
        while not stopping and self._connection.poll(wait):
            wait = 0.0
            message = self._connection.recv()
            if message[0] == "add":
                self._add(message[1], message[2])
            elif message[0] == "abort":
                outputs += self._abort(message[1])
            else:  # "stop"
                stopping = True
                outputs += self._abort(list(self._live))
        ran = not stopping and self._engine.has_unfinished_requests()
        if ran:
            outputs += self._engine.step()
        now = self._clock()
        stats_due = ran and (
            now - self._stats_sent_at >= STATS_EVERY_S or not self._engine.has_unfinished_requests()
        )
        if outputs or stats_due:
            for output in outputs:
                if output.finished:
                    self._live.discard(output.request_id)
            deltas = self._encoder.encode(outputs)
            self._connection.send(("outputs", deltas, self._engine.stats()))
            self._stats_sent_at = now
        return not stopping

    def _add(self, add_id: int, requests: list[EngineRequest]) -> None:
        try:
            added = add_together(self._engine, requests)
        except Exception as error:
            # add_request touches no device state: the error fails this HTTP request only.
            refusal = (str(error), isinstance(error, ValueError))
            self._connection.send(("added", add_id, refusal))
            return
        self._live.update(added)
        self._connection.send(("added", add_id, None))

    def _abort(self, request_ids: Sequence[str]) -> list[RequestOutput]:
        return abort_all(self._engine, request_ids)
