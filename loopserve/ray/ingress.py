"""The fleet's one HTTP entry: the OpenAI API in front of N engine replicas.

Owns: `Ingress`, the deployment class whose app (built on the replica by Serve through
`__serve_build_asgi_app__`) checks the API key and the fleet-wide concurrency and body-size
limits, picks a replica for each generation request (`RoutingPolicy` over the `Fleet`), forwards
the request through the replica's Serve handle and relays the answer (`ReplicaResponse`); serves
`/v1/models` from a replica, `/health` (200 while a replica is up) and `/metrics` (`render_fleet`);
and polls every replica's report in the background. Must not: import Ray (it is handed Serve
handles) or answer a generation request itself: replicas run the single-process server's code.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import Response

from loopserve.config import EngineConfig
from loopserve.entrypoints.openai.app import GENERATION_PATHS
from loopserve.entrypoints.openai.auth import ApiKeyMiddleware
from loopserve.entrypoints.openai.body import read_body
from loopserve.entrypoints.openai.config import ServerConfig
from loopserve.entrypoints.openai.errors import OpenAIError, install_error_handlers
from loopserve.entrypoints.openai.limits import RETRY_AFTER_S, ConcurrencyLimitMiddleware
from loopserve.entrypoints.openai.metrics import CONTENT_TYPE
from loopserve.entrypoints.openai.paths import route_path
from loopserve.ray.fleet import Fleet, ReplicaReport
from loopserve.ray.fleet_metrics import render_fleet
from loopserve.ray.forwarding import ForwardedRequest
from loopserve.ray.prompt_keys import PromptKeys
from loopserve.ray.proxy import ReplicaResponse
from loopserve.ray.routing import NoHealthyReplicaError, RoutingConfig, RoutingPolicy

logger = logging.getLogger(__name__)

# Seconds a replica may take to answer a poll before the ingress routes around it.
POLL_TIMEOUT_S = 5.0
# Request headers not passed on to replicas (the ingress checked the key).
_DROPPED_HEADERS = frozenset({b"authorization"})


class Ingress:
    def __init__(
        self,
        replicas: Sequence[Any],
        engine_config: EngineConfig,
        server_config: ServerConfig,
        routing: RoutingConfig,
    ) -> None:
        """`replicas`: the Serve handles of the engine replicas, replica i at index i."""
        self._handles = list(replicas)
        self._streams = [handle.options(stream=True) for handle in self._handles]
        self._config = server_config
        self._routing = routing
        self._fleet = Fleet(len(self._handles))
        self._policy = RoutingPolicy(routing)
        self._keys = PromptKeys.load(engine_config, server_config, routing.affinity_pages)

    def __serve_build_asgi_app__(self) -> FastAPI:
        return _ingress_app(self, self._config)

    @asynccontextmanager
    async def polling(self) -> AsyncIterator[None]:
        """Poll once (the fleet starts with every replica's report), then every interval."""
        await self.poll()
        task = asyncio.ensure_future(self._poll_forever())
        try:
            yield
        finally:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task

    async def poll(self) -> None:
        """Ask every replica for its report; one that does not answer is routed around."""
        await asyncio.gather(*(self._poll_one(index) for index in range(self._fleet.size)))

    async def _poll_forever(self) -> None:
        while True:
            await asyncio.sleep(self._routing.poll_interval_s)
            await self.poll()

    async def _poll_one(self, replica: int) -> None:
        response = self._handles[replica].report.remote()
        try:
            report: ReplicaReport = await asyncio.wait_for(response, POLL_TIMEOUT_S)
        except Exception as error:
            if self._fleet.is_up(replica):
                logger.warning("engine replica %d is down: %r", replica, error)
            response.cancel()
            self._fleet.mark_down(replica)
            return
        self._fleet.update(report)

    async def generate(self, request: Request) -> Response:
        body = await read_body(request, self._config.max_request_bytes)
        key = await asyncio.to_thread(self._keys.key, route_path(request.scope), body)
        return self._forward(request, body, key)

    def forward_to_any(self, request: Request) -> Response:
        return self._forward(request, b"", None)

    def health(self) -> Response:
        if not any(self._fleet.is_up(replica) for replica in range(self._fleet.size)):
            raise _unavailable()
        return Response(status_code=200)

    def metrics(self) -> Response:
        return Response(render_fleet(self._fleet), media_type=CONTENT_TYPE)

    def _forward(self, request: Request, body: bytes, key: bytes | None) -> Response:
        try:
            decision = self._policy.choose(key, self._fleet.loads())
        except NoHealthyReplicaError:
            raise _unavailable() from None
        headers = [item for item in request.scope["headers"] if item[0] not in _DROPPED_HEADERS]
        # The replica's app is mounted at "/": it gets the path below the ingress's prefix.
        path = route_path(request.scope)
        forwarded = ForwardedRequest(
            request.method, path, request.scope["query_string"], headers, body
        )
        parts = self._streams[decision.replica].forward.remote(forwarded)
        self._fleet.begin(decision)
        return ReplicaResponse(
            decision.replica,
            parts,
            cancel=parts.cancel,
            on_failure=self._fleet.mark_down,
            on_close=lambda: self._fleet.end(decision.replica),
        )


def _unavailable() -> OpenAIError:
    return OpenAIError(
        503,
        "no engine replica is available (each is failed or restarting); retry",
        error_type="server_error",
        code="engine_unavailable",
        headers={"Retry-After": str(RETRY_AFTER_S)},
    )


def _ingress_app(ingress: Ingress, config: ServerConfig) -> FastAPI:
    app = FastAPI(
        title="loopserve",
        lifespan=lambda _: ingress.polling(),
        docs_url=None,
        redoc_url=None,
        openapi_url=None,
    )
    install_error_handlers(app)

    @app.get("/health")
    async def health() -> Response:
        return ingress.health()

    @app.get("/metrics")
    async def metrics() -> Response:
        return ingress.metrics()

    @app.get("/v1/models")
    async def models(request: Request) -> Response:
        return ingress.forward_to_any(request)

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await ingress.generate(request)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await ingress.generate(request)

    app.add_middleware(
        ConcurrencyLimitMiddleware, limit=config.max_concurrent_requests, paths=GENERATION_PATHS
    )
    if config.api_key is not None:
        app.add_middleware(ApiKeyMiddleware, api_key=config.api_key)  # outermost: checked first
    return app
