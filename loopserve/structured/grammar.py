"""Constraints as grammars and token masks, through llguidance.

Owns: compiling a `StructuredOutputsParams` into an llguidance grammar against the model's
vocabulary (checked once, cached; an uncompilable schema, regex or grammar is a ValueError that
says why), and `GrammarState`, one request's matcher: which tokens may come next (a bitmask, bit
t of 32-bit word t // 32 set when token t is allowed) and the tokens it has accepted.
Must not: import torch (grammar state is meant to live in the torch-free engine, beside the tokens
it follows; the runner will only apply the masks).

Why llguidance rather than xgrammar: it has no dependencies and imports in ~50 ms (measured here:
xgrammar 0.2.9's import pulls in torch, transformers, sentencepiece and tiktoken), so the
torch-free engine can hold it, and it builds its vocabulary from `tokenizer.json` itself. The
price: on the built-in vocabulary (4,096 tokens) its masks take 12-46 µs a token against
xgrammar's 2-6 µs, though it compiles a schema 1.5-3x faster
(`python -m benchmarks.grammar_backends`). Masks are host time: `MaskWorker` computes a step's
batch of them on a thread of its own while the engine goes on building that step's outputs.

JSON is written with `, ` and `: ` separators and no other whitespace (vLLM's
`disable-any-whitespace`): a model that may write any amount of whitespace between tokens can
write it forever.
"""

from __future__ import annotations

import ctypes
import functools
import json
import time
from collections.abc import Iterable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from loopserve.structured_outputs import StructuredOutputsParams

# Separators of constrained JSON (Python's json.dumps defaults), no other whitespace.
JSON_OPTIONS: Any = {"item_separator": ", ", "key_separator": ": ", "whitespace_flexible": False}


class GrammarCompiler:
    """Compiles constraints for one vocabulary.

    Args:
        tokenizer_json: the text of the model's tokenizer.json.
        vocab_size: the model's vocabulary (logit rows; may exceed the tokenizer's).
        eos_token_ids: the ids that end a sequence: the only tokens allowed once the constraint
            is complete.
    """

    def __init__(self, tokenizer_json: str, vocab_size: int, eos_token_ids: Iterable[int]) -> None:
        import llguidance

        self._llg = llguidance
        eos = sorted(eos_token_ids)
        self.tokenizer = llguidance.LLTokenizer(
            tokenizer_json, n_vocab=vocab_size, eos_token=eos or None
        )
        self.vocab_size = vocab_size
        self.mask_words = (vocab_size + 31) // 32
        self._compiled = functools.lru_cache(maxsize=256)(self._compile)

    def grammar(self, spec: StructuredOutputsParams) -> str:
        """The llguidance grammar of a constraint; ValueError, saying why, if it cannot compile."""
        return self._compiled(spec)

    def state(self, spec: StructuredOutputsParams) -> GrammarState:
        """A new matcher for one request, at the constraint's start."""
        begin_after = None
        if spec.begin_after is not None:
            begin_after = self.single_token(spec.begin_after, "structured_outputs.begin_after")
        matcher = self._llg.LLMatcher(self.tokenizer, self.grammar(spec))
        return GrammarState(matcher, self.mask_words, begin_after)

    def single_token(self, text: str, what: str) -> int:
        ids = self.tokenizer.tokenize_str(text)
        if len(ids) != 1:
            raise ValueError(f"{what} must be one token of the vocabulary; {text!r} is {ids}")
        token: int = ids[0]
        return token

    def _compile(self, spec: StructuredOutputsParams) -> str:
        matcher = self._llg.LLMatcher
        kind = spec.kind
        try:
            if kind == "json":
                grammar = matcher.grammar_from_json_schema(str(spec.json), defaults=JSON_OPTIONS)
            elif kind == "json_object":
                grammar = matcher.grammar_from_json_schema(
                    {"type": "object"}, defaults=JSON_OPTIONS
                )
            elif kind == "regex":
                grammar = matcher.grammar_from_regex(str(spec.regex))
            elif kind == "choice":
                literals = " | ".join(json.dumps(item) for item in spec.choice or ())
                grammar = matcher.grammar_from_lark(f"start: {literals}")
            else:
                grammar = matcher.grammar_from_lark(_as_lark(spec.grammar))
        except ValueError as error:
            raise ValueError(f"structured_outputs.{kind}: {error}") from None
        problem = matcher.validate_grammar(grammar, self.tokenizer)
        if problem:
            raise ValueError(f"structured_outputs.{kind} does not compile: {problem.strip()}")
        return grammar


class GrammarState:
    """One request's place in its constraint. Before `begin_after` is generated (when set) the
    constraint is not yet active and every token is allowed."""

    def __init__(self, matcher: Any, mask_words: int, begin_after: int | None) -> None:
        self._matcher = matcher
        self._mask_words = mask_words
        self.begin_after = begin_after
        self.active = begin_after is None
        self.num_accepted = 0  # tokens generated so far (the next one has this index)

    def accept(self, token: int) -> None:
        """Advance past a generated token. ValueError if the constraint forbids it (which a
        masked sample never is)."""
        self.num_accepted += 1
        if not self.active:
            self.active = token == self.begin_after
            return
        if self._matcher.is_stopped():
            return  # complete: the end-of-sequence token that follows ends the request
        if not self._matcher.consume_token(token):
            raise ValueError(f"token {token} breaks the constraint: {self._matcher.get_error()}")

    def mask(self) -> bytes | None:
        """The allowed next tokens as a little-endian int32 bitmask; None while inactive."""
        if not self.active:
            return None
        mask: bytes = self._matcher.compute_bitmask()
        return mask[: 4 * self._mask_words]

    @property
    def complete(self) -> bool:
        """The constraint is satisfied and accepts nothing more."""
        stopped: bool = self._matcher.is_stopped()
        return self.active and stopped


class MaskWorker:
    """Computes the bitmasks of a batch of grammar states on one background thread.

    llguidance releases the GIL for the whole batch (one `LLExecutor` call writing into one
    buffer), so the caller's Python runs meanwhile; measured on this project's CPU machine, a
    batch of 12 JSON masks on a 49,152-token vocabulary (~3 ms there) overlapped a 4 ms loop of
    the caller's Python with 0.2 ms left to wait at `result`. A state must not be advanced while
    its batch is in flight (the caller waits on the future first).
    """

    def __init__(self, mask_words: int) -> None:
        import llguidance

        self._mask_bytes = 4 * mask_words
        self._executor = llguidance.LLExecutor(num_threads=1)
        self._thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="loopserve-masks")

    def submit(self, states: Sequence[GrammarState]) -> Future[list[bytes]]:
        """The bitmask of each (active) state, as `GrammarState.mask` would give it."""
        future = self._thread.submit(self._compute, [state._matcher for state in states])
        # Hand the GIL over now, so the worker enters llguidance (which drops it) at once rather
        # than at the interpreter's next thread switch (up to 5 ms away).
        time.sleep(0)
        return future

    def _compute(self, matchers: list[Any]) -> list[bytes]:
        size = self._mask_bytes
        buffer = bytearray(size * len(matchers))
        address = ctypes.addressof((ctypes.c_char * len(buffer)).from_buffer(buffer))
        targets = [(matcher, row) for row, matcher in enumerate(matchers)]
        self._executor.unsafe_compute_mask_ptr(targets, address, size, len(matchers))
        return [bytes(buffer[row * size : (row + 1) * size]) for row in range(len(matchers))]


def _as_lark(grammar: str | None) -> str:
    """A Lark grammar as given, or GBNF (llama.cpp's `root ::= ...`) converted to Lark."""
    assert grammar is not None
    if "::=" not in grammar:
        return grammar
    from llguidance.gbnf_to_lark import GbnfToLarkError, gbnf_to_lark

    try:
        lark: str = gbnf_to_lark(grammar)
    except GbnfToLarkError as error:  # not a ValueError
        raise ValueError(f"the GBNF grammar does not parse: {error}") from None
    return lark
