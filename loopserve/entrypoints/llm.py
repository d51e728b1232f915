"""`LLM`: the offline Python API (a thin wrapper around `Engine`, not a subclass of it), in vLLM's
shape: `generate` and `chat` return one `RequestOutput` per prompt, whose `.outputs` hold its `n`
sequences (`CompletionOutput`: `text`, `token_ids`, `exit_depths`, `logprobs`, `finish_reason`);
`n` is `SamplingParams.n` or the `n=` keyword (which must agree when both are given).

Owns: turning a batch of prompts (or conversations, rendered with the chat template) into ordered
outputs, `n` sequences per prompt as `n` engine requests (seeds `seed + i`, as the server does),
and a progress bar for large batches. Must not: duplicate engine logic; everything goes through
`Engine.add_request` and `Engine.step`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import replace
from typing import Any

from loopserve.config import EngineConfig
from loopserve.engine.engine import Engine
from loopserve.outputs import RequestMetrics, RequestOutput
from loopserve.sampling_params import SamplingParams
from loopserve.tokenizer import Tokenizer

Prompt = str | Sequence[int]
# One chat message: {"role": ..., "content": str or [{"type": "text", "text": ...}, ...]}.
Message = Mapping[str, Any]

_MAX_SEED = 2**63


class LLM:
    """Generate with a looped model.

    Args:
        model: checkpoint directory (HF layout), or "ouro-tiny"; None uses the built-in tiny model.
        **engine_options: any setting of `EngineConfig` or its `SchedulerConfig` (device, dtype,
            kv_layout, attention_backend, exit_mode, scheduling, max_num_seqs, seed, ...).
    """

    def __init__(self, model: str | None = None, **engine_options: Any) -> None:
        self.engine = Engine(EngineConfig.from_options(model=model, **engine_options))

    @property
    def tokenizer(self) -> Tokenizer | None:
        return self.engine.tokenizer

    def get_default_sampling_params(self) -> SamplingParams:
        """What `sampling_params=None` means: the checkpoint's generation_config.json sampling
        fields over `SamplingParams()`'s defaults."""
        return self.engine.default_sampling_params()

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        n: int | None = None,
        use_tqdm: bool | None = None,
    ) -> list[RequestOutput]:
        """Generate for every prompt; outputs come back in input order.

        Args:
            prompts: a string, a list of token ids, or a list of either.
            sampling_params: one for all prompts, or one per prompt (default:
                `get_default_sampling_params()`).
            n: sequences per prompt (default: each params' `n`); sequence i of a seeded request
                uses seed + i.
            use_tqdm: show a progress bar; None shows one for more than 8 prompts.
        Returns:
            One finished RequestOutput per prompt, with `n` sequences in `.outputs`.
        Raises:
            ValueError: bad input, or `n` differs from a params' `n` (other than 1).
        """
        batch = _as_prompt_list(prompts)
        params = self._params_list(sampling_params, len(batch))
        return self._generate(batch, params, n, use_tqdm)

    def chat(
        self,
        messages: Sequence[Message] | Sequence[Sequence[Message]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        n: int | None = None,
        use_tqdm: bool | None = None,
        chat_template: str | None = None,
        chat_template_kwargs: Mapping[str, Any] | None = None,
        add_generation_prompt: bool = True,
        reasoning_parser: str = "auto",
        tools: Sequence[Mapping[str, Any]] | None = None,
        tool_choice: str | Mapping[str, Any] = "auto",
        parallel_tool_calls: bool = True,
        tool_call_parser: str = "auto",
    ) -> list[RequestOutput]:
        """Answer conversations: each is rendered with the chat template and generated from.

        Args:
            messages: one conversation (a list of messages) or a list of conversations.
            sampling_params: as in `generate`.
            n: sequences per conversation, as in `generate`.
            use_tqdm: as in `generate`.
            chat_template: template text overriding the checkpoint's.
            chat_template_kwargs: extra template variables, e.g. {"enable_thinking": True}.
            add_generation_prompt: end the prompt with the header of the assistant's turn.
            reasoning_parser: as the server's `--reasoning-parser` (auto: `deepseek_r1` when the
                template writes <think>); with one, each sequence's `reasoning_content` and
                `content` hold its text split (its `text` stays whole); a params'
                `structured_outputs` then constrains the reply after its `</think>`.
            tools: OpenAI tool specs (`{"type": "function", "function": {"name", "parameters"}}`)
                for the template to render; each sequence's `tool_calls` then holds the calls
                parsed out of its reply and `content` the text around them.
            tool_choice: "auto" (the model may call the tools), "none" (they are not offered),
                "required" (the reply is one or more calls) or a named function
                (`{"type": "function", "function": {"name": ...}}`: one call of it); the last
                two are enforced by a grammar, so the calls always parse and their arguments
                match the functions' schemas.
            parallel_tool_calls: False: a "required" reply is exactly one call.
            tool_call_parser: as the server's `--tool-call-parser` (auto: `hermes` when the
                template writes <tool_call>).
        Returns:
            One RequestOutput per conversation; its `prompt` is the rendered text.
        Raises:
            ValueError: no chat template, the template refused a conversation, malformed tools,
                an unknown tool_choice (or one naming no tool), tools without a tool-call
                parser, tool_choice required or named with params that carry their own
                structured_outputs, or `n` differs from a params' `n`.
        """
        from loopserve.entrypoints.chat_prompts import check_tools, render_conversations
        from loopserve.entrypoints.reasoning import (
            after_reasoning,
            opens_reasoning,
            split_reasoning,
            splits_reasoning,
        )
        from loopserve.entrypoints.tool_calls import (
            parse_tool_calls,
            parses_tool_calls,
            tool_call_constraint,
        )

        offered = check_tools(tools) if tools is not None and tool_choice != "none" else None
        calls_only = tool_call_constraint(offered or [], tool_choice, parallel_tool_calls)
        texts, token_ids, template = render_conversations(
            messages,
            self.tokenizer,
            chat_template,
            chat_template_kwargs,
            add_generation_prompt,
            offered,
        )
        split = splits_reasoning(reasoning_parser, template)  # a bad name fails before generating
        if offered is not None and not parses_tool_calls(tool_call_parser, template):
            raise ValueError(
                "tools were given but no tool-call parser runs (the chat template writes no "
                "<tool_call>, or tool_call_parser is 'none'); pass tool_call_parser='hermes'"
            )
        params = self._params_list(sampling_params, len(texts))
        if calls_only is not None:
            if any(p.structured_outputs is not None for p in params):
                raise ValueError(
                    "tool_choice required or named constrains the reply itself: leave "
                    "structured_outputs unset in the sampling params"
                )
            params = [replace(p, structured_outputs=calls_only) for p in params]
        if split:
            params = [
                replace(
                    p,
                    structured_outputs=after_reasoning(p.structured_outputs, opens_reasoning(text)),
                )
                for p, text in zip(params, texts, strict=True)
            ]
        outputs = self._generate(list(token_ids), params, n, use_tqdm)
        for output, text in zip(outputs, texts, strict=True):
            output.prompt = text
            for sequence in output.outputs:
                content = sequence.text
                if split:
                    sequence.reasoning_content, content = split_reasoning(
                        content, opens_reasoning(text)
                    )
                if offered is not None:
                    content, calls = parse_tool_calls(content)
                    sequence.tool_calls = calls
                if split or offered is not None:
                    sequence.content = content
        return outputs

    def _params_list(
        self, params: SamplingParams | Sequence[SamplingParams] | None, count: int
    ) -> list[SamplingParams]:
        if params is None:
            return [self.get_default_sampling_params()] * count
        if isinstance(params, SamplingParams):
            return [params] * count
        params = list(params)
        if len(params) != count:
            raise ValueError(f"got {len(params)} SamplingParams for {count} prompts")
        return params

    def _generate(
        self,
        batch: list[Prompt],
        params: list[SamplingParams],
        n: int | None,
        use_tqdm: bool | None,
    ) -> list[RequestOutput]:
        counts = [_sequence_count(request_params, n) for request_params in params]
        groups: list[list[str]] = []
        try:
            for prompt, request_params, count in zip(batch, params, counts, strict=True):
                groups.append([])
                for index in range(count):
                    sequence_params = _sequence_params(request_params, index)
                    groups[-1].append(self.engine.add_request(prompt, sequence_params))
        except ValueError as error:
            for request_id in (request_id for group in groups for request_id in group):
                self.engine.abort(request_id)  # bad input loses nothing: undo what was queued
            raise ValueError(f"prompt {len(groups) - 1}: {error}") from None
        show = len(batch) > 8 if use_tqdm is None else use_tqdm
        finished = self._run(groups, show)
        return [_merged([finished[request_id] for request_id in group]) for group in groups]

    def _run(self, groups: list[list[str]], show_progress: bool) -> dict[str, RequestOutput]:
        """Step the engine until every request of `groups` finished; their final outputs."""
        finished: dict[str, RequestOutput] = {}
        group_of = {request_id: index for index, group in enumerate(groups) for request_id in group}
        left = [len(group) for group in groups]
        progress = None
        if show_progress:
            from tqdm import tqdm

            progress = tqdm(total=len(groups), desc="generating", unit="req", dynamic_ncols=True)
        generated = 0
        try:
            while self.engine.has_unfinished_requests():
                for output in self.engine.step():
                    generated += len(output.outputs[0].new_token_ids)
                    if output.finished:
                        finished[output.request_id] = output
                        left[group_of[output.request_id]] -= 1
                        if progress is not None and not left[group_of[output.request_id]]:
                            progress.update(1)
                if progress is not None:
                    rate = generated / max(progress.format_dict["elapsed"], 1e-9)
                    progress.set_postfix(tok_per_s=f"{rate:.1f}", refresh=False)
        except BaseException:
            for request_id in group_of:
                if request_id not in finished:
                    self.engine.abort(request_id)
            raise
        finally:
            if progress is not None:
                progress.close()
        return finished


def _sequence_count(params: SamplingParams, n: int | None) -> int:
    """Sequences for a prompt: the `n=` keyword if given, else `params.n`; both given must agree
    (a params' default `n=1` gives way to the keyword)."""
    if n is None:
        return params.n
    if n < 1:
        raise ValueError(f"n must be at least 1, got {n}")
    if params.n not in (1, n):
        raise ValueError(
            f"n={n} was given to generate/chat but SamplingParams.n is {params.n}; give one of them"
        )
    return n


def _sequence_params(params: SamplingParams, index: int) -> SamplingParams:
    """Sequence `index` of a request, one engine request (n=1): seed + index when seeded."""
    seed = params.seed
    if index and seed is not None:
        seed = (seed + index) % _MAX_SEED
    if params.n == 1 and seed == params.seed:
        return params
    return replace(params, n=1, seed=seed)


def _merged(outputs: list[RequestOutput]) -> RequestOutput:
    """The n engine requests of one prompt as one output with n sequences (the first's id)."""
    first = outputs[0]
    if len(outputs) == 1:
        return first
    completions = [replace(output.outputs[0], index=index) for index, output in enumerate(outputs)]
    return RequestOutput(
        request_id=first.request_id,
        prompt=first.prompt,
        prompt_token_ids=first.prompt_token_ids,
        outputs=completions,
        finished=all(output.finished for output in outputs),
        metrics=_merged_metrics([output.metrics for output in outputs]),
    )


def _merged_metrics(metrics: list[RequestMetrics]) -> RequestMetrics:
    """One request's times from its sequences': first arrival, first token, last finish."""

    def earliest(values: list[float | None]) -> float | None:
        known = [value for value in values if value is not None]
        return min(known) if known else None

    finished = [item.finished_time for item in metrics]
    return RequestMetrics(
        arrival_time=min(item.arrival_time for item in metrics),
        first_scheduled_time=earliest([item.first_scheduled_time for item in metrics]),
        first_token_time=earliest([item.first_token_time for item in metrics]),
        finished_time=None if None in finished else max(t for t in finished if t is not None),
        token_times=sorted(time for item in metrics for time in item.token_times),
    )


def _is_token_ids(value: object) -> bool:
    return (
        isinstance(value, Sequence)
        and not isinstance(value, str)
        and all(isinstance(item, int) for item in value)
    )


def _as_prompt_list(prompts: Prompt | Sequence[Prompt]) -> list[Prompt]:
    if isinstance(prompts, str):
        return [prompts]
    if prompts and _is_token_ids(prompts):
        return [[int(token) for token in prompts]]  # type: ignore[arg-type]
    batch: list[Prompt] = []
    for index, prompt in enumerate(prompts):
        if not isinstance(prompt, str) and not _is_token_ids(prompt):
            raise TypeError(f"prompt {index} must be a string or a list of token ids")
        batch.append(prompt)  # type: ignore[arg-type]
    return batch
