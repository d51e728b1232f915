"""The fused token choice (kernels/sampling.py) is the torch sampler's (`choose_tokens`): the same
values under the argmax and the same token, NaN and ties included."""

from __future__ import annotations

import pytest
import torch
import triton
import triton.language as tl

from loopserve.kernels.sampling import sample_tokens
from loopserve.sample.noise import gumbel_noise
from loopserve.sample.sampler import SamplingBatch, choose_tokens
from tests.kernels.conftest import ON_GPU


@triton.jit
def _draw_one(row_bits, vocab):  # type: ignore[no-untyped-def]
    """Every draw 1.0: every Gumbel draw +inf."""
    return tl.full(vocab.shape, 1.0, tl.float32)


# Patching a jit function works where the interpreter looks it up at each call, not compiled.
triton_interpreter_only = pytest.mark.skipif(ON_GPU, reason="runs in the CPU interpreter only")


def _batch(rows: int, device: torch.device, greedy: torch.Tensor) -> SamplingBatch:
    generator = torch.Generator().manual_seed(1)
    temperature = torch.rand(rows, generator=generator) * 1.5 + 0.25
    temperature[greedy] = 1.0
    return SamplingBatch(
        temperature=temperature.to(device),
        greedy=greedy.to(device),
        top_k=torch.zeros(rows, dtype=torch.int64, device=device),
        top_p=torch.ones(rows, device=device),
        min_p=torch.zeros(rows, device=device),
        seeds=torch.randint(0, 2**62, (rows,), generator=generator).to(device),
        counters=torch.randint(0, 2**20, (rows,), generator=generator).to(device),
        needs_filter=False,
        all_greedy=bool(greedy.all()),
        num_logprobs=0,
        logprob_counts=[None] * rows,
        any_logprobs=False,
    )


def _fused(logits: torch.Tensor, batch: SamplingBatch, values: torch.Tensor | None = None):
    return sample_tokens(
        logits, batch.temperature, batch.greedy, batch.seeds, batch.counters, batch.all_greedy,
        values,
    )  # fmt: skip


@pytest.mark.parametrize("vocab_size", [1, 1000, 2048, 3000])
@pytest.mark.parametrize("all_greedy", [False, True])
def test_tokens_and_values_are_the_torch_samplers(
    device: torch.device, vocab_size: int, all_greedy: bool
) -> None:
    rows = 6
    generator = torch.Generator().manual_seed(vocab_size)
    logits = (torch.randn(rows, vocab_size, generator=generator) * 3).to(device)
    greedy = torch.ones(rows, dtype=torch.bool) if all_greedy else torch.arange(rows) % 3 == 0
    batch = _batch(rows, device, greedy)
    values = torch.full_like(logits, float("nan"))
    tokens = _fused(logits, batch, values)
    assert tokens.dtype == torch.int64 and tokens.shape == (rows,)
    assert torch.equal(tokens, choose_tokens(logits, batch))
    noise = gumbel_noise(batch.seeds, batch.counters, vocab_size)
    noisy = logits / batch.temperature[:, None] + noise
    expected = logits if all_greedy else torch.where(batch.greedy[:, None], logits, noisy)
    if device.type == "cuda":
        assert torch.equal(values, expected)  # libdevice logf is CUDA's logf
    else:  # numpy's log against torch's: equal up to a last bit
        torch.testing.assert_close(values, expected, rtol=1e-6, atol=1e-6)


def test_first_maximum_and_nan_win_as_in_torch(device: torch.device) -> None:
    """Ties across and within the kernel's 1024-wide blocks, NaN, infinities, -inf rows."""
    vocab_size = 2500
    logits = torch.zeros(7, vocab_size)
    logits[0, [5, 1500, 2400]] = 2.0  # tie across blocks: the first index
    logits[1, [1030, 1031]] = 1.0  # tie inside a later block
    logits[2, [3, 2000]] = float("nan")  # NaN beats numbers; the first NaN
    logits[2, 100] = float("inf")
    logits[3] = float("-inf")  # nothing beats anything: index 0
    logits[4, [2499, 1024]] = float("inf")
    logits[5, 2499] = 1.0  # the last id of a partial block
    logits[6] = -1.0
    logits = logits.to(device)
    batch = _batch(7, device, torch.ones(7, dtype=torch.bool))
    tokens = _fused(logits, batch)
    assert tokens.tolist() == [5, 1030, 3, 0, 1024, 2499, 0]
    assert torch.equal(tokens, choose_tokens(logits, batch))


def test_rows_are_independent(device: torch.device) -> None:
    """A row's token does not depend on the rows beside it (batch invariance)."""
    generator = torch.Generator().manual_seed(3)
    logits = torch.randn(8, 1500, generator=generator).to(device)
    batch = _batch(8, device, torch.arange(8) % 2 == 0)
    together = _fused(logits, batch)
    for row in (0, 5):
        alone = SamplingBatch(
            **{
                name: getattr(batch, name)[row : row + 1]
                for name in ("temperature", "greedy", "top_k", "top_p", "min_p", "seeds")
            },
            counters=batch.counters[row : row + 1],
            needs_filter=False,
            all_greedy=bool(batch.greedy[row]),
            num_logprobs=0,
            logprob_counts=[None],
            any_logprobs=False,
        )
        assert _fused(logits[row : row + 1], alone).item() == together[row].item()


def test_refuses_logits_it_cannot_read(device: torch.device) -> None:
    batch = _batch(2, device, torch.ones(2, dtype=torch.bool))
    with pytest.raises(ValueError, match="fp32 logits"):
        _fused(torch.zeros(2, 10, dtype=torch.float16, device=device), batch)


@pytest.mark.gpu
def test_ouro_vocabulary_on_the_gpu(device: torch.device) -> None:
    """Ouro's 49,152 ids, 64 rows, half of them sampled: every value and token bit for bit."""
    rows, vocab_size = 64, 49152
    generator = torch.Generator().manual_seed(4)
    logits = (torch.randn(rows, vocab_size, generator=generator) * 4).to(device)
    batch = _batch(rows, device, torch.arange(rows) % 2 == 0)
    values = torch.empty_like(logits)
    assert torch.equal(_fused(logits, batch, values), choose_tokens(logits, batch))
    noise = gumbel_noise(batch.seeds, batch.counters, vocab_size)
    noisy = logits / batch.temperature[:, None] + noise
    assert torch.equal(values, torch.where(batch.greedy[:, None], logits, noisy))


def test_uniform_draws_are_inside_the_open_interval() -> None:
    """Every 32-bit hash gives a draw strictly inside (0, 1), so every Gumbel draw is finite (the
    extreme hashes included: 24 centred bits once rounded the top one to exactly 1.0)."""
    from loopserve.sample.noise import unit_interval

    bits = torch.tensor([0, 1, 511, 512, 2**31, 2**32 - 513, 2**32 - 1], dtype=torch.int64)
    draws = unit_interval(bits)
    assert bool((draws > 0).all() and (draws < 1).all())
    assert torch.isfinite(-torch.log(-torch.log(draws))).all()


@triton_interpreter_only
@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # log(0) of the +inf noise, on purpose
def test_lanes_past_the_vocabulary_never_win(monkeypatch: pytest.MonkeyPatch) -> None:
    """A vocabulary that does not fill its last block: lanes past it must lose even when their
    noise is +inf (it once made them NaN, which wins an argmax, and the token 2**62)."""
    import loopserve.kernels.sampling as sampling

    monkeypatch.setattr(sampling, "uniform", _draw_one)
    greedy = torch.tensor([False, False])
    batch = _batch(2, torch.device("cpu"), greedy)
    logits = torch.zeros(2, 1500)  # 1500 = one block of 1024 and a partial one
    tokens = _fused(logits, batch)
    assert tokens.tolist() == [0, 0]  # every in-vocabulary value is +inf: the first wins
