"""The benchmarks' random prompts, and their shared prefix (`bench offline --shared-prefix`,
`bench serve --shared-prefix-len`): one rule, so both benchmarks share the same prefix.

Owns: drawing prompts and the prefix from seeds. Must not: import torch or the engine (`bench
serve` only speaks HTTP); numpy loads inside functions (`loopserve --help` imports this module).
"""

from __future__ import annotations

import random


def shared_prefix(seed: int, length: int, vocab_size: int) -> list[int]:
    """`length` token indices in [0, vocab_size) that depend on `seed` and `length` alone: the
    same prefix in every trial, wave and request count of a run with that seed."""
    import numpy as np

    generator = np.random.default_rng([seed, 1, length])
    return [int(index) for index in generator.integers(0, vocab_size, size=length)]


def random_prompts(vocabulary: list[int], count: int, length: int, seed: int) -> list[list[int]]:
    """`count` prompts of `length` token ids drawn uniformly from `vocabulary` (seeded)."""
    rng = random.Random(seed)
    return [[rng.choice(vocabulary) for _ in range(length)] for _ in range(count)]


def serve_prompts(
    vocabulary: list[int],
    count: int,
    length: int,
    seed: int,
    prefix_len: int = 0,
    prefix_fraction: float = 0.0,
) -> list[list[int]]:
    """`bench serve`'s prompts: `random_prompts`, where round(prefix_fraction × count) of them,
    picked by the seed, start with the `prefix_len`-token `shared_prefix` (mapped into
    `vocabulary`). Without a prefix they are exactly `random_prompts`."""
    import numpy as np

    if not 0 <= prefix_len <= length:
        raise ValueError(f"the shared prefix ({prefix_len}) must fit the prompts ({length})")
    prompts = random_prompts(vocabulary, count, length, seed)
    sharing = round(prefix_fraction * count)
    if not prefix_len or not sharing:
        return prompts
    prefix = [vocabulary[index] for index in shared_prefix(seed, prefix_len, len(vocabulary))]
    chosen = np.random.default_rng([seed, 2]).choice(count, size=sharing, replace=False)
    for index in chosen:
        prompts[index][:prefix_len] = prefix
    return prompts
