"""`loopserve eval gsm8k`: few-shot chain-of-thought accuracy with a protocol fingerprint.

Owns: running the problems through a generate function in batches, scoring each with strict
extraction, and the report (per-question results, summary, fingerprint of model files, prompt,
decoding settings, data and package versions). Must not: download anything, or compare runs
(see `gsm8k_baseline`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from loopserve.eval.fingerprint import file_sha256, model_files, package_versions, text_sha256
from loopserve.eval.gsm8k_prompt import STOP_STRINGS, TEMPLATE, build_prompt, few_shot_prefix
from loopserve.eval.gsm8k_scoring import STRICT_PATTERN, Problem, extract_strict


@dataclass(frozen=True, slots=True)
class Decoding:
    """How answers are generated; every field is part of the protocol fingerprint."""

    # Longest answer in tokens.
    max_tokens: int = 256
    # Exit settings of every generated token (None: the checkpoint's default threshold and the
    # model's loop count).
    exit_threshold: float | None = None
    min_loops: int = 1
    max_loops: int | None = None
    # EngineConfig keyword arguments (device, dtype, kv_layout, exit_mode, seed, ...).
    engine: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class Completion:
    text: str
    num_tokens: int
    mean_exit_depth: float
    finish_reason: str | None


# A batch of prompts -> one greedy completion each, in order.
GenerateFn = Callable[[list[str]], list[Completion]]


def protocol_fingerprint(
    model_dir: Path, data_path: Path, num_problems: int, num_shots: int, decoding: Decoding
) -> dict[str, Any]:
    """Everything that decides the numbers of a run (paths are informative only)."""
    return {
        "model": {"path": str(model_dir), "files": model_files(model_dir)},
        "data": {
            "path": str(data_path),
            "sha256": file_sha256(data_path),
            "problems": num_problems,
        },
        "prompt": {
            "template": TEMPLATE,
            "num_shots": num_shots,
            "few_shot_sha256": text_sha256(few_shot_prefix(num_shots)),
            "stop": list(STOP_STRINGS),
        },
        "decoding": {"temperature": 0.0, **asdict(decoding)},
        "scoring": {"extraction": "strict", "pattern": STRICT_PATTERN.pattern},
        "versions": package_versions(),
    }


def score_problems(
    problems: list[Problem],
    generate: GenerateFn,
    num_shots: int,
    batch_size: int,
    progress: Callable[[str], None] | None = None,
) -> list[dict[str, Any]]:
    """One result per problem: the completion, the extracted number and whether it is right."""
    results: list[dict[str, Any]] = []
    for start in range(0, len(problems), batch_size):
        batch = problems[start : start + batch_size]
        completions = generate([build_prompt(problem.question, num_shots) for problem in batch])
        for problem, completion in zip(batch, completions, strict=True):
            extracted = extract_strict(completion.text)
            results.append(
                {
                    "index": problem.index,
                    "question": problem.question,
                    "gold": problem.gold,
                    "completion": completion.text,
                    "extracted": extracted,
                    "correct": extracted == problem.gold,
                    "num_tokens": completion.num_tokens,
                    "mean_exit_depth": completion.mean_exit_depth,
                    "finish_reason": completion.finish_reason,
                }
            )
        if progress is not None:
            correct = sum(result["correct"] for result in results)
            progress(f"{len(results)}/{len(problems)} answered, {correct} correct")
    return results


def summarize(results: list[dict[str, Any]]) -> dict[str, Any]:
    total = len(results)
    tokens = sum(result["num_tokens"] for result in results)
    depth_weight = sum(result["mean_exit_depth"] * result["num_tokens"] for result in results)
    return {
        "problems": total,
        "correct": sum(result["correct"] for result in results),
        "accuracy": sum(result["correct"] for result in results) / total,
        "extracted": sum(result["extracted"] is not None for result in results) / total,
        "mean_tokens": tokens / total,
        "mean_exit_depth": depth_weight / tokens if tokens else 0.0,
    }


def build_report(results: list[dict[str, Any]], fingerprint: dict[str, Any]) -> dict[str, Any]:
    return {"fingerprint": fingerprint, "summary": summarize(results), "questions": results}
