"""Incremental detokenization with stop strings.

Owns: turning a request's growing token list into text at amortised O(1) cost per token (it only
ever decodes a short window of recent tokens), never emitting half a UTF-8 character, and finding
stop strings. Must not: import torch.
"""

from __future__ import annotations

from loopserve.tokenizer import Tokenizer

# Prompt tokens kept as left context so the first output tokens decode with the right spacing.
_CONTEXT_TOKENS = 5


class IncrementalDetokenizer:
    def __init__(
        self,
        tokenizer: Tokenizer,
        prompt_token_ids: list[int],
        skip_special_tokens: bool,
        stop: tuple[str, ...],
    ) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.stop = stop
        self.text = ""
        self._tokens = list(prompt_token_ids[-_CONTEXT_TOKENS:])
        # Text of tokens[prefix:read] is already accounted for; tokens[read:] are not yet emitted.
        self._prefix = 0
        self._read = len(self._tokens)
        self._max_stop = max((len(s) for s in stop), default=0)

    def add(self, token_ids: list[int]) -> tuple[str, str | None]:
        """Append tokens; returns (new text, the stop string found or None).

        When a stop string is found, the text is cut just before it and nothing after it is
        returned.
        """
        self._tokens.extend(token_ids)
        prefix_text = self._decode(self._tokens[self._prefix : self._read])
        full_text = self._decode(self._tokens[self._prefix :])
        if len(full_text) <= len(prefix_text) or full_text.endswith("\ufffd"):
            return "", None  # an incomplete character: wait for the next token
        new_text = full_text[len(prefix_text) :]
        self._prefix, self._read = self._read, len(self._tokens)
        return self._append_checking_stop(new_text)

    def _append_checking_stop(self, new_text: str) -> tuple[str, str | None]:
        start = len(self.text)
        self.text += new_text
        if not self.stop:
            return new_text, None
        # A stop string may straddle old and new text, but must end inside the new text.
        search_from = max(0, start - self._max_stop + 1)
        best: tuple[int, str] | None = None
        for stop in self.stop:
            index = self.text.find(stop, search_from)
            if index != -1 and (best is None or index < best[0]):
                best = (index, stop)
        if best is None:
            return new_text, None
        index, stop = best
        self.text = self.text[:index]
        return self.text[start:], stop

    def _decode(self, token_ids: list[int]) -> str:
        return self.tokenizer.decode(token_ids, skip_special_tokens=self.skip_special_tokens)
