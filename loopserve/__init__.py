"""loopserve: inference and serving for looped language models (Ouro), with continuous depth
batching.

`import loopserve` stays light: `LLM` (which needs torch) is imported on first use, so the
torch-free scheduling modules can be imported without torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from loopserve.outputs import CompletionOutput, RequestOutput
from loopserve.sampling_params import SamplingParams

if TYPE_CHECKING:
    from loopserve.config import EngineConfig
    from loopserve.engine.engine import Engine
    from loopserve.entrypoints.llm import LLM

__all__ = [
    "LLM",
    "CompletionOutput",
    "Engine",
    "EngineConfig",
    "RequestOutput",
    "SamplingParams",
]
__version__ = "0.1.0"

_LAZY = {
    "LLM": "loopserve.entrypoints.llm",
    "Engine": "loopserve.engine.engine",
    "EngineConfig": "loopserve.config",
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'loopserve' has no attribute {name!r}")
