"""The Triton hash (kernels/noise.py) gives `sample.noise.uniform_noise`'s numbers bit for bit."""

from __future__ import annotations

import torch

from loopserve.kernels import noise as fused
from loopserve.sample import noise


def test_uniform_noise_is_the_torch_hash(device: torch.device) -> None:
    generator = torch.Generator().manual_seed(0)
    seeds = torch.randint(0, 2**62, (5,), generator=generator)
    seeds[0] = 0
    seeds[1] = 2**63 - 1  # every bit of both halves
    counters = torch.randint(0, 2**40, (5,), generator=generator)
    counters[2] = 2**32 + 3  # only the low 32 bits count
    seeds, counters = seeds.to(device), counters.to(device)
    for vocab_size in (1, 1000, 2500):
        expected = noise.uniform_noise(seeds, counters, vocab_size)
        got = fused.uniform_noise(seeds, counters, vocab_size)
        assert got.dtype == torch.float32 and got.shape == (5, vocab_size)
        assert torch.equal(got, expected)
