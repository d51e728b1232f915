"""Constrained decoding's pieces: bitmasks applied to logits (against a per-token reference),
`policy.may_exit` covering every exit `after_loop` can make, the decode step's hold and
deferred-constraint rules, and the engine's `Constraints.attach` handing out the right bitmasks."""

from __future__ import annotations

import itertools
import random

import pytest
import torch

from loopserve.depth import policy
from loopserve.depth.policy import SlotRule
from loopserve.engine.constraints import Constraints
from loopserve.engine.scheduler_output import PrefillChunk, SchedulerOutput, SlotStart
from loopserve.runner.token_masks import SlotMasks
from loopserve.sample.sampler import apply_token_mask, mask_tensors, mask_words
from loopserve.sampling_params import SamplingInfo, SamplingParams
from loopserve.structured.grammar import GrammarState
from loopserve.structured_outputs import StructuredOutputsParams
from loopserve.tokenizer import Tokenizer
from tests.unit.test_rules import rows
from tests.unit.test_structured_grammar import ASSET


def test_bitmask_forbids_exactly_the_cleared_bits_of_constrained_rows() -> None:
    vocab = 77  # not a multiple of 32: the last word is partly used
    rng = random.Random(5)
    allowed = [[rng.random() < 0.3 for _ in range(vocab)] for _ in range(3)]
    masks: list[bytes | None] = []
    for row in allowed:
        bits = sum(1 << token for token, ok in enumerate(row) if ok)
        masks.append(bits.to_bytes(4 * mask_words(vocab), "little"))
    masks.append(None)  # a free row
    constrained, words = mask_tensors(masks, vocab, torch.device("cpu"))
    logits = torch.randn(4, vocab)
    masked = apply_token_mask(logits, constrained, words)
    for row in range(3):
        for token in range(vocab):
            expected = logits[row, token] if allowed[row][token] else float("-inf")
            assert masked[row, token] == expected
    assert torch.equal(masked[3], logits[3])


def test_may_exit_covers_every_exit_the_policy_makes() -> None:
    cases = list(
        itertools.product(
            range(1, 5),  # loop
            (1, 2, 3),  # min_loops
            (2, 4),  # max_loops
            list(SlotRule),
            (0.0, 0.7, 1.0),  # hazard
            (False, True),  # stop_next
            (1, 3),  # trace depth
        )
    )
    loop, low, high, rule, hazard, stop_next, depth = (
        list(column) for column in zip(*cases, strict=True)
    )
    row = rows(
        loop=loop,
        min_loops=low,
        max_loops=high,
        rule=[int(r) for r in rule],
        stop_next=stop_next,
        trace_depth=depth,
        survival=[0.6] * len(cases),
    )
    ran = torch.ones(len(cases), dtype=torch.bool)
    exited = policy.after_loop(row, ran, torch.tensor(hazard)).exited
    may = policy.may_exit(row)
    assert bool((exited & ~may).sum() == 0), "a row exited where may_exit said it could not"
    assert bool(may.any()) and bool((~may).any())


def test_a_constrained_row_is_held_until_its_bitmask_and_a_deferred_one_begins() -> None:
    masks = SlotMasks(3, vocab_size=40, device=torch.device("cpu"))
    from loopserve.engine.scheduler_output import TokenMask

    words = (1 << 7).to_bytes(4 * mask_words(40), "little")
    masks.apply([TokenMask(0, 5, words), TokenMask(1, 2, None, begin_after=9)])
    assert masks.any([1]) and not masks.any([2])
    row = rows(loop=[1, 1, 1], min_loops=[1, 1, 1])  # gate rows: each may exit this loop
    held = masks.held(3, row, output_count=torch.tensor([6, 2, 0]))
    assert held.tolist() == [True, False, False]  # row 0's bitmask is for output 5, not 6
    held = masks.held(3, row, output_count=torch.tensor([5, 2, 0]))
    assert held.tolist() == [False, False, False]
    deeper = rows(loop=[1, 1, 1], min_loops=[3, 3, 3])  # no exit possible: nothing waits
    assert not masks.held(3, deeper, output_count=torch.tensor([6, 2, 0])).any()
    masks.begin(3, exited=torch.tensor([True, True, True]), tokens=torch.tensor([9, 9, 9]))
    assert masks.constrained.tolist() == [True, True, False]  # row 1 began, row 2 has none
    assert masks.held(3, row, output_count=torch.tensor([5, 3, 0])).tolist() == [
        False,
        True,
        False,
    ]


def test_attach_hands_out_first_start_and_learned_bitmasks() -> None:
    tokenizer = Tokenizer.from_directory(ASSET)
    assert tokenizer is not None
    constraints = Constraints(tokenizer, tokenizer.vocab_size, [0])
    spec = StructuredOutputsParams(choice=("alpha", "beta"))
    constraints.add("a", constraints.check(spec))
    constraints.add("b", constraints.check(spec))
    info = SamplingInfo(SamplingParams(), 0, 0)
    chunk = PrefillChunk("a", 0, 0, [1, 2], 4, completes_prompt=True, sampling=info)
    first = SchedulerOutput(step=1, prefill_chunks=[chunk], decode_slots={})
    constraints.attach(first)
    assert chunk.token_mask is not None and first.token_masks == []
    # "a" took its first token and starts in slot 0; "b" is decoding in slot 1 and learned one.
    (token,) = tokenizer.encode("al", add_special_tokens=False)[:1]
    assert constraints.accept("a", [token]) is None
    assert constraints.accept("b", [token]) is None
    start = SlotStart(slot=0, token=token, position=2, num_output_tokens=1, params=None)  # type: ignore[arg-type]
    second = SchedulerOutput(step=2, slot_starts=[start], decode_slots={0: "a", 1: "b"})
    constraints.attach(second)
    assert [(m.slot, m.index) for m in second.token_masks] == [(0, 1), (1, 1)]
    assert all(m.words is not None for m in second.token_masks)
    third = SchedulerOutput(step=3, decode_slots={0: "a", 1: "b"})
    constraints.attach(third)
    assert third.token_masks == []  # nothing learned since
    constraints.drop("a")
    constraints.drop("b")
    assert len(constraints) == 0


def test_prepared_bitmasks_are_the_ones_attach_would_compute(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """`prepare` computes the learned requests' masks on the worker; `attach` hands them out
    without computing them again, and recomputes a mask whose request moved on since."""
    tokenizer = Tokenizer.from_directory(ASSET)
    assert tokenizer is not None
    spec = StructuredOutputsParams(
        json='{"type": "object", "properties": {"k": {"type": "integer"}}}'
    )
    tokens = tokenizer.encode('{"k": 12', add_special_tokens=False)
    engines = [Constraints(tokenizer, tokenizer.vocab_size, [0]) for _ in range(2)]
    for constraints in engines:
        for request_id in "ab":
            constraints.add(request_id, constraints.check(spec))
            assert constraints.accept(request_id, tokens[:2]) is None
    sync, prepared = engines
    prepared.prepare()
    assert prepared.accept("b", tokens[2:3]) is None  # "b" moves on: its prepared mask is stale
    assert sync.accept("b", tokens[2:3]) is None
    computed: list[int] = []
    original = GrammarState.mask
    monkeypatch.setattr(
        GrammarState, "mask", lambda self: computed.append(self.num_accepted) or original(self)
    )
    outputs = [SchedulerOutput(step=1, decode_slots={0: "a", 1: "b"}) for _ in engines]
    prepared.attach(outputs[1])
    assert computed == [3]  # only "b", whose prepared mask was for index 2
    sync.attach(outputs[0])
    assert outputs[0].token_masks == outputs[1].token_masks
    assert [(m.slot, m.index) for m in outputs[1].token_masks] == [(0, 2), (1, 3)]
