"""`loopserve bench MODE`: benchmark commands; each mode is its own module under loopserve.bench.

Every measuring mode prints one JSON line per configuration (see docs/benchmarks.md).
"""

from __future__ import annotations

import argparse
import importlib

# mode -> module with add_arguments(parser) and run(args) -> int
BENCH_MODES: dict[str, str] = {
    "serve": "loopserve.bench.serve_client",
    "offline": "loopserve.bench.offline",
    "compare": "loopserve.bench.compare",
}


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("bench", help="measure throughput and latency")
    modes = parser.add_subparsers(dest="bench_mode", metavar="MODE", required=True)
    for mode, module_name in BENCH_MODES.items():
        module = importlib.import_module(module_name)
        mode_parser = modes.add_parser(
            mode, help=module.__doc__.splitlines()[0] if module.__doc__ else None
        )
        module.add_arguments(mode_parser)


def run(args: argparse.Namespace) -> int:
    result: int = importlib.import_module(BENCH_MODES[args.bench_mode]).run(args)
    return result
