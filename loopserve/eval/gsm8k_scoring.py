"""GSM8K answers: reading the data file, the gold number, and strict extraction of the model's.

Owns: the JSONL record format ({"question": ..., "answer": "... #### 72"}), the strict-match rule
("The answer is N" as the exemplars end, first occurrence only, no fallback to other numbers)
and the normalisation both sides get before exact string comparison. Must not: generate.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path

# The lm-evaluation-harness `strict-match` pattern of gsm8k-cot.
STRICT_PATTERN = re.compile(r"The answer is (-?[0-9.,]+)")
_GOLD_SEPARATOR = "####"


@dataclass(frozen=True, slots=True)
class Problem:
    index: int  # 0-based line number among the file's non-empty lines
    question: str
    gold: str  # normalised final number of the reference answer


def normalize_number(text: str) -> str:
    """Remove thousands separators, a dollar sign and a trailing full stop: '1,000.' -> '1000'."""
    return text.replace(",", "").replace("$", "").strip().rstrip(".")


def gold_answer(answer: str) -> str:
    """The number after '####' in a GSM8K reference answer."""
    if _GOLD_SEPARATOR not in answer:
        raise ValueError(f"reference answer has no '{_GOLD_SEPARATOR} <number>': {answer[-80:]!r}")
    return normalize_number(answer.rsplit(_GOLD_SEPARATOR, 1)[1])


def extract_strict(completion: str) -> str | None:
    """The normalised number of the first 'The answer is N' in the completion, else None."""
    match = STRICT_PATTERN.search(completion)
    return None if match is None else normalize_number(match.group(1))


def read_problems(path: Path, limit: int | None = None) -> list[Problem]:
    """Problems from a JSONL file with "question" and "answer" fields (GSM8K's own format)."""
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no such file (loopserve eval gsm8k reads a local JSONL)")
    problems: list[Problem] = []
    lines = [line for line in path.read_text().splitlines() if line.strip()]
    for number, line in enumerate(lines):
        try:
            record = json.loads(line)
            problems.append(
                Problem(number, str(record["question"]), gold_answer(str(record["answer"])))
            )
        except (json.JSONDecodeError, KeyError, TypeError, ValueError) as error:
            raise ValueError(
                f"{path}: record {number + 1} is not a GSM8K problem ({error})"
            ) from None
        if limit is not None and len(problems) == limit:
            break
    if not problems:
        raise ValueError(f"{path}: no problems")
    return problems
