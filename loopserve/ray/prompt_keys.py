"""The ingress's view of a request's prompt: just enough of it to route by prefix affinity.

Owns: `PromptKeys`, which reads a generation request's body the way its endpoint will (the same
protocol models, chat template and tokenizer, loaded from the checkpoint without its weights),
tokenizes only the start of the prompt (the characters that can hold the affinity pages) and
returns its affinity key. Must not: refuse requests: a body it cannot read has no key, and the
replica that gets it answers with the error, as the single-process server would.

Only the first prompt of a batch and only its first choice count; tokenizing a cut text can
differ from the whole text's tokens in the last few tokens before the cut, which only blurs the
last page of the key, the same way for every request that shares those characters.
"""

from __future__ import annotations

import json

from loopserve.config import EngineConfig
from loopserve.entrypoints.openai.body import BodyLimits, parse_json_body
from loopserve.entrypoints.openai.chat_template import (
    ChatTemplate,
    ChatTemplateError,
    load_chat_template,
)
from loopserve.entrypoints.openai.config import ServerConfig
from loopserve.entrypoints.openai.errors import OpenAIError
from loopserve.entrypoints.openai.limits import longest_token_bytes
from loopserve.entrypoints.openai.prompts import prompt_batch
from loopserve.entrypoints.openai.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    parse_request,
)
from loopserve.models.builtin import resolve_model_dir
from loopserve.ray.routing import affinity_key
from loopserve.tokenizer import Tokenizer

CHAT_PATH = "/v1/chat/completions"
COMPLETIONS_PATH = "/v1/completions"


class PromptKeys:
    def __init__(
        self,
        tokenizer: Tokenizer | None,
        chat_template: ChatTemplate | None,
        body_limits: BodyLimits,
        block_size: int,
        pages: int,
    ) -> None:
        self._tokenizer = tokenizer
        self._chat_template = chat_template
        self._body_limits = body_limits
        self._block_size = block_size
        self._pages = pages
        longest = longest_token_bytes(tokenizer) if pages else 1
        self._max_chars = pages * block_size * longest  # enough text for `pages` full pages

    @classmethod
    def load(
        cls, engine_config: EngineConfig, server_config: ServerConfig, pages: int
    ) -> PromptKeys:
        """The tokenizer and chat template the replicas use, read from the checkpoint."""
        tokenizer = Tokenizer.from_directory(resolve_model_dir(engine_config.model))
        return cls(
            tokenizer,
            load_chat_template(server_config.chat_template, tokenizer),
            BodyLimits(
                server_config.max_json_depth,
                server_config.max_json_number_digits,
                server_config.max_json_objects,
            ),
            engine_config.scheduler.block_size,
            pages,
        )

    def key(self, path: str, body: bytes) -> bytes | None:
        """The affinity key of the request's prompt; None without one (or for a bad request)."""
        if not self._pages:
            return None
        try:
            token_ids = self._prompt_tokens(path, body)
        except (OpenAIError, ChatTemplateError, json.JSONDecodeError, RecursionError):
            return None
        if token_ids is None:
            return None
        return affinity_key(token_ids, self._block_size, self._pages)

    def _prompt_tokens(self, path: str, body: bytes) -> list[int] | None:
        data = parse_json_body(body, self._body_limits)
        if path == COMPLETIONS_PATH:
            prompt = prompt_batch(parse_request(CompletionRequest, data).prompt)[0]
            if isinstance(prompt, list):
                return prompt
            return self._encode(prompt, special_tokens=True)
        if path == CHAT_PATH and self._chat_template is not None:
            chat = parse_request(ChatCompletionRequest, data)
            messages = [{"role": item.role, "content": item.text()} for item in chat.messages]
            text = self._chat_template.render(
                messages, chat.add_generation_prompt, chat.chat_template_kwargs
            )
            return self._encode(text, special_tokens=False)
        return None

    def _encode(self, text: str, special_tokens: bool) -> list[int] | None:
        if self._tokenizer is None:
            return None
        return self._tokenizer.encode(text[: self._max_chars], add_special_tokens=special_tokens)
