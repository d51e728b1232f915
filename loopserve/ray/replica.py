"""One engine replica of a Ray Serve fleet: the single-process server, reached through Ray.

Owns: `EngineReplica`, the deployment class: it builds the engine from the `EngineConfig` it is
given (every engine option as the CLI or caller set it), wraps it in the same app as
`loopserve serve` (routes, parsing, limits, streaming, errors; authentication stays with the
ingress), runs its engine thread for the replica's life, answers forwarded requests with that
app, reports load and counters when polled, and fails Serve's health check once the engine
thread has died (Serve then replaces the replica). Must not: import Ray (app.py makes this class
a deployment) or route (the ingress does).
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack
from dataclasses import replace

from loopserve.config import EngineConfig
from loopserve.engine.engine import Engine
from loopserve.entrypoints.openai.app import app_for, running, serving_context
from loopserve.entrypoints.openai.config import ServerConfig
from loopserve.ray.fleet import ReplicaReport
from loopserve.ray.forwarding import ForwardedRequest, ResponsePart, call_app


class EngineReplica:
    async def __init__(  # type: ignore[misc]  # Ray Serve awaits async constructors
        self, replica: int, engine_config: EngineConfig, server_config: ServerConfig
    ) -> None:
        self._replica = replica
        self._max_num_seqs = engine_config.scheduler.max_num_seqs
        # Before the engine: Serve calls __del__ on a replica whose constructor raised too.
        self._stack = AsyncExitStack()
        engine = await asyncio.to_thread(Engine, engine_config)
        self._context = serving_context(engine, replace(server_config, api_key=None))
        self._app = app_for(self._context)
        await self._stack.enter_async_context(running(self._context))

    async def forward(self, request: ForwardedRequest) -> AsyncIterator[ResponsePart]:
        """The app's response to `request`: a `ResponseStart`, then body chunks."""
        async for part in call_app(self._app, request):
            yield part

    def report(self) -> ReplicaReport:
        engine = self._context.engine
        return ReplicaReport.of(
            self._replica,
            os.getpid(),
            engine.alive,
            self._max_num_seqs,
            engine.stats(),
            self._context.metrics.totals(),
        )

    def check_health(self) -> None:
        """Serve's health check: raises once the engine thread is no longer running."""
        engine = self._context.engine
        if not engine.alive:
            raise RuntimeError(f"replica {self._replica}: the engine stopped ({engine.error!r})")

    async def __del__(self) -> None:
        """On shutdown (after Serve drained the replica): stop the engine, aborting what is left."""
        await self._stack.aclose()
