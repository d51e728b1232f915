"""Conversations -> prompts for `LLM.chat`: checked messages, rendered with the chat template
(`entrypoints/openai/chat_template.py`, shared with the server) and tokenized as the server does
(the template already placed the special tokens).

Owns: accepting one conversation or a list of them, message content as a string or as text parts
(joined with newlines, as the server does), and the error when the model has no template. Must
not: generate (the caller does) or import the server (only the template renderer, which needs
jinja2).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from loopserve.tokenizer import Tokenizer


def render_conversations(
    messages: Sequence[Mapping[str, Any]] | Sequence[Sequence[Mapping[str, Any]]],
    tokenizer: Tokenizer | None,
    chat_template: str | None,
    template_kwargs: Mapping[str, Any] | None,
    add_generation_prompt: bool,
) -> tuple[list[str], list[list[int]], str]:
    """The rendered text and token ids of each conversation, and the template's source.

    Raises:
        ValueError: no tokenizer or template, jinja2 missing, a malformed message, or the template
            refused a conversation.
    """
    try:
        from loopserve.entrypoints.openai.chat_template import load_chat_template
    except ImportError as error:
        raise ValueError(
            f"LLM.chat renders chat templates with jinja2 ({error}); pip install jinja2"
        ) from None
    if tokenizer is None:
        raise ValueError("this model has no tokenizer.json, so it cannot chat")
    template = load_chat_template(chat_template, tokenizer)
    if template is None:
        raise ValueError(
            "this model has no chat template (no chat_template.jinja, no chat_template in "
            "tokenizer_config.json); pass chat_template="
        )
    texts = []
    for index, conversation in enumerate(_conversations(messages)):
        try:
            checked = [_message(message) for message in conversation]
            texts.append(template.render(checked, add_generation_prompt, template_kwargs))
        except ValueError as error:
            raise ValueError(f"conversation {index}: {error}") from None
    token_ids = [tokenizer.encode(text, add_special_tokens=False) for text in texts]
    return texts, token_ids, template.source


def _conversations(
    messages: Sequence[Mapping[str, Any]] | Sequence[Sequence[Mapping[str, Any]]],
) -> list[Sequence[Mapping[str, Any]]]:
    if not messages:
        raise ValueError("messages must not be empty")
    if isinstance(messages[0], Mapping):
        return [messages]  # type: ignore[list-item]
    return list(messages)  # type: ignore[arg-type]


def _message(message: Mapping[str, Any]) -> dict[str, str]:
    if not isinstance(message, Mapping) or not isinstance(message.get("role"), str):
        raise ValueError(f"a message must be a mapping with a 'role' string, got {message!r}")
    content = message.get("content")
    if content is None:
        text = ""
    elif isinstance(content, str):
        text = content
    elif isinstance(content, list) and all(_is_text_part(part) for part in content):
        text = "\n".join(part["text"] for part in content)
    else:
        raise ValueError(f"message content must be a string or text parts, got {content!r}")
    checked = {"role": message["role"], "content": text}
    if isinstance(message.get("name"), str):
        checked["name"] = message["name"]
    return checked


def _is_text_part(part: Any) -> bool:
    return (
        isinstance(part, Mapping)
        and part.get("type") == "text"
        and isinstance(part.get("text"), str)
    )
