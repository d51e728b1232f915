"""Probe (GPU): does programmatic dependent launch (PDL) survive CUDA-graph capture on this
toolchain, and what does it buy a decode loop's chain of kernels at M = 1, 8, 32, 128 rows?

Not part of the package and not the engine's kernels: 24 layers of Ouro-1.4B-shaped bf16
weights; per layer the four weight matmuls (cuBLAS via F.linear, or a split-K Triton matmul
that can be PDL-launched and can prefetch its weight slice into L2 before waiting), with
stand-in Triton kernels between them shaped like the engine's (residual-add + two norms,
SiLU·up, and a copy standing in for RoPE + attention). Each variant is captured in one CUDA
graph and replayed; times are µs per loop (replay), four runs in A B B A order. PDL modes: 0
off, 1 the kernel lets its dependents launch at its start, 2 after its main loop; every
PDL-launched kernel waits (`gdc_wait`) before touching what its predecessor wrote. Also checks
that PDL variants give the same bits, and whether the matmul's bits depend on its row block.

    python scripts/pdl_probe.py OUT_DIR     (writes OUT_DIR/pdl_probe.json; about 80 s on an H200)

Figures and what they decided: docs/latency.md, "Programmatic dependent launch: measured".
"""

from __future__ import annotations

import json
import os
import sys

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

H, Q, KV, INNER, L = 2048, 2048, 2048, 5632, 24
DT = torch.bfloat16


@triton.jit
def _pdl_enter(PDL: tl.constexpr):
    if PDL:
        if PDL == 1:
            tl.extra.cuda.gdc_launch_dependents()
        tl.extra.cuda.gdc_wait()


@triton.jit
def _norm(x, weight, mask, size, eps, DTYPE: tl.constexpr):
    x = tl.where(mask, x, 0.0)
    variance = tl.sum(x * x, axis=0) / size
    normalised = (x * tl.rsqrt(variance + eps)).to(DTYPE).to(tl.float32)
    return (weight * normalised).to(DTYPE)


@triton.jit
def add_norm_kernel(u_ptr, r_ptr, wu_ptr, wo_ptr, s_ptr, n_ptr, su, sr, size, eps,
                    BLOCK: tl.constexpr, PDL: tl.constexpr):  # fmt: skip
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < size
    wu = tl.load(wu_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    wo = tl.load(wo_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    _pdl_enter(PDL)
    dtype = s_ptr.dtype.element_ty
    u = tl.load(u_ptr + row * su + cols, mask=mask, other=0.0).to(tl.float32)
    r = tl.load(r_ptr + row * sr + cols, mask=mask, other=0.0)
    total = (r.to(tl.float32) + _norm(u, wu, mask, size, eps, dtype).to(tl.float32)).to(dtype)
    tl.store(s_ptr + row * size + cols, total, mask=mask)
    tl.store(n_ptr + row * size + cols, _norm(total.to(tl.float32), wo, mask, size, eps, dtype),
             mask=mask)  # fmt: skip


@triton.jit
def silu_kernel(g_ptr, u_ptr, o_ptr, sg, su, size, BLOCK: tl.constexpr, PDL: tl.constexpr):
    _pdl_enter(PDL)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < size
    dtype = o_ptr.dtype.element_ty
    g = tl.load(g_ptr + row * sg + cols, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(u_ptr + row * su + cols, mask=mask, other=0.0).to(tl.float32)
    a = (g / (1.0 + tl.exp(-g))).to(dtype).to(tl.float32)
    tl.store(o_ptr + row * size + cols, (a * u).to(dtype), mask=mask)


@triton.jit
def rope_attn_kernel(qkv_ptr, o_ptr, sq, size, BLOCK: tl.constexpr, PDL: tl.constexpr):
    """Stand-in for rotary + attention: out = v * 1 (reads q/k/v rows)."""
    _pdl_enter(PDL)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < size
    q = tl.load(qkv_ptr + row * sq + cols, mask=mask, other=0.0).to(tl.float32)
    k = tl.load(qkv_ptr + row * sq + size + cols, mask=mask, other=0.0).to(tl.float32)
    v = tl.load(qkv_ptr + row * sq + 2 * size + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(o_ptr + row * size + cols, (v + 0.0 * q * k).to(o_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _prefetch_l2(ptrs):
    tl.inline_asm_elementwise(
        "prefetch.global.L2::evict_last [$1];\n mov.u32 $0, 0;", "=r,l", [ptrs],
        dtype=tl.int32, is_pure=False, pack=1,
    )  # fmt: skip


@triton.jit(do_not_specialize=["m"])
def gemv_kernel(x_ptr, w_ptr, out_ptr, partial_ptr, counter_ptr, m, n, k, sx, sw, so,
                CHUNK: tl.constexpr, SPLIT: tl.constexpr, BLOCK_N: tl.constexpr,
                BLOCK_K: tl.constexpr, ROWS: tl.constexpr, NUM_STAGES: tl.constexpr,
                PDL: tl.constexpr, PREFETCH: tl.constexpr, LINES: tl.constexpr):  # fmt: skip
    row_block = tl.program_id(0)
    column_block = tl.program_id(1)
    piece = tl.program_id(2)
    rows = row_block * ROWS + tl.arange(0, ROWS)
    columns = column_block * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = rows < m
    column_ok = columns < n
    offsets = tl.arange(0, BLOCK_K)
    w_rows = w_ptr + columns.to(tl.int64)[:, None] * sw
    x_rows = rows.to(tl.int64)[None, :]
    start = piece * CHUNK
    if PREFETCH:  # this program's weight slice into L2 while the previous kernel finishes
        lines = tl.minimum(tl.arange(0, LINES), CHUNK // 64 - 1)  # 128-byte lines of bf16
        _prefetch_l2(w_rows + (start + lines[None, :] * 64))
    if PDL:
        if PDL == 1:
            tl.extra.cuda.gdc_launch_dependents()
        tl.extra.cuda.gdc_wait()
    acc = tl.zeros((BLOCK_N, ROWS), dtype=tl.float32)
    for k0 in tl.range(start, tl.minimum(start + CHUNK, k), BLOCK_K, num_stages=NUM_STAGES):
        cols = k0 + offsets
        col_ok = cols < k
        w = tl.load(w_rows + cols[None, :], mask=column_ok[:, None] & col_ok[None, :], other=0.0)
        x = tl.load(x_ptr + x_rows * sx + cols[:, None], mask=row_ok[None, :] & col_ok[:, None],
                    other=0.0)  # fmt: skip
        acc = tl.dot(w, x, acc)
    if PDL == 2:
        tl.extra.cuda.gdc_launch_dependents()
    out_offsets = rows.to(tl.int64)[None, :] * so + columns[:, None]
    out_mask = column_ok[:, None] & row_ok[None, :]
    if SPLIT == 1:
        tl.store(out_ptr + out_offsets, acc.to(out_ptr.dtype.element_ty), mask=out_mask)
    else:
        tile = rows.to(tl.int64)[None, :] * n + columns[:, None]
        tl.store(partial_ptr + piece * m * n + tile, acc, mask=out_mask)
        tl.debug_barrier()
        counter = counter_ptr + row_block * tl.num_programs(1) + column_block
        arrived = tl.atomic_add(counter, 1, sem="acq_rel", scope="gpu")
        if arrived == SPLIT - 1:
            tl.atomic_xchg(counter, 0, sem="relaxed", scope="gpu")
            total = tl.zeros((BLOCK_N, ROWS), dtype=tl.float32)
            for other in range(SPLIT):
                part = partial_ptr + other * m * n + tile
                total += tl.load(part, mask=out_mask, other=0.0, cache_modifier=".cg")
            tl.store(out_ptr + out_offsets, total.to(out_ptr.dtype.element_ty), mask=out_mask)


COUNTERS = None


def gemv(x, w, pdl, prefetch, block_n=64, block_k=128, target=264, warps=4, stages=4, rows=16):
    global COUNTERS
    if COUNTERS is None:
        COUNTERS = torch.zeros(1 << 16, dtype=torch.int32, device=x.device)
    m, k = x.shape
    n = w.shape[0]
    k_tiles = triton.cdiv(k, block_k)
    wanted = min(k_tiles, triton.cdiv(target, triton.cdiv(n, block_n)))
    chunk = triton.cdiv(k_tiles, max(1, wanted)) * block_k
    split = triton.cdiv(k, chunk)
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    partials = torch.empty((split, m, n), dtype=torch.float32, device=x.device)
    grid = (triton.cdiv(m, rows), triton.cdiv(n, block_n), split)
    gemv_kernel[grid](x, w, out, partials, COUNTERS, m, n, k, x.stride(0), w.stride(0),
                      out.stride(0), CHUNK=chunk, SPLIT=split, BLOCK_N=block_n, BLOCK_K=block_k,
                      ROWS=rows, NUM_STAGES=stages, PDL=pdl, PREFETCH=prefetch,
                      LINES=triton.next_power_of_2(max(1, chunk // 64)), num_warps=warps,
                      launch_pdl=bool(pdl))  # fmt: skip
    return out


def layer_weights(seed):
    g = torch.Generator(device="cuda").manual_seed(seed)

    def w(n, k):
        return (torch.randn(n, k, device="cuda", generator=g) * 0.02).to(DT)

    ones = torch.ones(H, device="cuda", dtype=DT)
    return {"qkv": w(Q + 2 * KV, H), "o": w(H, Q), "gu": w(2 * INNER, H), "down": w(H, INNER),
            "n1": ones, "n2": ones.clone()}  # fmt: skip


def add_norm(u, r, wu, wo, pdl):
    s = torch.empty_like(r)
    nn = torch.empty_like(r)
    add_norm_kernel[(u.shape[0],)](u, r, wu, wo, s, nn, u.stride(0), r.stride(0), H, 1e-6,
                                   BLOCK=2048, PDL=pdl, launch_pdl=bool(pdl))  # fmt: skip
    return s, nn


def loop(h, normed, layers, mm, pdl, only_matmuls=False):
    for lw in layers:
        if only_matmuls:
            qkv = mm(normed, lw["qkv"])
            normed = mm(qkv[:, :Q], lw["o"])
            gu = mm(normed, lw["gu"])
            normed = mm(gu[:, :INNER], lw["down"])
            continue
        qkv = mm(normed, lw["qkv"])
        attn = torch.empty((h.shape[0], Q), device="cuda", dtype=DT)
        rope_attn_kernel[(h.shape[0], 2)](qkv, attn, qkv.stride(0), Q, BLOCK=1024, PDL=pdl,
                                          launch_pdl=bool(pdl))  # fmt: skip
        o = mm(attn, lw["o"])
        h, normed = add_norm(o, h, lw["n1"], lw["n2"], pdl)
        gu = mm(normed, lw["gu"])
        act = torch.empty((h.shape[0], INNER), device="cuda", dtype=DT)
        silu_kernel[(h.shape[0], 3)](gu, gu[:, INNER:], act, gu.stride(0), gu.stride(0), INNER,
                                     BLOCK=2048, PDL=pdl, launch_pdl=bool(pdl))  # fmt: skip
        d = mm(act, lw["down"])
        h, normed = add_norm(d, h, lw["n1"], lw["n2"], pdl)
    return h, normed


def graph_of(fn):
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(2):
            out = fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out = fn()
    return g, out


def time_graph(g, reps=100):
    for _ in range(10):
        g.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(3):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        for _ in range(reps):
            g.replay()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) * 1000 / reps)
    return sorted(times)[1]


def main():
    out_dir = sys.argv[1] if len(sys.argv) > 1 else "."
    torch.manual_seed(0)
    layers = [layer_weights(i) for i in range(L)]
    results = {}
    cublas = F.linear

    def triton_mm(pdl: int, prefetch: bool, **tiling: int):
        return lambda x, w: gemv(x, w, pdl, prefetch, **tiling)

    G = triton_mm
    variants = {
        "cublas+ops": (cublas, 0, False),
        "cublas+ops_pdlE": (cublas, 1, False),
        "gemv+ops": (G(0, False), 0, False),
        "gemv_pdlE_pf+ops_pdlE": (G(1, True), 1, False),
        "gemv_pdlE+ops_pdlE": (G(1, False), 1, False),
        "gemv_pdlL+ops_pdlL": (G(2, False), 2, False),
        "gemv_pdlL_pf+ops_pdlL": (G(2, True), 2, False),
        "gemv_pdlL_n128+ops_pdlL": (G(2, False, block_n=128), 2, False),
        "gemv_pdlL_t396+ops_pdlL": (G(2, False, target=396), 2, False),
        "mm:cublas": (cublas, 0, True),
        "mm:gemv": (G(0, False), 0, True),
        "mm:gemv_pdlE": (G(1, False), 1, True),
        "mm:gemv_pdlL": (G(2, False), 2, True),
        "mm:gemv_pdlL_pf": (G(2, True), 2, True),
        "mm:gemv_pdlL_r64": (G(2, False, rows=64), 2, True),
        "mm:gemv_pdlL_r128": (G(2, False, rows=128, block_n=64, warps=8), 2, True),
    }
    for m in (1, 8, 32, 128):
        h0 = torch.randn(m, H, device="cuda").to(DT)
        graphs, outs = {}, {}
        for name, (mm, pdl, only) in variants.items():
            if m > 8 and "gemv" in name and not name.startswith("mm:g"):
                continue
            if m > 8 and name in ("mm:gemv", "mm:gemv_pdlE", "mm:gemv_pdlL_pf"):
                continue
            try:
                graphs[name], outs[name] = graph_of(
                    lambda h0=h0, mm=mm, pdl=pdl, only=only: loop(
                        h0, h0.clone(), layers, mm, pdl, only
                    )
                )
            except Exception as e:  # a variant that does not compile or capture is reported
                results[f"{m}:{name}"] = f"ERROR {type(e).__name__}: {str(e)[:300]}"
                print(m, name, results[f"{m}:{name}"], flush=True)
        # exactness: pdl == non-pdl bitwise; gemv close to cublas
        pairs = [("cublas+ops", "cublas+ops_pdlE"), ("gemv+ops", "gemv_pdlE+ops_pdlE")]
        pairs += [("gemv+ops", "gemv_pdlL_pf+ops_pdlL"), ("mm:gemv_pdlL", "mm:gemv_pdlL_r64")]
        pairs += [("mm:gemv_pdlL", "mm:gemv_pdlL_r128")]
        for a, b in pairs:
            if a in graphs and b in graphs:
                graphs[a].replay()
                graphs[b].replay()
                torch.cuda.synchronize()
                same = all(torch.equal(x, y) for x, y in zip(outs[a], outs[b], strict=True))
                results[f"{m}:equal:{a}=={b}"] = same
        if "mm:gemv_pdlL" in graphs and "mm:cublas" in graphs:
            graphs["mm:gemv_pdlL"].replay()
            graphs["mm:cublas"].replay()
            torch.cuda.synchronize()
            x, y = outs["mm:gemv_pdlL"][1].float(), outs["mm:cublas"][1].float()
            results[f"{m}:gemv_vs_cublas_maxrel"] = ((x - y).abs().max() / y.abs().max()).item()
        names = list(graphs)
        times = {n: [] for n in names}
        for order in (names, names[::-1], names, names[::-1]):
            for n in order:
                times[n].append(time_graph(graphs[n]))
        for n in names:
            results[f"{m}:{n}"] = [round(t, 1) for t in times[n]]
            print(m, n, results[f"{m}:{n}"], flush=True)
        for k, v in results.items():
            if k.startswith(f"{m}:equal"):
                print(k, v, flush=True)
        del graphs, outs
        torch.cuda.empty_cache()
    with open(os.path.join(out_dir, "pdl_probe.json"), "w") as f:
        json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
