"""The stop set (config eos ∪ generation_config eos ∪ the tokenizer's eos ∪ a chat template's
end-of-turn token) and where the chat template comes from (chat_template.jinja wins)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from tokenizers import Tokenizer as BackendTokenizer
from tokenizers import decoders, models, pre_tokenizers, trainers

from loopserve.engine.end_of_sequence import end_of_sequence
from loopserve.models.generation_config import GenerationDefaults
from loopserve.models.ouro_config import OuroConfig
from loopserve.tokenizer import Tokenizer

CHATML = "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|eot_id|>", "<|end_turn|>"]
MODEL = OuroConfig(vocab_size=320, eos_token_ids=(0,))


@pytest.fixture(scope="module")
def backend() -> BackendTokenizer:
    tokenizer = BackendTokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300,
        special_tokens=SPECIALS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tokenizer.train_from_iterator(["hello world"] * 10, trainer)
    return tokenizer


def test_the_set_is_the_union_of_every_source(backend: BackendTokenizer) -> None:
    tokenizer = Tokenizer(backend, {"eos_token": "<|endoftext|>", "chat_template": CHATML})
    found = end_of_sequence(MODEL, GenerationDefaults(eos_token_ids=(0, 3)), tokenizer)
    assert found.token_ids == {0, 2, 3}
    described = found.describe()
    assert (
        "0 (config.json eos_token_id, generation_config.json eos_token_id, tokenizer" in described
    )
    assert "2 (<|im_end|> ends chat turns)" in described


def test_a_template_without_the_end_of_turn_token_adds_nothing(backend: BackendTokenizer) -> None:
    template = "{% for m in messages %}{{ m.content }}<|endoftext|>{% endfor %}"
    tokenizer = Tokenizer(
        backend, {"eos_token": {"content": "<|im_end|>"}, "chat_template": template}
    )
    assert end_of_sequence(MODEL, GenerationDefaults(), tokenizer).token_ids == {0, 2}  # eos_token
    assert end_of_sequence(MODEL, GenerationDefaults(), Tokenizer(backend, {})).token_ids == {0}


def test_huginns_end_of_turn_token_ends_chat_turns(backend: BackendTokenizer) -> None:
    """Huginn-0125's official generation stops at <|end_turn|> (id 65508) besides its eos
    <|end_text|>; a template that writes it makes it a stop token here too."""
    template = (
        "{% for m in messages %}<|begin_header|>{{ m.role }}<|end_header|>\n\n{{ m.content }}"
        "<|end_turn|>{% endfor %}"
    )
    tokenizer = Tokenizer(backend, {"chat_template": template})
    found = end_of_sequence(MODEL, GenerationDefaults(), tokenizer)
    assert found.token_ids == {0, 4} and "4 (<|end_turn|> ends chat turns)" in found.describe()


def test_ids_the_model_cannot_generate_are_left_out(backend: BackendTokenizer) -> None:
    small = OuroConfig(vocab_size=2, eos_token_ids=(0,))
    tokenizer = Tokenizer(backend, {"chat_template": CHATML})
    assert end_of_sequence(small, GenerationDefaults(eos_token_ids=(7,)), tokenizer).token_ids == {
        0
    }
    assert (
        end_of_sequence(OuroConfig(vocab_size=8, eos_token_ids=()), GenerationDefaults(), None)
        .describe()
        .startswith("none")
    )


def test_chat_template_jinja_wins_over_tokenizer_config(
    backend: BackendTokenizer, tmp_path: Path
) -> None:
    backend.save(str(tmp_path / "tokenizer.json"))
    named = [{"name": "tool_use", "template": "tools"}, {"name": "default", "template": "named"}]
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": named}))
    tokenizer = Tokenizer.from_directory(tmp_path)
    assert tokenizer is not None and tokenizer.chat_template == "named"
    (tmp_path / "chat_template.jinja").write_text("from the file")
    tokenizer = Tokenizer.from_directory(tmp_path)
    assert tokenizer is not None and tokenizer.chat_template == "from the file"
