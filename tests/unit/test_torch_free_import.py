"""The scheduling side must not import torch; `import loopserve` must not import optional extras."""

from __future__ import annotations

import subprocess
import sys

TORCH_FREE_MODULES = [
    "loopserve",
    "loopserve.request",
    "loopserve.sampling_params",
    "loopserve.outputs",
    "loopserve.config",
    "loopserve.engine.kv_manager",
    "loopserve.engine.scheduler",
    "loopserve.engine.scheduler_output",
    "loopserve.depth.trace",
    "loopserve.engine.detokenizer",
    "loopserve.models.ouro_config",
    "loopserve.models.builtin",
    "loopserve.models.generation_config",
    "loopserve.engine.end_of_sequence",
    "loopserve.structured_outputs",
    "loopserve.structured.grammar",
    "loopserve.engine.constraints",
]
OPTIONAL = ["torch", "triton", "flashinfer", "fastapi", "uvicorn", "matplotlib"]


def test_scheduling_modules_do_not_import_torch_or_extras() -> None:
    code = (
        "import importlib, sys\n"
        f"for name in {TORCH_FREE_MODULES!r}: importlib.import_module(name)\n"
        f"print(','.join(m for m in {OPTIONAL!r} if m in sys.modules))\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True
    )
    assert result.stdout.strip() == "", f"imported: {result.stdout.strip()}"


def test_the_check_itself_detects_torch() -> None:
    """Guard against a vacuous test: importing the runner does pull torch in."""
    code = "import sys, loopserve.runner.model_runner; print('torch' in sys.modules)"
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True
    )
    assert result.stdout.strip() == "True"
