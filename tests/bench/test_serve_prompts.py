"""`bench serve`'s prompts: the shared prefix goes to the asked fraction of them, is the same in
each, is `bench offline`'s prefix, and the whole workload is fixed by the seed."""

from __future__ import annotations

import argparse

import pytest

from loopserve.bench.prompts import random_prompts, serve_prompts, shared_prefix

VOCABULARY = list(range(3, 1003))  # like a tokenizer's ids less its special tokens


def _sharing(prompts: list[list[int]], prefix: list[int]) -> int:
    return sum(prompt[: len(prefix)] == prefix for prompt in prompts)


@pytest.mark.parametrize("fraction", [0.0, 0.25, 0.5, 1.0])
def test_the_fraction_of_prompts_starts_with_the_prefix(fraction: float) -> None:
    prompts = serve_prompts(VOCABULARY, 40, 64, seed=3, prefix_len=48, prefix_fraction=fraction)
    prefix = [VOCABULARY[index] for index in shared_prefix(3, 48, len(VOCABULARY))]
    assert len(prompts) == 40 and all(len(prompt) == 64 for prompt in prompts)
    assert _sharing(prompts, prefix) == round(fraction * 40)
    assert all(token in VOCABULARY for prompt in prompts for token in prompt)


def test_the_prefix_is_bench_offlines_and_only_the_prefix_is_replaced() -> None:
    plain = random_prompts(VOCABULARY, 10, 32, 7)
    shared = serve_prompts(VOCABULARY, 10, 32, seed=7, prefix_len=16, prefix_fraction=0.5)
    prefix = [VOCABULARY[index] for index in shared_prefix(7, 16, len(VOCABULARY))]
    for before, after in zip(plain, shared, strict=True):
        assert after[16:] == before[16:]
        assert after[:16] in (before[:16], prefix)
    # Without a prefix the prompts are the plain random ones (earlier runs stay comparable).
    assert serve_prompts(VOCABULARY, 10, 32, seed=7) == plain
    assert serve_prompts(VOCABULARY, 10, 32, seed=7, prefix_len=16) == plain


def test_the_same_seed_gives_the_same_prompts_and_another_seed_others() -> None:
    def sharing(seed: int) -> list[int]:
        prompts = serve_prompts(VOCABULARY, 20, 40, seed=seed, prefix_len=32, prefix_fraction=0.5)
        assert prompts == serve_prompts(
            VOCABULARY, 20, 40, seed=seed, prefix_len=32, prefix_fraction=0.5
        )
        prefix = [VOCABULARY[index] for index in shared_prefix(seed, 32, len(VOCABULARY))]
        return [index for index, prompt in enumerate(prompts) if prompt[:32] == prefix]

    assert len(sharing(1)) == len(sharing(2)) == 10
    assert sharing(1) != sharing(2)  # the seed picks which prompts share


def test_a_prefix_longer_than_the_prompt_is_refused() -> None:
    with pytest.raises(ValueError, match="shared prefix"):
        serve_prompts(VOCABULARY, 4, 8, seed=0, prefix_len=9, prefix_fraction=1.0)


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--shared-prefix-fraction", "0.5"], "needs --shared-prefix-len"),
        (["--shared-prefix-len", "128"], "shorter than --input-len"),
        (["--shared-prefix-len", "8", "--shared-prefix-fraction", "1.5"], r"in \[0, 1\]"),
    ],
)
def test_bench_serve_refuses_bad_prefix_flags(flags: list[str], message: str) -> None:
    from loopserve.bench.serve_client import _config, add_arguments

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    with pytest.raises(ValueError, match=message):
        _config(parser.parse_args(["--input-len", "128", *flags]))


def test_a_given_prefix_is_shared_by_every_prompt_unless_a_fraction_is_given() -> None:
    from loopserve.bench.serve_client import _config, add_arguments

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    assert _config(parser.parse_args([])).shared_prefix_fraction == 0.0
    assert _config(parser.parse_args(["--shared-prefix-len", "8"])).shared_prefix_fraction == 1.0
