"""Whether the Triton kernels can run in this environment, asked without importing triton.

Owns: `triton_installed`, the one test of that (the backends, the runner's setup and the sampler
ask it before they import a kernel module). Must not: import triton or any kernel module.
"""

from __future__ import annotations

import importlib.util


def triton_installed() -> bool:
    """Whether `import triton` would find the package (cheap once triton is imported)."""
    return importlib.util.find_spec("triton") is not None
