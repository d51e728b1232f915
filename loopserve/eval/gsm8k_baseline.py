"""Comparing a GSM8K run with a stored baseline run.

Owns: the regression rule (fail when accuracy drops by more than `max_drop`, absolute), the
refusal to compare runs on different data, and listing every protocol difference (values compared
as JSON stores them) so that a change in accuracy can be traced to a change in model, prompt,
decoding or versions. Must not: run anything.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

# Fingerprint fields that say where things were, not what they were.
_INFORMATIVE = frozenset({"model.path", "data.path"})


@dataclass(frozen=True, slots=True)
class Comparison:
    baseline_accuracy: float
    accuracy: float
    max_drop: float
    newly_wrong: list[int]  # problem indexes right in the baseline, wrong now
    newly_right: list[int]
    protocol_differences: list[str]  # "decoding.max_tokens: 256 -> 128"

    @property
    def drop(self) -> float:
        return self.baseline_accuracy - self.accuracy

    @property
    def passed(self) -> bool:
        return self.drop <= self.max_drop + 1e-12


def load_report(path: Path) -> dict[str, Any]:
    if not path.is_file():
        raise FileNotFoundError(f"baseline {path}: no such file")
    try:
        report = json.loads(path.read_text())
    except json.JSONDecodeError as error:
        raise ValueError(f"baseline {path}: not valid JSON ({error})") from None
    if not isinstance(report, dict) or not {"fingerprint", "summary", "questions"} <= report.keys():
        raise ValueError(f"baseline {path}: not a `loopserve eval gsm8k` report")
    return report


def _as_stored(value: Any) -> Any:
    """`value` as it reads back from a report file (tuples become lists, keys strings)."""
    return json.loads(json.dumps(value))


def _flatten(value: Any, prefix: str = "") -> dict[str, Any]:
    if not isinstance(value, dict):
        return {prefix: value}
    flat: dict[str, Any] = {}
    for key, item in value.items():
        flat.update(_flatten(item, f"{prefix}.{key}" if prefix else key))
    return flat


def protocol_differences(current: dict[str, Any], baseline: dict[str, Any]) -> list[str]:
    """Every field that differs, both sides as JSON stores them (a tuple of this run equals the
    baseline's list)."""
    now, before = _flatten(_as_stored(current)), _flatten(_as_stored(baseline))
    return [
        f"{key}: {before.get(key)!r} -> {now.get(key)!r}"
        for key in sorted(now.keys() | before.keys())
        if key not in _INFORMATIVE and now.get(key) != before.get(key)
    ]


def compare(report: dict[str, Any], baseline: dict[str, Any], max_drop: float) -> Comparison:
    """Compare two reports on the same problems; raises ValueError if the data differ."""
    data_now, data_before = report["fingerprint"]["data"], baseline["fingerprint"]["data"]
    if (data_now["sha256"], data_now["problems"]) != (
        data_before["sha256"],
        data_before["problems"],
    ):
        raise ValueError(
            "the baseline ran on different problems (data file hash or --limit differ); "
            "accuracies are not comparable"
        )
    before = {result["index"]: result["correct"] for result in baseline["questions"]}
    now = {result["index"]: result["correct"] for result in report["questions"]}
    return Comparison(
        baseline_accuracy=baseline["summary"]["accuracy"],
        accuracy=report["summary"]["accuracy"],
        max_drop=max_drop,
        newly_wrong=sorted(
            index for index, right in now.items() if before.get(index) and not right
        ),
        newly_right=sorted(
            index for index, right in now.items() if right and not before.get(index)
        ),
        protocol_differences=protocol_differences(report["fingerprint"], baseline["fingerprint"]),
    )
