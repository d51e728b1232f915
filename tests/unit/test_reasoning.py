"""The reasoning splitter: tags dropped, reasoning before `</think>` and content after it, the
same split however the text is cut into pieces (inside a tag included), and where a reply starts."""

from __future__ import annotations

import itertools

import pytest

from loopserve.entrypoints.reasoning import (
    ReasoningSplitter,
    opens_reasoning,
    split_reasoning,
    splits_reasoning,
)

CASES = [  # (reply, starts in reasoning, reasoning, content)
    (
        "Let me think.\n</think>\n\nThe answer is 4.",
        True,
        "Let me think.\n",
        "\n\nThe answer is 4.",
    ),
    ("still thinking when max_tokens came", True, "still thinking when max_tokens came", ""),
    ("<think>hmm</think>42", False, "hmm", "42"),
    ("\n<think>hmm</think>42", False, "hmm", "42"),
    ("Plain answer, no tags.", False, None, "Plain answer, no tags."),
    (
        "An answer that mentions <think> later.",
        False,
        None,
        "An answer that mentions <think> later.",
    ),
    ("a </thin> that is no tag</think>done", True, "a </thin> that is no tag", "done"),
    ("cut short </thi", True, "cut short </thi", ""),
    ("<thi", False, None, "<thi"),
]


@pytest.mark.parametrize(("text", "in_reasoning", "reasoning", "content"), CASES)
def test_a_whole_reply_splits(
    text: str, in_reasoning: bool, reasoning: str | None, content: str
) -> None:
    assert split_reasoning(text, in_reasoning) == (reasoning, content)


@pytest.mark.parametrize(("text", "in_reasoning", "reasoning", "content"), CASES)
def test_every_cut_of_a_stream_splits_as_the_whole(
    text: str, in_reasoning: bool, reasoning: str | None, content: str
) -> None:
    for cuts in [(i,) for i in range(len(text) + 1)] + [tuple(range(0, len(text), 3))]:
        splitter = ReasoningSplitter(in_reasoning)
        bounds = [0, *cuts, len(text)]
        pieces = [splitter.feed(text[a:b]) for a, b in itertools.pairwise(bounds)]
        pieces.append(splitter.finish())
        got_reasoning = "".join(piece[0] for piece in pieces)
        got_content = "".join(piece[1] for piece in pieces)
        assert (got_reasoning if splitter.reasoned else None, got_content) == (
            reasoning,
            content,
        ), cuts


def test_where_a_reply_starts_and_which_parser_runs() -> None:
    assert opens_reasoning("<|im_start|>assistant\n<think>\n")
    assert not opens_reasoning("<|im_start|>assistant\n<think>\n\n</think>\n\n")  # thinking off
    assert not opens_reasoning("<|im_start|>assistant\n")
    assert splits_reasoning("auto", "... {{ '<think>' }} ...")
    assert not splits_reasoning("auto", "no tags here") and not splits_reasoning("auto", None)
    assert splits_reasoning("deepseek_r1", None) and not splits_reasoning("none", "<think>")
    with pytest.raises(ValueError, match=r"\(--reasoning-parser\) must be one of"):
        splits_reasoning("qwen9", None)
