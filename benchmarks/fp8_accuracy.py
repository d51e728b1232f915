"""What fp8 costs in accuracy: the serial reference with fp8 weights (`quantization="fp8"`), an
fp8 KV cache (`kv_cache_dtype="fp8"`) and both, against the same reference unquantized,
teacher-forced on the same text.

    python -m benchmarks.fp8_accuracy [--model DIR] [--device cpu] [--tokens 48] [--texts 8]

Per variant and loop count (every token runs exactly that many loops): the mean KL divergence of
the variant's next-token distributions from the unquantized ones, the share of positions whose
top-1 token agrees, and the perplexity of the forced text under each (Python standard-library
sources, as the built-in model was trained on). Per variant and exit threshold (0.5, 0.7): the
mean exit depth of the forced tokens under the model's exit gate. Prints one JSON line each.
"""

from __future__ import annotations

import argparse
import inspect
import json
import math
import os

import torch

# name -> (engine quantization, reference kv_cache_dtype)
VARIANTS = {
    "none": ("none", "auto"),
    "fp8-kv": ("none", "fp8"),
    "fp8-weights": ("fp8", "auto"),
    "fp8-both": ("fp8", "fp8"),
}
THRESHOLDS = (0.5, 0.7)


def _rounded(row: dict[str, object]) -> str:
    return json.dumps({k: round(v, 6) if isinstance(v, float) else v for k, v in row.items()})


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default=None, help="checkpoint (default: the built-in model)")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--tokens", type=int, default=48, help="forced tokens per text")
    parser.add_argument("--texts", type=int, default=8)
    args = parser.parse_args(argv)
    from loopserve import LLM, SamplingParams
    from loopserve.reference import ReferenceOutput, SerialReference

    engines = {
        quantization: LLM(
            args.model, device=args.device, dtype=args.dtype, num_kv_pages=64,
            quantization=quantization,
        )
        for quantization in ("none", "fp8")
    }  # fmt: skip
    llm = engines["none"]
    assert llm.tokenizer is not None, "the model needs a tokenizer (the texts are text)"
    text = "\n".join(inspect.getsource(module) for module in (argparse, os, inspect))
    ids = llm.tokenizer.encode(text)
    span = 16 + args.tokens
    windows = [ids[i * span : (i + 1) * span] for i in range(args.texts)]
    references = {
        name: SerialReference(
            engines[quantization].engine.runner.model,  # type: ignore[attr-defined]
            exit_mode="ouro",
            kv_cache_dtype=kv_dtype,
        )
        for name, (quantization, kv_dtype) in VARIANTS.items()
    }

    def forced_runs(params: SamplingParams) -> dict[str, list[ReferenceOutput]]:
        resolved = llm.engine.resolve(params)
        return {
            name: [
                reference.generate(window[:16], resolved, forced_tokens=window[16:])
                for window in windows
            ]
            for name, reference in references.items()
        }

    num_loops = llm.engine.model_config.num_loops
    for loops in range(1, num_loops + 1):
        params = SamplingParams(
            max_tokens=args.tokens, temperature=0.0, min_loops=loops, max_loops=loops,
            ignore_eos=True,
        )  # fmt: skip
        runs = forced_runs(params)
        for name in VARIANTS:
            totals = {"kl": 0.0, "agree": 0, "nll_exact": 0.0, "nll": 0.0, "n": 0}
            for window, exact_run, run in zip(windows, runs["none"], runs[name], strict=True):
                for index, token in enumerate(window[16:]):
                    exact = torch.log_softmax(exact_run.logits[index].double(), -1)
                    quantized = torch.log_softmax(run.logits[index].double(), -1)
                    totals["kl"] += float((exact.exp() * (exact - quantized)).sum())
                    totals["agree"] += int(exact.argmax() == quantized.argmax())
                    totals["nll_exact"] += -float(exact[token])
                    totals["nll"] += -float(quantized[token])
                    totals["n"] += 1
            n = totals["n"]
            unquantized, perplexity = (math.exp(totals[key] / n) for key in ("nll_exact", "nll"))
            row = {
                "variant": name, "loops": loops, "positions": n, "mean_kl": totals["kl"] / n,
                "top1_agreement": totals["agree"] / n, "perplexity_unquantized": unquantized,
                "perplexity": perplexity, "perplexity_change": perplexity / unquantized - 1,
            }  # fmt: skip
            print(_rounded(row), flush=True)
    for threshold in THRESHOLDS:
        params = SamplingParams(
            max_tokens=args.tokens, temperature=0.0, exit_threshold=threshold, ignore_eos=True
        )
        for name, variant_runs in forced_runs(params).items():
            depths = [d for run in variant_runs for d in run.exit_depths[1:]]  # generated tokens
            mean = sum(depths) / len(depths)
            print(_rounded({"variant": name, "threshold": threshold, "mean_exit_depth": mean}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
