"""Chat templates: messages -> prompt text, with the checkpoint's Jinja template (HF conventions).

Owns: choosing the template (an override, else the tokenizer's: `chat_template.jinja` or
tokenizer_config.json's `chat_template`), compiling it once in jinja2's immutable sandbox, and
rendering it with the variables HF templates expect (`messages`, `add_generation_prompt`,
`bos_token`, `eos_token`, `raise_exception`, `strftime_now`, the `tojson` filter) plus the
caller's `chat_template_kwargs` (e.g. `enable_thinking` for Ouro's Thinking templates), as
`apply_chat_template` passes them. Used by the server and by `LLM.chat`, so it needs jinja2 but
nothing of the server. Must not: tokenize (callers do), or run templates outside the sandbox.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from datetime import datetime
from typing import Any

from jinja2 import TemplateError
from jinja2.sandbox import ImmutableSandboxedEnvironment

from loopserve.tokenizer import Tokenizer

# Template variables that the renderer sets itself; chat_template_kwargs may not replace them.
RESERVED_VARIABLES = frozenset(
    {"messages", "add_generation_prompt", "bos_token", "eos_token", "raise_exception"}
    | {"strftime_now", "tools"}
)


class ChatTemplateError(ValueError):
    """The template refused the messages, or the kwargs are not allowed; the caller's fault."""


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
        self.source = source  # the template text (the reasoning parser reads what it writes)
        self._bos_token = bos_token or ""
        self._eos_token = eos_token or ""

    def render(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool,
        template_kwargs: Mapping[str, Any] | None = None,
        tools: list[dict[str, Any]] | None = None,
    ) -> str:
        """The prompt text.

        Args:
            messages: `{"role", "content"[, "name", "tool_calls", "tool_call_id"]}` dicts, in
                order.
            add_generation_prompt: end with the header of the assistant's turn.
            template_kwargs: extra template variables (`chat_template_kwargs`).
            tools: the request's tools (`{"type": "function", "function": {...}}`), as the
                template's `tools` variable (HF's convention); None: not set.
        Raises:
            ChatTemplateError: the template refused the messages, or a kwarg names a variable the
                renderer sets.
        """
        extra = dict(template_kwargs or {})
        reserved = sorted(RESERVED_VARIABLES & extra.keys())
        if reserved:
            raise ChatTemplateError(f"chat_template_kwargs may not set {reserved}")
        try:
            return self._template.render(
                **extra,
                **({} if tools is None else {"tools": tools}),
                messages=messages,
                add_generation_prompt=add_generation_prompt,
                bos_token=self._bos_token,
                eos_token=self._eos_token,
            )
        except TemplateError as error:
            raise ChatTemplateError(f"the chat template rejected the messages: {error}") from None


def load_chat_template(override: str | None, tokenizer: Tokenizer | None) -> ChatTemplate | None:
    """The chat template: `override` (template text) or the tokenizer's; None if neither.

    Raises:
        ValueError: the template does not compile.
    """
    bos = tokenizer.bos_token if tokenizer is not None else None
    eos = tokenizer.eos_token if tokenizer is not None else None
    source = override
    if source is None and tokenizer is not None:
        source = tokenizer.chat_template
    return None if source is None else ChatTemplate(source, bos, eos)


def _tojson(value: Any, indent: int | None = None) -> str:
    return json.dumps(value, ensure_ascii=False, indent=indent)


def _raise_exception(message: str) -> None:
    raise TemplateError(message)


def _strftime_now(format_string: str) -> str:
    return datetime.now().strftime(format_string)
