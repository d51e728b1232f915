"""What constrained decoding costs end to end: offline closed-loop throughput with a JSON schema on
every request against the same requests unconstrained, on one engine, alternated A B B A.

    python -m benchmarks.structured_cost --tokenizer TOKENIZER_JSON [--model DIR]
        [--concurrency 1,32] [--exits fixed,trace] [--workload 512/128] [--out FILE.jsonl]

A CPU rehearsal on the built-in model (it has its own tokenizer):
    python -m benchmarks.structured_cost --model loopserve/assets/ouro-tiny \
        --tokenizer loopserve/assets/ouro-tiny/tokenizer.json --device cpu --dtype float32 \
        --workload 32/16 --concurrency 1,4

The model defaults to the bench's random Ouro-1.4B checkpoint (`loopserve bench offline`'s),
which has no tokenizer: constraints are written in text, so `--tokenizer` names a tokenizer.json
whose vocabulary fits the model's (`python -m benchmarks.structured_cost --build-tokenizer FILE`
trains a byte-level BPE of the model's 49,152 tokens on the Python standard library's sources
in a few seconds). The checkpoint is seen through a folder of links with that tokenizer beside it.

The schema is an array of at least 40 small objects (integers, bounded strings, booleans): the
grammar never completes within the 128 output tokens, so both variants generate the same number
of tokens (every request must end by length). Exits `fixed` run every loop; `trace` draws depths
from the family's trace (d2.6 for Ouro), where a token that exits after one loop waits for its
bitmask (`runner/token_masks.py`). Also printed: host time in the grammar (compiling, advancing,
bitmasks) per engine step of the constrained runs.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks.jsonl import emit

SCHEMA: dict[str, Any] = {
    "type": "array",
    "items": {
        "type": "object",
        "properties": {
            "id": {"type": "integer", "minimum": 0, "maximum": 100000},
            "name": {"type": "string", "maxLength": 12},
            "ok": {"type": "boolean"},
        },
        "required": ["id", "name", "ok"],
        "additionalProperties": False,
    },
    "minItems": 40,
}


def build_tokenizer(path: Path, vocab_size: int = 49152) -> None:
    """A byte-level BPE of `vocab_size` tokens trained on the standard library's sources."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    sources = sorted(str(p) for p in Path(json.__file__).parents[1].rglob("*.py"))
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    texts = (Path(source).read_text(errors="replace") for source in sources)
    tokenizer.train_from_iterator(texts, trainer, length=len(sources))
    tokenizer.save(str(path))
    print(f"wrote {path}: {tokenizer.get_vocab_size()} tokens from {len(sources)} files")


def with_tokenizer(model: Path, tokenizer: Path, into: Path) -> Path:
    """A folder of links to `model`'s files with `tokenizer` as its tokenizer.json."""
    for item in model.iterdir():
        if item.name != "tokenizer.json":
            (into / item.name).symlink_to(item.resolve())
    (into / "tokenizer.json").symlink_to(tokenizer.resolve())
    return into


class GrammarClock:
    """Host seconds the engine's thread spends in constraint work (wraps its methods; `attach`
    includes waiting for the masks `prepare` started on the worker thread)."""

    def __init__(self, constraints: Any) -> None:
        self.seconds = 0.0
        for name in ("check", "accept", "prepare", "attach"):
            setattr(constraints, name, self._timed(getattr(constraints, name)))

    def _timed(self, method: Any) -> Any:
        def timed(*args: Any) -> Any:
            start = time.perf_counter()
            try:
                return method(*args)
            finally:
                self.seconds += time.perf_counter() - start

        return timed


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", help="checkpoint directory (default: the bench's random one)")
    parser.add_argument("--tokenizer", type=Path, help="tokenizer.json for the model")
    parser.add_argument("--build-tokenizer", type=Path, metavar="FILE", help="write one, exit")
    parser.add_argument("--concurrency", default="1,32")
    parser.add_argument("--exits", default="fixed,trace")
    parser.add_argument("--workload", default="512/128")
    parser.add_argument("--kv-layout", default="shared")
    parser.add_argument("--device", default="cuda", help="cpu: a rehearsal on a small model")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--out", type=Path, help="append one JSON line per measurement")
    args = parser.parse_args(argv)
    if args.build_tokenizer is not None:
        build_tokenizer(args.build_tokenizer)
        return 0
    if args.tokenizer is None or not args.tokenizer.is_file():
        parser.error("--tokenizer FILE (a tokenizer.json) is needed; --build-tokenizer makes one")
    from loopserve.bench.checkpoint_cache import ensure_random_checkpoint

    model = Path(args.model) if args.model else ensure_random_checkpoint()
    with tempfile.TemporaryDirectory() as folder:
        view = with_tokenizer(model, args.tokenizer, Path(folder))
        return _measure(args, view)


def _measure(args: argparse.Namespace, model: Path) -> int:
    from loopserve.bench.closed_loop import run_closed_loop
    from loopserve.bench.sweep_spec import Workload
    from loopserve.bench.timed_runner import TimedRunner
    from loopserve.config import EngineConfig
    from loopserve.engine.engine import Engine
    from loopserve.runner.setup import build_runner
    from loopserve.structured_outputs import StructuredOutputsParams

    concurrencies = [int(value) for value in args.concurrency.split(",")]
    workload = Workload.parse(args.workload)
    config = EngineConfig.from_options(
        model=str(model),
        device=args.device,
        dtype=args.dtype,
        kv_layout=args.kv_layout,
        exit_mode="trace",
        max_num_seqs=max(concurrencies),
    )
    runner = TimedRunner(build_runner(config))
    engine = Engine(config, runner)
    clock = GrammarClock(engine.constraints)
    spec = StructuredOutputsParams(json=SCHEMA)
    loops, vocab = engine.model_config.num_loops, engine.model_config.vocab_size
    rows = []
    for concurrency in concurrencies:
        for exits in args.exits.split(","):
            count = max(2 * concurrency, 4)

            def requests(
                seed: int,
                constrained: bool,
                count: int = count,
                concurrency: int = concurrency,
                exits: str = exits,
            ) -> list[Any]:
                spec_or_none = spec if constrained else None
                return _requests(
                    workload, count, concurrency, vocab, loops, exits, seed, spec_or_none
                )

            for constrained in (False, True):  # warm-up: graphs of both kinds, compiles
                run_closed_loop(engine, requests(0, constrained)[:concurrency], concurrency, "w")
            trials: dict[bool, list[dict[str, float]]] = {False: [], True: []}
            for trial, constrained in enumerate((False, True, True, False)):
                steps_before = engine.stats().steps
                clock.seconds = runner.wait_s = 0.0
                record = run_closed_loop(
                    engine, requests(trial + 1, constrained), concurrency, f"t{trial}"
                )
                tokens = sum(len(r.exit_depths) for r in record.requests)
                steps = max(engine.stats().steps - steps_before, 1)
                trials[constrained].append(
                    {
                        "tok_s": tokens / record.duration_s,
                        "steps_per_token": steps / tokens,
                        "ms_per_step": 1e3 * record.duration_s / steps,
                        "wait_ms_per_step": 1e3 * runner.wait_s / steps,
                        "grammar_ms_per_step": 1e3 * clock.seconds / steps,
                    }
                )
            mean = {
                key: {name: statistics.mean(t[name] for t in values) for name in values[0]}
                for key, values in trials.items()
            }
            free, constrained_rate = mean[False]["tok_s"], mean[True]["tok_s"]
            row = {
                "concurrency": concurrency,
                "exits": exits,
                "workload": args.workload,
                "free_tok_s": round(free, 1),
                "constrained_tok_s": round(constrained_rate, 1),
                "ratio": round(constrained_rate / free, 3),
                "grammar_host_ms_per_step": round(mean[True]["grammar_ms_per_step"], 3),
                # Why it costs: more steps per token (held rows) or longer steps, and whether the
                # host still waits for the device (wait -> 0: the host is the bottleneck).
                **{
                    f"{name}_{'constrained' if key else 'free'}": round(value[name], 3)
                    for key, value in mean.items()
                    for name in ("steps_per_token", "ms_per_step", "wait_ms_per_step")
                },
                "trials": {
                    str(key): [round(t["tok_s"], 1) for t in values]
                    for key, values in trials.items()
                },
            }
            rows.append(row)
            emit(row, args.out)
    print(
        "\n| C | exits | unconstrained tok/s | json_schema tok/s | ratio | grammar host ms/step "
        "| steps/token free, json | ms/step free, json | device wait ms/step free, json |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for row in rows:
        pairs = [
            f"{row[name + '_free']}, {row[name + '_constrained']}"
            for name in ("steps_per_token", "ms_per_step", "wait_ms_per_step")
        ]
        print(
            f"| {row['concurrency']} | {row['exits']} | {row['free_tok_s']} | "
            f"{row['constrained_tok_s']} | {row['ratio']} | {row['grammar_host_ms_per_step']} | "
            + " | ".join(pairs)
            + " |"
        )
    return 0


def _requests(
    workload: Any,
    count: int,
    concurrency: int,
    vocab: int,
    loops: int,
    exits: str,
    seed: int,
    spec: Any,
) -> list[Any]:
    """The bench's seeded random requests, each with structured outputs `spec` (None: free)."""
    from loopserve.bench.closed_loop import make_requests

    free = make_requests(
        workload, count, seed=(seed, concurrency), vocab_size=vocab, num_loops=loops,
        exits=exits, temperature=1.0,
    )  # fmt: skip
    if spec is None:
        return free
    return [
        dataclasses.replace(item, params=dataclasses.replace(item.params, structured_outputs=spec))
        for item in free
    ]


if __name__ == "__main__":
    sys.exit(main())
