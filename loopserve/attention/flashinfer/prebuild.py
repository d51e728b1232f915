"""Builds FlashInfer's JIT modules for a list of attention shapes ahead of time, in one ninja run
over every core, instead of one by one (14-25 s each) on first use.

Owns: the JIT specs each FlashInfer backend loads for an `AttentionSpec` (the same arguments
FlashInfer's wrappers derive, so the builds land in the cache they look in). Must not: matter for
correctness: a module missing here, or built under another name by another FlashInfer version, is
simply compiled on first use, as FlashInfer does anyway.

Usage (on the GPU machine, flashinfer importable):
  python -m loopserve.attention.flashinfer.prebuild --shape 16,16,128,bfloat16,16 ...
A shape is `heads,kv_heads,head_dim,dtype,block[,kv_dtype]` (kv_dtype: the cache's, such as
float8_e4m3fn; default dtype); every registered FlashInfer backend that can serve it on this GPU
gets its modules built (both FA2 decode kernels with --both-decode-kernels).
"""

from __future__ import annotations

import argparse
import logging
import sys
import time
from typing import Any

import torch

from loopserve.attention.base import AttentionSpec
from loopserve.attention.flashinfer.backend import FlashInferBackend
from loopserve.attention.flashinfer.fa2 import FlashInferFA2Backend, default_decode_kernel
from loopserve.attention.flashinfer.xqa import FlashInferXQABackend

logger = logging.getLogger(__name__)


def jit_specs(spec: AttentionSpec, both_decode_kernels: bool = False) -> dict[str, Any]:
    """{module name: JIT spec} of what the FlashInfer backends that can serve `spec` will load."""
    from flashinfer.jit.attention import modules
    from flashinfer.jit.xqa import gen_xqa_module

    dtype, dim = spec.dtype, spec.head_size
    # (q, kv, out, index dtypes, head dims, no position encoding, no window, no soft cap)
    common = (dtype, spec.cache_dtype, dtype, torch.int32, dim, dim, 0, False, False)
    found: list[Any] = []
    backends: list[type[FlashInferBackend]] = [FlashInferFA2Backend, FlashInferXQABackend]
    if any(not backend.unsupported_reasons(spec) for backend in backends):
        # Both backends prefill with the same kernel (`FlashInferBackend.prefill_kernel`).
        if FlashInferFA2Backend.prefill_kernel(spec) == "fa3":
            found.append(modules.gen_batch_prefill_module("fa3", *common, False))
        else:
            found.append(modules._gen_batch_prefill_primary_module("fa2", *common, False))
    if not FlashInferFA2Backend.unsupported_reasons(spec):
        kernels = {default_decode_kernel(spec)}
        if both_decode_kernels:
            kernels = {"cuda_core", "tensor_core"}
        if "cuda_core" in kernels:
            found.append(modules.gen_batch_decode_module(*common))
        if "tensor_core" in kernels:  # FA2's tensor-core decode runs its prefill module
            found.append(modules._gen_batch_prefill_primary_module("fa2", *common, False))
    if not FlashInferXQABackend.unsupported_reasons(spec):
        group = spec.num_heads // spec.num_kv_heads
        found.append(gen_xqa_module(dtype, dtype, spec.block_size, dim, group, False, dtype, 1))
    return {jit.name: jit for jit in found}


def prebuild(specs: list[AttentionSpec], both_decode_kernels: bool = False) -> list[str]:
    """Build every module the specs need (already built ones are skipped); their names."""
    from flashinfer.jit import build_jit_specs

    wanted: dict[str, Any] = {}
    for spec in specs:
        wanted |= jit_specs(spec, both_decode_kernels)
    pending = [jit for jit in wanted.values() if not jit.is_compiled]
    started = time.monotonic()
    if pending:
        build_jit_specs(pending, verbose=False)
    logger.info(
        "flashinfer prebuild: %d modules, %d compiled in %.0f s",
        len(wanted),
        len(pending),
        time.monotonic() - started,
    )
    return sorted(wanted)


def parse_shape(text: str, capability: tuple[int, int] | None) -> AttentionSpec:
    heads, kv_heads, dim, dtype, block, *kv_dtype = text.split(",")
    return AttentionSpec(
        device_type="cuda",
        compute_capability=capability,
        dtype=getattr(torch, dtype),
        head_size=int(dim),
        num_heads=int(heads),
        num_kv_heads=int(kv_heads),
        block_size=int(block),
        cuda_graphs=True,
        kv_dtype=getattr(torch, kv_dtype[0]) if kv_dtype else None,
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--shape", action="append", required=True, help="h,kv_h,dim,dtype,block[,kv_dtype]"
    )
    parser.add_argument("--both-decode-kernels", action="store_true")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    capability = torch.cuda.get_device_capability() if torch.cuda.is_available() else None
    specs = [parse_shape(shape, capability) for shape in args.shape]
    for name in prebuild(specs, args.both_decode_kernels):
        print(name)
    return 0


if __name__ == "__main__":
    sys.exit(main())
