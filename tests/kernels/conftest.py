"""Kernel tests run compiled on a CUDA GPU, or in triton's CPU interpreter where there is none.

Triton decides between compiler and interpreter when a kernel is *defined*, so TRITON_INTERPRET=1
must be set before the kernel modules are imported: this conftest sets it while this directory is
collected (the test modules import the kernels at the top) and while each of its tests runs. It
restores the previous value after collection, so tests of other directories, which expect `auto`
to choose the torch backend on a CPU, never see it. With a GPU it is never set. The workbench's
kernel tests (benchmarks/tests) run under the same rules: their conftest imports this one's.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from tests.kernels import interpreter_patching

ON_GPU = torch.cuda.is_available()
# The folders whose GPU-marked tests are skipped (not run in the interpreter) without a GPU.
KERNEL_TEST_DIRS = (Path(__file__).parent, Path(__file__).parents[2] / "benchmarks" / "tests")
_PREVIOUS = os.environ.get("TRITON_INTERPRET")
if not ON_GPU:
    os.environ["TRITON_INTERPRET"] = "1"
    # The interpreter without its repeated, idempotent re-patching of triton.language on every
    # helper call (the module says why that changes nothing; a sixth of these tests' time).
    interpreter_patching.install()


def pytest_collection_finish(session: pytest.Session) -> None:
    if _PREVIOUS is None:
        os.environ.pop("TRITON_INTERPRET", None)
    else:
        os.environ["TRITON_INTERPRET"] = _PREVIOUS


@pytest.fixture(autouse=True)
def interpreter_while_testing(monkeypatch: pytest.MonkeyPatch) -> None:
    if not ON_GPU:
        monkeypatch.setenv("TRITON_INTERPRET", "1")


@pytest.fixture
def device() -> torch.device:
    return torch.device("cuda" if ON_GPU else "cpu")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    skip = pytest.mark.skip(reason="needs a CUDA GPU (realistic sizes are too slow to interpret)")
    for item in items:
        if "gpu" in item.keywords and not ON_GPU and item.path.parent in KERNEL_TEST_DIRS:
            item.add_marker(skip)
