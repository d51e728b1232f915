"""Incremental detokenization with stop strings.

Owns: turning a request's growing token list into text at amortised O(1) cost per token (it only
ever decodes a short window of recent tokens), never emitting half a UTF-8 character while the
request runs, finding stop strings, and holding back the last (longest stop string - 1)
characters until they can no longer be the start of a stop string, so streamed text is never
taken back. At the end (`flush`) the tokens still held for an incomplete character are released
as `decode` renders them (complete characters as text, the leftover bytes as U+FFFD), so the
concatenated stream equals `tokenizer.decode(token_ids)` exactly, unless a stop string cut it.
Must not: import torch.

Why the pieces add up to `decode(token_ids)`: a window starts where the text decoded so far ended
in a complete character, so its bytes start a fresh UTF-8 sequence and decoding the window gives
exactly the characters `decode` gives for those tokens inside the whole sequence. The output is
decoded on its own (no prompt context), as `decode(token_ids)` is.
"""

from __future__ import annotations

from loopserve.tokenizer import Tokenizer


class IncrementalDetokenizer:
    def __init__(
        self, tokenizer: Tokenizer, skip_special_tokens: bool, stop: tuple[str, ...]
    ) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.stop = stop
        self._text = ""  # everything decoded so far (cut before a stop string once one is found)
        self._released = 0  # characters of _text handed out so far
        self._tokens: list[int] = []
        # Text of tokens[prefix:read] is already accounted for; tokens[read:] are not yet emitted.
        self._prefix = 0
        self._read = 0
        self._max_stop = max((len(s) for s in stop), default=0)

    @property
    def text(self) -> str:
        """The text handed out so far (what `add` and `flush` returned, concatenated)."""
        return self._text[: self._released]

    def add(self, token_ids: list[int]) -> tuple[str, str | None]:
        """Append tokens; returns (newly released text, the stop string found or None).

        When a stop string is found, the text is cut just before it and everything up to the
        cut is released.
        """
        self._tokens.extend(token_ids)
        prefix_text = self._decode(self._tokens[self._prefix : self._read])
        full_text = self._decode(self._tokens[self._prefix :])
        if len(full_text) > len(prefix_text) and not full_text.endswith("\ufffd"):
            # (otherwise an incomplete character: wait for the next token)
            self._prefix, self._read = self._read, len(self._tokens)
            stop = self._append_checking_stop(full_text[len(prefix_text) :])
            if stop is not None:
                return self.flush(), stop
        return self._release(len(self._text) - max(0, self._max_stop - 1)), None

    def flush(self) -> str:
        """Release everything (the request finished): the text held back for stop strings and the
        tokens of an incomplete character, as `decode` renders them. A stop string inside that
        tail still cuts the text there."""
        if self._read < len(self._tokens):
            prefix_text = self._decode(self._tokens[self._prefix : self._read])
            full_text = self._decode(self._tokens[self._prefix :])
            self._prefix = self._read = len(self._tokens)
            self._append_checking_stop(full_text[len(prefix_text) :])
        return self._release(len(self._text))

    def _release(self, end: int) -> str:
        start = self._released
        self._released = max(start, end)
        return self._text[start : self._released]

    def _append_checking_stop(self, new_text: str) -> str | None:
        start = len(self._text)
        self._text += new_text
        # A stop string may straddle old and new text, but must end inside the new text.
        search_from = max(0, start - self._max_stop + 1)
        best: tuple[int, str] | None = None
        for stop in self.stop:
            index = self._text.find(stop, search_from)
            if index != -1 and (best is None or index < best[0]):
                best = (index, stop)
        if best is None:
            return None
        index, stop = best
        self._text = self._text[:index]
        return stop

    def _decode(self, token_ids: list[int]) -> str:
        return self.tokenizer.decode(token_ids, skip_special_tokens=self.skip_special_tokens)
