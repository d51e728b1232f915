"""What one streamed choice has sent, and the delta each engine output adds.

Owns: turning a request's cumulative `RequestOutput`s into deltas, one per token an engine
output adds, or one where it finishes the choice (as vLLM streams: an event per token, its text
possibly empty): the text not yet sent and the tokens, exit depths and log-probs generated
since the last delta. The engine's text only grows (its detokenizer holds back half characters
and the possible start of a stop string until they are settled), so a delta's text is the text
beyond what was sent, and may be empty while tokens arrive (held-back text, or a model without
a tokenizer). Slicing the cumulative text costs O(new text) per delta. Must not: decode tokens,
look for stop strings (the engine's incremental detokenizer does both) or format chunks.
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
        self._done = False

    def deltas(self, output: RequestOutput) -> list[ChoiceDelta]:
        """What `output` adds since the last delta, one delta per new token (a speculating
        engine's output may carry several; the new text goes with the last of them); none
        where it adds no token and does not finish the choice. Every output of the choice must
        pass through here, in order."""
        sequence = output.outputs[0]
        start = self._num_tokens_sent
        end = len(sequence.token_ids)
        finish_reason = sequence.finish_reason
        if self._done or (end == start and finish_reason is None):
            return []
        text = sequence.text[self._num_chars_sent :]
        self._num_chars_sent = len(sequence.text)
        self._num_tokens_sent = end
        self._done = finish_reason is not None
        last = max(start, end - 1)  # a finish without a new token: one delta, with no token
        logprobs = sequence.logprobs
        return [
            ChoiceDelta(
                text=text if index == last else "",
                token_ids=sequence.token_ids[index : index + 1],
                exit_depths=sequence.exit_depths[index : index + 1],
                logprobs=logprobs[index : index + 1] if logprobs is not None else None,
                finish_reason=finish_reason if index == last else None,
                stop_reason=sequence.stop_reason if index == last else None,
            )
            for index in range(start, last + 1)
        ]
