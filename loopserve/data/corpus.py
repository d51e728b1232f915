"""The training corpus: the Python standard library's source and documentation, split by file.

Owns: finding the corpus files under a root (by default the stdlib of the running interpreter,
which every machine has offline), the deterministic train/held-out split by file, reading the
text, and a fingerprint that says exactly which corpus a model saw. Must not: import torch or
tokenize (the tokenizer and the training data are built elsewhere from `CorpusFile`s).

The split depends only on each file's path relative to the root, so a file is held out on every
machine and every Python version that has it; the contents differ between Python versions, which
is why the fingerprint records the interpreter version and a hash of every file.
"""

from __future__ import annotations

import hashlib
import sys
import sysconfig
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

# Directories never read: installed packages, test suites (not shipped by every distribution),
# build configuration and bytecode caches.
_SKIPPED_DIRECTORIES = frozenset(
    {"site-packages", "dist-packages", "test", "tests", "idle_test", "__pycache__"}
)
# Generated files that are not source anyone wrote: build data, and codec tables (their
# docstring opens with this marker).
_SKIPPED_PREFIXES = ("_sysconfigdata", "config-")
_GENERATED_MARKER = '""" Python Character Mapping Codec'


@dataclass(frozen=True, slots=True)
class CorpusFile:
    relative_path: str  # POSIX path relative to the corpus root; decides the split
    text: str


@dataclass(frozen=True, slots=True)
class CorpusSplit:
    train: list[CorpusFile]
    held_out: list[CorpusFile]


def default_root() -> Path:
    """The standard library directory of the running interpreter."""
    return Path(sysconfig.get_paths()["stdlib"])


def _is_corpus_file(relative: Path) -> bool:
    if any(part in _SKIPPED_DIRECTORIES for part in relative.parts[:-1]):
        return False
    if any(part.startswith(_SKIPPED_PREFIXES) for part in relative.parts):
        return False
    return relative.suffix == ".py"


def list_files(root: Path) -> list[str]:
    """Relative POSIX paths of the corpus files under `root`, sorted."""
    if not root.is_dir():
        raise FileNotFoundError(f"corpus root {root} is not a directory")
    paths = (path.relative_to(root) for path in root.rglob("*.py") if path.is_file())
    found = sorted(path.as_posix() for path in paths if _is_corpus_file(path))
    if not found:
        raise FileNotFoundError(f"no Python source files under corpus root {root}")
    return found


def is_held_out(relative_path: str, held_out_fraction: float) -> bool:
    """A stable pseudo-random choice from the path alone (sha256 of it)."""
    digest = hashlib.sha256(relative_path.encode()).digest()
    bucket = int.from_bytes(digest[:8], "big") / 2**64  # uniform in [0, 1)
    return bucket < held_out_fraction


def read_text(path: Path) -> str:
    # A few stdlib files carry bytes that are not UTF-8; replace them rather than drop the file.
    text = path.read_text(encoding="utf-8", errors="replace")
    return text.replace("\r\n", "\n")


def load_split(
    root: Path | None = None,
    held_out_fraction: float = 0.05,
    max_files: int | None = None,
    max_held_out_chars: int = 200_000,
) -> CorpusSplit:
    """Read the corpus and split it by file.

    Args:
        root: corpus directory; None is the running interpreter's stdlib.
        held_out_fraction: expected fraction of files held out for evaluation.
        max_files: keep only this many files (a stable subset chosen by path hash), for quick runs.
        max_held_out_chars: larger files always go to training.
    """
    if not 0.0 < held_out_fraction < 1.0:
        raise ValueError(f"held_out_fraction must be in (0, 1), got {held_out_fraction}")
    root = default_root() if root is None else root
    names = list_files(root)
    if max_files is not None:
        names = sorted(sorted(names, key=_path_hash)[:max_files])
    train: list[CorpusFile] = []
    held_out: list[CorpusFile] = []
    for name in names:
        file = CorpusFile(name, read_text(root / name))
        if file.text.startswith(_GENERATED_MARKER):
            continue
        # One huge file (pydoc_data/topics.py, the language documentation) must not dominate
        # the evaluation, nor be missing from training.
        small = len(file.text) <= max_held_out_chars
        (held_out if small and is_held_out(name, held_out_fraction) else train).append(file)
    if not train or not held_out:
        raise ValueError(
            f"the split of {len(names)} corpus files left an empty side; use more files or "
            "another held_out_fraction"
        )
    return CorpusSplit(train=train, held_out=held_out)


def _path_hash(name: str) -> str:
    # Salted, so that the subset is independent of the held-out choice (which hashes the bare path).
    return hashlib.sha256(b"subset\0" + name.encode()).hexdigest()


def fingerprint(files: Iterable[CorpusFile]) -> dict[str, object]:
    """Which files, with which contents, on which interpreter: enough to tell two corpora apart."""
    digest = hashlib.sha256()
    count = characters = 0
    for file in files:
        digest.update(file.relative_path.encode() + b"\0" + file.text.encode() + b"\0")
        count += 1
        characters += len(file.text)
    return {
        "python_version": sys.version.split()[0],
        "files": count,
        "characters": characters,
        "sha256": digest.hexdigest(),
    }
