"""Where the built-in tiny model lives (shipped inside the package).

Owns: the path and the name of the default model (`ouro-tiny`, usable wherever a checkpoint
directory is: `LLM("ouro-tiny")`, `--model ouro-tiny`; a local directory of that name wins, as a
local path wins in Hugging Face). Must not: import torch.
"""

from __future__ import annotations

from pathlib import Path

BUILTIN_MODEL_NAME = "ouro-tiny"
BUILTIN_MODEL_DIR = Path(__file__).resolve().parent.parent / "assets" / BUILTIN_MODEL_NAME


def resolve_model_dir(model: str | None) -> Path:
    """The checkpoint directory for a user's `model` argument (None or "ouro-tiny": the built-in
    model, unless a local directory is called ouro-tiny)."""
    if model is None or (model == BUILTIN_MODEL_NAME and not Path(model).is_dir()):
        if not (BUILTIN_MODEL_DIR / "config.json").exists():
            raise FileNotFoundError(
                f"the built-in model is missing from {BUILTIN_MODEL_DIR}; reinstall loopserve "
                "or pass --model DIR"
            )
        return BUILTIN_MODEL_DIR
    path = Path(model).expanduser()
    if not path.is_dir():
        raise FileNotFoundError(
            f"model {model!r} is not a directory; pass a local HF checkpoint folder "
            f"(config.json + *.safetensors) or {BUILTIN_MODEL_NAME!r} (the built-in model); "
            "loopserve does not download models"
        )
    return path
