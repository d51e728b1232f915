"""Engine replicas on Ray Serve behind one OpenAI endpoint (the `ray` extra; docs/ray.md).

`build_app(engine_config, server_config, num_replicas=N)` returns a Serve application for users
composing their own; `loopserve serve --replicas N` runs one. Only `loopserve.ray.app` imports
Ray, and only when one of these is used: `import loopserve.ray.routing` (the policy) needs none.
"""

from __future__ import annotations

from importlib import import_module
from typing import Any

__all__ = ["build_app", "serve_replicas"]


def __getattr__(name: str) -> Any:
    if name in __all__:
        return getattr(import_module("loopserve.ray.app"), name)
    raise AttributeError(f"module 'loopserve.ray' has no attribute {name!r}")
