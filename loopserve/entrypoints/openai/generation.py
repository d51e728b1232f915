"""The engine requests of one HTTP request: handed over together, their outputs merged.

Owns: `Generation` (start -> batches of outputs as they arrive -> close, which aborts whatever is
unfinished, so a client that leaves frees its KV pages) and turning engine failures into OpenAI
errors. Must not: format responses or touch the engine except through its `EngineLink`.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Sequence

from loopserve.entrypoints.openai.engine_thread import (
    EngineDeadError,
    EngineLink,
    EngineRequest,
    OutputQueue,
)
from loopserve.entrypoints.openai.errors import OpenAIError, bad_request
from loopserve.entrypoints.openai.protocol import field_named_in
from loopserve.outputs import RequestOutput


class Generation:
    def __init__(
        self,
        engine: EngineLink,
        requests: Sequence[EngineRequest],
        constraint_field: str | None = None,
    ) -> None:
        self._engine = engine
        self._constraint_field = constraint_field
        self._requests = requests
        self._queue: OutputQueue = asyncio.Queue()
        self._unfinished = {request.request_id for request in requests}

    async def start(self) -> None:
        """Hand the requests to the engine; 400 when it rejects one, 503 when it is down."""
        try:
            await self._engine.add(self._requests, self._queue)
        except ValueError as error:
            self._unfinished.clear()  # the engine queued none of them
            raise self._rejected(str(error)) from None
        except EngineDeadError as error:
            self._unfinished.clear()
            raise _unavailable(error) from None
        except BaseException:
            self.close()  # cancelled while the engine may have taken them
            raise

    def _rejected(self, message: str) -> OpenAIError:
        """The 400 of an engine rejection, naming the field the client wrote: a constraint that
        does not compile came from `structured_outputs`, `response_format`, `tool_choice`..."""
        field = field_named_in(message)
        if field == "structured_outputs" and self._constraint_field not in (None, field):
            field = self._constraint_field
            message = f"{field}: {message}"
        return bad_request(message, field)

    async def batches(self) -> AsyncIterator[list[RequestOutput]]:
        """Outputs in arrival order, as many as are ready at a time, until all requests finish."""
        while self._unfinished:
            items = [await self._queue.get()]
            while not self._queue.empty():
                items.append(self._queue.get_nowait())
            batch = []
            for item in items:
                if isinstance(item, EngineDeadError):
                    if not self._unfinished:
                        continue  # the final (abort) outputs came first: nothing is lost
                    self._unfinished.clear()
                    raise _unavailable(item)
                if item.finished:
                    self._unfinished.discard(item.request_id)
                batch.append(item)
            yield batch

    async def final_outputs(self) -> dict[str, RequestOutput]:
        """Run to the end; the last output of each request. 503 if the server aborted one."""
        final: dict[str, RequestOutput] = {}
        async for batch in self.batches():
            for output in batch:
                final[output.request_id] = output
        if any(output.outputs[0].finish_reason == "abort" for output in final.values()):
            message = "the request was aborted: the server is shutting down"
            raise OpenAIError(503, message, error_type="server_error")
        return final

    def close(self) -> None:
        """Abort the requests that have not finished (idempotent; never waits)."""
        if self._unfinished:
            self._engine.abort(sorted(self._unfinished))
            self._unfinished.clear()


def _unavailable(error: EngineDeadError) -> OpenAIError:
    return OpenAIError(503, str(error), error_type="server_error", code="engine_unavailable")
