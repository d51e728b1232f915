"""Writing a trained tiny model as an HF-layout Ouro checkpoint directory.

Owns: the files of a trained checkpoint: config.json, generation_config.json, model.safetensors
(through `write_checkpoint`), tokenizer.json, chat_template.jinja and training_info.json (how it
was trained). Must
not: overwrite a non-empty directory unless asked to, or write anything the loader cannot read.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from tokenizers import Tokenizer

from loopserve.models.checkpoint_writer import write_checkpoint
from loopserve.models.loader import expected_tensors
from loopserve.models.ouro import OuroForCausalLM
from loopserve.train.tokenizer_training import save_chat_template, save_tokenizer

# The files this module writes; a directory holding only these may be overwritten.
CHECKPOINT_FILES = (
    "config.json",
    "generation_config.json",
    "model.safetensors",
    "tokenizer.json",
    "chat_template.jinja",
    "training_info.json",
)


def check_output_directory(directory: Path, overwrite: bool) -> None:
    """Refuse a non-empty output directory unless `overwrite` and it holds checkpoint files only."""
    if not directory.exists():
        return
    if not directory.is_dir():
        raise ValueError(f"{directory} exists and is not a directory")
    present = sorted(path.name for path in directory.iterdir())
    if not present:
        return
    if not overwrite:
        raise ValueError(f"{directory} is not empty; choose a new directory or pass --overwrite")
    foreign = [name for name in present if name not in CHECKPOINT_FILES]
    if foreign:
        raise ValueError(f"{directory} holds files that are not a tiny checkpoint's: {foreign}")


def export_checkpoint(
    model: OuroForCausalLM,
    tokenizer: Tokenizer,
    directory: Path,
    info: dict[str, Any],
    dtype: torch.dtype = torch.bfloat16,
) -> Path:
    """Write the model's weights in `dtype`, its tokenizer and `info`; returns the directory."""
    state = model.state_dict()
    tensors = {
        name: state[name].detach().to(device="cpu", dtype=dtype).contiguous()
        for name in expected_tensors(model.config)
    }
    write_checkpoint(directory, model.config, tensors)
    save_tokenizer(tokenizer, directory)
    save_chat_template(directory)
    (directory / "training_info.json").write_text(json.dumps(info, indent=1) + "\n")
    return directory
