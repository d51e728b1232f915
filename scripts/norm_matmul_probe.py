"""A residual add and two RMSNorms in a matmul's prologue, against the chain (GPU; tenth session).

`python scripts/norm_matmul_probe.py OUT.jsonl [--rows 1,4,8]`, from the repository root.
What it builds: `add_norm_linear`, one launch for what a decode layer runs as `fused_ops.add_norm`
then a cuBLAS weight matmul (then `silu_mul` for the gate/up projection). Each program first
normalises its block's rows whole, one row at a time with `fused_ops.inverse_rms` on the same
[BLOCK_H] row shape as add_norm's kernel (so the same reduction order), stores them (every
program the same bits; column block 0 also the residual sum), waits at a CTA barrier, then runs
`kernels.matmul`'s K loop over them; `preload` issues the first weight tile(s) before that
prologue. For the qkv projection (add_norm + cuBLAS) and the gate/up projection (add_norm +
cuBLAS + silu_mul) at each row count and candidate tiling:
- bits: whether the outputs (the residual sum and the projection) equal the chain's;
- µs per call: CUDA-graph replay (`bench.graph_replay.replay_ms`) over 24 weight copies (more
  than the 50 MB L2 holds) of: the chain; its cuBLAS matmul alone; `kernels.matmul.linear`
  alone; `add_norm_linear` with and without `preload`; for gate/up, `linear(swiglu=True)` (SiLU·up
  as the matmul's epilogue, no norm) against cuBLAS + `silu_mul`.
Prints and appends one JSON line per (projection, rows, tiling, variant). docs/latency.md,
"Norms and SiLU·up into the matmuls", has the H200's figures: bits equal everywhere, the norm
prologue slower than the chain, the SiLU·up epilogue faster (the engine runs it).
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from loopserve.bench.graph_replay import replay_ms
from loopserve.kernels import fused_ops
from loopserve.kernels.fused_ops import add_normalised, inverse_rms, scale, silu_times
from loopserve.kernels.matmul import Tiling, linear

HIDDEN, INTER, QKV = 2048, 5632, 6144
COPIES = 24
EPS = 1e-6
TILINGS = {
    "16x16x256w4s4": Tiling(16, 16, 256, 4, 4),
    "16x32x128w4s3": Tiling(16, 32, 128, 4, 3),
    "16x64x128w4s3": Tiling(16, 64, 128, 4, 3),
    "16x64x64w4s4": Tiling(16, 64, 64, 4, 4),
    "16x128x64w4s3": Tiling(16, 128, 64, 4, 3),
    "16x64x128w8s3": Tiling(16, 64, 128, 8, 3),
}


@triton.jit
def _add_norm_matmul_kernel(
    update_ptr,  # [M, H] the sublayer output
    residual_ptr,  # [M, H]
    update_weight_ptr,  # [H] norm_u's weight
    out_weight_ptr,  # [H] norm_o's weight
    total_ptr,  # [M, H] out: residual + norm_u(update), written by column block 0
    normed_ptr,  # [M, H] out: norm_o(total), written (the same bits) by every program
    w_ptr,  # [N, H]
    out_ptr,  # [M, N], or [M, N / 2] with SWIGLU
    M, H, N_OUT, stride_update, stride_residual, stride_w, eps,
    UPCAST: tl.constexpr,  # CPU tensors (the interpreter): dot operands in fp32
    EVEN_K: tl.constexpr,  # H % BLOCK_K == 0
    SWIGLU: tl.constexpr,  # out = silu(x W_gate^T) * x W_up^T, W = [W_gate; W_up]
    PRELOAD: tl.constexpr,  # load the first weight tile(s) before the prologue
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_H: tl.constexpr,
):  # fmt: skip
    dtype = total_ptr.dtype.element_ty
    first_row = tl.program_id(1) * BLOCK_M
    rows = first_row + tl.arange(0, BLOCK_M)
    in_rows = rows < M
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    in_cols = cols < N_OUT
    w_cols = cols.to(tl.int64)[None, :] * stride_w
    up_offset = N_OUT.to(tl.int64) * stride_w  # the up half's first row of W (SWIGLU)
    first_depth = tl.arange(0, BLOCK_K)
    first_mask = (first_depth < H)[:, None] & in_cols[None, :]
    if PRELOAD:  # in flight while the prologue runs
        w_first = tl.load(w_ptr + w_cols + first_depth[:, None], mask=first_mask, other=0.0)
        up_first = w_first
        if SWIGLU:
            up_ptrs = w_ptr + up_offset + w_cols + first_depth[:, None]
            up_first = tl.load(up_ptrs, mask=first_mask, other=0.0)
    # Prologue: this block's rows normalised whole, as add_norm's kernel does, into `normed`.
    hidden = tl.arange(0, BLOCK_H)
    in_hidden = hidden < H
    update_weight = tl.load(update_weight_ptr + hidden, mask=in_hidden, other=0.0).to(tl.float32)
    out_weight = tl.load(out_weight_ptr + hidden, mask=in_hidden, other=0.0).to(tl.float32)
    for slot in range(0, tl.minimum(M - first_row, BLOCK_M)):
        row = (first_row + slot).to(tl.int64)
        update = tl.load(update_ptr + row * stride_update + hidden, mask=in_hidden, other=0.0)
        update = update.to(tl.float32)
        residual = tl.load(residual_ptr + row * stride_residual + hidden, mask=in_hidden, other=0.0)
        inverse_u = inverse_rms(update, in_hidden, H, eps)
        total = add_normalised(update, residual.to(tl.float32), update_weight, inverse_u, dtype)
        if tl.program_id(0) == 0:
            tl.store(total_ptr + row * H + hidden, total, mask=in_hidden)
        total = total.to(tl.float32)
        normed = scale(total, inverse_rms(total, in_hidden, H, eps), out_weight, dtype)
        tl.store(normed_ptr + row * H + hidden, normed, mask=in_hidden)
    tl.debug_barrier()  # every thread's rows stored before any thread reads them
    # Main loop: a matmul over `normed` as kernels.matmul's, K in order (and the up half).
    a_rows = normed_ptr + rows.to(tl.int64)[:, None] * H
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    first_loop_start: tl.constexpr = BLOCK_K if PRELOAD else 0
    if PRELOAD:  # the first chunk, with the tiles loaded before the prologue
        a_mask = in_rows[:, None] & (first_depth < H)[None, :]
        a = tl.load(a_rows + first_depth[None, :], mask=a_mask, other=0.0)
        if UPCAST:
            a, w_first, up_first = a.to(tl.float32), w_first.to(tl.float32), up_first.to(tl.float32)
        acc = tl.dot(a, w_first, acc)
        if SWIGLU:
            acc_up = tl.dot(a, up_first, acc_up)
    for start in range(first_loop_start, H, BLOCK_K):
        depth = start + tl.arange(0, BLOCK_K)
        in_depth = depth < H if not EVEN_K else tl.full((BLOCK_K,), True, tl.int1)
        a = tl.load(a_rows + depth[None, :], mask=in_rows[:, None] & in_depth[None, :], other=0.0)
        w_mask = in_depth[:, None] & in_cols[None, :]
        w = tl.load(w_ptr + w_cols + depth[:, None], mask=w_mask, other=0.0)  # [BK, BN]
        w_up = w
        if SWIGLU:
            w_up = tl.load(w_ptr + up_offset + w_cols + depth[:, None], mask=w_mask, other=0.0)
        if UPCAST:
            a, w, w_up = a.to(tl.float32), w.to(tl.float32), w_up.to(tl.float32)
        acc = tl.dot(a, w, acc)
        if SWIGLU:
            acc_up = tl.dot(a, w_up, acc_up)
    # Rounded to W's dtype as a matmul's output would be, then (SWIGLU) SiLU·up as silu_mul does.
    out = acc.to(w_ptr.dtype.element_ty)
    if SWIGLU:
        up = acc_up.to(w_ptr.dtype.element_ty)
        out = silu_times(out.to(tl.float32), up.to(tl.float32), w_ptr.dtype.element_ty)
    out_ptrs = out_ptr + rows.to(tl.int64)[:, None] * N_OUT + cols[None, :]
    tl.store(out_ptrs, out.to(out_ptr.dtype.element_ty), mask=in_rows[:, None] & in_cols[None, :])


def add_norm_linear(
    update: torch.Tensor,  # [M, H]
    residual: torch.Tensor,  # [M, H]
    update_weight: torch.Tensor,  # [H]
    out_weight: torch.Tensor,  # [H]
    eps: float,
    weight: torch.Tensor,  # [N, H], update's dtype
    swiglu: bool,
    tiling: Tiling,
    preload: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(total, out): total = residual + norm_u(update) [M, H], out = norm_o(total) W^T [M, N];
    with `swiglu`, out = silu(gate) * up [M, N / 2] of that product's halves. The bits of
    `fused_ops.add_norm` followed by `F.linear` (and `fused_ops.silu_mul`)."""
    rows, size = update.shape
    columns = weight.shape[0] // 2 if swiglu else weight.shape[0]
    if weight.shape[1] != size or weight.dtype != update.dtype or residual.shape != update.shape:
        raise ValueError(
            f"add_norm_linear of update {tuple(update.shape)} {update.dtype}, residual "
            f"{tuple(residual.shape)} by W {tuple(weight.shape)} {weight.dtype}: W must be [N, H] "
            "of the update's dtype and the residual the update's shape"
        )
    if swiglu and weight.shape[0] % 2:
        raise ValueError(f"add_norm_linear with swiglu needs an even N, not {weight.shape[0]}")
    if update.stride(1) != 1 or residual.stride(1) != 1 or not weight.is_contiguous():
        raise ValueError("add_norm_linear needs a contiguous last dimension and a contiguous W")
    total = torch.empty((rows, size), dtype=update.dtype, device=update.device)
    normed = torch.empty_like(total)
    out = torch.empty((rows, columns), dtype=update.dtype, device=update.device)
    if rows == 0:
        return total, out
    grid = (triton.cdiv(columns, tiling.block_n), triton.cdiv(rows, tiling.block_m))
    _add_norm_matmul_kernel[grid](
        update, residual, update_weight, out_weight, total, normed, weight, out, rows, size,
        columns, update.stride(0), residual.stride(0), weight.stride(0), eps,
        UPCAST=update.device.type == "cpu", EVEN_K=size % tiling.block_k == 0, SWIGLU=swiglu,
        PRELOAD=preload,
        BLOCK_M=tiling.block_m, BLOCK_N=tiling.block_n, BLOCK_K=tiling.block_k,
        BLOCK_H=triton.next_power_of_2(size), num_warps=tiling.num_warps,
        num_stages=tiling.num_stages,
    )  # fmt: skip
    return total, out


def _swiglu(out: torch.Tensor) -> torch.Tensor:
    gate, up = out.split([out.shape[1] // 2] * 2, dim=-1)
    return fused_ops.silu_mul(gate, up)


def _us(work: Callable[[torch.Tensor], object], weights: list[torch.Tensor]) -> float:
    return replay_ms(lambda: [work(w) for w in weights]) * 1e3 / COPIES


def _measure(name: str, rows: int, weights: list[torch.Tensor], swiglu: bool, sink) -> None:
    update = torch.randn(rows, HIDDEN, device="cuda", dtype=torch.bfloat16)
    residual = torch.randn(rows, HIDDEN, device="cuda", dtype=torch.bfloat16) * 4
    wu = (1 + 0.1 * torch.randn(HIDDEN, device="cuda")).to(torch.bfloat16)
    wo = (1 + 0.1 * torch.randn(HIDDEN, device="cuda")).to(torch.bfloat16)
    normed = fused_ops.add_norm(update, residual, wu, wo, EPS)[1]

    def chain(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        total, normed = fused_ops.add_norm(update, residual, wu, wo, EPS)
        out = F.linear(normed, w)
        return total, _swiglu(out) if swiglu else out

    expected = chain(weights[0])
    base = {"proj": name, "rows": rows, "chain_us": _us(chain, weights)}
    base["cublas_us"] = _us(lambda w: F.linear(normed, w), weights)
    if swiglu:
        base["cublas_silu_us"] = _us(lambda w: _swiglu(F.linear(normed, w)), weights)
    for label, tiling in TILINGS.items():
        variants: dict[str, Callable[[torch.Tensor], object]] = {
            "linear": lambda w, t=tiling: linear(normed, w, t),
            "fused": lambda w, t=tiling: add_norm_linear(
                update, residual, wu, wo, EPS, w, swiglu, t
            ),
            "fused_preload": lambda w, t=tiling: add_norm_linear(
                update, residual, wu, wo, EPS, w, swiglu, t, preload=True
            ),
        }
        if swiglu:
            variants["swiglu_only"] = lambda w, t=tiling: linear(normed, w, t, swiglu=True)
        for variant, work in variants.items():
            row = dict(base, tiling=label, variant=variant, us=_us(work, weights))
            got = work(weights[0])
            if variant.startswith("fused"):
                assert isinstance(got, tuple)
                row["total_equal"] = bool(torch.equal(got[0], expected[0]))
                got = got[1]
            reference = F.linear(normed, weights[0]) if variant == "linear" else expected[1]
            assert isinstance(got, torch.Tensor)
            row["out_equal"] = bool(torch.equal(got, reference))
            print(json.dumps(row), flush=True)
            sink.write(json.dumps(row) + "\n")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("--rows", default="1,2,4,8")
    args = parser.parse_args()
    torch.manual_seed(0)
    with open(args.out, "a") as sink:
        for name, columns, swiglu in (("qkv", QKV, False), ("gate_up", 2 * INTER, True)):
            weights = [
                torch.randn(columns, HIDDEN, device="cuda", dtype=torch.bfloat16) * 0.02
                for _ in range(COPIES)
            ]
            for rows in (int(r) for r in args.rows.split(",")):
                _measure(name, rows, weights, swiglu, sink)


if __name__ == "__main__":
    main()
