"""What a checkpoint's generation_config.json adds to its config.json.

Owns: reading generation_config.json. Must not: import torch.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from loopserve.models.ouro_config import ConfigError


@dataclass(frozen=True, slots=True)
class GenerationDefaults:
    """Extra end-of-sequence ids."""

    eos_token_ids: tuple[int, ...] = ()


def read_generation_defaults(directory: Path) -> GenerationDefaults:
    path = directory / "generation_config.json"
    if not path.exists():
        return GenerationDefaults()
    try:
        raw = json.loads(path.read_text())
    except json.JSONDecodeError as error:
        raise ConfigError(f"{path}: not valid JSON ({error})") from None
    eos = raw.get("eos_token_id")
    eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,))
    return GenerationDefaults(eos_token_ids=tuple(int(token) for token in eos_ids))
