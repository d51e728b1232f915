"""Conversations -> prompts for `LLM.chat`: checked messages, rendered with the chat template
(`entrypoints/openai/chat_template.py`, shared with the server) and tokenized as the server does
(the template already placed the special tokens).

Owns: accepting one conversation or a list of them, message content as a string or as text parts
(joined with newlines, as the server does), the tool fields a message may carry (`tool_calls`,
`tool_call_id`) and the tools a template may render, and the error when the model has no
template. Must not: generate (the caller does) or import the server (only the template renderer,
which needs jinja2).
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
    tools: list[dict[str, Any]] | None = None,
) -> tuple[list[str], list[list[int]], str]:
    """The rendered text and token ids of each conversation, and the template's source; `tools`
    (OpenAI's `{"type": "function", "function": {"name": ...}}`) are the template's `tools`.

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
            texts.append(template.render(checked, add_generation_prompt, template_kwargs, tools))
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


def check_tools(tools: Any) -> list[dict[str, Any]]:
    """OpenAI tool specs, checked as the server's request model checks them."""
    if not isinstance(tools, Sequence) or isinstance(tools, str) or not tools:
        raise ValueError(f"tools must be a non-empty list of tool specs, got {tools!r}")
    for tool in tools:
        function = tool.get("function") if isinstance(tool, Mapping) else None
        name = function.get("name") if isinstance(function, Mapping) else None
        if tool.get("type") != "function" or not isinstance(name, str) or not name:
            raise ValueError(
                "each tool must be {'type': 'function', 'function': {'name': ..., "
                f"'parameters': {{...}}}}, got {tool!r}"
            )
    return [dict(tool) for tool in tools]


def _message(message: Mapping[str, Any]) -> dict[str, Any]:
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
    checked: dict[str, Any] = {"role": message["role"], "content": text}
    if isinstance(message.get("name"), str):
        checked["name"] = message["name"]
    # An assistant turn that called tools, and a tool's answer to one (as the server renders).
    if isinstance(message.get("tool_calls"), list):
        checked["tool_calls"] = message["tool_calls"]
    if isinstance(message.get("tool_call_id"), str):
        checked["tool_call_id"] = message["tool_call_id"]
    return checked


def _is_text_part(part: Any) -> bool:
    return (
        isinstance(part, Mapping)
        and part.get("type") == "text"
        and isinstance(part.get("text"), str)
    )
