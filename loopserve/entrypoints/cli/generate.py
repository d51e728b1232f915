"""`loopserve generate`: generate completions for prompts from the command line.

Its sampling flags are generated from `SamplingParams` (same defaults, help and validation), its
engine flags from `EngineConfig`.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from loopserve.entrypoints.cli.engine_args import add_engine_arguments, engine_options
from loopserve.entrypoints.cli.sampling_args import add_sampling_arguments, sampling_params
from loopserve.sampling_params import SamplingParams


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "generate",
        help="generate text (the built-in tiny model when --model is not given)",
        description="Generate completions. Flags mirror SamplingParams and EngineConfig, with "
        "their defaults (--temperature 0 is greedy).",
    )
    parser.add_argument("--prompt", action="append", default=[], help="a text prompt (repeatable)")
    parser.add_argument(
        "--prompt-ids", action="append", default=[], help="a prompt as comma-separated token ids"
    )
    parser.add_argument("--prompts-file", type=Path, help="a file with one text prompt per line")
    add_sampling_arguments(parser)
    add_engine_arguments(parser)
    parser.add_argument("--json", action="store_true", help="print one JSON object per prompt")


def _int_list(text: str) -> list[int]:
    try:
        return [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise ValueError(f"expected comma-separated integers, got {text!r}") from None


def run(args: argparse.Namespace) -> int:
    from loopserve.entrypoints.llm import LLM
    from loopserve.models.builtin import resolve_model_dir
    from loopserve.tokenizer import has_tokenizer

    prompts: list[str | list[int]] = [*args.prompt]
    prompts += [_int_list(ids) for ids in args.prompt_ids]
    if args.prompts_file is not None:
        prompts += [line for line in args.prompts_file.read_text().splitlines() if line.strip()]
    if not prompts:
        raise ValueError("give at least one --prompt, --prompt-ids or --prompts-file")
    sampling_params(args, SamplingParams())  # bad flags fail before the model loads
    directory = resolve_model_dir(args.model)
    if (
        directory.is_dir()
        and any(isinstance(p, str) for p in prompts)
        and not has_tokenizer(directory)
    ):
        raise ValueError(
            f"{directory} has no tokenizer.json: give the prompts as token ids (--prompt-ids)"
        )
    llm = LLM(args.model, **engine_options(args))
    # Flags not given take the checkpoint's generation_config.json defaults, as in the server.
    params = sampling_params(args, llm.get_default_sampling_params())
    requests = llm.generate(prompts, params)
    for prompt, output in (
        (p, o) for p, r in zip(prompts, requests, strict=True) for o in r.outputs
    ):
        if args.json:
            record: dict[str, object] = {
                "prompt": prompt,
                "index": output.index,  # which of the prompt's --n sequences
                "text": output.text,
                "token_ids": output.token_ids,
                "exit_depths": output.exit_depths,
                "finish_reason": output.finish_reason,
            }
            if output.logprobs is not None:
                record["logprobs"] = [[e.token_id, e.logprob, list(e.top)] for e in output.logprobs]
            print(json.dumps(record))
        else:
            shown = prompt if isinstance(prompt, str) else f"<{len(prompt)} token ids>"
            sequence = f" (sequence {output.index})" if params.n > 1 else ""
            print(f"--- prompt: {shown}{sequence}")
            print(output.text if llm.tokenizer is not None else output.token_ids)
            print(
                f"--- {len(output.token_ids)} tokens, finish_reason={output.finish_reason}, "
                f"mean exit depth {output.mean_exit_depth:.2f}, depths {output.exit_depths}"
            )
    sys.stdout.flush()
    return 0
