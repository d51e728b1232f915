"""GSM8K: data, prompt, strict extraction, report, baseline comparison and the CLI (fixture)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from loopserve.entrypoints.cli import main
from loopserve.eval.gsm8k import (
    Completion,
    Decoding,
    build_report,
    protocol_fingerprint,
    score_problems,
)
from loopserve.eval.gsm8k_baseline import compare, load_report
from loopserve.eval.gsm8k_prompt import EXEMPLARS, build_prompt
from loopserve.eval.gsm8k_scoring import extract_strict, gold_answer, read_problems
from loopserve.models.builtin import BUILTIN_MODEL_DIR

FIXTURE = Path(__file__).parent / "fixtures" / "gsm8k_small.jsonl"


def test_reads_the_fixture() -> None:
    problems = read_problems(FIXTURE)
    assert [problem.gold for problem in problems] == ["27", "31", "48", "1350", "15", "48"]
    assert problems[1].question.startswith("Mia has 40 stickers")
    assert len(read_problems(FIXTURE, limit=2)) == 2


def test_bad_data_files_are_clear(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="no such file"):
        read_problems(tmp_path / "missing.jsonl")
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"question": "q", "answer": "no final number"}\n')
    with pytest.raises(ValueError, match="record 1 is not a GSM8K problem"):
        read_problems(bad)


@pytest.mark.parametrize(
    ("completion", "expected"),
    [
        (" 3 + 4 = 7. The answer is 7.", "7"),
        (" So 1,000 + 350 = 1,350. The answer is 1,350.", "1350"),
        (" The answer is -3. Later: The answer is 5.", "-3"),  # the first one counts
        (" The answer is $12.", None),  # strict: the number must follow directly
        (" 3 + 4 = 7. So 7 apples.", None),  # no fallback to the last number
        (" the answer is 7.", None),  # case matters, as in the exemplars
    ],
)
def test_strict_extraction(completion: str, expected: str | None) -> None:
    assert extract_strict(completion) == expected


def test_gold_answer() -> None:
    assert gold_answer("work...\n#### 1,234") == "1234"
    with pytest.raises(ValueError, match="####"):
        gold_answer("no marker 5")


def test_prompt_is_few_shot_chain_of_thought() -> None:
    prompt = build_prompt("  How many?  ", num_shots=8)
    assert prompt.count("Q: ") == 9 and prompt.count("The answer is") == 8
    assert prompt.endswith("Q: How many?\nA:")
    assert prompt.startswith(f"Q: {EXEMPLARS[0][0]}\nA: {EXEMPLARS[0][1]}\n\n")
    assert build_prompt("How many?", num_shots=0) == "Q: How many?\nA:"
    with pytest.raises(ValueError, match="num_shots"):
        build_prompt("q", num_shots=9)


def _fake_generate(answers: dict[str, str]):  # type: ignore[no-untyped-def]
    """Answers by the question in the last Q: line of each prompt."""

    def generate(prompts: list[str]) -> list[Completion]:
        completions = []
        for prompt in prompts:
            question = prompt.rsplit("Q: ", 1)[1].removesuffix("\nA:")
            completions.append(
                Completion(answers.get(question, " I do not know."), 10, 2.5, "stop")
            )
        return completions

    return generate


def _report(tmp_path: Path, right: int) -> dict:
    problems = read_problems(FIXTURE)
    answers = {p.question: f" The answer is {p.gold}." for p in problems[:right]}
    results = score_problems(problems, _fake_generate(answers), num_shots=8, batch_size=4)
    model = tmp_path / "model"
    model.mkdir(exist_ok=True)
    (model / "config.json").write_text("{}")
    fingerprint = protocol_fingerprint(model, FIXTURE, len(problems), 8, Decoding(max_tokens=64))
    return build_report(results, fingerprint)


def test_report_scores_and_fingerprints(tmp_path: Path) -> None:
    report = _report(tmp_path, right=4)
    summary = report["summary"]
    assert (summary["correct"], summary["problems"]) == (4, 6)
    assert summary["accuracy"] == pytest.approx(4 / 6)
    assert summary["extracted"] == pytest.approx(4 / 6)
    assert summary["mean_exit_depth"] == pytest.approx(2.5)
    assert [q["correct"] for q in report["questions"]] == [True] * 4 + [False] * 2
    fingerprint = report["fingerprint"]
    assert set(fingerprint["model"]["files"]) == {"config.json"}
    assert len(fingerprint["data"]["sha256"]) == 64
    assert fingerprint["decoding"]["max_tokens"] == 64
    assert fingerprint["decoding"]["temperature"] == 0.0
    assert fingerprint["versions"]["torch"] is not None


def test_baseline_comparison(tmp_path: Path) -> None:
    baseline = _report(tmp_path, right=5)
    same = compare(_report(tmp_path, right=5), baseline, max_drop=0.0)
    assert same.passed and same.protocol_differences == []
    worse = compare(_report(tmp_path, right=4), baseline, max_drop=0.1)
    assert not worse.passed and worse.newly_wrong == [4]
    assert compare(_report(tmp_path, right=4), baseline, max_drop=0.2).passed
    changed = _report(tmp_path, right=5)
    changed["fingerprint"]["decoding"]["max_tokens"] = 128
    assert compare(changed, baseline, 0.0).protocol_differences == [
        "decoding.max_tokens: 64 -> 128"
    ]
    other_data = _report(tmp_path, right=5)
    other_data["fingerprint"]["data"]["sha256"] = "0" * 64
    with pytest.raises(ValueError, match="different problems"):
        compare(other_data, baseline, 0.0)
    with pytest.raises(ValueError, match="not a `loopserve eval gsm8k` report"):
        (tmp_path / "x.json").write_text("[]")
        load_report(tmp_path / "x.json")


def test_cli_with_the_builtin_model_and_a_baseline(tmp_path: Path) -> None:
    first = tmp_path / "run.json"
    argv = ["eval", "gsm8k", str(FIXTURE), "--limit", "2", "--num-shots", "1", "--max-tokens", "6"]
    assert main([*argv, "--output", str(first)]) == 0
    report = json.loads(first.read_text())
    assert report["summary"]["problems"] == 2
    assert len(report["questions"]) == 2
    files = report["fingerprint"]["model"]["files"]
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= set(files)
    assert report["fingerprint"]["model"]["path"] == str(BUILTIN_MODEL_DIR)
    assert all(1 <= q["mean_exit_depth"] <= 4 for q in report["questions"])
    # The same run against itself passes; against a perfect baseline it fails.
    assert main([*argv, "--baseline", str(first)]) == 0
    perfect = dict(report, summary=dict(report["summary"], accuracy=1.0))
    (tmp_path / "perfect.json").write_text(json.dumps(perfect))
    assert main([*argv, "--baseline", str(tmp_path / "perfect.json")]) == 1
