"""`loopserve eval`: quality against depth (`perplexity`) and GSM8K accuracy (`gsm8k`).

Owns: the flags of both evaluations, loading what they need, printing their tables and writing
their JSON reports (and the plot, whose matplotlib is checked before any work). Must not: contain
scoring logic (see `loopserve.eval`).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

from loopserve.config import KV_CACHE_DTYPES, QUANTIZATIONS
from loopserve.entrypoints.cli.engine_args import add_engine_arguments, engine_options

if TYPE_CHECKING:
    from loopserve.eval.gsm8k import Decoding, GenerateFn

DEFAULT_THRESHOLDS = "0.95,0.9,0.8,0.7,0.6,0.5,0.4"


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("eval", help="evaluate quality against loop depth")
    commands = parser.add_subparsers(dest="eval_command", metavar="EVALUATION", required=True)
    _add_perplexity(commands)
    _add_gsm8k(commands)
    plot = commands.add_parser("plot", help="draw a curve written by `eval perplexity --output`")
    plot.add_argument("curve", type=Path, help="the JSON report of `eval perplexity`")
    plot.add_argument("output", type=Path, help="image file to write (.png, .svg, .pdf)")


def _add_perplexity(commands: argparse._SubParsersAction) -> None:
    parser = commands.add_parser(
        "perplexity",
        help="held-out perplexity, mean exit depth and exit-depth histogram per exit threshold",
        description=(
            "Teacher-forced held-out perplexity on the files of the Python standard library that "
            "train-tiny holds out, exact with respect to the engine's `full` KV layout and "
            "`ouro` exits: every fixed depth 1..L, then each exit threshold at full depth."
        ),
    )
    parser.add_argument("--model", default=None, help="checkpoint directory (default: built-in)")
    parser.add_argument(
        "--thresholds", default=DEFAULT_THRESHOLDS, help="comma-separated exit thresholds"
    )
    parser.add_argument("--no-fixed-depths", action="store_true", help="skip depths 1..L-1")
    parser.add_argument("--min-loops", type=int, default=1)
    parser.add_argument(
        "--seq-len", type=int, default=None, help="predicted tokens per window (default: trained)"
    )
    parser.add_argument(
        "--max-tokens", type=int, default=8192, help="predicted tokens at most (0: all)"
    )
    parser.add_argument("--batch-size", type=int, default=8, help="windows per forward pass")
    parser.add_argument(
        "--device", default="auto", help="auto (the GPU when torch sees one, else cpu), cpu, cuda:N"
    )
    parser.add_argument("--dtype", default="float32", help="float32, bfloat16 or float16")
    parser.add_argument(
        "--kv-cache-dtype",
        default="auto",
        choices=KV_CACHE_DTYPES,
        help="fp8: the block's K/V rounded as an fp8 cache stores them (docs/quantization.md)",
    )
    parser.add_argument(
        "--calculate-kv-scales",
        action="store_true",
        help="with --kv-cache-dtype fp8: per-layer K and V scales calculated from the "
        "calibration prompts, as the engine's calculate_kv_scales does (default: 1)",
    )
    parser.add_argument(
        "--quantization",
        default="none",
        choices=QUANTIZATIONS,
        help="fp8: the layers' projections quantized as the engine's quantization=fp8 does",
    )
    parser.add_argument("--corpus-root", type=Path, default=None, help="default: the stdlib")
    parser.add_argument(
        "--held-out-fraction", type=float, default=None, help="default: as trained, else 0.05"
    )
    parser.add_argument("--output", type=Path, default=None, help="write the curve as JSON")
    parser.add_argument("--plot", type=Path, default=None, help="draw the curve (needs matplotlib)")


def _add_gsm8k(commands: argparse._SubParsersAction) -> None:
    parser = commands.add_parser(
        "gsm8k",
        help="few-shot chain-of-thought GSM8K accuracy from a local JSONL file",
        description=(
            "Greedy few-shot chain-of-thought answers to the problems of a local GSM8K-format "
            "JSONL file ({'question', 'answer': '... #### N'}); the final number is extracted "
            "strictly ('The answer is N'). Writes per-question results and a protocol fingerprint."
        ),
    )
    parser.add_argument("data", type=Path, help="GSM8K-format JSONL file (nothing is downloaded)")
    parser.add_argument("--num-shots", type=int, default=8, help="exemplars in the prompt (0-8)")
    parser.add_argument("--limit", type=int, default=None, help="only the first N problems")
    parser.add_argument("--max-tokens", type=int, default=256, help="longest answer in tokens")
    parser.add_argument("--exit-threshold", type=float, default=None)
    parser.add_argument("--min-loops", type=int, default=1)
    parser.add_argument("--max-loops", type=int, default=None)
    parser.add_argument("--batch-size", type=int, default=64, help="problems per generate call")
    parser.add_argument("--output", type=Path, default=None, help="write the report as JSON")
    parser.add_argument("--baseline", type=Path, default=None, help="a stored report to compare")
    parser.add_argument(
        "--max-drop", type=float, default=0.02, help="allowed accuracy drop vs the baseline"
    )
    add_engine_arguments(parser)


def run(args: argparse.Namespace) -> int:
    if args.eval_command == "perplexity":
        return _run_perplexity(args)
    if args.eval_command == "plot":
        return _run_plot(args)
    return _run_gsm8k(args)


def _run_plot(args: argparse.Namespace) -> int:
    from loopserve.eval.perplexity import CurvePoint, markdown_table
    from loopserve.eval.plot import plot_curve, require_matplotlib

    require_matplotlib()
    if not args.curve.is_file():
        raise FileNotFoundError(f"{args.curve}: no such file")
    try:
        report = json.loads(args.curve.read_text())
        points = [CurvePoint(**point) for point in report["points"]]
    except (json.JSONDecodeError, KeyError, TypeError) as error:
        raise ValueError(f"{args.curve}: not an `eval perplexity` report ({error})") from None
    print(markdown_table(points))
    plot_curve(points, args.output, Path(report.get("model", "model")).name)
    print(f"wrote {args.output}")
    return 0


def _floats(text: str) -> list[float]:
    try:
        return [float(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise ValueError(f"expected comma-separated numbers, got {text!r}") from None


def _training_info(model_dir: Path) -> dict[str, Any]:
    path = model_dir / "training_info.json"
    return json.loads(path.read_text()).get("config", {}) if path.exists() else {}


def _run_perplexity(args: argparse.Namespace) -> int:
    from loopserve.eval.perplexity import (
        curve_settings,
        evaluate_setting,
        held_out_windows,
        markdown_table,
    )
    from loopserve.kv.storage import special_cache_dtype
    from loopserve.models.builtin import resolve_model_dir
    from loopserve.models.kv_scales import fp8_kv_scales
    from loopserve.models.loader import load_checkpoint, resolve_dtype
    from loopserve.models.quant import quantize_model
    from loopserve.runner.setup import resolve_device
    from loopserve.tokenizer import Tokenizer

    if args.plot is not None:
        from loopserve.eval.plot import require_matplotlib

        require_matplotlib()  # fail now, not after the whole evaluation
    if args.calculate_kv_scales and args.kv_cache_dtype != "fp8":
        raise ValueError(
            "--calculate-kv-scales needs --kv-cache-dtype fp8 (scales apply to an fp8 KV cache "
            f"only), got {args.kv_cache_dtype!r}"
        )
    thresholds = _floats(args.thresholds)
    model_dir = resolve_model_dir(args.model)
    tokenizer = Tokenizer.from_directory(model_dir)
    if tokenizer is None:
        raise ValueError(f"{model_dir} has no tokenizer.json; perplexity needs one")
    trained = _training_info(model_dir)
    seq_len = args.seq_len or trained.get("seq_len", 512)
    if args.max_tokens and args.max_tokens < seq_len:
        raise ValueError(
            f"--max-tokens {args.max_tokens} is less than one window of --seq-len {seq_len} "
            "predicted tokens; raise --max-tokens (0: all) or lower --seq-len"
        )
    device = resolve_device(args.device)
    model = load_checkpoint(model_dir, resolve_dtype(args.dtype), device)
    if args.quantization == "fp8":
        model.fuse_projections()
        quantize_model(model)
    kv_dtype = special_cache_dtype(args.kv_cache_dtype)
    kv_scales = None
    if kv_dtype is not None:  # as the engine runs it: calculated, the checkpoint's, or 1
        kv_scales = fp8_kv_scales(model, model_dir, args.calculate_kv_scales)
    separator = model.config.bos_token_id
    windows = held_out_windows(
        tokenizer,
        separator if separator is not None else model.config.eos_token_ids[0],
        seq_len=seq_len,
        max_tokens=args.max_tokens or None,
        corpus_root=args.corpus_root,
        held_out_fraction=args.held_out_fraction or trained.get("held_out_fraction", 0.05),
        max_files=trained.get("max_files"),
    ).to(device)
    if thresholds and (not model.config.has_exit_rule or model.has_stage_layers):
        reason = (
            "has no exit rule: exit thresholds do not apply"
            if not model.config.has_exit_rule
            else "has coda layers, whose early-exit perplexity is not implemented"
        )
        print(
            f"{model.config.family} {reason}, so only the fixed depths are measured",
            file=sys.stderr,
        )
        thresholds = []
    settings = curve_settings(
        model.config.num_loops, thresholds, not args.no_fixed_depths, args.min_loops
    )
    points = []
    for setting in settings:
        points.append(
            evaluate_setting(model, windows, setting, args.batch_size, kv_dtype, kv_scales)
        )
        _print_point(points[-1])
    report = {
        "model": str(model_dir),
        "windows": list(windows.shape),
        "device": str(device),
        "dtype": args.dtype,
        "kv_cache_dtype": args.kv_cache_dtype,
        "kv_cache_scales": None if kv_scales is None else kv_scales.source,
        "quantization": args.quantization,
        "points": [_as_dict(point) for point in points],
    }
    print(markdown_table(points))
    _write_outputs(report, points, args, title=model_dir.name)
    return 0


def _as_dict(point: Any) -> dict[str, Any]:
    from dataclasses import asdict

    return asdict(point)


def _print_point(point: Any) -> None:
    histogram = " ".join(str(count) for count in point.depth_histogram)
    print(
        f"{point.label:<16} mean depth {point.mean_depth:5.3f}  perplexity {point.perplexity:9.4f}"
        f"  ({point.tokens} tokens)  exits per depth [{histogram}]",
        flush=True,
    )


def _write_outputs(
    report: dict[str, Any], points: list[Any], args: argparse.Namespace, title: str
) -> None:
    if args.output is not None:
        args.output.parent.mkdir(parents=True, exist_ok=True)
        args.output.write_text(json.dumps(report, indent=1) + "\n")
        print(f"wrote {args.output}")
    if args.plot is not None:
        from loopserve.eval.plot import plot_curve

        plot_curve(points, args.plot, title)
        print(f"wrote {args.plot}")


def _run_gsm8k(args: argparse.Namespace) -> int:
    from loopserve.eval.gsm8k import Decoding, build_report, protocol_fingerprint, score_problems
    from loopserve.eval.gsm8k_baseline import load_report
    from loopserve.eval.gsm8k_scoring import read_problems
    from loopserve.models.builtin import resolve_model_dir
    from loopserve.tokenizer import has_tokenizer

    baseline = None if args.baseline is None else load_report(args.baseline)
    problems = read_problems(args.data, args.limit)
    model_dir = resolve_model_dir(args.model)
    if not has_tokenizer(model_dir):  # before the weights load
        raise ValueError(f"{model_dir} has no tokenizer.json; gsm8k needs one")
    decoding = Decoding(
        max_tokens=args.max_tokens,
        exit_threshold=args.exit_threshold,
        min_loops=args.min_loops,
        max_loops=args.max_loops,
        engine=engine_options(args),
    )
    fingerprint = protocol_fingerprint(
        model_dir, args.data, len(problems), args.num_shots, decoding
    )
    generate = _llm_generate_fn(str(model_dir), decoding)
    results = score_problems(problems, generate, args.num_shots, args.batch_size, print)
    report = build_report(results, fingerprint)
    summary = report["summary"]
    print(
        f"accuracy {summary['accuracy']:.4f} ({summary['correct']}/{summary['problems']}), "
        f"answers extracted {summary['extracted']:.2%}, mean exit depth "
        f"{summary['mean_exit_depth']:.3f}"
    )
    if args.output is not None:
        args.output.parent.mkdir(parents=True, exist_ok=True)
        args.output.write_text(json.dumps(report, indent=1) + "\n")
        print(f"wrote {args.output}")
    return 0 if baseline is None else _check_baseline(report, baseline, args.max_drop)


def _check_baseline(report: dict[str, Any], baseline: dict[str, Any], max_drop: float) -> int:
    """Print the comparison with a stored run; 1 when accuracy fell by more than max_drop."""
    from loopserve.eval.gsm8k_baseline import compare

    comparison = compare(report, baseline, max_drop)
    for difference in comparison.protocol_differences:
        print(f"protocol differs: {difference}")
    print(
        f"baseline accuracy {comparison.baseline_accuracy:.4f}, now {comparison.accuracy:.4f} "
        f"(drop {comparison.drop:+.4f}, allowed {comparison.max_drop}); "
        f"newly wrong {comparison.newly_wrong[:20]}, newly right {comparison.newly_right[:20]}"
    )
    if not comparison.passed:
        print("FAILED: accuracy dropped by more than --max-drop", file=sys.stderr)
        return 1
    return 0


def _llm_generate_fn(model: str | None, decoding: Decoding) -> GenerateFn:
    """Greedy generation with `loopserve.LLM` under `decoding`, stopping at STOP_STRINGS."""
    from loopserve.entrypoints.llm import LLM
    from loopserve.eval.gsm8k import Completion
    from loopserve.eval.gsm8k_prompt import STOP_STRINGS
    from loopserve.sampling_params import SamplingParams

    llm = LLM(model, **decoding.engine)
    params = SamplingParams(
        max_tokens=decoding.max_tokens, temperature=0.0, stop=STOP_STRINGS,
        exit_threshold=decoding.exit_threshold, min_loops=decoding.min_loops,
        max_loops=decoding.max_loops,
    )  # fmt: skip

    def generate(prompts: list[str]) -> list[Completion]:
        sequences = [output.outputs[0] for output in llm.generate(prompts, params, use_tqdm=False)]
        return [
            Completion(out.text, len(out.token_ids), out.mean_exit_depth, out.finish_reason)
            for out in sequences
        ]

    return generate
