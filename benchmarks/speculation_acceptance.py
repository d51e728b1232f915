"""How often the model's own first loops propose the right token: self-speculative decoding on a
trained model (the built-in one by default), for each number of proposed tokens K and draft
depth d.

    python -m benchmarks.speculation_acceptance [--model DIR] [--prompts 8] [--tokens 64]

One request at a time (as at C=1), greedy, at fixed depth (threshold 1) and with the exit gate
at 0.5, on prompts cut from Python standard-library sources (what the built-in model was
trained on). Per (threshold, K, d): proposals that got a decode row, the share confirmed, the
decode steps per generated token with and without speculation (what a step-bound GPU turns into
time), and whether every output equals decoding without speculation (it must). One JSON line
each.
"""

from __future__ import annotations

import argparse
import inspect
import json
import os

PAIRS = [(k, d) for d in (1, 2, 3) for k in (1, 2, 4, 8)]
THRESHOLDS = (1.0, 0.5)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default=None, help="checkpoint (default: the built-in model)")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=64, help="generated tokens per prompt")
    args = parser.parse_args(argv)
    from loopserve import LLM, SamplingParams

    def engine(speculative: tuple[int, int] | None) -> LLM:
        options: dict[str, object] = {}
        if speculative is not None:
            k, d = speculative
            options["speculative_config"] = {
                "num_speculative_tokens": k, "draft_loops": d, "disable_by_batch_size": None,
            }  # fmt: skip
        return LLM(
            args.model, device=args.device, dtype=args.dtype, num_kv_pages=256, max_num_seqs=1,
            **options,
        )  # fmt: skip

    plain = engine(None)
    assert plain.tokenizer is not None, "the model needs a tokenizer (the prompts are text)"
    loops = plain.engine.model_config.num_loops
    text = "\n".join(inspect.getsource(module) for module in (argparse, os, inspect))
    ids = plain.tokenizer.encode(text)
    prompts = [ids[i * 200 : i * 200 + 32] for i in range(args.prompts)]

    def run(llm: LLM, threshold: float) -> tuple[list[list[int]], int, int]:
        """(outputs, decode steps, generated tokens) of the prompts one after another."""
        params = SamplingParams(
            max_tokens=args.tokens, temperature=0.0, exit_threshold=threshold, ignore_eos=True
        )
        before = llm.engine.stats().decode_steps
        outputs = [
            llm.generate([prompt], params, use_tqdm=False)[0].outputs[0].token_ids
            for prompt in prompts
        ]
        steps = llm.engine.stats().decode_steps - before
        return outputs, steps, sum(len(tokens) - 1 for tokens in outputs)

    for threshold in THRESHOLDS:
        expected, plain_steps, tokens = run(plain, threshold)
        for k, d in PAIRS:
            if d >= loops:
                continue
            llm = engine((k, d))
            outputs, steps, _ = run(llm, threshold)
            stats = llm.engine.stats()
            row = {
                "threshold": threshold, "k": k, "d": d,
                "proposed": stats.proposed_tokens,
                "acceptance": round(stats.proposal_acceptance_rate, 4),
                "mean_accepted_length": round(stats.mean_accepted_length, 4),
                "steps_per_token": round(steps / tokens, 4),
                "plain_steps_per_token": round(plain_steps / tokens, 4),
                "step_ratio": round(steps / plain_steps, 4),
                "identical": outputs == expected,
            }  # fmt: skip
            print(json.dumps(row), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
