"""Batch invariance at Ouro-1.4B's shapes on a CUDA GPU (the GPU tests check it on a small model).

`python scripts/invariance_probe.py [--engine-only] [--batch-invariant]`, from the repository root,
prints:
1. for each weight matmul of a layer and the LM head (cuBLAS bf16, `F.linear` as the model runs
   it), the classes of row counts M whose row 0 gets the same bits: one class means a row's
   result does not depend on how many rows share the matmul;
2. for the random-weight Ouro-1.4B checkpoint (bf16, `exit_mode=ouro`, the GPU engine tests'
   prompts and sampling settings), whether requests generate alone what they generate in batches
   of 32 and of 128 (tokens and exit depths), and the first token where they differ; with
   `--batch-invariant`, for engines with that setting (kernels/matmul.py).
Seventh session on the H200 (docs/latency.md, "Batch invariance at full size"): one class for
every matmul but the down projection (K = 5632), whose bits split at M = 96; alone == in a batch
of 32, but 2 of 4 requests checked differed in a batch of 128.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.nn.functional as F

SHAPES = {
    "qkv": (6144, 2048),
    "o": (2048, 2048),
    "gate_up": (11264, 2048),
    "down": (2048, 5632),
    "lm_head": (49152, 2048),
}
ROW_COUNTS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 256, 512, 1024, 2048)


def matmul_classes() -> None:
    torch.manual_seed(0)
    for name, (n, k) in SHAPES.items():
        weight = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02
        x = torch.randn(ROW_COUNTS[-1], k, device="cuda", dtype=torch.bfloat16)
        classes: list[tuple[torch.Tensor, list[int]]] = []
        for m in ROW_COUNTS:
            row = F.linear(x[:m], weight)[0]
            match = next((c for c in classes if torch.equal(c[0], row)), None)
            if match is None:
                classes.append((row, [m]))
            else:
                match[1].append(m)
        print(f"{name:8s} row-0 bit classes over M: " + " / ".join(str(c[1]) for c in classes))


def engine_alone_against_batches(batch_invariant: bool) -> None:
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "gpu"))
    from test_engine_gpu import mixed_params, prompts, run  # the GPU tests' workload

    from loopserve.bench.checkpoint_cache import ensure_random_checkpoint
    from loopserve.config import EngineConfig
    from loopserve.engine.engine import Engine

    checkpoint = ensure_random_checkpoint()

    def engine() -> Engine:
        return Engine(
            EngineConfig.from_options(
                model=str(checkpoint), device="cuda", dtype="bfloat16", exit_mode="ouro",
                max_num_seqs=128, num_kv_pages=8192, batch_invariant=batch_invariant,
            )
        )  # fmt: skip

    single = engine()
    for size in (32, 128):
        batch, params = prompts(size, seed=2), mixed_params(size, 0.6)
        together = run(engine(), batch, params)
        for index in (0, 7, 31, size - 1):
            alone = run(single, [batch[index]], [params[index]])[0]
            tokens = zip(alone[0], together[index][0], strict=False)
            first = next((i for i, (a, b) in enumerate(tokens) if a != b), None)
            print(
                f"request {index}: alone == in a batch of {size}: {alone == together[index]} "
                f"(first differing token: {first}; exit depths equal: "
                f"{alone[1] == together[index][1]})"
            )


if __name__ == "__main__":
    if "--engine-only" not in sys.argv:
        matmul_classes()
    engine_alone_against_batches("--batch-invariant" in sys.argv)
