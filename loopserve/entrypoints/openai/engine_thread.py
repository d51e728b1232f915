"""The engine thread: the only code that touches the `Engine` while the server runs.

Owns: one thread that applies queued commands (add, abort), steps the engine while it has work,
sleeps on a condition when it has none, hands outputs to each HTTP request's asyncio queue with
one `loop.call_soon_threadsafe` per step, records metrics, and snapshots `EngineStats` for
/metrics. Must not: run on the event loop, or be bypassed: every engine call crosses here.

Commands cross through a deque guarded by a `threading.Condition`; `add` resolves a
`concurrent.futures.Future` once the engine accepted (or rejected with ValueError) all the
requests of one HTTP request, atomically. On `stop`, or when the engine raises, every queued
add is refused and every request still running is aborted (its KV pages freed) and its final
output delivered.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
import threading
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

from loopserve.engine.engine import Engine, EngineStats
from loopserve.entrypoints.openai.metrics import ServerMetrics
from loopserve.outputs import RequestOutput
from loopserve.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


class EngineDeadError(RuntimeError):
    """The engine thread is not running (shut down, or failed)."""


@dataclass(frozen=True, slots=True)
class EngineRequest:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams


# Where the outputs of one HTTP request go (read on the event loop).
OutputQueue = asyncio.Queue[RequestOutput | EngineDeadError]


@dataclass(frozen=True, slots=True)
class _Add:
    requests: Sequence[EngineRequest]
    queue: OutputQueue
    accepted: concurrent.futures.Future[None]


@dataclass(frozen=True, slots=True)
class _Abort:
    request_ids: tuple[str, ...]


class EngineLink(Protocol):
    """How request handlers reach the engine: `EngineThread`, or `engine_process.EngineProcess`
    (the engine in a process of its own)."""

    error: BaseException | None

    def start(self, loop: asyncio.AbstractEventLoop) -> None: ...

    @property
    def alive(self) -> bool: ...

    def stats(self) -> EngineStats: ...

    async def add(self, requests: Sequence[EngineRequest], queue: OutputQueue) -> None: ...

    def abort(self, request_ids: Sequence[str]) -> None: ...

    def request_stop(self) -> None: ...

    def stop(self, timeout: float | None = None) -> None: ...


class OutputRouter:
    """Hands engine outputs to each HTTP request's asyncio queue (one event-loop callback per
    batch) and records their metrics. Used by one thread at a time: the engine thread, or the
    engine process's reader."""

    def __init__(self, metrics: ServerMetrics) -> None:
        self._metrics = metrics
        self._queues: dict[str, OutputQueue] = {}
        self.loop: asyncio.AbstractEventLoop | None = None

    @property
    def request_ids(self) -> list[str]:
        """Requests whose final output has not been delivered yet."""
        return list(self._queues)

    def register(self, request_ids: Sequence[str], queue: OutputQueue) -> None:
        for request_id in request_ids:
            self._queues[request_id] = queue

    def deliver(self, outputs: list[RequestOutput]) -> None:
        self._metrics.observe((output, len(output.outputs[0].new_token_ids)) for output in outputs)
        batch: list[tuple[OutputQueue, RequestOutput | EngineDeadError]] = []
        for output in outputs:
            if output.finished:
                queue = self._queues.pop(output.request_id, None)
            else:
                queue = self._queues.get(output.request_id)
            if queue is not None:
                batch.append((queue, output))
        self._send(batch)

    def shut_down(
        self, reason: EngineDeadError, abort: Callable[[list[str]], list[RequestOutput]]
    ) -> None:
        """Deliver what `abort` returns for the requests still waiting for outputs, then send
        `reason` to every one of them: no more outputs will come."""
        queues = set(self._queues.values())
        try:
            self.deliver(abort(self.request_ids))
        finally:
            self._queues.clear()
            self._send([(queue, reason) for queue in queues])

    def _send(self, batch: list[tuple[OutputQueue, RequestOutput | EngineDeadError]]) -> None:
        if not batch or self.loop is None:
            return
        try:
            self.loop.call_soon_threadsafe(_put_all, batch)
        except RuntimeError:
            logger.debug("the event loop is closed; %d outputs dropped", len(batch))


class EngineThread:
    def __init__(self, engine: Engine, metrics: ServerMetrics) -> None:
        self._engine = engine
        self._router = OutputRouter(metrics)
        self._commands: deque[_Add | _Abort] = deque()
        self._wakeup = threading.Condition()
        self._stopping = False
        self._closed = False  # set by the thread when it stops taking commands
        self._thread: threading.Thread | None = None
        self._stats = engine.stats()
        self.error: BaseException | None = None

    # ----- event loop side -------------------------------------------------------------------

    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        """Start the thread; outputs are delivered on `loop`."""
        self._router.loop = loop
        self._thread = threading.Thread(target=self._run, name="loopserve-engine", daemon=True)
        self._thread.start()

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and self.error is None

    def stats(self) -> EngineStats:
        """The latest snapshot, taken by the engine thread after its last step."""
        return self._stats

    async def add(self, requests: Sequence[EngineRequest], queue: OutputQueue) -> None:
        """Queue requests together; returns once the engine accepted all of them.

        Raises:
            ValueError: the engine rejected one of them; none of them is queued.
            EngineDeadError: the engine thread is not running.
        """
        accepted: concurrent.futures.Future[None] = concurrent.futures.Future()
        self._submit(_Add(requests, queue, accepted))
        await asyncio.wrap_future(accepted)

    def abort(self, request_ids: Sequence[str]) -> None:
        """Abort requests (unknown or finished ids are ignored); does not wait."""
        if request_ids:
            # A stopped thread has aborted everything already.
            with contextlib.suppress(EngineDeadError):
                self._submit(_Abort(tuple(request_ids)))

    def request_stop(self) -> None:
        """Make the thread abort whatever is running, refuse new requests and end; no waiting."""
        with self._wakeup:
            self._stopping = True
            self._wakeup.notify()

    def stop(self, timeout: float | None = None) -> None:
        """`request_stop`, then wait for the thread to end."""
        self.request_stop()
        if self._thread is not None:
            self._thread.join(timeout)

    def _submit(self, command: _Add | _Abort) -> None:
        with self._wakeup:
            if self._closed:
                raise EngineDeadError("the engine is not running (the server is shutting down)")
            self._commands.append(command)
            self._wakeup.notify()

    # ----- engine thread ---------------------------------------------------------------------

    def _run(self) -> None:
        try:
            while self._iterate():
                pass
            self._shut_down(EngineDeadError("the server is shutting down"))
        except BaseException as error:
            logger.exception("the engine failed; the server stops serving requests")
            self.error = error
            self._shut_down(EngineDeadError(f"the engine failed: {error!r}"))

    def _iterate(self) -> bool:
        """Apply queued commands and run one step; False once stopping."""
        with self._wakeup:
            while not (self._commands or self._stopping or self._engine.has_unfinished_requests()):
                self._wakeup.wait()
            if self._stopping:
                return False
            commands = list(self._commands)
            self._commands.clear()
        outputs: list[RequestOutput] = []
        for command in commands:
            if isinstance(command, _Add):
                self._add(command)
            else:
                outputs += self._abort(command.request_ids)
        if self._engine.has_unfinished_requests():
            outputs += self._engine.step()
        self._router.deliver(outputs)
        self._stats = self._engine.stats()
        return True

    def _add(self, command: _Add) -> None:
        if not command.accepted.set_running_or_notify_cancel():
            return  # the client left before the engine saw the requests
        try:
            added = add_together(self._engine, command.requests)
        except BaseException as error:
            command.accepted.set_exception(error)
            # add_request touches no device state: an unexpected error fails this request only
            # (the client gets it), the engine keeps serving the others.
            if not isinstance(error, Exception):
                raise
            return
        self._router.register(added, command.queue)
        command.accepted.set_result(None)

    def _abort(self, request_ids: Sequence[str]) -> list[RequestOutput]:
        return abort_all(self._engine, request_ids)

    def _shut_down(self, reason: EngineDeadError) -> None:
        """Refuse queued adds, abort every running request and tell its client."""
        with self._wakeup:
            self._closed = True
            commands = list(self._commands)
            self._commands.clear()
        for command in commands:
            if isinstance(command, _Add) and command.accepted.set_running_or_notify_cancel():
                command.accepted.set_exception(reason)
        try:
            self._router.shut_down(reason, self._abort)
        finally:
            self._stats = self._engine.stats()


def add_together(engine: Engine, requests: Sequence[EngineRequest]) -> list[str]:
    """Add the requests of one HTTP request, all or none: on an error the ones already added
    are taken back and it is raised. Returns their ids."""
    added: list[str] = []
    try:
        for request in requests:
            engine.add_request(request.prompt_token_ids, request.params, request.request_id)
            added.append(request.request_id)
    except BaseException:
        for request_id in added:
            engine.abort(request_id)
        raise
    return added


def abort_all(engine: Engine, request_ids: Sequence[str]) -> list[RequestOutput]:
    """Abort these requests (unknown or finished ones are skipped); their final outputs."""
    outputs = []
    for request_id in request_ids:
        output = engine.abort(request_id)
        if output is not None:
            outputs.append(output)
    return outputs


def _put_all(batch: list[tuple[OutputQueue, RequestOutput | EngineDeadError]]) -> None:
    for queue, item in batch:
        queue.put_nowait(item)
