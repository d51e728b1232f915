"""llguidance against xgrammar on the structured-output work a host does: compiling a JSON schema
and computing the next-token mask at each token of a valid document, on a checkpoint's
tokenizer.json, llguidance through loopserve's own `GrammarCompiler`. Needs xgrammar and
transformers (not installed by any extra): `python -m benchmarks.grammar_backends [MODEL_DIR]`
(default: the built-in model).
Prints one line per schema: tokens, compile time, median and worst mask time per token."""

from __future__ import annotations

import json
import statistics
import sys
import time
from functools import partial
from pathlib import Path
from typing import Any

from loopserve.models.builtin import BUILTIN_MODEL_DIR
from loopserve.structured.grammar import GrammarCompiler
from loopserve.structured_outputs import StructuredOutputsParams

SCHEMAS: dict[str, tuple[dict[str, Any], str]] = {
    "flat": (
        {
            "type": "object",
            "properties": {
                "name": {"type": "string", "maxLength": 20},
                "age": {"type": "integer", "minimum": 0, "maximum": 150},
            },
            "required": ["name", "age"],
        },
        '{"name": "Ada Lovelace", "age": 36}',
    ),
    "nested": (
        {
            "type": "object",
            "properties": {
                "user": {
                    "type": "object",
                    "properties": {
                        "id": {"type": "integer"},
                        "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 4},
                    },
                    "required": ["id", "tags"],
                },
                "kind": {"enum": ["a", "b", "c"]},
            },
            "required": ["user", "kind"],
        },
        '{"user": {"id": 7, "tags": ["x", "yy"]}, "kind": "b"}',
    ),
    "numbers": (
        {
            "type": "array",
            "items": {"type": "number", "minimum": -5, "maximum": 5},
            "minItems": 3,
            "maxItems": 3,
        },
        "[1.5, -2, 4.25]",
    ),
}


def _timed(function: Any) -> tuple[Any, float]:
    start = time.perf_counter()
    value = function()
    return value, time.perf_counter() - start


def main() -> None:
    import xgrammar
    from transformers import PreTrainedTokenizerFast

    directory = Path(sys.argv[1]) if len(sys.argv) > 1 else Path(BUILTIN_MODEL_DIR)
    vocab = json.loads((directory / "config.json").read_text())["vocab_size"]
    path = str(directory / "tokenizer.json")
    # llguidance as the engine drives it; end-of-sequence ids do not change the timings.
    grammars = GrammarCompiler(Path(path).read_text(), vocab, [0])
    info = xgrammar.TokenizerInfo.from_huggingface(
        PreTrainedTokenizerFast(tokenizer_file=path), vocab_size=vocab
    )
    compiler = xgrammar.GrammarCompiler(info, cache_enabled=False)
    for name, (schema, document) in SCHEMAS.items():
        ids = grammars.tokenizer.tokenize_str(document)
        state, llg_compile = _timed(
            partial(grammars.state, StructuredOutputsParams.from_dict({"json": schema}))
        )
        llg_masks = []
        for token in ids:
            llg_masks.append(_timed(state.mask)[1])
            state.accept(token)
        compiled, xgr_compile = _timed(
            lambda s=schema: compiler.compile_json_schema(json.dumps(s), any_whitespace=False)
        )
        xmatcher = xgrammar.GrammarMatcher(compiled)
        bitmask = xgrammar.allocate_token_bitmask(1, vocab)
        xgr_masks = []
        for token in ids:
            xgr_masks.append(_timed(partial(xmatcher.fill_next_token_bitmask, bitmask))[1])
            assert xmatcher.accept_token(token)
        print(
            f"{name}: {len(ids)} tokens | llguidance compile {llg_compile * 1e3:.2f} ms, mask "
            f"median {statistics.median(llg_masks) * 1e6:.0f} us, max {max(llg_masks) * 1e6:.0f}"
            f" us | xgrammar compile {xgr_compile * 1e3:.2f} ms, mask median "
            f"{statistics.median(xgr_masks) * 1e6:.0f} us, max {max(xgr_masks) * 1e6:.0f} us"
        )


if __name__ == "__main__":
    main()
