"""The flashinfer library itself: whether it is installed, whether it can build its kernels, and
importing it.

Owns: the only `import flashinfer` of the package, done on first use (about 3 s), and the tests
the backends' `environment_reasons` ask. Must not: import flashinfer at module import time.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import sys
from types import ModuleType

INSTALL_HINT = "pip install 'loopserve[flashinfer]'"


def flashinfer_installed() -> bool:
    if "flashinfer" in sys.modules:  # imported already (or a test's stand-in)
        return True
    return importlib.util.find_spec("flashinfer") is not None


def jit_compiler_found() -> bool:
    """Whether FlashInfer can build its kernels on first use: with nvcc, looked up as FlashInfer
    does (`CUDA_HOME` / `CUDA_PATH`, else `nvcc` on PATH, else /usr/local/cuda), or from the
    prebuilt `flashinfer-jit-cache` package."""
    if importlib.util.find_spec("flashinfer_jit_cache") is not None:
        return True
    home = os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH")
    if home is None:
        on_path = shutil.which("nvcc")
        if on_path is not None:
            return True
        home = "/usr/local/cuda"
    return os.path.exists(os.path.join(home, "bin", "nvcc"))


def import_flashinfer() -> ModuleType:
    """flashinfer, imported on first use (about 3 s)."""
    import flashinfer

    return flashinfer
