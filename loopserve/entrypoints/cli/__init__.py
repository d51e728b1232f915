"""The `loopserve` command line: one module per subcommand.

Owns: dispatch, the logging level (`--log-level`, before or after the subcommand), and how a
command ends: a user error is one line on stderr and exit code 2, Ctrl-C is one line and exit code
130 (no traceback either way). Each subcommand module defines `add_parser(subparsers)` and
`run(args) -> int` and keeps heavy imports (torch, the engine, servers) inside `run`, so
`loopserve --help` stays fast.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import sys
from collections.abc import Sequence

# subcommand -> module; the order is the order of `loopserve --help`.
SUBCOMMANDS: dict[str, str] = {
    "generate": "loopserve.entrypoints.cli.generate",
    "serve": "loopserve.entrypoints.cli.serve",
    "make-checkpoint": "loopserve.entrypoints.cli.make_checkpoint",
    "bench": "loopserve.entrypoints.cli.bench",
    "train-tiny": "loopserve.entrypoints.cli.train_tiny",
    "eval": "loopserve.entrypoints.cli.eval",
}
LOG_LEVELS = ("debug", "info", "warning", "error", "critical")
LOG_LEVEL_HELP = f"Python logging level: {', '.join(LOG_LEVELS)} (before or after the command)"
# The exit code of a command stopped with Ctrl-C (128 + SIGINT), as shells report it.
INTERRUPTED = 130


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="loopserve", description="Inference and serving for looped language models (Ouro)."
    )
    parser.add_argument(
        "--log-level", default="warning", help=LOG_LEVEL_HELP + " (default: warning)"
    )
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for module_name in SUBCOMMANDS.values():
        importlib.import_module(module_name).add_parser(subparsers)
    _accept_log_level_after_commands(parser)
    return parser


def _accept_log_level_after_commands(parser: argparse.ArgumentParser) -> None:
    """Every (sub)subcommand takes --log-level too; given there, it wins over the one before."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for command_parser in action.choices.values():
                command_parser.add_argument(
                    "--log-level", default=argparse.SUPPRESS, help=LOG_LEVEL_HELP
                )
                _accept_log_level_after_commands(command_parser)


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.log_level.lower() not in LOG_LEVELS:
        print(
            f"loopserve: error: --log-level must be one of {', '.join(LOG_LEVELS)}, "
            f"got {args.log_level!r}",
            file=sys.stderr,
        )
        return 2
    logging.basicConfig(level=args.log_level.upper(), format="%(levelname)s %(name)s: %(message)s")
    module = importlib.import_module(SUBCOMMANDS[args.command])
    try:
        result: int = module.run(args)
    except (ValueError, FileNotFoundError) as error:
        print(f"loopserve {args.command}: error: {error}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"loopserve {args.command}: interrupted", file=sys.stderr)
        return INTERRUPTED
    return result


if __name__ == "__main__":
    sys.exit(main())
