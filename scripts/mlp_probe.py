"""Probe (GPU): what a decode MLP costs at 1-64 rows when its matmuls are our own kernels, and
whether one persistent kernel (a grid barrier between gate/up and down) beats two launches.

Not part of the package and not the engine's kernels: 24 layers of Ouro-1.4B-shaped bf16
weights (hidden 2,048, inner 5,632; 1.66 GB, so the L2 holds none of it). Each variant is
captured in one CUDA graph over the 24 layers (`bench.graph_replay.replay_ms`):
- today's chain (at 1, 8, 32, 64 rows): cuBLAS gate/up (`F.linear`),
  `kernels/fused_ops.silu_mul`, cuBLAS down;
- `thin` (at 1, 8, 32, 64 rows): tensor-core kernels whose row bits cannot depend on the row
  count: rows padded to whole blocks of `bm` (a grid axis), each block the same dots; a
  gate/up program owns 16 gate and the matching 16 up columns, so SiLU*up is its epilogue
  (rounded as the chain rounds: each matmul output to bf16, SiLU to bf16, the product to
  bf16); the down projection's K is cut into `split` slices fixed by the shape, whose fp32
  partials the last program to arrive folds in slice order. Records whether row 0 has the
  bits it has alone;
- `two` (one row): a CUDA-core gate/up GEMV (BI gate rows and the matching up rows a program,
  SiLU*up as the epilogue), then a CUDA-core down GEMV (BN output rows a program);
- `persistent` (one row): the same GEMV blocks in one launch of `programs` programs (all
  resident), an arrival counter per layer (acq_rel atomics, then a spin) between them;
  PREFETCH loads the first down tile before the barrier.
Every record carries the largest difference to the chain's output over the chain's largest
magnitude (bf16 rounding of another summation order: ~0.005).

    python scripts/mlp_probe.py OUT.jsonl [thin,two,persistent]   (~30 s a part on an H200)

Figures and what they decided: docs/latency.md, "Our own MLP kernels at M = 1".
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import json
import sys
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from loopserve.bench.graph_replay import replay_ms
from loopserve.kernels.fused_ops import silu_mul

HIDDEN, INNER, LAYERS = 2048, 5632, 24
MAX_ROWS = 64  # the thin kernels pad every row count to this
ROW_COUNTS = (1, 8, 32, 64)


@triton.jit
def _gate_up_blocks(
    x_ptr, wgu_ptr, h_ptr, first, step, HIDDEN: tl.constexpr, INNER: tl.constexpr,
    BI: tl.constexpr, BK: tl.constexpr, STAGES: tl.constexpr,
):  # fmt: skip
    """Blocks first, first + step, ... of BI gate rows (and the same up rows): silu(g) * u."""
    rows = tl.arange(0, BI)
    ks = tl.arange(0, BK)
    for block in range(first, INNER // BI, step):
        j = block * BI + rows
        acc_gate = tl.zeros([BI], tl.float32)
        acc_up = tl.zeros([BI], tl.float32)
        for k0 in tl.range(0, HIDDEN, BK, num_stages=STAGES):
            xk = tl.load(x_ptr + k0 + ks).to(tl.float32)
            gate = tl.load(wgu_ptr + j[:, None] * HIDDEN + k0 + ks[None, :])
            up = tl.load(wgu_ptr + (j[:, None] + INNER) * HIDDEN + k0 + ks[None, :])
            acc_gate += tl.sum(gate.to(tl.float32) * xk[None, :], 1)
            acc_up += tl.sum(up.to(tl.float32) * xk[None, :], 1)
        gate = acc_gate.to(tl.bfloat16).to(tl.float32)
        up = acc_up.to(tl.bfloat16).to(tl.float32)
        activated = (gate / (1.0 + tl.exp(-gate))).to(tl.bfloat16).to(tl.float32)
        tl.store(h_ptr + j, (activated * up).to(tl.bfloat16))


@triton.jit
def _down_block(
    h_ptr, wd_ptr, y_ptr, block, acc, start, HIDDEN: tl.constexpr, INNER: tl.constexpr,
    BN: tl.constexpr, BK2: tl.constexpr, STAGES: tl.constexpr, CACHE: tl.constexpr,
):  # fmt: skip
    """Output rows block * BN + [0, BN) from column `start` on, added to `acc`; stored."""
    n = block * BN + tl.arange(0, BN)
    ks = tl.arange(0, BK2)
    for k0 in tl.range(start, INNER, BK2, num_stages=STAGES):
        hk = tl.load(h_ptr + k0 + ks, cache_modifier=CACHE).to(tl.float32)
        w = tl.load(wd_ptr + n[:, None] * INNER + k0 + ks[None, :])
        acc += tl.sum(w.to(tl.float32) * hk[None, :], 1)
    tl.store(y_ptr + n, acc.to(tl.bfloat16))


@triton.jit
def persistent_mlp(
    x_ptr, wgu_ptr, wd_ptr, h_ptr, y_ptr, arrivals_ptr, HIDDEN: tl.constexpr,
    INNER: tl.constexpr, BI: tl.constexpr, BK: tl.constexpr, BN: tl.constexpr,
    BK2: tl.constexpr, STAGES: tl.constexpr, PREFETCH: tl.constexpr,
):  # fmt: skip
    program = tl.program_id(0)
    programs = tl.num_programs(0)
    _gate_up_blocks(x_ptr, wgu_ptr, h_ptr, program, programs, HIDDEN, INNER, BI, BK, STAGES)
    ks = tl.arange(0, BK2)
    n = program * BN + tl.arange(0, BN)
    if PREFETCH:  # the first tile of this program's first down block, before the barrier
        mask = (n < HIDDEN)[:, None]
        first_tile = tl.load(wd_ptr + n[:, None] * INNER + ks[None, :], mask=mask, other=0.0)
    tl.debug_barrier()  # every thread's h stores precede the release
    seen = tl.atomic_add(arrivals_ptr, 1, sem="acq_rel", scope="gpu") + 1
    while seen < programs:
        seen = tl.atomic_add(arrivals_ptr, 0, sem="acquire", scope="gpu")
    tl.debug_barrier()
    for block in range(program, HIDDEN // BN, programs):
        acc = tl.zeros([BN], tl.float32)
        start = 0
        if PREFETCH:  # noqa: SIM102 (first_tile exists only under the constexpr)
            if block == program:
                hk = tl.load(h_ptr + ks, cache_modifier=".cg").to(tl.float32)
                acc += tl.sum(first_tile.to(tl.float32) * hk[None, :], 1)
                start = BK2
        _down_block(h_ptr, wd_ptr, y_ptr, block, acc, start, HIDDEN, INNER, BN, BK2, STAGES, ".cg")


@triton.jit
def gate_up_kernel(
    x_ptr, wgu_ptr, h_ptr, HIDDEN: tl.constexpr, INNER: tl.constexpr, BI: tl.constexpr,
    BK: tl.constexpr, STAGES: tl.constexpr,
):  # fmt: skip
    _gate_up_blocks(
        x_ptr, wgu_ptr, h_ptr, tl.program_id(0), tl.num_programs(0), HIDDEN, INNER, BI, BK,
        STAGES,
    )  # fmt: skip


@triton.jit
def down_kernel(
    h_ptr, wd_ptr, y_ptr, HIDDEN: tl.constexpr, INNER: tl.constexpr, BN: tl.constexpr,
    BK2: tl.constexpr, STAGES: tl.constexpr,
):  # fmt: skip
    acc = tl.zeros([BN], tl.float32)
    _down_block(h_ptr, wd_ptr, y_ptr, tl.program_id(0), acc, 0, HIDDEN, INNER, BN, BK2, STAGES, "")


@triton.jit
def _tile_dot(a, b, acc, UPCAST: tl.constexpr):
    if UPCAST:  # the CPU interpreter multiplies bf16 bit patterns as integers; fp32 is exact
        return tl.dot(a.to(tl.float32), b.to(tl.float32), acc)
    return tl.dot(a, b, acc)


@triton.jit
def thin_gate_up_kernel(
    x_ptr, wgu_ptr, h_ptr, rows, HIDDEN: tl.constexpr, INNER: tl.constexpr, BM: tl.constexpr,
    BI: tl.constexpr, BK: tl.constexpr, STAGES: tl.constexpr, UPCAST: tl.constexpr,
):  # fmt: skip
    """Row block program_id(1) of x (BM rows, padded: every row count runs the same dots) times
    BI gate and BI up columns on tensor cores; SiLU*up as the epilogue."""
    j = tl.program_id(0) * BI + tl.arange(0, BI)
    m = tl.program_id(1) * BM + tl.arange(0, BM)
    ks = tl.arange(0, BK)
    acc_gate = tl.zeros([BM, BI], tl.float32)
    acc_up = tl.zeros([BM, BI], tl.float32)
    for k0 in tl.range(0, HIDDEN, BK, num_stages=STAGES):
        x = tl.load(x_ptr + m[:, None] * HIDDEN + k0 + ks[None, :], mask=(m < rows)[:, None])
        gate = tl.load(wgu_ptr + j[None, :] * HIDDEN + k0 + ks[:, None])  # [BK, BI]
        up = tl.load(wgu_ptr + (j[None, :] + INNER) * HIDDEN + k0 + ks[:, None])
        acc_gate = _tile_dot(x, gate, acc_gate, UPCAST)
        acc_up = _tile_dot(x, up, acc_up, UPCAST)
    gate = acc_gate.to(tl.bfloat16).to(tl.float32)
    up = acc_up.to(tl.bfloat16).to(tl.float32)
    activated = (gate / (1.0 + tl.exp(-gate))).to(tl.bfloat16).to(tl.float32)
    out = h_ptr + m[:, None] * INNER + j[None, :]
    tl.store(out, (activated * up).to(tl.bfloat16), mask=(m < rows)[:, None])


@triton.jit
def thin_down_kernel(
    h_ptr, wd_ptr, y_ptr, partial_ptr, arrivals_ptr, rows, HIDDEN: tl.constexpr,
    INNER: tl.constexpr, MAX_ROWS: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
    BK: tl.constexpr, STAGES: tl.constexpr, SPLIT: tl.constexpr, UPCAST: tl.constexpr,
):  # fmt: skip
    """Output columns block program_id(0), K slice program_id(1) of SPLIT (fixed by the shape),
    row block program_id(2). With SPLIT > 1 each program stores its fp32 partial and the last of
    a block's SPLIT programs to arrive folds them in slice order (the same bits whoever folds)."""
    block = tl.program_id(0)
    n = block * BN + tl.arange(0, BN)
    m = tl.program_id(2) * BM + tl.arange(0, BM)
    ks = tl.arange(0, BK)
    in_rows = (m < rows)[:, None]
    acc = tl.zeros([BM, BN], tl.float32)
    SLICE: tl.constexpr = INNER // SPLIT
    first = tl.program_id(1) * SLICE
    for k0 in tl.range(first, first + SLICE, BK, num_stages=STAGES):
        h = tl.load(h_ptr + m[:, None] * INNER + k0 + ks[None, :], mask=in_rows)
        w = tl.load(wd_ptr + n[None, :] * INNER + k0 + ks[:, None])  # [BK, BN]
        acc = _tile_dot(h, w, acc, UPCAST)
    out = y_ptr + m[:, None] * HIDDEN + n[None, :]
    if SPLIT == 1:
        tl.store(out, acc.to(tl.bfloat16), mask=in_rows)
    else:
        cell = m[:, None] * HIDDEN + n[None, :]
        tl.store(partial_ptr + tl.program_id(1) * MAX_ROWS * HIDDEN + cell, acc, mask=in_rows)
        tl.debug_barrier()  # every thread's partial stores precede the release
        counter = arrivals_ptr + tl.program_id(2) * (HIDDEN // BN) + block
        if tl.atomic_add(counter, 1, sem="acq_rel", scope="gpu") == SPLIT - 1:
            tl.atomic_xchg(counter, 0, sem="relaxed", scope="gpu")
            total = tl.zeros([BM, BN], tl.float32)
            for part in tl.static_range(SPLIT):
                partial = partial_ptr + part * MAX_ROWS * HIDDEN + cell
                total += tl.load(partial, mask=in_rows, other=0.0, cache_modifier=".cg")
            tl.store(out, total.to(tl.bfloat16), mask=in_rows)


@dataclass(frozen=True)
class Blocks:
    bi: int  # gate (and up) rows a gate/up block
    bk: int  # columns a gate/up tile
    bn: int  # output rows a down block
    bk2: int  # columns a down tile
    stages: int


@dataclass(frozen=True)
class Thin:
    bm: int  # rows a block (every row count is padded to whole blocks)
    bk: int  # columns a gate/up tile
    bk2: int  # columns a down tile
    stages: int
    split: int = 1  # K slices of the down projection (fixed by the shape, not the rows)


@dataclass
class Layers:
    gate_up: list[torch.Tensor]  # [2 * INNER, HIDDEN] each
    down: list[torch.Tensor]  # [HIDDEN, INNER] each
    x: torch.Tensor  # [MAX_ROWS, HIDDEN]; the GEMV variants read row 0
    h: torch.Tensor  # [LAYERS, MAX_ROWS, INNER]
    y: torch.Tensor  # [LAYERS, MAX_ROWS, HIDDEN]
    arrivals: torch.Tensor  # [LAYERS] int32
    partials: torch.Tensor  # [4, MAX_ROWS, HIDDEN] fp32, the down projection's K slices
    down_arrivals: torch.Tensor  # [MAX_ROWS, HIDDEN // 16] int32, 0 between launches


def chain(layers: Layers, rows: int) -> None:
    for layer in range(LAYERS):
        gate_up = F.linear(layers.x[:rows], layers.gate_up[layer])
        h = silu_mul(gate_up[:, :INNER], gate_up[:, INNER:])
        layers.y[layer, :rows] = F.linear(h, layers.down[layer])


def thin(layers: Layers, rows: int, t: Thin) -> None:
    upcast = layers.x.device.type == "cpu"
    row_blocks = -(-rows // t.bm)
    for layer in range(LAYERS):
        thin_gate_up_kernel[(INNER // 16, row_blocks)](
            layers.x, layers.gate_up[layer], layers.h[layer], rows, HIDDEN, INNER, t.bm, 16,
            t.bk, t.stages, upcast,
        )  # fmt: skip
        thin_down_kernel[(HIDDEN // 16, t.split, row_blocks)](
            layers.h[layer], layers.down[layer], layers.y[layer], layers.partials,
            layers.down_arrivals, rows, HIDDEN, INNER, MAX_ROWS, t.bm, 16, t.bk2, t.stages,
            t.split, upcast,
        )  # fmt: skip


def two_launches(layers: Layers, b: Blocks) -> None:
    for layer in range(LAYERS):
        gate_up_kernel[(INNER // b.bi,)](
            layers.x, layers.gate_up[layer], layers.h[layer], HIDDEN, INNER, b.bi, b.bk, b.stages
        )
        down_kernel[(HIDDEN // b.bn,)](
            layers.h[layer], layers.down[layer], layers.y[layer], HIDDEN, INNER, b.bn, b.bk2,
            b.stages,
        )  # fmt: skip


def persistent(layers: Layers, b: Blocks, programs: int, prefetch: bool) -> None:
    layers.arrivals.zero_()
    for layer in range(LAYERS):
        persistent_mlp[(programs,)](
            layers.x, layers.gate_up[layer], layers.down[layer], layers.h[layer],
            layers.y[layer], layers.arrivals[layer:], HIDDEN, INNER, b.bi, b.bk, b.bn, b.bk2,
            b.stages, prefetch,
        )  # fmt: skip


def main(path: str, parts: list[str]) -> None:
    device = torch.device("cuda")
    torch.manual_seed(0)
    dtype = torch.bfloat16

    def weight(rows: int, cols: int) -> torch.Tensor:
        return torch.randn(rows, cols, device=device, dtype=dtype) * 0.02

    layers = Layers(
        gate_up=[weight(2 * INNER, HIDDEN) for _ in range(LAYERS)],
        down=[weight(HIDDEN, INNER) for _ in range(LAYERS)],
        x=torch.randn(MAX_ROWS, HIDDEN, device=device, dtype=dtype),
        h=torch.empty(LAYERS, MAX_ROWS, INNER, device=device, dtype=dtype),
        y=torch.empty(LAYERS, MAX_ROWS, HIDDEN, device=device, dtype=dtype),
        arrivals=torch.zeros(LAYERS, device=device, dtype=torch.int32),
        partials=torch.empty(4, MAX_ROWS, HIDDEN, device=device),
        down_arrivals=torch.zeros(MAX_ROWS, HIDDEN // 16, device=device, dtype=torch.int32),
    )
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    megabytes = LAYERS * 3 * INNER * HIDDEN * 2 / 1e6
    references = {}
    for rows in ROW_COUNTS:
        chain(layers, rows)
        references[rows] = layers.y[:, :rows].float().clone()

    with open(path, "w") as sink:

        def record(name: str, rows: int, fn: Callable[[], None], **fields: object) -> None:
            layers.y.zero_()
            fn()
            torch.cuda.synchronize()
            reference = references[rows]
            error = (layers.y[:, :rows].float() - reference).abs().max() / reference.abs().max()
            ms = replay_ms(fn)
            line = {"variant": name, "rows": rows, "us_per_layer": ms * 1e3 / LAYERS}
            line |= {"tb_s": megabytes / ms / 1e3, "rel_err": error.item()} | fields
            print(json.dumps(line), flush=True)
            sink.write(json.dumps(line) + "\n")

        for rows in ROW_COUNTS:
            record("cublas+silu_mul", rows, functools.partial(chain, layers, rows))
        if "thin" in parts:
            thins = [Thin(64, bk, bk, stages) for bk in (64, 128, 256) for stages in (3, 4, 5)]
            thins = [t for t in thins if t.bk * t.stages <= 1024]  # 256 x 5: out of shared memory
            thins += [Thin(16, 256, 256, 4, split) for split in (1, 2)]
            thins += [Thin(16, 256, 128, 4, 4), Thin(64, 256, 128, 4, 4), Thin(64, 256, 256, 4, 2)]
            for t in thins:
                alone = None
                for rows in ROW_COUNTS:
                    fn = functools.partial(thin, layers, rows, t)
                    fn()
                    alone = layers.y[:, 0].clone() if alone is None else alone
                    same = torch.equal(layers.y[:, 0], alone)  # row 0's bits as when alone
                    record("thin", rows, fn, row0_as_alone=same, **dataclasses.asdict(t))
        if "two" in parts:
            for sizes in itertools.product((16, 8), (256, 512), (16, 8), (256, 512), (2, 3)):
                b = Blocks(*sizes)
                fn = functools.partial(two_launches, layers, b)
                record("two_launches", 1, fn, **dataclasses.asdict(b))
        if "persistent" in parts:
            for programs, prefetch, (bi, bk), (bn, bk2), stages in itertools.product(
                (sms, 2 * sms), (False, True), ((16, 256), (8, 512)), ((16, 256), (8, 512)), (2, 3)
            ):
                b = Blocks(bi, bk, bn, bk2, stages)
                fn = functools.partial(persistent, layers, b, programs, prefetch)
                fields = {"programs": programs, "prefetch": prefetch} | dataclasses.asdict(b)
                record("persistent", 1, fn, **fields)


if __name__ == "__main__":
    main(
        sys.argv[1], sys.argv[2].split(",") if len(sys.argv) > 2 else ["thin", "two", "persistent"]
    )
