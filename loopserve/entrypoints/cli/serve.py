"""`loopserve serve`: the OpenAI-compatible HTTP server (needs the `serve` extra)."""

from __future__ import annotations

import argparse
import os
from pathlib import Path

from loopserve.entrypoints.cli.engine_args import add_engine_arguments, engine_options

# The environment variable read when --api-key is not given (keeps the key out of `ps`).
API_KEY_ENV = "LOOPSERVE_API_KEY"
BUILTIN_MODEL_NAME = "ouro-tiny"


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "serve",
        help="serve a model through the OpenAI API (the built-in tiny model without --model)",
        description="OpenAI-compatible server: /v1/completions, /v1/chat/completions, "
        "/v1/models, /health, /metrics. Needs `pip install loopserve[serve]`.",
    )
    group = parser.add_argument_group("server")
    group.add_argument("--host", default="127.0.0.1", help="address to bind (default loopback)")
    group.add_argument("--port", type=int, default=8000)
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
    group.add_argument("--max-concurrent-requests", type=int, default=256, help="more get 429")
    group.add_argument(
        "--max-request-bytes", type=int, default=8 * 2**20, help="larger bodies get 413"
    )
    group.add_argument("--max-choices-per-request", type=int, default=128, help="n x prompts")
    group.add_argument(
        "--shutdown-timeout", type=int, default=30, help="seconds to drain requests on SIGTERM"
    )
    group.add_argument(
        "--chat-template", default=None, help="a Jinja chat template file, overriding the model's"
    )
    group.add_argument("--uvicorn-log-level", default="info")
    add_engine_arguments(parser)


def run(args: argparse.Namespace) -> int:
    try:
        from loopserve.entrypoints.openai.config import ServerConfig
        from loopserve.entrypoints.openai.server import run_server
    except ImportError as error:
        raise ValueError(
            f"serving needs the `serve` extra ({error}); run: pip install 'loopserve[serve]'"
        ) from None
    from loopserve.config import EngineConfig

    names = args.served_model_name or [args.model or BUILTIN_MODEL_NAME]
    chat_template = None
    if args.chat_template is not None:
        chat_template = Path(args.chat_template).read_text()
    config = ServerConfig(
        host=args.host,
        port=args.port,
        served_model_names=tuple(names),
        api_key=args.api_key,
        max_concurrent_requests=args.max_concurrent_requests,
        max_request_bytes=args.max_request_bytes,
        max_choices_per_request=args.max_choices_per_request,
        shutdown_timeout_s=args.shutdown_timeout,
        chat_template=chat_template,
        log_level=args.uvicorn_log_level,
    )
    run_server(EngineConfig.from_options(model=args.model, **engine_options(args)), config)
    return 0
