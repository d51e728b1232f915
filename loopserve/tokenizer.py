"""Text <-> token ids through a checkpoint's `tokenizer.json` (the `tokenizers` library).

Owns: loading the tokenizer and its chat template's source, and plain encode/decode. The template
is found as transformers finds it: `chat_template.jinja` beside the tokenizer (how current
transformers saves it) wins over `chat_template` in tokenizer_config.json (a string, or a list of
{name, template} whose "default" entry is used). Must not: import torch, or render templates
(`entrypoints/openai/chat_template.py` does). A checkpoint without tokenizer.json has no
tokenizer (`has_tokenizer` tells without loading anything); prompts must then be token ids.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

CHAT_TEMPLATE_FILE = "chat_template.jinja"
TOKENIZER_FILE = "tokenizer.json"


def has_tokenizer(directory: str | Path) -> bool:
    """Whether a checkpoint directory has a tokenizer, known before anything loads (so a command
    that needs one can say so before the weights load)."""
    return (Path(directory) / TOKENIZER_FILE).is_file()


class Tokenizer:
    def __init__(
        self, backend: Any, config: dict[str, Any], chat_template_file: str | None = None
    ) -> None:
        self._backend = backend
        self.chat_template: str | None = (
            chat_template_file
            if chat_template_file is not None
            else _configured_template(config.get("chat_template"))
        )
        self.bos_token: str | None = _token_text(config.get("bos_token"))
        self.eos_token: str | None = _token_text(config.get("eos_token"))
        self.special_ids = frozenset(
            index
            for index, token in backend.get_added_tokens_decoder().items()
            if getattr(token, "special", False)
        )

    @classmethod
    def from_directory(cls, directory: str | Path) -> Tokenizer | None:
        """The tokenizer of a checkpoint directory, or None when it has no tokenizer.json."""
        from tokenizers import Tokenizer as BackendTokenizer

        if not has_tokenizer(directory):
            return None
        directory = Path(directory)
        path = directory / TOKENIZER_FILE
        config_path = directory / "tokenizer_config.json"
        config = json.loads(config_path.read_text()) if config_path.exists() else {}
        template_path = directory / CHAT_TEMPLATE_FILE
        template = template_path.read_text() if template_path.exists() else None
        return cls(BackendTokenizer.from_file(str(path)), config, template)

    @property
    def vocab_size(self) -> int:
        size: int = self._backend.get_vocab_size(with_added_tokens=True)
        return size

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        # encode_batch releases the interpreter lock while it works (encode holds it), so a long
        # prompt tokenized in a server's worker thread does not stall its event loop.
        (encoding,) = self._backend.encode_batch([text], add_special_tokens=add_special_tokens)
        ids: list[int] = encoding.ids
        return ids

    def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str:
        text: str = self._backend.decode(token_ids, skip_special_tokens=skip_special_tokens)
        return text

    def to_json(self) -> str:
        """The tokenizer as tokenizer.json text (what a grammar backend builds its vocabulary
        from)."""
        text: str = self._backend.to_str()
        return text

    def token_to_id(self, token: str) -> int | None:
        index: int | None = self._backend.token_to_id(token)
        return index


def _configured_template(entry: Any) -> str | None:
    """tokenizer_config.json's `chat_template`: a string, or a list of {name, template}."""
    if entry is None or isinstance(entry, str):
        return entry
    if isinstance(entry, list):
        named = {item.get("name"): item.get("template") for item in entry if isinstance(item, dict)}
        template = named.get("default")
        if isinstance(template, str):
            return template
    raise ValueError("tokenizer_config.json: chat_template must be a string or have a 'default'")


def _token_text(value: Any) -> str | None:
    if isinstance(value, dict):
        content = value.get("content")
        return content if isinstance(content, str) else None
    return value if isinstance(value, str) else None
