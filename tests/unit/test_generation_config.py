"""generation_config.json: eos ids and the sampling defaults it sets (read torch-free)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from loopserve.models.generation_config import SamplingDefaults, read_generation_defaults
from loopserve.models.model_config import ConfigError


def _read(tmp_path: Path, raw: object) -> object:
    (tmp_path / "generation_config.json").write_text(json.dumps(raw))
    return read_generation_defaults(tmp_path)


@pytest.mark.parametrize(
    ("hf_field", "value", "field", "expected"),
    [
        ("temperature", 0.6, "temperature", 0.6),
        ("top_p", 0.7, "top_p", 0.7),
        ("top_k", 20, "top_k", 20),
        ("min_p", 0.05, "min_p", 0.05),
        ("max_new_tokens", 1024, "max_tokens", 1024),
    ],
)
def test_each_sampling_default_is_read_under_its_sampling_params_name(
    tmp_path: Path, hf_field: str, value: float, field: str, expected: float
) -> None:
    defaults = _read(tmp_path, {"eos_token_id": [0, 2], hf_field: value})
    assert defaults.eos_token_ids == (0, 2)  # type: ignore[attr-defined]
    assert defaults.sampling.overrides() == {field: expected}  # type: ignore[attr-defined]


def test_repetition_penalty_is_read_but_never_applied(tmp_path: Path) -> None:
    defaults = _read(tmp_path, {"repetition_penalty": 1.1, "do_sample": True})
    assert defaults.sampling.repetition_penalty == 1.1  # type: ignore[attr-defined]
    assert defaults.sampling.overrides() == {}  # type: ignore[attr-defined]


def test_no_file_and_unset_fields_mean_no_defaults(tmp_path: Path) -> None:
    assert read_generation_defaults(tmp_path).sampling == SamplingDefaults()
    assert _read(tmp_path, {"eos_token_id": 0, "temperature": None}).sampling == SamplingDefaults()  # type: ignore[attr-defined]


@pytest.mark.parametrize(
    ("raw", "message"),
    [
        ({"temperature": "hot"}, "temperature must be a number"),
        ({"top_k": 2.5}, "integer"),
        ([], "object"),
    ],
)
def test_malformed_files_name_the_problem(tmp_path: Path, raw: object, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        _read(tmp_path, raw)
