"""Where a benchmark number came from: the code version and the machine.

Owns: the git SHA (with a dirty flag) of the checkout, and a description of the device. Must not:
fail a benchmark because git or a GPU is missing; unknown values are reported as such.

The SHA comes from `LOOPSERVE_GIT_SHA` when set (a copy of the tree without `.git`, e.g. on a
lent GPU machine), else from `git` in the package's checkout.
"""

from __future__ import annotations

import os
import platform
import subprocess
from dataclasses import dataclass
from pathlib import Path

import torch

_REPO = Path(__file__).resolve().parents[2]


@dataclass(frozen=True, slots=True)
class Provenance:
    git_sha: str
    git_dirty: bool | None  # None when unknown
    device: str  # e.g. "cuda:0 NVIDIA H200 (sm_90)" or "cpu x86_64"
    torch_version: str
    cuda_version: str | None


def _git(*args: str) -> str | None:
    try:
        done = subprocess.run(
            ["git", *args], cwd=_REPO, capture_output=True, text=True, timeout=10, check=True
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return done.stdout.strip()


def describe(device: torch.device) -> Provenance:
    sha = os.environ.get("LOOPSERVE_GIT_SHA") or _git("rev-parse", "HEAD") or "unknown"
    status = None if "LOOPSERVE_GIT_SHA" in os.environ else _git("status", "--porcelain")
    if device.type == "cuda":
        major, minor = torch.cuda.get_device_capability(device)
        name = f"{device} {torch.cuda.get_device_name(device)} (sm_{major}{minor})"
    else:
        name = f"cpu {platform.machine()} ({torch.get_num_threads()} threads)"
    return Provenance(
        git_sha=sha,
        git_dirty=None if status is None else bool(status),
        device=name,
        torch_version=torch.__version__,
        cuda_version=torch.version.cuda,
    )
