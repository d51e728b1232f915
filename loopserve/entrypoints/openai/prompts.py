"""From a validated request to engine requests: prompts, output budgets and sampling params.

Owns: tokenizing prompts (run off the event loop; a text's size is checked first, token ids are
checked against the vocabulary and the context before anything decodes them), the context-length
check and the default `max_tokens` (the checkpoint's `max_new_tokens` if it sets one, within what
is left of the context, else what is left, as in vLLM), `n` fan-out with per-choice seeds
(`seed + choice`, as in vLLM), and the `SamplingParams` of each choice (fields the request leaves
unset take the checkpoint's generation_config.json defaults). Must not: talk to the engine or
format responses.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from loopserve.entrypoints.openai.context import ModelInfo
from loopserve.entrypoints.openai.engine_thread import EngineRequest
from loopserve.entrypoints.openai.errors import OpenAIError, bad_request
from loopserve.entrypoints.openai.limits import RequestLimits
from loopserve.entrypoints.openai.protocol import GenerationFields, PromptInput, field_named_in
from loopserve.models.generation_config import SamplingDefaults
from loopserve.sampling_params import SamplingParams
from loopserve.structured_outputs import StructuredOutputsParams


@dataclass(frozen=True, slots=True)
class Prompt:
    token_ids: list[int]
    text: str | None  # the prompt as text, for echo (None when not needed or no tokenizer)


@dataclass(frozen=True, slots=True)
class ChoicePlan:
    """One choice of a response: which prompt it continues and its engine request."""

    index: int  # the choice's `index` in the response
    prompt_index: int
    prompt: Prompt
    request: EngineRequest


@dataclass(frozen=True, slots=True)
class ChoiceOptions:
    """What the request asks of every choice, beyond the generation fields."""

    max_tokens: int | None  # None: what is left of the context
    logprobs: int | None
    prompt_param: str  # the request field that holds the prompt, for error messages


def prompt_batch(prompt: PromptInput) -> list[str | list[int]]:
    """The prompts of a completion request: one text or token-id list per item of the batch."""
    if isinstance(prompt, str):
        return [prompt]
    if prompt and isinstance(prompt[0], int):
        return [prompt]
    return list(prompt)  # type: ignore[arg-type]


def tokenize_prompts(
    batch: Sequence[str | list[int]], model: ModelInfo, limits: RequestLimits, keep_text: bool
) -> list[Prompt]:
    """The prompts of a completion request (run in a worker thread: tokenizing can be slow)."""
    if not batch:
        raise bad_request("prompt must not be empty", "prompt")
    return [_prompt(item, model, limits, keep_text, special_tokens=True) for item in batch]


def tokenize_chat_prompt(text: str, model: ModelInfo, limits: RequestLimits) -> Prompt:
    """A rendered chat prompt; the template already placed any special tokens."""
    return _prompt(text, model, limits, keep_text=False, special_tokens=False, param="messages")


def _prompt(
    item: str | list[int],
    model: ModelInfo,
    limits: RequestLimits,
    keep_text: bool,
    special_tokens: bool,
    param: str = "prompt",
) -> Prompt:
    tokenizer = model.tokenizer
    if isinstance(item, str):
        if tokenizer is None:
            raise bad_request("this model has no tokenizer: give the prompt as token ids", param)
        limits.check_prompt_bytes(item, param)
        token_ids = tokenizer.encode(item, add_special_tokens=special_tokens)
        return Prompt(token_ids, item if keep_text else None)
    if item and not 0 <= min(item) <= max(item) < model.vocab_size:
        bad = next(token for token in item if not 0 <= token < model.vocab_size)
        message = f"prompt: token id {bad} is outside the vocabulary [0, {model.vocab_size})"
        raise bad_request(message, param)
    if len(item) >= model.max_model_len:
        raise _no_room(len(item), model.max_model_len, param)
    text = None
    if keep_text and tokenizer is not None:
        text = tokenizer.decode(item, skip_special_tokens=False)
    return Prompt(list(item), text)


def plan_choices(
    base_id: str,
    prompts: Sequence[Prompt],
    request: GenerationFields,
    options: ChoiceOptions,
    max_model_len: int,
    defaults: SamplingDefaults | None = None,
    constraint: StructuredOutputsParams | None = None,
) -> list[ChoicePlan]:
    """One engine request per (prompt, choice); choice `index` = prompt_index * n + choice
    (the number of choices was checked against the server's limit before tokenizing).
    `defaults`: the checkpoint's sampling defaults for the fields the request leaves unset;
    `constraint`: what every choice's output must match (`constraints.request_constraint`)."""
    defaults = defaults or SamplingDefaults()
    plans = []
    for prompt_index, prompt in enumerate(prompts):
        max_tokens = output_budget(len(prompt.token_ids), options, max_model_len)
        if options.max_tokens is None and defaults.max_tokens is not None:
            max_tokens = min(max_tokens, defaults.max_tokens)
        for choice in range(request.n):
            seed = None if request.seed is None else request.seed + choice
            params = sampling_params(
                request, max_tokens, options.logprobs, seed, defaults, constraint
            )
            index = prompt_index * request.n + choice
            engine_request = EngineRequest(f"{base_id}-{index}", prompt.token_ids, params)
            plans.append(ChoicePlan(index, prompt_index, prompt, engine_request))
    return plans


def stop_ids(request: GenerationFields, model: ModelInfo) -> set[int]:
    """The token ids a choice stops on: its `stop_token_ids` and, unless it ignores EOS, the
    model's end-of-sequence ids (the engine caps how many one request may have)."""
    ids = set(request.stop_token_ids)
    return ids if request.ignore_eos else ids | model.eos_token_ids


def output_budget(num_prompt_tokens: int, options: ChoiceOptions, max_model_len: int) -> int:
    """max_tokens for one prompt; a 400 OpenAIError when it does not fit the context."""
    if num_prompt_tokens == 0:
        raise bad_request("the prompt is empty", options.prompt_param)
    if options.max_tokens is None:
        if num_prompt_tokens >= max_model_len:
            raise _no_room(num_prompt_tokens, max_model_len, options.prompt_param)
        return max_model_len - num_prompt_tokens
    if num_prompt_tokens + options.max_tokens > max_model_len:
        raise bad_request(
            f"This model's maximum context length is {max_model_len} tokens. However, you "
            f"requested {num_prompt_tokens + options.max_tokens} tokens ({num_prompt_tokens} in "
            f"the prompt, {options.max_tokens} in the completion). Please reduce the length of "
            "the prompt or the completion.",
            "max_tokens",
        )
    return options.max_tokens


def sampling_params(
    request: GenerationFields,
    max_tokens: int,
    logprobs: int | None,
    seed: int | None,
    defaults: SamplingDefaults | None = None,
    constraint: StructuredOutputsParams | None = None,
) -> SamplingParams:
    """The engine's params for one choice; a 400 OpenAIError when they are invalid. Sampling
    fields the request leaves unset take `defaults`, then SamplingParams' own."""
    fields = (defaults or SamplingDefaults()).overrides()
    fields.pop("max_tokens", None)  # the budget is settled by the caller
    for name in ("temperature", "top_p", "top_k", "min_p"):
        if getattr(request, name) is not None:
            fields[name] = getattr(request, name)
    try:
        return SamplingParams(
            **fields,
            max_tokens=max_tokens,
            seed=seed,
            ignore_eos=request.ignore_eos,
            stop_token_ids=tuple(request.stop_token_ids),
            stop=request.stop_strings,
            logprobs=logprobs,
            skip_special_tokens=request.skip_special_tokens,
            priority=request.priority,
            min_loops=request.min_loops,
            max_loops=request.max_loops,
            exit_threshold=request.exit_threshold,
            structured_outputs=constraint,
        )
    except (TypeError, ValueError) as error:
        raise bad_request(str(error), field_named_in(str(error))) from None


def _no_room(num_prompt_tokens: int, max_model_len: int, param: str) -> OpenAIError:
    return bad_request(
        f"{param}: This model's maximum context length is {max_model_len} tokens, and the prompt "
        f"has {num_prompt_tokens} tokens: no room is left for the completion.",
        param,
    )
