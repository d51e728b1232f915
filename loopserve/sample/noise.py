"""Counter-based sampling noise: the same (seed, token index, vocab id) gives the same number on
any device and in any batch.

Owns: a 32-bit integer hash evaluated with int64 tensor arithmetic that never overflows, and the
uniform and Gumbel draws built on it. Must not: use a stateful torch.Generator (its stream would
depend on which rows share a batch). On CUDA the hash runs as its Triton twin
(`kernels/noise.py`, held to `uniform_noise` bit for bit by tests/kernels/test_noise.py).
"""

from __future__ import annotations

import torch

from loopserve.kernels.availability import compiled_for

_MASK32 = 0xFFFFFFFF


def _mul32(x: torch.Tensor, constant: int) -> torch.Tensor:
    """(x * constant) mod 2**32 for x in [0, 2**32), without int64 overflow."""
    low = x & 0xFFFF
    high = x >> 16
    return ((((high * constant) & 0xFFFF) << 16) + low * constant) & _MASK32


def _mix32(x: torch.Tensor) -> torch.Tensor:
    """The murmur3 finaliser: a bijection on 32-bit values with good avalanche."""
    x = x ^ (x >> 16)
    x = _mul32(x, 0x85EBCA6B)
    x = x ^ (x >> 13)
    x = _mul32(x, 0xC2B2AE35)
    return x ^ (x >> 16)


def uniform_noise(seeds: torch.Tensor, counters: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """seeds [R] int64 (>= 0), counters [R] int64 -> uniform draws in (0, 1), [R, V] fp32."""
    seed_low = seeds & _MASK32
    seed_high = (seeds >> 32) & _MASK32
    row = _mix32(seed_low ^ _mix32(seed_high ^ _mix32(counters & _MASK32)))  # [R]
    vocab = torch.arange(vocab_size, device=seeds.device, dtype=torch.int64)
    bits = _mix32(row[:, None] ^ _mul32(vocab, 0x9E3779B1)[None, :])
    return unit_interval(_mix32(bits ^ 0x5BD1E995))


def unit_interval(bits: torch.Tensor) -> torch.Tensor:
    """32-bit hashes -> fp32 draws: 23 random bits centred in their interval, in [2**-24,
    1 - 2**-24] and all exact in fp32, so never 0 or 1 (24 bits centred would round their top
    value to 1.0: a Gumbel draw of +inf, which picks its token whatever the logits)."""
    return ((bits >> 9).to(torch.float32) + 0.5) * (1.0 / 8388608.0)


def uniform_draws(seeds: torch.Tensor, counters: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """`uniform_noise`; on CUDA with triton from the hash's one-launch twin (the same bits)."""
    if compiled_for(seeds):
        from loopserve.kernels.noise import uniform_noise as fused_uniform_noise

        return fused_uniform_noise(seeds, counters, vocab_size)
    return uniform_noise(seeds, counters, vocab_size)


def gumbel_noise(seeds: torch.Tensor, counters: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Standard Gumbel draws [R, V] fp32: argmax(logits + g) samples softmax(logits)."""
    return -torch.log(-torch.log(uniform_draws(seeds, counters, vocab_size)))
