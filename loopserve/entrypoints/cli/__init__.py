"""The `loopserve` command line: one module per subcommand.

Owns: dispatch. Each subcommand module defines `add_parser(subparsers)` and `run(args) -> int` and
keeps heavy imports (torch, the engine, servers) inside `run`, so `loopserve --help` stays fast.
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


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="loopserve", description="Inference and serving for looped language models (Ouro)."
    )
    parser.add_argument("--log-level", default="WARNING", help="Python logging level")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for module_name in SUBCOMMANDS.values():
        importlib.import_module(module_name).add_parser(subparsers)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(levelname)s %(name)s: %(message)s")
    module = importlib.import_module(SUBCOMMANDS[args.command])
    try:
        result: int = module.run(args)
    except (ValueError, FileNotFoundError) as error:
        print(f"loopserve {args.command}: error: {error}", file=sys.stderr)
        return 2
    return result


if __name__ == "__main__":
    sys.exit(main())
