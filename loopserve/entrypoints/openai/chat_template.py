"""Chat templates: messages -> prompt text, with the checkpoint's Jinja template (HF conventions).

Owns: choosing the template (a server override, else `chat_template` from tokenizer_config.json),
compiling it once in jinja2's immutable sandbox, and rendering it with the variables HF templates
expect (`messages`, `add_generation_prompt`, `bos_token`, `eos_token`, `raise_exception`,
`strftime_now`, the `tojson` filter). Must not: tokenize (serving code does), or run templates
outside the sandbox.
"""

from __future__ import annotations

import json
from datetime import datetime
from typing import Any

from jinja2 import TemplateError
from jinja2.sandbox import ImmutableSandboxedEnvironment

from loopserve.entrypoints.openai.errors import bad_request
from loopserve.tokenizer import Tokenizer


class ChatTemplate:
    def __init__(self, source: str, bos_token: str | None, eos_token: str | None) -> None:
        environment = ImmutableSandboxedEnvironment(
            trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"]
        )
        environment.filters["tojson"] = _tojson
        environment.globals["raise_exception"] = _raise_exception
        environment.globals["strftime_now"] = _strftime_now
        try:
            self._template = environment.from_string(source)
        except TemplateError as error:
            raise ValueError(f"the chat template does not compile: {error}") from None
        self._bos_token = bos_token or ""
        self._eos_token = eos_token or ""

    def render(self, messages: list[dict[str, str]], add_generation_prompt: bool) -> str:
        """The prompt text; a 400 OpenAIError when the template refuses the messages."""
        try:
            return self._template.render(
                messages=messages,
                add_generation_prompt=add_generation_prompt,
                bos_token=self._bos_token,
                eos_token=self._eos_token,
            )
        except TemplateError as error:
            message = f"the chat template rejected the messages: {error}"
            raise bad_request(message, "messages") from None


def load_chat_template(override: str | None, tokenizer: Tokenizer | None) -> ChatTemplate | None:
    """The server's chat template: `override` (template text) or the checkpoint's; None if neither.

    Raises:
        ValueError: the template does not compile, or the checkpoint's entry is malformed.
    """
    bos = tokenizer.bos_token if tokenizer is not None else None
    eos = tokenizer.eos_token if tokenizer is not None else None
    source = override
    if source is None and tokenizer is not None:
        source = _default_template(tokenizer.chat_template)
    return None if source is None else ChatTemplate(source, bos, eos)


def _default_template(entry: Any) -> str | None:
    """tokenizer_config.json's `chat_template`: a string, or a list of {name, template}."""
    if entry is None or isinstance(entry, str):
        return entry
    if isinstance(entry, list):
        named = {item.get("name"): item.get("template") for item in entry if isinstance(item, dict)}
        template = named.get("default")
        if isinstance(template, str):
            return template
    raise ValueError("tokenizer_config.json: chat_template must be a string or have a 'default'")


def _tojson(value: Any, indent: int | None = None) -> str:
    return json.dumps(value, ensure_ascii=False, indent=indent)


def _raise_exception(message: str) -> None:
    raise TemplateError(message)


def _strftime_now(format_string: str) -> str:
    return datetime.now().strftime(format_string)
