"""Compile every decode kernel variant for sm_90a without a GPU, and report what the compiler did.

Owns: a compile-only launch of `paged_decode_attention` (meta tensors; a stand-in CUDA driver that
reports sm_90; `JITFunction` launches turned into `warmup` compiles, so the arguments are
specialised exactly as a real launch would be) over the decode sweep's tilings and the shapes the
GPU tests use; per variant: registers, spill stack, shared memory, 16-byte `cp.async` (pipelined
loads), `bar.sync` and tensor-core instruction counts. Must not: be imported by the engine (it
swaps triton's active driver while it runs).

Usage: python -m benchmarks.decode_compile [--quick] [--json]
       PYTHONPATH=$PWD:.carry/triton-3.6 python -m benchmarks.decode_compile   (triton 3.6)
Exit status 1 if a variant fails to compile, spills more than MAX_SPILL bytes, or needs more
shared memory than sm_90 has.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import re
import subprocess
import sys
import tempfile
from collections.abc import Iterator

import torch

from loopserve.kernels.decode_plan import DecodeTiling
from loopserve.kv.metadata import AttentionMetadata

SHARED_MEMORY_SM90 = 227 * 1024
MAX_SPILL = 16  # bytes; a register or two saved around the loop (seen: 8 with triton 3.6) is fine
OURO = (16, 16, 128, torch.bfloat16)  # query heads, KV heads, head dim, dtype
Variant = tuple[str, tuple[int, int, int, torch.dtype], DecodeTiling]


@contextlib.contextmanager
def compile_only(compiled: list) -> Iterator[None]:
    """Kernel launches compile for sm_90 (no launch) and append (name, CompiledKernel)."""
    from triton.backends.compiler import GPUTarget
    from triton.runtime.driver import driver
    from triton.runtime.jit import JITFunction

    class Sm90Driver:  # what JITFunction.run asks of the active driver before a launch
        def get_current_device(self) -> int:
            return 0

        def get_current_stream(self, device: int | None = None) -> int:
            return 0

        def get_current_target(self) -> GPUTarget:
            return GPUTarget("cuda", 90, 32)

    def launcher(self, grid):
        def launch(*args, **kwargs):
            compiled.append((self.fn.__name__, self.run(*args, grid=grid, warmup=True, **kwargs)))

        return launch

    previous_driver, previous_getitem = driver._active, JITFunction.__getitem__
    driver.set_active(Sm90Driver())
    JITFunction.__getitem__ = launcher
    try:
        yield
    finally:
        JITFunction.__getitem__ = previous_getitem
        driver._active = previous_driver


def launch_decode(
    shape: tuple, tiling: DecodeTiling, splits: int, fused_write: bool, last: bool = False
) -> None:
    """`paged_decode_attention` on meta tensors of `shape` (32 rows, 8192-token tables)."""
    from loopserve.kernels.paged_decode import new_workspace, paged_decode_attention

    num_heads, num_kv_heads, head_dim, dtype = shape
    rows, block, pages = 32, 16, 512
    meta = torch.device("meta")

    def empty(*size: int, kind: torch.dtype = dtype) -> torch.Tensor:
        return torch.empty(*size, dtype=kind, device=meta)

    key_cache, value_cache = (
        empty(4096, block, num_kv_heads, head_dim),
        empty(4096, block, num_kv_heads, head_dim),
    )
    q, k, v = (
        empty(rows, num_heads, head_dim),
        empty(rows, num_kv_heads, head_dim),
        empty(rows, num_kv_heads, head_dim),
    )
    metadata = AttentionMetadata(
        empty(rows + 1, kind=torch.int32), empty(rows, kind=torch.int32),
        empty(rows, pages, kind=torch.int32), empty(rows, kind=torch.int64), 1, pages * block,
        None, None,
    )  # fmt: skip
    partitions = tiling.partitions_bound(pages * block)
    workspace = new_workspace(rows, num_heads, head_dim, partitions, meta)
    paged_decode_attention(
        q, key_cache, value_cache, metadata, empty(rows, num_heads, head_dim), workspace,
        scale=head_dim**-0.5, num_split_programs=splits, tiling=tiling,
        new_kv=(k, v) if fused_write else None, last_program_combines=last,
    )  # fmt: skip


def resources(kernel) -> dict[str, int]:
    """What the compiled kernel uses, from its cubin (cuobjdump) and PTX."""
    import triton

    tools = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as cubin:
        cubin.write(kernel.asm["cubin"])
        cubin.flush()
        command = [os.path.join(tools, "cuobjdump"), "--dump-resource-usage", cubin.name]
        usage = subprocess.run(command, capture_output=True, text=True, check=True).stdout
    found = re.search(r"REG:(\d+) STACK:(\d+) SHARED:(\d+)", usage)
    assert found is not None, usage
    ptx = kernel.asm["ptx"]
    return {
        "registers": int(found.group(1)),
        "spill_stack": int(found.group(2)),
        "shared": int(kernel.metadata.shared),
        "cp_async_16B": len(
            re.findall(
                r"cp\.async\.c[ag]\.shared\.global(?:\.L2::\w+)? \[[^]]*\], \[[^]]*\], 0x10", ptx
            )
        ),
        "bar_sync": len(re.findall(r"\bbar\.sync\b", ptx)),
        "mma": len(re.findall(r"\b(?:mma\.sync|wgmma\.mma_async)\b", ptx)),
    }


def variants(quick: bool) -> Iterator[Variant]:
    """The sweep's tilings at Ouro's shape, then each test shape's default tiling."""
    from benchmarks.decode_sweep import TILING_CANDIDATES

    for name, tiling in TILING_CANDIDATES.items():
        yield name, OURO, tiling
    if quick:
        return
    shapes = [(32, 8, 128, torch.bfloat16), (12, 2, 128, torch.bfloat16)]  # GQA 4 and 6
    shapes += [(8, 8, dim, torch.bfloat16) for dim in (32, 64, 80, 96, 256)]
    shapes += [(16, 16, 128, torch.float16), (16, 16, 128, torch.float32)]
    shapes += [
        (32, 8, 256, torch.bfloat16),
        (64, 4, 128, torch.bfloat16),
    ]  # dots at D 256, 16 heads
    for shape in shapes:
        group = shape[0] // shape[1]
        yield "default", shape, DecodeTiling.for_shape(group, shape[2])
    lanes = DecodeTiling(tensor_cores=False, heads_per_program=1, block_n=32)
    yield "lanes-n32 (GQA)", (32, 8, 128, torch.bfloat16), lanes


def check(quick: bool) -> list[dict]:
    """One record per compiled kernel: decode variants x {1, 2} splits x fused write or not, and
    2 splits with the last program combining."""
    records = []
    cases = [(1, True, False), (2, True, False), (1, False, False), (2, False, False)]
    cases.append((2, True, True))
    for name, shape, tiling in variants(quick):
        for splits, fused_write, last in cases:
            compiled: list = []
            record = {"variant": name, "shape": str(shape), "splits": splits}
            record |= {
                "fused_write": fused_write,
                "last_combines": last,
                **dataclasses.asdict(tiling),
            }
            try:
                with compile_only(compiled):
                    launch_decode(shape, tiling, splits, fused_write, last)
            except Exception as error:  # report every variant, then fail
                records.append(record | {"error": repr(error)[:300]})
                continue
            for kernel_name, kernel in compiled:
                records.append(record | {"kernel": kernel_name, **resources(kernel)})
    return records


def _problems(record: dict) -> list[str]:
    problems = [record["error"]] if "error" in record else []
    if record.get("spill_stack", 0) > MAX_SPILL:
        problems.append(f"{record['spill_stack']} bytes of spill stack")
    if record.get("shared", 0) > SHARED_MEMORY_SM90:
        problems.append(f"{record['shared']} bytes of shared memory")
    return problems


def _line(record: dict, problems: list[str]) -> str:
    keys = ("registers", "spill_stack", "shared", "cp_async_16B", "bar_sync", "mma")
    figures = " ".join(f"{key}={record.get(key)}" for key in keys)
    where = f"{record['variant']:22} {record['shape']:32} splits={record['splits']}"
    kernel = f"write={int(record['fused_write'])} last={int(record['last_combines'])}"
    kernel += f" {record.get('kernel', '-'):16}"
    return f"{where} {kernel} {figures} {'; '.join(problems)}"


def main(argv: list[str] | None = None) -> int:
    import triton

    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="only the sweep's tilings")
    parser.add_argument("--json", action="store_true", help="one JSON line per kernel")
    args = parser.parse_args(argv)
    records = check(args.quick)
    failed = 0
    for record in records:
        problems = _problems(record)
        failed += bool(problems)
        if args.json:
            print(json.dumps(record | {"triton": triton.__version__, "problems": problems}))
            continue
        print(_line(record, problems))
    print(f"triton {triton.__version__}, sm_90a: {len(records)} kernels, {failed} with problems")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
