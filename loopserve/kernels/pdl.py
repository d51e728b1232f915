"""Programmatic dependent launch (PDL, Hopper and later): a kernel launched with `launch_pdl`
may start while the kernel before it in the stream is still running, once every program of
that one has called `launch_dependents`; it must then `wait_for_inputs` before it reads anything
an earlier kernel wrote and before it writes anything at all.

Owns: the two in-kernel calls (each a no-op unless its `PDL` constexpr is set, so the CPU
interpreter, which has no grid dependency control, never traces them) and `pdl_supported`.
Must not: decide which launches use it (`models.ops.TritonOps` and the attention spec's
`dependent_launch_rows` do: fp8 decode rows through the GEMV, where every kernel of a layer is
one of ours; a kernel waiting on cuBLAS gains nothing, docs/latency.md).

What it buys: a decode loop at one row is ~180 short kernels, each paying a launch and a ramp.
A dependent starts during its predecessor's tail; the fp8 GEMV also loads its first weight tile
before it waits (weights never change while a step runs), so that tile streams in while the
norm or attention kernel before it finishes (docs/quantization.md, "Speed on the GPU").
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl


@triton.jit
def launch_dependents(PDL: tl.constexpr):
    """Let the next kernel, if launched as a dependent, start as soon as every program got here."""
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()


@triton.jit
def wait_for_inputs(PDL: tl.constexpr):
    """Wait until the kernels before this one have finished and their writes are visible."""
    if PDL:
        tl.extra.cuda.gdc_wait()


def pdl_supported(device: torch.device | str) -> bool:
    """Whether kernels on `device` can be launched as programmatic dependents: CUDA, SM90+, and
    a triton that has grid dependency control (`gdc_wait` and the `launch_pdl` option came
    together; older triton refuses the option, so `launch_options` passes it only when set)."""
    device = torch.device(device)
    return device.type == "cuda" and _triton_has_gdc() and _major(device.index) >= 9


def launch_options(pdl: bool) -> dict[str, bool]:
    """The launch keyword of a programmatic dependent, or none (what every triton accepts)."""
    return {"launch_pdl": True} if pdl else {}


def _triton_has_gdc() -> bool:
    cuda = getattr(tl.extra, "cuda", None)
    return cuda is not None and hasattr(cuda, "gdc_wait")


@functools.cache
def _major(index: int | None) -> int:
    return torch.cuda.get_device_capability(index)[0]
