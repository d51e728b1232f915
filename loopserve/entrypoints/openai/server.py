"""Running the app under uvicorn, with graceful shutdown.

Owns: binding the address (before the model loads, so a taken port fails at once), building the
engine and the app, exempting what start-up built from the garbage collector, the uvicorn
settings, and telling the caller the URL once uvicorn listens (`on_listening`: after the model has
loaded, so the URL answers at once; with port 0 it carries the port the system chose). On SIGTERM
or Ctrl-C uvicorn stops accepting connections and waits for open ones; the app lets in-flight
requests finish for `shutdown_timeout_s`, then aborts the rest (their clients get
`finish_reason: "abort"`); uvicorn cancels whatever is still open a few seconds later; the app's
lifespan then stops the engine: its process (`config.engine_process`, the default), or its thread.
An engine process whose app never ran (a chat template that does not compile, say) is ended here.
Must not: parse command lines (the CLI does).
"""

from __future__ import annotations

import socket
from collections.abc import Callable
from typing import TYPE_CHECKING

from loopserve.config import EngineConfig
from loopserve.engine.engine import Engine
from loopserve.entrypoints.openai.app import build_app
from loopserve.entrypoints.openai.config import ServerConfig
from loopserve.entrypoints.openai.engine_process import EngineChild
from loopserve.entrypoints.openai.gc_freeze import objects_frozen

# Seconds uvicorn waits, after the app aborted what was left, before it cancels connections.
SHUTDOWN_BACKSTOP_S = 5

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
        # A backstop: the app aborts what is left after shutdown_timeout_s (see `shutdown`).
        timeout_graceful_shutdown=config.shutdown_timeout_s + SHUTDOWN_BACKSTOP_S,
    )


def bind_socket(host: str, port: int) -> socket.socket:
    """A socket bound to (host, port), not listening yet: uvicorn listens once the app is ready,
    so clients are refused until then. Raises OSError when the address cannot be bound:
    `socket.gaierror` when `host` is not an address or name, errno EADDRNOTAVAIL when it is none
    of this machine's, EADDRINUSE when the port is taken."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    # IPPROTO_TCP, not 0: asyncio sets TCP_NODELAY only on sockets that say they are TCP, and
    # without it every response waits for the client's delayed ACK (~40 ms).
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError:
        sock.close()
        raise
    return sock


def socket_url(sock: socket.socket) -> str:
    """`http://HOST:PORT` of a bound socket, with the port it really got (port 0 picks one)."""
    host, port = sock.getsockname()[:2]
    return f"http://[{host}]:{port}" if sock.family == socket.AF_INET6 else f"http://{host}:{port}"


def run_server(
    engine_config: EngineConfig,
    config: ServerConfig,
    sock: socket.socket,
    on_listening: Callable[[str], None] | None = None,
) -> None:
    """Load the model, then serve on `sock` (from `bind_socket`) until SIGTERM or Ctrl-C;
    `on_listening(url)` runs once uvicorn accepts connections. With `config.engine_process` (the
    default) the engine is built in a spawned process, which imports the caller's main module:
    a script calling this must do so under `if __name__ == "__main__":`."""
    import uvicorn

    class Server(uvicorn.Server):
        async def startup(self, sockets: list[socket.socket] | None = None) -> None:
            await super().startup(sockets)  # exits the process if the app failed to start
            if on_listening is not None:
                on_listening(socket_url(sock))

    engine = EngineChild.spawn(engine_config) if config.engine_process else Engine(engine_config)
    try:
        app = build_app(engine, config)
        with objects_frozen():
            Server(uvicorn_config(app, config)).run(sockets=[sock])
    finally:
        if isinstance(engine, EngineChild):  # stopped by the app, unless it never started
            engine.close()
