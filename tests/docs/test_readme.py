"""The README's examples are run, and what they print is what the README shows.

Two kinds of blocks are checked, everything else (GPU commands, real checkpoints, a running
server) is only shown:
- a ```console block: `$ command` lines (a trailing `\\` continues a command) each followed by
  the output the command prints on stdout;
- a ```python block followed directly by a ```text block: the program and what it prints.

`LOOPSERVE_UPDATE_README=1 python -m pytest tests/docs` rewrites the shown outputs from a run, so
the README is produced by this test and cannot drift from the code.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
UPDATE = os.environ.get("LOOPSERVE_UPDATE_README") == "1"
_FENCE = re.compile(r"^```(\w*)\n(.*?)^```\n", re.DOTALL | re.MULTILINE)
# `loopserve` as the installed script runs it, from this source tree whatever is installed.
_SHELL_PRELUDE = f'loopserve() {{ "{sys.executable}" -m loopserve.entrypoints.cli "$@"; }}\n'


@dataclass(frozen=True)
class Example:
    name: str
    kind: str  # "console" or "python"
    program: str  # the command(s) or the Python source
    shown: str  # the output the README shows
    span: tuple[int, int]  # where `shown` sits in the README's text


def examples(text: str) -> list[Example]:
    blocks = list(_FENCE.finditer(text))
    found = []
    for index, block in enumerate(blocks):
        kind, body = block.group(1), block.group(2)
        if kind == "console":
            found += _console_examples(body, block.start(2))
        elif kind == "python" and index + 1 < len(blocks):
            following = blocks[index + 1]
            between = text[block.end() : following.start()]
            if following.group(1) == "text" and not between.strip():
                name = f"python@{text.count(chr(10), 0, block.start()) + 1}"
                span = (following.start(2), following.end(2))
                found.append(Example(name, "python", body, following.group(2), span))
    return found


def _console_examples(body: str, offset: int) -> list[Example]:
    """Each `$ command` of a console block with the output lines that follow it."""
    found = []
    lines = body.splitlines(keepends=True)
    position, index = offset, 0
    while index < len(lines):
        if not lines[index].startswith("$ "):
            raise ValueError(
                f"console block at {offset}: output before a command: {lines[index]!r}"
            )
        command = [lines[index][2:]]
        position += len(lines[index])
        index += 1
        while command[-1].rstrip("\n").endswith("\\") and index < len(lines):
            command.append(lines[index])
            position += len(lines[index])
            index += 1
        start = position
        while index < len(lines) and not lines[index].startswith("$ "):
            position += len(lines[index])
            index += 1
        program = "".join(command)
        shown = body[start - offset : position - offset]
        found.append(Example(program.split()[1], "console", program, shown, (start, position)))
    return found


def run(example: Example) -> str:
    environment = os.environ | {"PYTHONPATH": str(ROOT)}
    if example.kind == "console":
        command = ["bash", "-c", _SHELL_PRELUDE + example.program]
    else:
        command = [sys.executable, "-c", example.program]
    result = subprocess.run(
        command, capture_output=True, text=True, timeout=600, env=environment, cwd=ROOT, check=False
    )
    assert result.returncode == 0, f"{example.program}\n{result.stderr}"
    return result.stdout


def _normalised(text: str) -> str:
    return "\n".join(line.rstrip() for line in text.strip("\n").splitlines())


def test_the_readme_has_checked_examples() -> None:
    kinds = [example.kind for example in examples(README.read_text())]
    assert kinds.count("console") >= 2 and kinds.count("python") >= 2


_COLLECTED = examples(README.read_text())


@pytest.mark.parametrize("index", range(len(_COLLECTED)), ids=[item.name for item in _COLLECTED])
def test_a_readme_example_prints_what_the_readme_shows(index: int) -> None:
    text = README.read_text()
    example = examples(text)[index]  # read now: an update run rewrites earlier examples first
    printed = run(example)
    if UPDATE:
        start, end = example.span
        README.write_text(text[:start] + printed + text[end:])
        pytest.skip("LOOPSERVE_UPDATE_README=1: the README now shows this run's output")
    assert _normalised(printed) == _normalised(example.shown)
