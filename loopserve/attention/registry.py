"""Attention backends by name, and `auto` selection with logged reasons.

Owns: the name -> "module:Class" table and the selection rule. Must not: import a backend module
before it is asked about (optional dependencies stay lazy).
"""

from __future__ import annotations

import importlib
import logging

from loopserve.attention.base import AttentionBackend, AttentionSpec

logger = logging.getLogger(__name__)

ATTENTION_BACKENDS: dict[str, str] = {
    "torch": "loopserve.attention.torch_backend:TorchAttentionBackend",
    "triton": "loopserve.attention.triton_backend:TritonAttentionBackend",
}
# `auto` tries these in order and takes the first that can serve the spec.
AUTO_ORDER: tuple[str, ...] = ("triton", "torch")


class BackendUnavailableError(ValueError):
    """The requested backend cannot serve this engine; the message lists why."""


def backend_class(name: str) -> type[AttentionBackend]:
    try:
        target = ATTENTION_BACKENDS[name]
    except KeyError:
        choices = ", ".join(["auto", *ATTENTION_BACKENDS])
        raise BackendUnavailableError(
            f"unknown attention backend {name!r}; choose one of {choices}"
        ) from None
    module_name, class_name = target.split(":")
    cls: type[AttentionBackend] = getattr(importlib.import_module(module_name), class_name)
    return cls


def select_backend(name: str, spec: AttentionSpec) -> type[AttentionBackend]:
    """The backend class for `name` ("auto" or a registered name); never falls back silently."""
    if name != "auto":
        cls = backend_class(name)
        reasons = cls.unsupported_reasons(spec)
        if reasons:
            raise BackendUnavailableError(
                f"attention backend {name!r} cannot run here: " + "; ".join(reasons)
            )
        return cls
    rejected: list[str] = []
    for candidate in AUTO_ORDER:
        cls = backend_class(candidate)
        reasons = cls.unsupported_reasons(spec)
        if not reasons:
            for line in rejected:
                logger.info("attention backend %s", line)
            logger.info("attention backend: auto chose %s", candidate)
            return cls
        rejected.append(f"{candidate} skipped: {'; '.join(reasons)}")
    raise BackendUnavailableError("no attention backend can run here: " + " | ".join(rejected))
