"""Hard limits on what one client can ask of the server, enforced before any work.

Owns: `ConcurrencyLimitMiddleware` (pure ASGI: at most N generation requests in flight, counted
until their response, streamed or not, has ended; more get 429 with `Retry-After`) and
`RequestLimits`, the per-request caps resolved when the app is built (choices, stop strings and
stop token ids, log-probs, prompt bytes before tokenizing), with the checks that enforce them:
each refusal is a 400 naming the field and the flag that sets the limit. Must not: validate
field types or ranges (protocol models and `SamplingParams` do) or block the event loop.

Why these caps: every generated token of every choice is checked against every stop string, and
tokenizing holds the interpreter lock, so without them one request could stall all others.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from starlette.types import ASGIApp, Receive, Scope, Send

from loopserve.entrypoints.openai.config import ServerConfig
from loopserve.entrypoints.openai.errors import OpenAIError, bad_request
from loopserve.entrypoints.openai.paths import route_path
from loopserve.tokenizer import Tokenizer

# Seconds a client told 429 should wait before it retries.
RETRY_AFTER_S = 1


class ConcurrencyLimitMiddleware:
    def __init__(self, app: ASGIApp, limit: int, paths: Iterable[str]) -> None:
        self.app = app
        self.limit = limit
        self.paths = frozenset(paths)
        self.in_flight = 0  # touched only on the event loop

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or route_path(scope) not in self.paths:
            await self.app(scope, receive, send)
            return
        if self.in_flight >= self.limit:
            error = OpenAIError(
                429,
                f"too many concurrent requests: the limit is {self.limit}; retry later",
                error_type="rate_limit_error",
                code="too_many_requests",
                headers={"Retry-After": str(RETRY_AFTER_S)},
            )
            await error.response()(scope, receive, send)
            return
        self.in_flight += 1
        try:
            await self.app(scope, receive, send)
        finally:
            self.in_flight -= 1


@dataclass(frozen=True, slots=True)
class RequestLimits:
    max_choices: int  # n times the number of prompts
    max_stop_strings: int
    max_stop_bytes: int  # UTF-8 bytes of all stop strings together
    max_stop_token_ids: int  # stop token ids plus the model's end-of-sequence ids
    max_logprobs: int
    max_prompt_bytes: int  # UTF-8 bytes of one text prompt

    @classmethod
    def resolve(
        cls,
        config: ServerConfig,
        tokenizer: Tokenizer | None,
        max_model_len: int,
        max_stop_token_ids: int,
    ) -> RequestLimits:
        """The limits of `config`, with the prompt-bytes default worked out for the model."""
        max_prompt_bytes = config.max_prompt_bytes
        if max_prompt_bytes is None:
            max_prompt_bytes = max_model_len * longest_token_bytes(tokenizer)
        return cls(
            max_choices=config.max_choices_per_request,
            max_stop_strings=config.max_stop_strings,
            max_stop_bytes=config.max_stop_bytes,
            max_stop_token_ids=max_stop_token_ids,
            max_logprobs=config.max_logprobs,
            max_prompt_bytes=max_prompt_bytes,
        )

    def check_choices(self, num_prompts: int, n: int) -> None:
        if num_prompts * n > self.max_choices:
            raise bad_request(
                f"n: {num_prompts} prompt(s) times n={n} is more than the {self.max_choices} "
                "choices one request may ask for (--max-choices-per-request)",
                "n",
            )

    def check_stop(self, stop: Sequence[str], stop_token_ids: set[int]) -> None:
        """`stop_token_ids` together with the model's end-of-sequence ids the request keeps."""
        if len(stop) > self.max_stop_strings:
            message = f"at most {self.max_stop_strings} stop strings, got {len(stop)}"
            raise bad_request(f"stop: {message} (--max-stop-strings)", "stop")
        num_bytes = sum(len(text.encode()) for text in stop)
        if num_bytes > self.max_stop_bytes:
            message = (
                f"the stop strings have {num_bytes} UTF-8 bytes, more than {self.max_stop_bytes}"
            )
            raise bad_request(f"stop: {message} (--max-stop-bytes)", "stop")
        if len(stop_token_ids) > self.max_stop_token_ids:
            raise bad_request(
                f"stop_token_ids: at most {self.max_stop_token_ids} stop token ids, counting the "
                f"model's end-of-sequence ids (unless ignore_eos), got {len(stop_token_ids)}",
                "stop_token_ids",
            )

    def check_logprobs(self, logprobs: int | None, param: str) -> None:
        if logprobs is not None and logprobs > self.max_logprobs:
            raise bad_request(
                f"{param}: at most {self.max_logprobs} log-probability alternatives, got "
                f"{logprobs} (--max-logprobs)",
                param,
            )

    def check_prompt_bytes(self, text: str, param: str) -> None:
        """Before tokenizing: a text longer than this cannot fit (or is refused by the server)."""
        if len(text) > self.max_prompt_bytes or len(text.encode()) > self.max_prompt_bytes:
            raise bad_request(
                f"{param}: the prompt text has more than {self.max_prompt_bytes} UTF-8 bytes, the "
                "most this server tokenizes (--max-prompt-bytes)",
                param,
            )


def longest_token_bytes(tokenizer: Tokenizer | None) -> int:
    """UTF-8 bytes of the model's longest token (1 without a tokenizer: text is refused then).

    A text of more than max_model_len times this many bytes has more tokens than fit the context.
    """
    if tokenizer is None:
        return 1
    decoded = (
        tokenizer.decode([index], skip_special_tokens=False)
        for index in range(tokenizer.vocab_size)
    )
    return max((len(text.encode()) for text in decoded), default=1)
