"""The FastAPI application: routes, middlewares, error handlers and the engine link's lifespan.

Owns: `build_app`, which wires one `ServingContext` into the routes (`/v1/completions`,
`/v1/chat/completions`, `/v1/models`, `/health`, `/metrics`) over an engine built in a process of
its own (`EngineChild`) or in this one (`Engine`, then run by an engine thread), starts the engine
link with the app and stops it (aborting what is left) when the app shuts down (`running`, which a
Ray replica enters itself: it serves the app without a lifespan); on SIGTERM it aborts what is
still running once the drain timeout has passed (`abort_after_drain`). Must not: hold module-level
state (every app carries its own context) or call the engine (the link owns it).
"""

from __future__ import annotations

import asyncio
import signal
import threading
import time
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager
from types import FrameType
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from loopserve.engine.engine import Engine
from loopserve.entrypoints.openai.auth import ApiKeyMiddleware
from loopserve.entrypoints.openai.body import BodyLimits
from loopserve.entrypoints.openai.chat_template import load_chat_template
from loopserve.entrypoints.openai.config import ServerConfig
from loopserve.entrypoints.openai.context import ModelInfo, ServingContext
from loopserve.entrypoints.openai.engine_process import EngineChild, EngineProcess
from loopserve.entrypoints.openai.engine_thread import EngineLink, EngineThread
from loopserve.entrypoints.openai.errors import OpenAIError, install_error_handlers
from loopserve.entrypoints.openai.limits import ConcurrencyLimitMiddleware, RequestLimits
from loopserve.entrypoints.openai.logprobs import LogprobFormatter
from loopserve.entrypoints.openai.metrics import CONTENT_TYPE, ServerMetrics
from loopserve.entrypoints.openai.responses import ModelCard, ModelList, to_json
from loopserve.entrypoints.openai.serving_chat import create_chat_completion
from loopserve.entrypoints.openai.serving_completions import create_completion
from loopserve.entrypoints.reasoning import splits_reasoning
from loopserve.entrypoints.tool_calls import parses_tool_calls

GENERATION_PATHS = ("/v1/completions", "/v1/chat/completions")
# Threads for the CPU work of requests (parsing, templates, tokenizing). Few: that work holds the
# interpreter lock most of the time, and each thread more takes a share of it from the event loop.
REQUEST_WORKER_THREADS = 2


def build_app(engine: Engine | EngineChild, config: ServerConfig) -> FastAPI:
    """The app serving `engine` (in this process, or an engine process); from here on only the
    engine thread (or the engine process) touches the engine.

    Raises:
        ValueError: the chat template does not compile.
    """
    return app_for(serving_context(engine, config))


def serving_context(engine: Engine | EngineChild, config: ServerConfig) -> ServingContext:
    """Everything the routes share; the engine thread (or the engine process's reader) starts
    with `running`.

    Raises:
        ValueError: the chat template does not compile.
    """
    model = engine.model if isinstance(engine, EngineChild) else ModelInfo.of(engine)
    metrics = ServerMetrics(model.num_loops)
    link: EngineLink = (
        EngineProcess(engine, metrics)
        if isinstance(engine, EngineChild)
        else EngineThread(engine, metrics)
    )
    chat_template = load_chat_template(config.chat_template, model.tokenizer)
    source = chat_template.source if chat_template is not None else None
    return ServingContext(
        config=config,
        model=model,
        engine=link,
        metrics=metrics,
        chat_template=chat_template,
        splits_reasoning=splits_reasoning(config.reasoning_parser, source),
        parses_tool_calls=parses_tool_calls(config.tool_call_parser, source),
        logprobs=LogprobFormatter(model.tokenizer),
        started=int(time.time()),
        limits=RequestLimits.resolve(
            config, model.tokenizer, model.max_model_len, model.max_stop_token_ids
        ),
        body_limits=BodyLimits(
            config.max_json_depth, config.max_json_number_digits, config.max_json_objects
        ),
        workers=ThreadPoolExecutor(REQUEST_WORKER_THREADS, thread_name_prefix="loopserve-request"),
    )


@asynccontextmanager
async def running(context: ServingContext) -> AsyncIterator[None]:
    """The engine link runs inside this block (the engine thread, or the engine process's
    reader, delivering on the running event loop); on the way out it stops, aborting what is
    left. The app's lifespan, and a Ray replica's life."""
    loop = asyncio.get_running_loop()
    context.engine.start(loop)
    restore_signals = abort_after_drain(loop, context.engine, context.config.shutdown_timeout_s)
    try:
        yield
    finally:
        restore_signals()
        context.workers.shutdown(wait=False, cancel_futures=True)
        await asyncio.to_thread(context.engine.stop)


def app_for(context: ServingContext) -> FastAPI:
    """The routes and middlewares over `context`; its lifespan is `running(context)`."""
    app = FastAPI(
        title="loopserve",
        lifespan=lambda _: running(context),
        docs_url=None,
        redoc_url=None,
        openapi_url=None,
    )
    install_error_handlers(app)
    _add_routes(app, context)
    config = context.config
    app.add_middleware(
        ConcurrencyLimitMiddleware, limit=config.max_concurrent_requests, paths=GENERATION_PATHS
    )
    if config.api_key is not None:
        app.add_middleware(ApiKeyMiddleware, api_key=config.api_key)  # outermost: checked first
    return app


def _add_routes(app: FastAPI, context: ServingContext) -> None:
    @app.get("/health")
    async def health() -> Response:
        if not context.engine.alive:
            raise OpenAIError(
                503,
                "the engine is not running",
                error_type="server_error",
                code="engine_unavailable",
            )
        return Response(status_code=200)

    @app.get("/metrics")
    async def metrics() -> Response:
        text = context.metrics.render(context.engine.stats())
        return Response(text, media_type=CONTENT_TYPE)

    @app.get("/v1/models")
    async def models() -> JSONResponse:
        cards = [
            ModelCard(
                id=name,
                created=context.started,
                root=context.model.root,
                max_model_len=context.model.max_model_len,
                num_loops=context.model.num_loops,
                dtype=context.model.dtype,
                kv_cache_dtype=context.model.kv_cache_dtype,
                kv_cache_scales=context.model.kv_cache_scales,
                quantization=context.model.quantization,
            )
            for name in context.config.served_model_names
        ]
        return JSONResponse(to_json(ModelList(data=cards)))

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await create_completion(request, context)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await create_chat_completion(request, context)


SIGNALS = (signal.SIGTERM, signal.SIGINT)


def abort_after_drain(
    loop: asyncio.AbstractEventLoop, engine: EngineLink, timeout_s: float
) -> Callable[[], None]:
    """Install the hook; returns a function that restores the previous handlers.

    Graceful shutdown: the hook runs in front of the server's own signal handlers (uvicorn's,
    which stop accepting connections and wait for open ones, still run) and schedules
    the engine link's `request_stop` after the drain timeout: every request still running is then
    aborted and its client gets a final chunk with `finish_reason: "abort"` and `data: [DONE]`
    (a non-streaming one a 503), so connections close and the server can exit. Does nothing off
    the main thread (a server started in a thread handles no signals).
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
