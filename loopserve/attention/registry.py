"""Attention backends by name, and `auto` selection with logged reasons.

Owns: the name -> "module:Class" table and the selection rule. Must not: import a backend module
before it is asked about (optional dependencies stay lazy).
"""

from __future__ import annotations

import dataclasses
import importlib
import logging
from dataclasses import dataclass

from loopserve.attention.base import AttentionBackend, AttentionSpec

logger = logging.getLogger(__name__)

ATTENTION_BACKENDS: dict[str, str] = {
    "torch": "loopserve.attention.torch_backend:TorchAttentionBackend",
    "triton": "loopserve.attention.triton_backend:TritonAttentionBackend",
    "flashinfer_fa2": "loopserve.attention.flashinfer.fa2:FlashInferFA2Backend",
    "flashinfer_xqa": "loopserve.attention.flashinfer.xqa:FlashInferXQABackend",
}
# `auto` tries these in order and takes the first that can serve the spec. Where no measurement
# says otherwise, the Triton kernels come first (the FlashInfer backends then only stand in for
# them, say where triton is missing, ahead of the eager torch reference).
AUTO_ORDER: tuple[str, ...] = ("triton", "flashinfer_fa2", "flashinfer_xqa", "torch")
# Per compute-capability major, where measured. SM90: one H200, Ouro-1.4B, end to end
# (`scripts/gpu_backends_e2e.sh`, 512/128, A B B A, 2026-12-03): FA2 over Triton 0.82-0.84x at
# C=1, 0.75-0.91x at C=32, 0.97-1.03x (noise) at C=128 (Triton's prompt passes replay as CUDA
# graphs, FlashInfer's run eagerly); per layer the kernels are within a few percent from 8 rows up
# and Triton leads at one row (docs/kernels.md). Triton first; it also needs no JIT, serves fp32.
AUTO_ORDER_BY_ARCH: dict[int, tuple[str, ...]] = {
    9: ("triton", "flashinfer_fa2", "flashinfer_xqa", "torch"),
}


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


@dataclass(frozen=True, slots=True)
class BackendChoice:
    backend: type[AttentionBackend]
    cuda_graphs: bool  # the decode step may be captured (False: it runs eagerly)


def select_backend(name: str, spec: AttentionSpec) -> BackendChoice:
    """The backend for `name` ("auto" or a registered name), and whether graphs stay on.

    CUDA graphs are a preference: `auto` takes the first backend that can serve `spec` with
    graphs, else the first that can serve it eagerly; an explicit choice is used eagerly when it
    cannot be captured. Every reason is logged; a backend never falls back to another silently,
    and an explicit choice never falls back at all.
    """
    eager = dataclasses.replace(spec, cuda_graphs=False)
    if name != "auto":
        cls = backend_class(name)
        reasons = cls.unsupported_reasons(eager)
        if reasons:
            raise BackendUnavailableError(
                f"attention backend {name!r} cannot run here: " + "; ".join(reasons)
            )
        return _choice(cls, spec, [])
    rejected: list[str] = []
    for candidate_spec in [spec, eager] if spec.cuda_graphs else [spec]:
        for candidate in auto_order(spec):
            cls = backend_class(candidate)
            reasons = cls.unsupported_reasons(candidate_spec)
            if not reasons:
                return _choice(cls, spec, rejected)
            rejected.append(f"{candidate} skipped: {'; '.join(reasons)}")
    raise BackendUnavailableError("no attention backend can run here: " + " | ".join(rejected))


def auto_order(spec: AttentionSpec) -> tuple[str, ...]:
    """The order `auto` tries backends in for `spec`'s architecture."""
    if spec.device_type == "cuda" and spec.compute_capability is not None:
        return AUTO_ORDER_BY_ARCH.get(spec.compute_capability[0], AUTO_ORDER)
    return AUTO_ORDER


def _choice(cls: type[AttentionBackend], spec: AttentionSpec, rejected: list[str]) -> BackendChoice:
    for line in rejected:
        logger.info("attention backend %s", line)
    graphs = spec.cuda_graphs and cls.supports_cuda_graphs
    if spec.cuda_graphs and not graphs:
        logger.warning(
            "attention backend %s cannot be captured in CUDA graphs: the decode step runs "
            "eagerly (slower); install triton for graphs",
            cls.name,
        )
    logger.info("attention backend: %s (CUDA graphs %s)", cls.name, "on" if graphs else "off")
    return BackendChoice(cls, graphs)
