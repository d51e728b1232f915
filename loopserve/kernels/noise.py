"""Triton twin of `sample.noise.uniform_noise`: the counter-based hash in one launch.

Owns: evaluating the same 32-bit hash (the murmur3 finaliser over seed, counter and vocab id, in
int64 arithmetic that never overflows) for a whole [rows, vocab] block at once. Must not: change
a single operation without its torch twin: tests/kernels/test_noise.py holds them equal bit for
bit. The torch version launches ~60 elementwise kernels over [rows, vocab] per sampled step
(~0.14 ms a step at one row on the H200); this is one. `row_bits` and `uniform` are the hash
itself, shared with the fused sampler (kernels/sampling.py).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _mul32(x, constant: tl.constexpr):
    """(x * constant) mod 2**32 for x in [0, 2**32), without int64 overflow."""
    low = x & 0xFFFF
    high = x >> 16
    return ((((high * constant) & 0xFFFF) << 16) + low * constant) & 0xFFFFFFFF


@triton.jit
def _mix32(x):
    x = x ^ (x >> 16)
    x = _mul32(x, 0x85EBCA6B)
    x = x ^ (x >> 13)
    x = _mul32(x, 0xC2B2AE35)
    return x ^ (x >> 16)


@triton.jit
def row_bits(seed, counter):
    """The hash of one row's (seed, counter): int64 scalars in, a 32-bit value in int64 out."""
    mask32 = 0xFFFFFFFF
    return _mix32((seed & mask32) ^ _mix32(((seed >> 32) & mask32) ^ _mix32(counter & mask32)))


@triton.jit
def uniform(row_bits, vocab):
    """The draws of vocab ids `vocab` (int64) for a row hashed by `row_bits`, in (0, 1) fp32."""
    bits = _mix32(row_bits ^ _mul32(vocab, 0x9E3779B1))
    bits = _mix32(bits ^ 0x5BD1E995)
    return ((bits >> 9).to(tl.float32) + 0.5) * (1.0 / 8388608.0)  # sample/noise.py says why


@triton.jit
def _uniform_noise_kernel(seeds_ptr, counters_ptr, out_ptr, vocab_size, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    bits = row_bits(tl.load(seeds_ptr + row).to(tl.int64), tl.load(counters_ptr + row).to(tl.int64))
    vocab = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK).to(tl.int64)
    out = uniform(bits, vocab)
    tl.store(out_ptr + row.to(tl.int64) * vocab_size + vocab, out, mask=vocab < vocab_size)


def uniform_noise(seeds: torch.Tensor, counters: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """seeds [R] int64 (>= 0), counters [R] int64 -> uniform draws in (0, 1), [R, V] fp32."""
    rows = seeds.shape[0]
    out = torch.empty((rows, vocab_size), dtype=torch.float32, device=seeds.device)
    if rows == 0:
        return out
    block = 1024
    _uniform_noise_kernel[(rows, triton.cdiv(vocab_size, block))](
        seeds, counters, out, vocab_size, BLOCK=block
    )
    return out
