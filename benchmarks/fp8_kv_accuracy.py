"""What an fp8 KV cache costs in accuracy: the serial reference with K/V kept as float8 e4m3
(`kv_cache_dtype="fp8"`) against the same reference with exact K/V, teacher-forced on the same
text, at each loop count.

    python -m benchmarks.fp8_kv_accuracy [--model DIR] [--device cpu] [--tokens 48] [--texts 8]

Per loop count (every token runs exactly that many loops): the mean KL divergence of the fp8
next-token distributions from the exact ones, the share of positions whose top-1 token agrees,
and the perplexity of the forced text under each (the text: Python standard-library sources, as
the built-in model was trained on). Prints one JSON line per loop count.
"""

from __future__ import annotations

import argparse
import inspect
import json
import math
import os

import torch


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default=None, help="checkpoint (default: the built-in model)")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--tokens", type=int, default=48, help="forced tokens per text")
    parser.add_argument("--texts", type=int, default=8)
    args = parser.parse_args(argv)
    from loopserve import LLM, SamplingParams
    from loopserve.reference import SerialReference

    llm = LLM(args.model, device=args.device, dtype=args.dtype, num_kv_pages=64)
    assert llm.tokenizer is not None, "the model needs a tokenizer (the texts are text)"
    model = llm.engine.runner.model  # type: ignore[attr-defined]
    sources = [inspect.getsource(module) for module in (argparse, os, inspect)]
    text = "\n".join(sources)
    ids = llm.tokenizer.encode(text)
    span = 16 + args.tokens
    windows = [ids[i * span : (i + 1) * span] for i in range(args.texts)]
    for loops in range(1, model.config.num_loops + 1):
        totals = {"kl": 0.0, "agree": 0, "nll_exact": 0.0, "nll_fp8": 0.0, "n": 0}
        for window in windows:
            prompt, forced = window[:16], window[16:]
            params = SamplingParams(
                max_tokens=len(forced), temperature=0.0, min_loops=loops, max_loops=loops,
                ignore_eos=True,
            )  # fmt: skip
            resolved = llm.engine.resolve(params)
            runs = {
                name: SerialReference(model, exit_mode="ouro", kv_cache_dtype=name).generate(
                    prompt, resolved, forced_tokens=forced
                )
                for name in ("auto", "fp8")
            }
            for index, token in enumerate(forced):
                exact = torch.log_softmax(runs["auto"].logits[index].double(), -1)
                fp8 = torch.log_softmax(runs["fp8"].logits[index].double(), -1)
                totals["kl"] += float((exact.exp() * (exact - fp8)).sum())
                totals["agree"] += int(exact.argmax() == fp8.argmax())
                totals["nll_exact"] += -float(exact[token])
                totals["nll_fp8"] += -float(fp8[token])
                totals["n"] += 1
        n = totals["n"]
        row = {
            "loops": loops,
            "positions": n,
            "mean_kl": totals["kl"] / n,
            "top1_agreement": totals["agree"] / n,
            "perplexity_exact": math.exp(totals["nll_exact"] / n),
            "perplexity_fp8": math.exp(totals["nll_fp8"] / n),
        }
        row["perplexity_change"] = row["perplexity_fp8"] / row["perplexity_exact"] - 1
        print(json.dumps({k: round(v, 6) if isinstance(v, float) else v for k, v in row.items()}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
