"""The checkpoint's sampling defaults (generation_config.json), checked once when an engine starts.

Owns: `checked_sampling_defaults`. Must not: read files (`models.generation_config` does).
"""

from __future__ import annotations

import logging

from loopserve.models.generation_config import GenerationDefaults, SamplingDefaults
from loopserve.models.model_config import ConfigError
from loopserve.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


def checked_sampling_defaults(generation: GenerationDefaults, use: bool) -> SamplingDefaults:
    """The checkpoint's sampling defaults, checked once as `SamplingParams` would check them, and
    logged; none unless `use` (`generation_config="none"` turns them off)."""
    if not use:
        return SamplingDefaults()
    defaults = generation.sampling
    try:
        SamplingParams(**defaults.overrides())
    except ValueError as error:
        raise ConfigError(f"generation_config.json: {error}") from None
    if defaults.overrides():
        logger.info(
            "sampling defaults from generation_config.json (for fields a request leaves unset; "
            "--generation-config none turns them off): %s",
            defaults.overrides(),
        )
    if defaults.repetition_penalty not in (None, 1.0):
        logger.warning(
            "generation_config.json sets repetition_penalty %s, which loopserve does not "
            "implement: requests run without it",
            defaults.repetition_penalty,
        )
    return defaults
