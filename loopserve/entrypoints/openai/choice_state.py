"""What one streamed choice has sent, and the next delta to send.

Owns: turning a request's cumulative `RequestOutput`s into deltas: the text not yet sent and the
tokens, exit depths and log-probs generated since the last delta. The engine's text only grows
(its detokenizer holds back half characters and the possible start of a stop string until they
are settled), so a delta is the text beyond what was sent. Slicing the cumulative text costs
O(new text) per delta. Must not: decode tokens, look for stop strings (the engine's incremental
detokenizer does both) or format chunks.
"""

from __future__ import annotations

from dataclasses import dataclass

from loopserve.outputs import RequestOutput, TokenLogprobs


@dataclass(frozen=True, slots=True)
class ChoiceDelta:
    text: str
    token_ids: list[int]
    exit_depths: list[int]
    logprobs: list[TokenLogprobs] | None
    finish_reason: str | None  # set on the last delta
    stop_reason: str | int | None


class ChoiceState:
    def __init__(self) -> None:
        self._num_chars_sent = 0
        self._num_tokens_sent = 0
        self._latest: RequestOutput | None = None
        self._done = False

    def update(self, output: RequestOutput) -> None:
        self._latest = output

    def take_delta(self) -> ChoiceDelta | None:
        """What to send now, or None while no new text is visible and the choice runs on."""
        if self._latest is None or self._done:
            return None
        output = self._latest.outputs[0]
        text = output.text[self._num_chars_sent :]
        if not text and not output.finished:
            return None  # half a character, or text held back: carry the tokens forward
        start = self._num_tokens_sent
        self._num_chars_sent = len(output.text)
        self._num_tokens_sent = len(output.token_ids)
        self._done = output.finished
        return ChoiceDelta(
            text=text,
            token_ids=output.token_ids[start:],
            exit_depths=output.exit_depths[start:],
            logprobs=output.logprobs[start:] if output.logprobs is not None else None,
            finish_reason=output.finish_reason if output.finished else None,
            stop_reason=output.stop_reason,
        )
