"""`loopserve serve`: the OpenAI-compatible HTTP server (needs the `serve` extra); with
`--replicas N`, N engine replicas behind one endpoint on Ray Serve (needs the `ray` extra).

Binds `--host`/`--port` before loading the model, so a bad address or a taken port is reported at
once, naming the flag at fault; once the model has loaded and the server accepts connections,
prints `loopserve serve: listening on http://HOST:PORT` (the port really bound, so `--port 0` can be
found) on stdout. Must not: restate the server's defaults (they come from `ServerConfig`).
"""

from __future__ import annotations

import argparse
import dataclasses
import errno
import os
import socket
from pathlib import Path

from loopserve.entrypoints.cli.engine_args import add_engine_arguments, engine_options
from loopserve.entrypoints.openai.config import ServerConfig
from loopserve.entrypoints.reasoning import PARSERS
from loopserve.entrypoints.tool_calls import PARSERS as TOOL_CALL_PARSERS
from loopserve.models.builtin import BUILTIN_MODEL_NAME

# The environment variable read when --api-key is not given (keeps the key out of `ps`).
API_KEY_ENV = "LOOPSERVE_API_KEY"
# Request limits: flag -> (ServerConfig field, help). Each refusal names its flag.
LIMIT_FLAGS: dict[str, tuple[str, str]] = {
    "--max-concurrent-requests": ("max_concurrent_requests", "completions in flight; more get 429"),
    "--max-request-bytes": ("max_request_bytes", "larger bodies get 413"),
    "--max-json-depth": ("max_json_depth", "JSON nesting depth of a body"),
    "--max-json-number-digits": ("max_json_number_digits", "characters of one JSON number"),
    "--max-json-objects": ("max_json_objects", "JSON objects ({...}) in one body"),
    "--max-choices-per-request": ("max_choices_per_request", "n x prompts"),
    "--max-stop-strings": ("max_stop_strings", "stop strings per request"),
    "--max-stop-bytes": ("max_stop_bytes", "UTF-8 bytes of a request's stop strings together"),
    "--max-logprobs": ("max_logprobs", "log-prob alternatives per token (logprobs, top_logprobs)"),
    "--max-prompt-bytes": (
        "max_prompt_bytes",
        "UTF-8 bytes of one text prompt, checked before tokenizing (default: the context length "
        "times the longest token's bytes: the most that can fit)",
    ),
}


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "serve",
        help="serve a model through the OpenAI API (the built-in tiny model without --model)",
        description="OpenAI-compatible server: /v1/completions, /v1/chat/completions, "
        "/v1/models, /health, /metrics. Needs `pip install loopserve[serve]`.",
    )
    defaults = ServerConfig()
    group = parser.add_argument_group("server")
    group.add_argument("--host", default=defaults.host, help="address to bind (default loopback)")
    group.add_argument(
        "--port",
        type=int,
        default=defaults.port,
        help="0: any free port; once the model has loaded and the server accepts connections, "
        "'loopserve serve: listening on http://HOST:PORT' is printed on stdout (default: "
        "%(default)s)",
    )
    group.add_argument(
        "--served-model-name",
        nargs="+",
        default=None,
        help="names clients use in `model` (default: the --model argument, or ouro-tiny)",
    )
    group.add_argument(
        "--api-key",
        default=os.environ.get(API_KEY_ENV),
        help=f"require 'Authorization: Bearer KEY' on all but /health (default: ${API_KEY_ENV})",
    )
    group.add_argument(
        "--shutdown-timeout",
        type=int,
        default=defaults.shutdown_timeout_s,
        help="seconds to drain requests on SIGTERM (default: %(default)s)",
    )
    group.add_argument(
        "--chat-template", default=None, help="a Jinja chat template file, overriding the model's"
    )
    group.add_argument(
        "--reasoning-parser",
        choices=PARSERS,
        default=defaults.reasoning_parser,
        help="split chat replies' <think>...</think> into reasoning_content (deepseek_r1); auto: "
        "when the chat template writes <think> (default: %(default)s)",
    )
    group.add_argument(
        "--tool-call-parser",
        choices=TOOL_CALL_PARSERS,
        default=defaults.tool_call_parser,
        help="find <tool_call>{json}</tool_call> in chat replies to requests with tools "
        "(hermes); auto: when the chat template writes <tool_call> (default: %(default)s)",
    )
    group.add_argument("--uvicorn-log-level", default=defaults.log_level)
    engine_default = "on" if defaults.engine_process else "off"
    group.add_argument(
        "--engine-process",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="run the engine in a process of its own, apart from the HTTP event loop, so they no "
        f"longer share Python's interpreter lock (default: {engine_default}; "
        "on an H100 with 128 requests in flight, served throughput was 0.96 of offline "
        "this way and 0.89 with the engine in a thread: docs/server.md); --no-engine-process "
        "keeps the engine in a thread of the server (one process: for debugging and profiling). "
        "With --replicas each engine runs in a Ray actor process and the flag is refused",
    )
    limits = parser.add_argument_group("request limits (a request over one gets a 4xx naming it)")
    for flag, (name, help_text) in LIMIT_FLAGS.items():
        default = getattr(defaults, name)
        shown = "" if default is None else " (default: %(default)s)"
        limits.add_argument(flag, dest=name, type=int, default=default, help=help_text + shown)
    _add_replica_arguments(parser)
    add_engine_arguments(parser)


def _add_replica_arguments(parser: argparse.ArgumentParser) -> None:
    """Flags of the Ray Serve fleet; the routing knobs' defaults come from `RoutingConfig`."""
    from loopserve.ray.routing import RoutingConfig

    defaults = RoutingConfig()
    group = parser.add_argument_group(
        "replicas (Ray Serve; needs `pip install loopserve[ray]`, see docs/ray.md)"
    )
    group.add_argument(
        "--replicas",
        type=int,
        default=None,
        help="serve N engine replicas (one GPU each on CUDA) behind one endpoint, on Ray Serve "
        "(default: one engine in this process, without Ray)",
    )
    group.add_argument(
        "--gpus-per-replica",
        type=float,
        default=1.0,
        help="on CUDA, the share of a GPU each replica takes, in (0, 1]; 0.5 runs two replicas on "
        "each GPU, each with --gpu-memory-utilization at most 0.5 (default: 1)",
    )
    group.add_argument(
        "--ray-address",
        default=None,
        help="join this Ray cluster (e.g. auto, ray://HOST:10001) instead of starting a local one",
    )
    knobs = {
        "--affinity-pages": ("affinity_pages", int, "full KV pages of a prompt that route it; "
                             "0: route by load only"),
        "--saturation": ("saturation", float, "load at which a prompt's replica is passed over"),
        "--max-imbalance": ("max_imbalance", float, "load a prompt's replica may have above the "
                            "least-loaded one's before it is passed over"),
        "--poll-interval": ("poll_interval_s", float, "seconds between load polls"),
    }  # fmt: skip
    for flag, (name, kind, help_text) in knobs.items():
        default = getattr(defaults, name)
        group.add_argument(
            flag, dest=name, type=kind, default=default, help=f"{help_text} (default: {default})"
        )


def run(args: argparse.Namespace) -> int:
    if args.replicas is not None:
        return _run_replicas(args)
    try:
        from loopserve.entrypoints.openai.server import bind_socket, run_server
    except ImportError as error:
        raise ValueError(
            f"serving needs the `serve` extra ({error}); run: pip install 'loopserve[serve]'"
        ) from None
    from loopserve.config import EngineConfig

    config = _server_config(args)
    if args.engine_process is not None:  # else ServerConfig's default: the engine process
        config = dataclasses.replace(config, engine_process=args.engine_process)
    engine_config = EngineConfig.from_options(model=args.model, **engine_options(args))
    try:
        sock = bind_socket(config.host, config.port)
    except OSError as error:
        raise ValueError(_bind_error(config.host, config.port, error)) from None
    run_server(engine_config, config, sock, _announce)
    return 0


def _bind_error(host: str, port: int, error: OSError) -> str:
    """One line blaming the flag at fault: --host when it is no address of this machine, else
    --port (taken, or privileged)."""
    reason = error.strerror or str(error)
    if isinstance(error, socket.gaierror):
        return (
            f"--host {host!r} is not a valid address or host name ({reason}); give an IP address "
            "of this machine (127.0.0.1: loopback only, 0.0.0.0: every interface) or its name"
        )
    if error.errno == errno.EADDRNOTAVAIL:
        return (
            f"--host {host}: no network interface of this machine has that address ({reason}); "
            "give one of its addresses (127.0.0.1: loopback only, 0.0.0.0: every interface)"
        )
    return (
        f"--port {port}: cannot listen on {host}:{port} ({reason}); choose another --port "
        "(0: any free one)"
    )


def _announce(url: str) -> None:
    print(f"loopserve serve: listening on {url}", flush=True)


def _run_replicas(args: argparse.Namespace) -> int:
    if args.replicas < 1:
        raise ValueError(f"--replicas must be at least 1, got {args.replicas}")
    if args.engine_process:  # given explicitly (the default is None)
        raise ValueError(
            "--engine-process is for the single-process server: with --replicas each engine "
            "already runs in a Ray actor process of its own, apart from the ingress; drop it"
        )
    try:
        from loopserve.ray import serve_replicas
    except ImportError as error:
        raise ValueError(f"--replicas: {error}") from None
    from loopserve.config import EngineConfig
    from loopserve.ray.routing import RoutingConfig

    routing = RoutingConfig(
        affinity_pages=args.affinity_pages,
        saturation=args.saturation,
        max_imbalance=args.max_imbalance,
        poll_interval_s=args.poll_interval_s,
    )
    # The replicas' engines run in their Ray actors, each beside its app; no engine process.
    config = dataclasses.replace(_server_config(args), engine_process=False)
    engine_config = EngineConfig.from_options(model=args.model, **engine_options(args))
    serve_replicas(
        engine_config, config, args.replicas, args.ray_address, routing, args.gpus_per_replica
    )
    return 0


def _server_config(args: argparse.Namespace) -> ServerConfig:
    names = args.served_model_name or [args.model or BUILTIN_MODEL_NAME]
    chat_template = None
    if args.chat_template is not None:
        chat_template = Path(args.chat_template).read_text()
    limits = {name: getattr(args, name) for name, _ in LIMIT_FLAGS.values()}
    return ServerConfig(
        host=args.host,
        port=args.port,
        served_model_names=tuple(names),
        api_key=args.api_key,
        shutdown_timeout_s=args.shutdown_timeout,
        chat_template=chat_template,
        reasoning_parser=args.reasoning_parser,
        tool_call_parser=args.tool_call_parser,
        log_level=args.uvicorn_log_level,
        **limits,
    )
