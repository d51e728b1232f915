"""Training the byte-level BPE tokenizer of the tiny model (the `tokenizers` library).

Owns: the tokenizer's design (byte-level pre-tokenizer and decoder, one special token that is
both bos and eos, like Ouro's id 0), its chat template, and training it on the corpus. Must not:
import torch, or know about the model beyond the vocabulary size it is asked for.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from loopserve.data.corpus import CorpusFile

# The only special token; id 0, ends every document and is the model's bos and eos.
END_OF_TEXT = "<|endoftext|>"
CHAT_TEMPLATE_FILE = "chat_template.jinja"
# The model learned Python source, not conversations, so a chat is written the way its corpus
# writes prose: each message as a comment line ("# user: ..."); the assistant's turn starts after
# an empty line, where the model writes code. There is no end-of-turn token; answers end at eos or
# max_tokens.
CHAT_TEMPLATE = """\
{%- for message in messages -%}
{{- '# ' + message['role'] + ': ' + message['content'] | replace('\\n', '\\n# ') + '\\n' -}}
{%- endfor -%}
{%- if add_generation_prompt -%}
{{- '\\n' -}}
{%- endif -%}
"""


def _texts(files: list[CorpusFile]) -> Iterator[str]:
    for file in files:
        yield file.text


def train_tokenizer(files: list[CorpusFile], vocab_size: int) -> Tokenizer:
    """A byte-level BPE tokenizer with `vocab_size` tokens (END_OF_TEXT is id 0)."""
    if vocab_size < 300:
        raise ValueError(f"vocab_size must be at least 300 (256 bytes + merges), got {vocab_size}")
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=[END_OF_TEXT],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(_texts(files), trainer=trainer, length=len(files))
    if tokenizer.token_to_id(END_OF_TEXT) != 0:
        raise RuntimeError(f"{END_OF_TEXT} did not get id 0")
    return tokenizer


def save_tokenizer(tokenizer: Tokenizer, directory: Path) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / "tokenizer.json"
    tokenizer.save(str(path))
    return path


def save_chat_template(directory: Path) -> Path:
    """The tiny model's chat template as chat_template.jinja (how transformers saves it)."""
    path = directory / CHAT_TEMPLATE_FILE
    path.write_text(CHAT_TEMPLATE)
    return path
