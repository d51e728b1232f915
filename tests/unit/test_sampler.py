from __future__ import annotations

import pytest
import torch

from loopserve.sample.noise import uniform_noise
from loopserve.sample.sampler import SamplingBatch, sample
from loopserve.sampling_params import SamplingInfo, SamplingParams


def batch_of(*infos: SamplingInfo, vocab: int = 50) -> SamplingBatch:
    return SamplingBatch.build(infos, vocab, torch.device("cpu"))


def test_noise_depends_only_on_seed_and_counter() -> None:
    seeds = torch.tensor([1, 2**40 + 7, 1], dtype=torch.int64)
    counters = torch.tensor([0, 0, 5], dtype=torch.int64)
    noise = uniform_noise(seeds, counters, 1000)
    alone = uniform_noise(seeds[1:2], counters[1:2], 1000)
    assert torch.equal(noise[1], alone[0])
    assert not torch.equal(noise[0], noise[2])
    assert float(noise.min()) > 0.0 and float(noise.max()) < 1.0
    assert abs(float(noise.mean()) - 0.5) < 0.02  # roughly uniform


def test_sampling_follows_the_distribution() -> None:
    probs = torch.tensor([0.5, 0.3, 0.2])
    logits = probs.log()[None, :].repeat(4000, 1)
    infos = [
        SamplingInfo(SamplingParams(temperature=1.0), seed=9, output_index=i) for i in range(4000)
    ]
    tokens = sample(logits, batch_of(*infos, vocab=3)).tokens
    frequencies = torch.bincount(tokens, minlength=3).float() / 4000
    torch.testing.assert_close(frequencies, probs, atol=0.03, rtol=0)


@pytest.mark.parametrize(
    ("params", "allowed"),
    [
        (SamplingParams(top_k=2), {0, 1}),
        (SamplingParams(top_p=0.6), {0, 1}),  # 0.4 + 0.3 reaches 0.6
        (SamplingParams(top_p=0.3), {0}),
        (SamplingParams(min_p=0.6), {0, 1}),  # keeps p >= 0.24
    ],
)
def test_filters(params: SamplingParams, allowed: set[int]) -> None:
    logits = torch.tensor([0.4, 0.3, 0.2, 0.1]).log()[None, :].repeat(500, 1)
    infos = [SamplingInfo(params, seed=1, output_index=i) for i in range(500)]
    tokens = set(sample(logits, batch_of(*infos, vocab=4)).tokens.tolist())
    assert tokens == allowed


def test_greedy_rows_mixed_with_sampled_rows() -> None:
    logits = torch.tensor([[0.0, 5.0, 1.0], [0.0, 5.0, 1.0]])
    infos = [
        SamplingInfo(SamplingParams(temperature=0.0, logprobs=0), 1, 0),
        SamplingInfo(SamplingParams(temperature=100.0), 1, 0),
    ]
    result = sample(logits, batch_of(*infos, vocab=3))
    assert int(result.tokens[0]) == 1
    torch.testing.assert_close(result.logprobs[0], logits[0].log_softmax(-1)[1])
    # Without any row asking for log-probs none are computed (the tokens are the same).
    plain = [SamplingInfo(SamplingParams(temperature=t), 1, 0) for t in (0.0, 100.0)]
    unlogged = sample(logits, batch_of(*plain, vocab=3))
    assert torch.equal(unlogged.tokens, result.tokens)
    assert unlogged.top_ids.shape == (2, 0) and not unlogged.logprobs.any()
