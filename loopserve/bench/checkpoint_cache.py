"""The random-weight Ouro-1.4B checkpoint that GPU benchmarks run when no model is given.

Owns: where it is cached (`DEFAULT_CACHE_DIR`), writing it once (bf16, HF layout, through the same
writer as `loopserve make-checkpoint --preset ouro-1.4b`), and reporting progress while it does.
Must not: overwrite a finished checkpoint, or leave a half-written one where a later run would
find it (it writes beside the target and renames when done).
"""

from __future__ import annotations

import shutil
import sys
import time
from pathlib import Path

DEFAULT_CACHE_DIR = Path.home() / ".cache" / "loopserve" / "ouro-1.4b-random"
PRESET = "ouro-1.4b"
SEED = 0


def is_checkpoint(directory: Path) -> bool:
    return (directory / "config.json").is_file() and any(directory.glob("*.safetensors"))


def ensure_random_checkpoint(directory: Path = DEFAULT_CACHE_DIR) -> Path:
    """Return `directory`, writing the random Ouro-1.4B checkpoint there first if it is missing."""
    if is_checkpoint(directory):
        _say(f"using the cached random {PRESET} checkpoint in {directory}")
        return directory
    if directory.exists() and any(directory.iterdir()):
        raise ValueError(f"{directory} exists but holds no checkpoint; remove it or pass --model")
    import torch

    from loopserve.models.checkpoint_writer import random_state_dict, write_checkpoint
    from loopserve.models.families import preset_config

    config = preset_config(PRESET)
    partial = directory.with_name(f"{directory.name}.partial")
    shutil.rmtree(partial, ignore_errors=True)
    started = time.monotonic()
    _say(
        f"writing a random-weight {PRESET} checkpoint (bf16, seed {SEED}) to {directory}: "
        "drawing the weights on the CPU (about 10-60 s; done once per machine)"
    )
    tensors = random_state_dict(config, seed=SEED, dtype=torch.bfloat16)
    total = sum(tensor.numel() * tensor.element_size() for tensor in tensors.values())
    _say(f"  drew {total / 1e9:.2f} GB in {time.monotonic() - started:.0f} s; writing safetensors")
    write_checkpoint(partial, config, tensors)
    del tensors
    directory.parent.mkdir(parents=True, exist_ok=True)
    if directory.exists():
        directory.rmdir()  # empty (checked above)
    partial.rename(directory)
    _say(f"  checkpoint ready in {time.monotonic() - started:.0f} s")
    return directory


def _say(message: str) -> None:
    print(message, file=sys.stderr, flush=True)
