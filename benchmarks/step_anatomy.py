"""Where the time of a decode step goes, and which operations break batch invariance.

Owns: `python -m benchmarks.step_anatomy`, a GPU diagnostic that prints one JSON line per
finding: (1) for every matmul shape of an Ouro-1.4B loop and the LM head, whether row 0 of a batch
of M rows is bitwise equal to the same row computed alone (M = 1); (2) the time of one loop of the
shared stack, of the coda (LM head + sampling) and of the exit gate at several batch sizes, so the
extra LM-head cost of the device-resident step (which runs the coda for every row) is measured.
Must not: assert speed; it measures and reports.
"""

from __future__ import annotations

import argparse
import json
import time

import torch
import torch.nn.functional as F

from loopserve.models.layers import LoopContext
from loopserve.models.loader import dummy_model
from loopserve.models.looped import LoopedForCausalLM
from loopserve.models.ouro_config import OuroConfig
from loopserve.sample.sampler import SamplingBatch, sample
from loopserve.sampling_params import SamplingInfo, SamplingParams

BATCHES = (1, 2, 4, 8, 16, 32, 64, 128, 256)


def matmul_invariance(config: OuroConfig, device: torch.device) -> list[dict[str, object]]:
    """Row 0 of x[:M] @ W.T versus x[:1] @ W.T, bitwise, for each weight shape of a loop."""
    hidden, inner = config.hidden_size, config.intermediate_size
    q_size = config.num_attention_heads * config.head_dim
    kv_size = config.num_key_value_heads * config.head_dim
    shapes = {
        "q_proj": (q_size, hidden),
        "k_proj/v_proj": (kv_size, hidden),
        "o_proj": (hidden, q_size),
        "gate_proj/up_proj": (inner, hidden),
        "down_proj": (hidden, inner),
        "lm_head": (config.vocab_size, hidden),
    }
    generator = torch.Generator(device=device).manual_seed(0)
    findings: list[dict[str, object]] = []
    for name, (rows, cols) in shapes.items():
        weight = torch.randn(rows, cols, device=device, generator=generator).to(torch.bfloat16)
        x = torch.randn(max(BATCHES), cols, device=device, generator=generator).to(torch.bfloat16)
        alone = F.linear(x[:1], weight)
        differs = [m for m in BATCHES if not torch.equal(F.linear(x[:m], weight)[:1], alone)]
        findings.append({"kind": "matmul_invariance", "op": name, "shape": [rows, cols],
                         "batches_differing_from_1": differs})  # fmt: skip
    return findings


def _time(fn: object, repeats: int = 50) -> float:
    """Median milliseconds of fn() with CUDA events, after warm-up."""
    assert callable(fn)
    for _ in range(5):
        fn()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return sorted(times)[len(times) // 2]


def _costs_at(model: LoopedForCausalLM, batch: int, device: torch.device) -> dict[str, object]:
    hidden = torch.randn(batch, model.config.hidden_size, device=device).to(model.dtype)
    cos, sin = model.rope(torch.zeros(batch, dtype=torch.int64, device=device))

    def attention(layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return v.repeat_interleave(q.shape[1] // k.shape[1], dim=1)  # one key: its value

    context = LoopContext(cos, sin, attention)
    vocab = model.config.vocab_size
    infos = [SamplingInfo(SamplingParams(temperature=1.0), index, 0) for index in range(batch)]
    sampled = SamplingBatch.build(infos, vocab, device)
    greedy_info = SamplingInfo(SamplingParams(temperature=0.0), 0, 0)
    greedy = SamplingBatch.build([greedy_info] * batch, vocab, device)
    with torch.inference_mode():
        loop_ms = _time(lambda: model.run_loop(hidden, context))
        gate_ms = _time(lambda: model.exit_probability(hidden, hidden, 1.0))
        coda_greedy_ms = _time(lambda: sample(model.compute_logits(hidden), greedy))
        coda_sampled_ms = _time(lambda: sample(model.compute_logits(hidden), sampled))
    return {
        "kind": "step_costs",
        "batch": batch,
        "loop_ms": loop_ms,
        "gate_ms": gate_ms,
        "coda_greedy_ms": coda_greedy_ms,
        "coda_sampled_ms": coda_sampled_ms,
        "coda_greedy_over_loop": coda_greedy_ms / loop_ms,
    }


def step_costs(model: LoopedForCausalLM, device: torch.device) -> list[dict[str, object]]:
    """Loop vs coda vs gate time per batch size (attention over a 1-token context: weights only)."""
    return [_costs_at(model, batch, device) for batch in (1, 8, 32, 128)]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--device", default="cuda")
    args = parser.parse_args()
    device = torch.device(args.device)
    config = OuroConfig()
    started = time.monotonic()
    for finding in matmul_invariance(config, device):
        print(json.dumps(finding), flush=True)
    if device.type == "cuda":
        model = dummy_model(config, torch.bfloat16, device)
        for finding in step_costs(model, device):
            print(json.dumps(finding), flush=True)
    print(json.dumps({"kind": "done", "seconds": round(time.monotonic() - started, 1)}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
