"""Structured outputs' grammar layer: request validation, compile errors that say why, and masks
that allow exactly what the constraint allows, on the built-in model's vocabulary."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from loopserve.sampling_params import SamplingParams
from loopserve.structured.grammar import GrammarCompiler, GrammarState
from loopserve.structured_outputs import StructuredOutputsParams

ASSET = Path(__file__).resolve().parents[2] / "loopserve" / "assets" / "ouro-tiny"
EOS = 0


@pytest.fixture(scope="module")
def compiler() -> GrammarCompiler:
    vocab = json.loads((ASSET / "config.json").read_text())["vocab_size"]
    return GrammarCompiler((ASSET / "tokenizer.json").read_text(), vocab, [EOS])


def allowed(state: GrammarState, token: int) -> bool:
    mask = state.mask()
    assert mask is not None
    word = int.from_bytes(mask[4 * (token // 32) : 4 * (token // 32) + 4], "little")
    return bool(word >> (token % 32) & 1)


def walk(compiler: GrammarCompiler, spec: StructuredOutputsParams, text: str) -> GrammarState:
    """Feed `text`'s tokens through a new state, checking each is allowed before it is taken."""
    state = compiler.state(spec)
    for token in compiler.tokenizer.tokenize_str(text):
        assert allowed(state, token), (text, token)
        state.accept(token)
    return state


def test_params_take_exactly_one_constraint() -> None:
    with pytest.raises(ValueError, match="exactly one"):
        StructuredOutputsParams()
    with pytest.raises(ValueError, match="got regex, choice"):
        StructuredOutputsParams(regex="a", choice=("a",))
    with pytest.raises(ValueError, match="not valid JSON"):
        StructuredOutputsParams(json="{nope")
    with pytest.raises(ValueError, match="unknown field"):
        StructuredOutputsParams.from_dict({"jsn": {}})
    with pytest.raises(ValueError, match="non-empty"):
        StructuredOutputsParams(choice=("",))
    with pytest.raises(TypeError, match="list of strings"):
        StructuredOutputsParams(choice=(1, 2))  # type: ignore[arg-type]


def test_a_schema_as_dict_or_text_is_one_hashable_value_with_its_key_order() -> None:
    a = SamplingParams(structured_outputs={"json": {"b": 1, "a": 2}})
    b = SamplingParams(structured_outputs={"json": '{"b": 1,  "a": 2}'})
    assert a == b and hash(a) == hash(b)
    assert a.structured_outputs is not None
    assert list(a.structured_outputs.schema()) == ["b", "a"]
    reordered = SamplingParams(structured_outputs={"json": {"a": 2, "b": 1}})
    assert reordered != a  # the order of properties is the order the output writes them in


def test_properties_are_written_in_the_schema_s_order(compiler: GrammarCompiler) -> None:
    schema = {
        "type": "object",
        "properties": {"zeta": {"type": "integer"}, "alpha": {"type": "integer"}},
        "required": ["zeta", "alpha"],
    }
    spec = StructuredOutputsParams(json=schema)
    assert walk(compiler, spec, '{"zeta": 1, "alpha": 2}').complete
    state = walk(compiler, spec, '{"')
    assert not allowed(state, compiler.tokenizer.tokenize_str("alpha")[0])


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        (StructuredOutputsParams(json={"type": "foo"}), "(?s)json does not compile.*foo"),
        (StructuredOutputsParams(regex="[a-"), "(?s)regex does not compile.*unclosed"),
        (StructuredOutputsParams(grammar="start: undefined_rule"), "grammar does not compile"),
        (StructuredOutputsParams(grammar="root ::= ("), "GBNF grammar does not parse.*Expected"),
    ],
)
def test_uncompilable_constraints_say_why(
    compiler: GrammarCompiler, spec: StructuredOutputsParams, message: str
) -> None:
    with pytest.raises(ValueError, match=message):
        compiler.state(spec)


def test_json_schema_mask_allows_a_valid_document_and_refuses_others(
    compiler: GrammarCompiler,
) -> None:
    schema = {
        "type": "object",
        "properties": {
            "n": {"type": "integer"},
            "tags": {"type": "array", "items": {"enum": ["x", "y"]}},
        },
        "required": ["n", "tags"],
    }
    spec = StructuredOutputsParams(json=schema)
    state = walk(compiler, spec, '{"n": 12, "tags": ["x", "y"]}')
    assert state.complete
    start = compiler.state(spec)
    for text in ("[", "x", " {"):
        (token, *_) = compiler.tokenizer.tokenize_str(text)
        assert not allowed(start, token), text
    with pytest.raises(ValueError, match="breaks the constraint"):
        start.accept(compiler.tokenizer.tokenize_str("[")[0])


def test_regex_choice_and_gbnf(compiler: GrammarCompiler) -> None:
    digits = StructuredOutputsParams(regex="[0-9]{3}")
    assert walk(compiler, digits, "407").complete
    choice = StructuredOutputsParams(choice=("yes", 'say "no"'))
    assert walk(compiler, choice, 'say "no"').complete
    gbnf = StructuredOutputsParams(grammar='root ::= "a" ("b" | "c")')
    assert walk(compiler, gbnf, "ac").complete
    state = compiler.state(gbnf)
    state.accept(compiler.tokenizer.tokenize_str("a")[0])
    assert not allowed(state, compiler.tokenizer.tokenize_str("d")[0])


def test_a_complete_constraint_allows_only_end_of_sequence(compiler: GrammarCompiler) -> None:
    state = walk(compiler, StructuredOutputsParams(choice=("ok",)), "ok")
    mask = state.mask()
    assert mask is not None
    allowed_ids = [t for t in range(compiler.vocab_size) if allowed(state, t)]
    assert allowed_ids == [EOS]


def test_begin_after_leaves_tokens_free_until_it_is_generated(compiler: GrammarCompiler) -> None:
    (newline,) = compiler.tokenizer.tokenize_str("\n")
    spec = StructuredOutputsParams(regex="[0-9]+", begin_after="\n")
    state = compiler.state(spec)
    assert state.mask() is None and not state.active
    state.accept(compiler.tokenizer.tokenize_str("x")[0])
    assert state.mask() is None
    state.accept(newline)
    assert state.active and state.num_accepted == 2
    assert not allowed(state, compiler.tokenizer.tokenize_str("x")[0])
    with pytest.raises(ValueError, match="one token"):
        compiler.state(StructuredOutputsParams(regex="a", begin_after="</think> and more"))


def test_compiling_and_masking_import_no_torch() -> None:
    """Grammar state is meant for the torch-free engine: llguidance must not pull torch in."""
    code = (
        "import sys\n"
        "from loopserve.structured.grammar import GrammarCompiler\n"
        "from loopserve.structured_outputs import StructuredOutputsParams\n"
        f"text = open({str(ASSET / 'tokenizer.json')!r}).read()\n"
        "state = GrammarCompiler(text, 4096, [0]).state(StructuredOutputsParams(regex='[a-z]+'))\n"
        "assert state.mask() is not None\n"
        "print('torch' in sys.modules)\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True
    )
    assert result.stdout.strip() == "False"


def test_the_mask_worker_computes_what_each_state_would(compiler: GrammarCompiler) -> None:
    """Masks from the worker thread (one llguidance batch) equal `GrammarState.mask`, on a
    vocabulary that is not a whole number of 32-bit words."""
    from loopserve.structured.grammar import MaskWorker

    odd = GrammarCompiler((ASSET / "tokenizer.json").read_text(), compiler.vocab_size + 7, [EOS])
    spec = StructuredOutputsParams(json='{"type": "array", "items": {"type": "boolean"}}')
    states = [walk(odd, spec, text) for text in ("[", "[true", "[true, ", "")]
    worker = MaskWorker(odd.mask_words)
    assert worker.submit(states).result() == [state.mask() for state in states]
    assert len({state.mask() for state in states}) > 1  # the states differ, so their masks do
