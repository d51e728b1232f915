"""What a checkpoint's generation_config.json adds to its config.json: end-of-sequence ids and
sampling defaults.

Owns: reading generation_config.json and `SamplingDefaults`, the sampling fields it sets, in
`SamplingParams`' names. Must not: import torch, or decide when the defaults apply (the engine
and the server fill the fields a request leaves unset).

The sampling fields read are vLLM's: `temperature`, `top_p`, `top_k`, `min_p`, `max_new_tokens`
(-> `max_tokens`) and `repetition_penalty`, each only where the file sets it. As in vLLM,
`do_sample` is not read. loopserve does not implement `repetition_penalty`: it is reported (so the
engine can say so) and never applied.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from loopserve.models.model_config import ConfigError

GENERATION_CONFIG_FILE = "generation_config.json"

# generation_config.json name -> SamplingParams name, for the defaults that loopserve applies.
_SAMPLING_FIELDS = {
    "temperature": "temperature",
    "top_p": "top_p",
    "top_k": "top_k",
    "min_p": "min_p",
    "max_new_tokens": "max_tokens",
}


@dataclass(frozen=True, slots=True)
class SamplingDefaults:
    """The sampling fields a checkpoint's generation_config.json sets (None: not set)."""

    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    max_tokens: int | None = None  # HF `max_new_tokens`
    # Read to be reported: loopserve has no repetition penalty, so it is never applied.
    repetition_penalty: float | None = None

    def overrides(self) -> dict[str, Any]:
        """The fields that are set and that loopserve applies, as `SamplingParams` keywords."""
        return {
            item.name: getattr(self, item.name)
            for item in fields(self)
            if item.name != "repetition_penalty" and getattr(self, item.name) is not None
        }


@dataclass(frozen=True, slots=True)
class GenerationDefaults:
    """What generation_config.json says: extra end-of-sequence ids and sampling defaults."""

    eos_token_ids: tuple[int, ...] = ()
    sampling: SamplingDefaults = field(default_factory=SamplingDefaults)


def read_generation_defaults(directory: Path) -> GenerationDefaults:
    """The checkpoint's generation_config.json (empty defaults when it has none)."""
    path = directory / GENERATION_CONFIG_FILE
    if not path.exists():
        return GenerationDefaults()
    try:
        raw = json.loads(path.read_text())
    except json.JSONDecodeError as error:
        raise ConfigError(f"{path}: not valid JSON ({error})") from None
    if not isinstance(raw, dict):
        raise ConfigError(f"{path}: expected a JSON object")
    eos = raw.get("eos_token_id")
    eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,))
    try:
        sampling = _sampling_defaults(raw)
    except (TypeError, ValueError) as error:
        raise ConfigError(f"{path}: {error}") from None
    return GenerationDefaults(
        eos_token_ids=tuple(int(token) for token in eos_ids), sampling=sampling
    )


def _sampling_defaults(raw: dict[str, Any]) -> SamplingDefaults:
    values: dict[str, Any] = {}
    for hf_name, name in _SAMPLING_FIELDS.items():
        if raw.get(hf_name) is not None:
            values[name] = _number(raw[hf_name], hf_name, integer=name in ("top_k", "max_tokens"))
    if raw.get("repetition_penalty") is not None:
        values["repetition_penalty"] = _number(raw["repetition_penalty"], "repetition_penalty")
    return SamplingDefaults(**values)


def _number(value: Any, name: str, integer: bool = False) -> float | int:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"{name} must be a number, got {value!r}")
    if integer:
        if value != int(value):
            raise ValueError(f"{name} must be an integer, got {value!r}")
        return int(value)
    return float(value)
