"""A GSM8K baseline read back from JSON matches the run that wrote it: protocol values are
compared as JSON stores them (the run's tuples are the file's lists), real changes still show."""

from __future__ import annotations

import json

from loopserve.eval.gsm8k_baseline import compare, protocol_differences


def _report(engine: dict[str, object]) -> dict[str, object]:
    return {
        "fingerprint": {
            "data": {"sha256": "a" * 64, "problems": 1},
            "decoding": {"max_tokens": 6, "engine": engine},
        },
        "summary": {"accuracy": 1.0},
        "questions": [{"index": 0, "correct": True}],
    }


def test_a_tuple_and_its_stored_list_are_the_same_protocol() -> None:
    run = _report({"exit_mode": "trace", "trace_distribution": (0.1, 0.4, 0.3, 0.2)})
    stored = json.loads(json.dumps(run))
    assert stored["fingerprint"]["decoding"]["engine"]["trace_distribution"] == [0.1, 0.4, 0.3, 0.2]
    comparison = compare(run, stored, max_drop=0.0)
    assert comparison.passed and comparison.protocol_differences == []


def test_a_changed_value_is_still_listed() -> None:
    run = _report({"trace_distribution": (0.1, 0.4, 0.3, 0.2)})
    stored = json.loads(json.dumps(_report({"trace_distribution": [0.25, 0.25, 0.25, 0.25]})))
    assert protocol_differences(run["fingerprint"], stored["fingerprint"]) == [  # type: ignore[arg-type]
        "decoding.engine.trace_distribution: [0.25, 0.25, 0.25, 0.25] -> [0.1, 0.4, 0.3, 0.2]"
    ]
