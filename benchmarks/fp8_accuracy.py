"""What fp8 costs in accuracy: the serial reference with fp8 weights (`quantization="fp8"`), an
fp8 KV cache (`kv_cache_dtype="fp8"`, with scale 1 and with the per-layer scales that
`calculate_kv_scales` gives) and both, against the same reference unquantized, teacher-forced on
the same text.

    python -m benchmarks.fp8_accuracy [--model DIR] [--device cpu] [--tokens 48] [--texts 8]
        [--kv-gain G] [--variants fp8-kv,fp8-weights,...] [--dtype bfloat16]

Per variant and loop count (every token runs exactly that many loops): the mean KL divergence of
the variant's next-token distributions from the unquantized ones, the share of positions whose
top-1 token agrees, and the perplexity of the forced text under each (Python standard-library
sources, as the built-in model was trained on). Per variant and exit threshold (0.5, 0.7): the
mean exit depth of the forced tokens under the model's exit gate. A checkpoint without a tokenizer
(the random-weight Ouro-1.4B that the GPU scripts write) is forced through seeded random token
ids instead of text; `--dtype bfloat16` makes the baseline the bf16 model. First, per KV layer: the
largest |K| and |V| the calibration prompts gave, and the largest over the whole text the windows
are cut from, in windows of the prompts' length (what the calculated scales' headroom is for).
Prints one JSON line each.

`--kv-gain G` runs the same model with K and V G times larger: each layer's k and v projections
times G, its q and o projections over G, so q . k and the attention output are unchanged (for a
power of two, bit for bit in fp32, fp8 weights included). Scale 1 then saturates what exceeds 448;
calculated scales grow by G and store the same bits.
"""

from __future__ import annotations

import argparse
import inspect
import json
import math
import os
import shutil
import tempfile
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

# name -> (engine quantization, reference kv_cache_dtype, calculated KV scales (else 1))
VARIANTS = {
    "none": ("none", "auto", False),
    "fp8-kv": ("none", "fp8", False),
    "fp8-kv-calculated": ("none", "fp8", True),
    "fp8-weights": ("fp8", "auto", False),
    "fp8-both": ("fp8", "fp8", False),
    "fp8-both-calculated": ("fp8", "fp8", True),
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
    parser.add_argument(
        "--kv-gain", type=float, default=1.0, help="K and V this many times larger (module doc)"
    )
    parser.add_argument(
        "--variants",
        default=",".join(VARIANTS),
        help=f"comma-separated, of {', '.join(VARIANTS)} ('none' always runs: the baseline)",
    )
    args = parser.parse_args(argv)
    chosen = ["none", *(v for v in args.variants.split(",") if v and v != "none")]
    unknown = [name for name in chosen if name not in VARIANTS]
    if unknown:
        parser.error(f"--variants: unknown {', '.join(unknown)}; known: {', '.join(VARIANTS)}")
    variants = {name: VARIANTS[name] for name in chosen}
    from loopserve import LLM, SamplingParams
    from loopserve.models.builtin import resolve_model_dir
    from loopserve.models.kv_scales import calculate_kv_scales, calibration_prompts, kv_amax
    from loopserve.reference import ReferenceOutput, SerialReference

    scratch = tempfile.TemporaryDirectory()
    model_dir = resolve_model_dir(args.model)
    if args.kv_gain != 1.0:
        model_dir = _with_kv_gain(model_dir, args.kv_gain, Path(scratch.name) / "gained")
    engines = {
        quantization: LLM(
            str(model_dir), device=args.device, dtype=args.dtype, num_kv_pages=64,
            quantization=quantization,
        )
        for quantization in ("none", "fp8")
    }  # fmt: skip
    llm = engines["none"]
    models = {name: llm.engine.runner.model for name, llm in engines.items()}  # type: ignore[attr-defined]
    model = models["none"]
    config = model.config
    prompts = calibration_prompts(config.vocab_size, config.max_position_embeddings)
    length = prompts.shape[1]
    span = 16 + args.tokens
    if llm.tokenizer is not None:
        text = "\n".join(inspect.getsource(module) for module in (argparse, os, inspect))
        ids = llm.tokenizer.encode(text)
    else:  # a random-weight checkpoint has no tokenizer and no text to force: seeded token ids,
        # as many as the windows take (at least one calibration prompt's length)
        generator = torch.Generator().manual_seed(0)
        count = max(args.texts * span, length)
        ids = torch.randint(1, config.vocab_size, (count,), generator=generator).tolist()
    windows = [ids[i * span : (i + 1) * span] for i in range(args.texts)]
    rows = len(ids) // length
    texts = torch.tensor(ids[: rows * length]).view(rows, length)  # all of it, in prompts' length
    texts_amax = torch.stack([kv_amax(model, chunk) for chunk in texts.split(64)]).amax(0)
    for layer, (calibrated, seen) in enumerate(
        zip(kv_amax(model, prompts).tolist(), texts_amax.tolist(), strict=True)
    ):
        ratio = [a / b for a, b in zip(seen, calibrated, strict=True)]
        pairs = {"calibration_amax_kv": calibrated, "texts_amax_kv": seen, "ratio_kv": ratio}
        print(
            json.dumps({"layer": layer} | {k: [round(v, 4) for v in p] for k, p in pairs.items()})
        )
    scales = {name: calculate_kv_scales(model) for name, model in models.items()}
    references = {
        name: SerialReference(
            models[quantization],
            exit_mode="ouro",
            kv_cache_dtype=kv_dtype,
            kv_scales=scales[quantization] if calculated else None,
        )
        for name, (quantization, kv_dtype, calculated) in variants.items()
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
        for name in variants:
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
    scratch.cleanup()
    return 0


def _with_kv_gain(source: Path, gain: float, target: Path) -> Path:
    """A copy of the checkpoint at `source` whose attention keeps K and V `gain` times larger
    and computes the same (module doc); Ouro's and Nanbeige's tensor names."""
    from loopserve.models.loader import checkpoint_files

    shutil.copytree(source, target)
    factors = {"q_proj": 1 / gain, "k_proj": gain, "v_proj": gain, "o_proj": 1 / gain}
    for path in sorted(set(checkpoint_files(target).values())):
        tensors = load_file(str(path))
        for name, tensor in tensors.items():
            parts = name.split(".")
            if parts[-1] == "weight" and parts[-2] in factors:
                tensors[name] = tensor * factors[parts[-2]]
        save_file(tensors, str(path), metadata={"format": "pt"})
    return target


if __name__ == "__main__":
    raise SystemExit(main())
