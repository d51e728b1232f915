"""Protocol fingerprints: what an evaluation ran on, so that two runs can be compared honestly.

Owns: hashing files (model files, data) and recording package versions. Must not: import torch or
any optional package eagerly (versions are read from installed metadata).
"""

from __future__ import annotations

import hashlib
import platform
from importlib import metadata
from pathlib import Path
from typing import Any

# Packages whose versions can change an evaluation's numbers.
_PACKAGES = ("torch", "tokenizers", "safetensors", "numpy", "triton", "flashinfer-python")
_CHUNK = 1 << 20


def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        while chunk := handle.read(_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def text_sha256(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


def model_files(directory: Path) -> dict[str, str]:
    """sha256 of every file a checkpoint directory holds (weights, config, tokenizer), by name."""
    return {path.name: file_sha256(path) for path in sorted(directory.iterdir()) if path.is_file()}


def package_versions() -> dict[str, Any]:
    from loopserve import __version__

    versions: dict[str, Any] = {"python": platform.python_version(), "loopserve": __version__}
    for name in _PACKAGES:
        try:
            versions[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            versions[name] = None
    return versions
