"""The corpus split: by file, stable, and independent of which subset of files is used."""

from __future__ import annotations

from pathlib import Path

import pytest

from loopserve.data.corpus import (
    default_root,
    fingerprint,
    is_held_out,
    list_files,
    load_split,
)


def _write(root: Path, name: str, text: str) -> None:
    path = root / name
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


@pytest.fixture
def corpus_root(tmp_path: Path) -> Path:
    for index in range(200):
        _write(tmp_path, f"package{index % 7}/module_{index}.py", f"VALUE = {index}\n")
    _write(tmp_path, "site-packages/foreign.py", "x = 1\n")
    _write(tmp_path, "test/test_thing.py", "x = 1\n")
    _write(tmp_path, "encodings/cp999.py", '""" Python Character Mapping Codec cp999\n"""\n')
    _write(tmp_path, "_sysconfigdata__linux.py", "build = {}\n")
    _write(tmp_path, "README.txt", "not python\n")
    return tmp_path


def test_lists_python_sources_only(corpus_root: Path) -> None:
    names = list_files(corpus_root)
    assert len(names) == 201  # 200 modules + the codec table (skipped later, by content)
    assert not any(name.startswith(("site-packages", "test/", "_sysconfigdata")) for name in names)
    assert names == sorted(names)


def test_split_is_by_file_and_skips_generated_tables(corpus_root: Path) -> None:
    split = load_split(corpus_root, held_out_fraction=0.2)
    train = {file.relative_path for file in split.train}
    held_out = {file.relative_path for file in split.held_out}
    assert not train & held_out
    assert len(train) + len(held_out) == 200
    assert "encodings/cp999.py" not in train | held_out
    assert 20 <= len(held_out) <= 60  # about 20 % of 200
    assert all(is_held_out(name, 0.2) for name in held_out)


def test_subset_keeps_each_files_side(corpus_root: Path) -> None:
    full = load_split(corpus_root, held_out_fraction=0.2)
    subset = load_split(corpus_root, held_out_fraction=0.2, max_files=80)
    full_held_out = {file.relative_path for file in full.held_out}
    subset_names = [file.relative_path for file in subset.train + subset.held_out]
    assert len(subset_names) <= 80
    for file in subset.held_out:
        assert file.relative_path in full_held_out
    for file in subset.train:
        assert file.relative_path not in full_held_out
    # The subset is not biased towards held-out files (they would come first if it were).
    assert len(subset.held_out) < len(subset_names) / 2


def test_large_files_stay_in_training(corpus_root: Path) -> None:
    big = "x = 1\n" * 100
    for index in range(20):
        _write(corpus_root, f"big/module_{index}.py", big)
    split = load_split(corpus_root, held_out_fraction=0.5, max_held_out_chars=len(big) - 1)
    assert not any(file.relative_path.startswith("big/") for file in split.held_out)


def test_fingerprint_sees_content(corpus_root: Path) -> None:
    def everything() -> dict[str, object]:
        split = load_split(corpus_root, 0.2)
        return fingerprint(split.train + split.held_out)

    before = everything()
    assert everything() == before
    _write(corpus_root, "package0/module_0.py", "VALUE = 'changed'\n")
    after = everything()
    assert after["sha256"] != before["sha256"]
    assert after["files"] == before["files"]


def test_bad_arguments_are_clear(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="not a directory"):
        list_files(tmp_path / "missing")
    with pytest.raises(FileNotFoundError, match="no Python source"):
        list_files(tmp_path)
    with pytest.raises(ValueError, match="held_out_fraction"):
        load_split(tmp_path, held_out_fraction=1.5)


def test_the_stdlib_is_a_corpus() -> None:
    names = list_files(default_root())
    assert len(names) > 300
    assert "argparse.py" in names
