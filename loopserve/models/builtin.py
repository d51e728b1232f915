"""Where the built-in tiny model lives (shipped inside the package).

Owns: the path of the default model. Must not: import torch.
"""

from __future__ import annotations

from pathlib import Path

BUILTIN_MODEL_DIR = Path(__file__).resolve().parent.parent / "assets" / "ouro-tiny"


def resolve_model_dir(model: str | None) -> Path:
    """The checkpoint directory for a user's `model` argument (None: the built-in model)."""
    if model is None:
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
            "(config.json + *.safetensors); loopserve does not download models"
        )
    return path
