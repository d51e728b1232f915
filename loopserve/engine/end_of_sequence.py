"""Which generated tokens end a request: a checkpoint's end-of-sequence ids.

Owns: the rule, resolved once per engine. The set is the union of
1. config.json's `eos_token_id` (one id or a list),
2. generation_config.json's `eos_token_id`,
3. the tokenizer's eos token (`eos_token` in tokenizer_config.json),
4. a chat model's end-of-turn token: each of `END_OF_TURN_TOKENS` that the chat template writes
   and the tokenizer holds as one token. Ouro's ChatML template ends every turn with
   `<|im_end|>` (id 2) while all its eos fields say `<|endoftext|>` (id 0), so without this rule a
   chat answer would never stop.
Ids outside the model's vocabulary are left out (the model cannot generate them). A request with
`ignore_eos` ignores the whole set; its `stop_token_ids` are added to it.
Must not: import torch, or decide when a request stops (the scheduler and the device decode step
apply the set).
"""

from __future__ import annotations

from dataclasses import dataclass

from loopserve.models.generation_config import GenerationDefaults
from loopserve.models.model_config import LoopedConfig
from loopserve.tokenizer import Tokenizer

# Tokens that end an assistant turn in common chat formats (ChatML, Llama 3, Phi-3, Gemma, and
# Huginn-0125's, whose official generation stops at `<|end_turn|>` too).
END_OF_TURN_TOKENS = ("<|im_end|>", "<|eot_id|>", "<|end|>", "<end_of_turn>", "<|end_turn|>")


@dataclass(frozen=True, slots=True)
class EndOfSequence:
    """The end-of-sequence ids of a checkpoint and why each is one (for the start-up log)."""

    reasons: tuple[tuple[int, str], ...]  # (token id, where it comes from), ascending ids

    @property
    def token_ids(self) -> frozenset[int]:
        return frozenset(token for token, _ in self.reasons)

    def describe(self) -> str:
        if not self.reasons:
            return "none (requests stop at max_tokens, stop strings or stop_token_ids)"
        return ", ".join(f"{token} ({reason})" for token, reason in self.reasons)


def end_of_sequence(
    model: LoopedConfig, generation: GenerationDefaults, tokenizer: Tokenizer | None
) -> EndOfSequence:
    """The end-of-sequence set of a checkpoint (see the module docstring for the rule)."""
    found: dict[int, list[str]] = {}

    def add(token: int | None, reason: str) -> None:
        if token is not None and 0 <= token < model.vocab_size:
            found.setdefault(token, []).append(reason)

    for token in model.eos_token_ids:
        add(token, "config.json eos_token_id")
    for token in generation.eos_token_ids:
        add(token, "generation_config.json eos_token_id")
    if tokenizer is not None:
        if tokenizer.eos_token is not None:
            add(
                tokenizer.token_to_id(tokenizer.eos_token),
                f"tokenizer eos_token {tokenizer.eos_token}",
            )
        for token_text in end_of_turn_tokens(tokenizer):
            add(tokenizer.token_to_id(token_text), f"{token_text} ends chat turns")
    return EndOfSequence(tuple((token, ", ".join(found[token])) for token in sorted(found)))


def end_of_turn_tokens(tokenizer: Tokenizer) -> list[str]:
    """The END_OF_TURN_TOKENS that the tokenizer's chat template writes and its vocabulary holds."""
    template = tokenizer.chat_template
    if template is None:
        return []
    return [
        token
        for token in END_OF_TURN_TOKENS
        if token in template and tokenizer.token_to_id(token) is not None
    ]
