"""Running the app under uvicorn, with graceful shutdown.

Owns: building the engine and the app, and the uvicorn settings: on SIGTERM or Ctrl-C uvicorn
stops accepting connections, lets in-flight requests finish for `shutdown_timeout_s`, then
cancels them (which aborts their engine requests); the app's lifespan then stops the engine
thread, aborting anything left. Must not: parse command lines (the CLI does).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from loopserve.config import EngineConfig
from loopserve.engine.engine import Engine
from loopserve.entrypoints.openai.app import build_app
from loopserve.entrypoints.openai.config import ServerConfig

if TYPE_CHECKING:
    import uvicorn
    from fastapi import FastAPI


def uvicorn_config(app: FastAPI, config: ServerConfig) -> uvicorn.Config:
    import uvicorn

    return uvicorn.Config(
        app,
        host=config.host,
        port=config.port,
        log_level=config.log_level,
        lifespan="on",
        timeout_graceful_shutdown=config.shutdown_timeout_s,
    )


def run_server(engine_config: EngineConfig, config: ServerConfig) -> None:
    """Load the model, then serve until SIGTERM or Ctrl-C."""
    import uvicorn

    app = build_app(Engine(engine_config), config)
    uvicorn.Server(uvicorn_config(app, config)).run()
