"""Reasoning apart from the answer: `<think>…</think>` output split into reasoning and content.

Owns: which parser a server runs (`auto`: `deepseek_r1` when the chat template writes `<think>`,
else `none`), where a reply starts (inside the reasoning when the rendered prompt leaves a
`<think>` open, as templates with thinking on do; otherwise in the content, where a reply that
itself opens with `<think>` enters the reasoning), and `ReasoningSplitter`, which splits text as it
streams: the tags are dropped, everything before `</think>` is reasoning and everything after it
content, and text that may be the start of a tag is held back until it is known not to be, so a
stream cut inside a tag splits exactly as the whole text does. Must not: import torch or know
about requests (the chat writer and `LLM.chat` feed it text).
"""

from __future__ import annotations

import dataclasses

from loopserve.structured_outputs import StructuredOutputsParams

START, END = "<think>", "</think>"
# `--reasoning-parser` values.
PARSERS = ("auto", "deepseek_r1", "none")


def splits_reasoning(parser: str, chat_template: str | None) -> bool:
    """Whether replies are split, for a parser name and the chat template's source."""
    return parser_runs("reasoning_parser", parser, PARSERS, START, chat_template)


def parser_runs(
    setting: str, parser: str, choices: tuple[str, ...], tag: str, chat_template: str | None
) -> bool:
    """Whether a reply parser runs: `choices` are ("auto", the parser, "none"); `auto` runs it
    when the chat template writes `tag`. The tool-call parser follows the same rule."""
    if parser not in choices:
        flag = "--" + setting.replace("_", "-")
        raise ValueError(f"{setting} ({flag}) must be one of {', '.join(choices)}, got {parser!r}")
    if parser == "auto":
        return chat_template is not None and tag in chat_template
    return parser != "none"


def opens_reasoning(prompt: str) -> bool:
    """Whether a reply to `prompt` starts inside the reasoning: its last `<think>` is not closed."""
    return prompt.rfind(START) > prompt.rfind(END)


def after_reasoning(
    constraint: StructuredOutputsParams | None, in_reasoning: bool | None
) -> StructuredOutputsParams | None:
    """A reply that starts inside the reasoning is free until `</think>`, then constrained (the
    engine refuses, saying so, where `</think>` is not one token of the vocabulary)."""
    if constraint is None or not in_reasoning or constraint.begin_after is not None:
        return constraint
    return dataclasses.replace(constraint, begin_after=END)


def split_reasoning(text: str, in_reasoning: bool) -> tuple[str | None, str]:
    """(reasoning or None when there is none, content) of a whole reply."""
    splitter = ReasoningSplitter(in_reasoning)
    reasoning, content = splitter.feed(text)
    tail_reasoning, tail_content = splitter.finish()
    reasoning += tail_reasoning
    return (reasoning if splitter.reasoned else None), content + tail_content


class ReasoningSplitter:
    """Splits one reply's text, fed in pieces, into (reasoning, content) pieces."""

    def __init__(self, in_reasoning: bool) -> None:
        self._in_reasoning = in_reasoning
        # In the content before any of it was released: a leading `<think>` may still come.
        self._may_open = not in_reasoning
        self._held = ""  # text not yet released: it may be the start of a tag
        self.reasoned = in_reasoning  # the reply had a reasoning part

    def feed(self, text: str) -> tuple[str, str]:
        """The reasoning and content that `text` (the next piece) releases."""
        pending, self._held = self._held + text, ""
        reasoning = content = ""
        if self._may_open:
            stripped = pending.lstrip()
            if START.startswith(stripped):  # all of it may still be the start of `<think>`
                self._held = pending
                return "", ""
            self._may_open = False
            if stripped.startswith(START):
                self._in_reasoning = self.reasoned = True
                pending = stripped[len(START) :]
        if self._in_reasoning:
            end = pending.find(END)
            if end == -1:
                keep = partial_tag(pending, END)
                self._held = pending[len(pending) - keep :]
                return pending[: len(pending) - keep], ""
            reasoning, pending = pending[:end], pending[end + len(END) :]
            self._in_reasoning = False
        content = pending
        return reasoning, content

    def finish(self) -> tuple[str, str]:
        """What was held back, at the end of the reply (a tag never completed is text)."""
        held, self._held = self._held, ""
        return (held, "") if self._in_reasoning else ("", held)


def partial_tag(text: str, tag: str) -> int:
    """The length of the longest end of `text` that is a proper start of `tag` (what a streaming
    parser holds back; the tool-call parser uses it too)."""
    for length in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:length]):
            return length
    return 0
