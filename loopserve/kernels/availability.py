"""Whether the Triton kernels can run in this environment, asked without importing triton.

Owns: `triton_installed`, the one test of that (the backends, the runner's setup and the sampler
ask it before they import a kernel module), `compiled_for`, whether a compiled kernel can take a
given tensor, and `interpreter_mode`, whether triton runs kernels in its CPU interpreter. Must
not: import triton or any kernel module.
"""

from __future__ import annotations

import importlib.util
import os
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch


def triton_installed() -> bool:
    """Whether `import triton` would find the package (cheap once triton is imported)."""
    return importlib.util.find_spec("triton") is not None


def compiled_for(tensor: torch.Tensor) -> bool:
    """Whether a compiled Triton kernel can run on `tensor`: it lives on a CUDA device and triton
    is installed (a CPU tensor takes the torch code, which the kernel is a twin of)."""
    return tensor.is_cuda and triton_installed()


def interpreter_mode() -> bool:
    """True when triton is told to interpret kernels on the CPU (the kernel tests' mode; triton
    reads it when a kernel is defined, so it must be set before the kernel modules import)."""
    return os.environ.get("TRITON_INTERPRET") == "1"
