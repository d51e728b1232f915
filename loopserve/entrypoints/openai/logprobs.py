"""Log-probabilities in the two OpenAI formats.

Owns: token strings for log-probs (each token decoded on its own, O(1) per token; without a
tokenizer `token_id:N` as in vLLM), the completions format (`tokens`, `token_logprobs`,
`top_logprobs` dicts that include the sampled token, `text_offset` into the choice's text: all
equal without a tokenizer, whose text is empty) and the chat format
(`content` entries with `bytes` and `top_logprobs`). Must not: compute log-probs (the engine
does) or emit -inf, which JSON cannot carry (it becomes -9999.0, as in vLLM).
"""

from __future__ import annotations

from collections.abc import Sequence

from loopserve.entrypoints.openai.responses import (
    ChatLogprobs,
    ChatTokenLogprob,
    CompletionLogprobs,
    TopLogprob,
)
from loopserve.outputs import TokenLogprobs
from loopserve.tokenizer import Tokenizer

_FLOOR = -9999.0


class LogprobFormatter:
    def __init__(self, tokenizer: Tokenizer | None) -> None:
        self._tokenizer = tokenizer

    def token_text(self, token_id: int) -> str:
        if self._tokenizer is None:
            return f"token_id:{token_id}"
        return self._tokenizer.decode([token_id], skip_special_tokens=False)

    def completion(
        self, entries: Sequence[TokenLogprobs], text_offset: int
    ) -> tuple[CompletionLogprobs, int]:
        """The completions format for `entries`; offsets count from `text_offset`.

        Returns:
            The log-probs and the text offset after the last token.
        """
        result = CompletionLogprobs(tokens=[], token_logprobs=[], top_logprobs=[], text_offset=[])
        for entry in entries:
            token = self.token_text(entry.token_id)
            top = {self.token_text(token_id): _finite(logprob) for token_id, logprob in entry.top}
            top[token] = _finite(entry.logprob)  # the sampled token wins a clash of strings
            result.tokens.append(token)
            result.token_logprobs.append(_finite(entry.logprob))
            result.top_logprobs.append(top)
            result.text_offset.append(text_offset)
            # Offsets index the choice's text; without a tokenizer that text is empty, so the
            # `token_id:N` strings take no room in it.
            text_offset += len(token) if self._tokenizer is not None else 0
        return result, text_offset

    def chat(self, entries: Sequence[TokenLogprobs]) -> ChatLogprobs:
        """The chat format for `entries` (`top_logprobs` as many as the engine returned)."""
        content = []
        for entry in entries:
            token = self.token_text(entry.token_id)
            top = [self._top(self.token_text(token_id), logprob) for token_id, logprob in entry.top]
            content.append(
                ChatTokenLogprob(
                    token=token,
                    logprob=_finite(entry.logprob),
                    bytes=list(token.encode("utf-8")),
                    top_logprobs=top,
                )
            )
        return ChatLogprobs(content=content)

    @staticmethod
    def _top(token: str, logprob: float) -> TopLogprob:
        return TopLogprob(token=token, logprob=_finite(logprob), bytes=list(token.encode("utf-8")))


def _finite(logprob: float) -> float:
    return max(logprob, _FLOOR)
