from __future__ import annotations

import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer as BackendTokenizer
from tokenizers import decoders, models, pre_tokenizers, trainers

from loopserve.engine.detokenizer import IncrementalDetokenizer
from loopserve.tokenizer import Tokenizer

TEXT = "def café(x):\n    return '日本語 ünïcödé' + x  # ok 🎉 done\n"


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    backend = BackendTokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300,
        special_tokens=["<|endoftext|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    backend.train_from_iterator(["def f(x): return x + 1\n"] * 20, trainer)
    return Tokenizer(backend, {})


def test_incremental_text_equals_full_decode(tokenizer: Tokenizer) -> None:
    ids = tokenizer.encode(TEXT)
    detokenizer = IncrementalDetokenizer(tokenizer, True, ())
    pieces = []
    for token in ids:
        piece, stop = detokenizer.add([token])
        assert stop is None and "\ufffd" not in piece  # never half a character
        pieces.append(piece)
    assert "".join(pieces) == detokenizer.text == TEXT
    assert sum(1 for p in pieces if p == "") > 0  # multi-byte characters were held back


def test_stop_strings_cut_the_text(tokenizer: Tokenizer) -> None:
    detokenizer = IncrementalDetokenizer(tokenizer, True, ("return", "zzz"))
    seen = ""
    for token in tokenizer.encode(TEXT):
        piece, stop = detokenizer.add([token])
        seen += piece
        if stop is not None:
            break
    assert stop == "return"
    assert detokenizer.text == seen == "def café(x):\n    "


def test_streamed_text_is_never_taken_back(tokenizer: Tokenizer) -> None:
    """Text that might be the start of a stop string is held back until it cannot be."""
    text = "x = 1\nreturn_value = 2\nret"
    for stop in ("return ", "zzz"):
        detokenizer = IncrementalDetokenizer(tokenizer, True, (stop, "q"))
        streamed = ""
        found = None
        for token in tokenizer.encode(text):
            piece, found = detokenizer.add([token])
            streamed += piece
            assert detokenizer.text == streamed
            if found is not None:
                break
        streamed += detokenizer.flush()
        assert streamed == text  # neither stop string occurs: all of it, in order
        assert found is None
    detokenizer = IncrementalDetokenizer(tokenizer, True, ("value",))
    streamed = ""
    for token in tokenizer.encode(text):
        piece, found = detokenizer.add([token])
        streamed += piece
        assert "valu" not in streamed  # the stop string's prefix was never streamed
        if found is not None:
            break
    assert found == "value" and streamed == "x = 1\nreturn_"


def _stream(detokenizer: IncrementalDetokenizer, chunks: list[list[int]]) -> str:
    streamed = ""
    for chunk in chunks:
        piece, stop = detokenizer.add(chunk)
        assert stop is None
        streamed += piece
    return streamed + detokenizer.flush()


def test_a_tail_of_an_incomplete_character_is_flushed_as_decode_renders_it(
    tokenizer: Tokenizer,
) -> None:
    """The request ends inside a character: its bytes are not dropped but become U+FFFD."""
    ids = tokenizer.encode("ok 🎉")
    cut = ids[:-1]  # the last byte-level token completes the emoji
    assert tokenizer.decode(cut).endswith("\ufffd")
    detokenizer = IncrementalDetokenizer(tokenizer, True, ())
    running = "".join(detokenizer.add([token])[0] for token in cut)
    assert "\ufffd" not in running  # nothing half-decoded while the request runs
    assert running + detokenizer.flush() == tokenizer.decode(cut)
    assert detokenizer.text == tokenizer.decode(cut)


@settings(max_examples=300, deadline=None)
@given(data=st.data(), skip_special_tokens=st.booleans())
def test_streamed_text_equals_decode_of_any_token_ids(
    tokenizer: Tokenizer, data: st.DataObject, skip_special_tokens: bool
) -> None:
    """For any id sequence (stray bytes, split characters, special tokens) and any split into
    steps, the concatenated stream is exactly decode(ids)."""
    ids = data.draw(st.lists(st.integers(0, tokenizer.vocab_size - 1), max_size=40), label="ids")
    cuts = sorted(data.draw(st.sets(st.integers(1, max(1, len(ids) - 1))), label="cuts"))
    bounds = [0, *cuts, len(ids)]
    chunks = [ids[start:end] for start, end in itertools.pairwise(bounds) if end > start]
    detokenizer = IncrementalDetokenizer(tokenizer, skip_special_tokens, ())
    expected = tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)
    assert _stream(detokenizer, chunks) == expected == detokenizer.text
