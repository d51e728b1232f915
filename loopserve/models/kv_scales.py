"""Per-layer K and V scales of an fp8 KV cache: 1, a checkpoint's, or calculated from fixed
calibration prompts (`calculate_kv_scales`, `--calculate-kv-scales`, as vLLM names it).

Owns: which of those a model runs with (`fp8_kv_scales`, for the engine and `eval perplexity`
alike), the calibration prompts, the pass that records each KV layer's largest |K| and |V|, and
the rule from those to scales. Must not: know about pages, requests or backends: the prompts run
through the model's own stages with plain causal attention over unquantized K/V, as a prompt
runs in the engine (every loop, then the coda).

The prompts are token ids, so that every checkpoint calibrates alike with or without a
tokenizer: `CALIBRATION_PROMPTS` sequences of `CALIBRATION_TOKENS` ids, token i of the whole
run being `(i * 2654435761) % vocab_size` (Knuth's multiplicative hash: ids spread over the
vocabulary, the same on every machine). A layer's K and V scale are its largest |K| and |V| over
every position, prompt and loop, times `HEADROOM`, over 448 (e4m3's largest value); a layer
whose K or V are all zero keeps scale 1.
"""

from __future__ import annotations

from pathlib import Path

import torch

from loopserve.kv.storage import FP8_MAX, KVScales
from loopserve.models.layers import LoopContext
from loopserve.models.loader import checkpoint_kv_scales
from loopserve.models.looped import PROMPT_STATE_SEED, LoopedForCausalLM
from loopserve.models.window_attention import causal_attention

CALIBRATION_PROMPTS = 4
CALIBRATION_TOKENS = 128
# What the calibration's largest |K| and |V| are stored as: 448 / HEADROOM. Values up to HEADROOM
# times the largest seen still fit; the cost is log2(HEADROOM) binades at the bottom of e4m3's
# range, where values round to subnormals (docs/quantization.md says why 2).
HEADROOM = 2.0
_HASH = 2654435761


def calibration_prompts(vocab_size: int, max_tokens: int) -> torch.Tensor:
    """[CALIBRATION_PROMPTS, min(CALIBRATION_TOKENS, max_tokens)] int64 token ids."""
    length = min(CALIBRATION_TOKENS, max_tokens)
    ids = torch.arange(CALIBRATION_PROMPTS * length, dtype=torch.int64) * _HASH % vocab_size
    return ids.view(CALIBRATION_PROMPTS, length)


@torch.inference_mode()
def kv_amax(model: LoopedForCausalLM, prompts: torch.Tensor) -> torch.Tensor:
    """[num_kv_layers, 2] fp32: each KV layer's largest |K| and |V| (after RoPE, as the cache
    stores them) while `prompts` [P, S] run through the prelude, every loop and the coda."""
    batch, seq_len = prompts.shape
    device = model.device
    amax = torch.zeros((model.num_kv_layers, 2), dtype=torch.float32, device=device)
    attend = causal_attention(batch, seq_len)

    def attention(layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        seen = torch.stack([k.abs().amax(), v.abs().amax()]).float()
        amax[layer] = torch.maximum(amax[layer], seen)  # (NaN propagates: refused after)
        return attend(layer, q, k, v)

    positions = torch.arange(seq_len, device=device).repeat(batch)
    cos, sin = model.rope(positions)
    ctx = LoopContext(cos, sin, attention)
    seeds = torch.full_like(positions, PROMPT_STATE_SEED)
    hidden = model.start(prompts.reshape(-1).to(device), positions, seeds, ctx)
    for _ in range(model.config.num_loops):
        hidden = model.run_loop(hidden, ctx)
    model.coda(hidden, ctx)
    return amax.cpu()


def scales_from_amax(amax: torch.Tensor) -> KVScales:
    """Scales [L, 2] from each layer's largest |K| and |V| [L, 2] (module doc)."""
    if not bool(torch.isfinite(amax).all()):
        raise ValueError(
            "calculate_kv_scales: the calibration prompts gave K/V that are not finite "
            f"(largest |K|, |V| per layer: {amax.tolist()})"
        )
    scale = torch.where(amax > 0, amax * HEADROOM / FP8_MAX, torch.ones_like(amax))
    return KVScales(scale, "calculated")


def calculate_kv_scales(model: LoopedForCausalLM) -> KVScales:
    """The fp8 cache's per-layer scales from the calibration prompts (module doc)."""
    config = model.config
    prompts = calibration_prompts(config.vocab_size, config.max_position_embeddings)
    amax = kv_amax(model, prompts)
    return scales_from_amax(amax)


def fp8_kv_scales(model: LoopedForCausalLM, checkpoint: Path | None, calculate: bool) -> KVScales:
    """The scales an fp8 cache of `model` runs with: calculated from the calibration prompts
    (`calculate`, which overrides a checkpoint's), else the `checkpoint` directory's `k_scale` /
    `v_scale` tensors if it has them, else 1."""
    if calculate:
        return calculate_kv_scales(model)
    loaded = None if checkpoint is None else checkpoint_kv_scales(checkpoint)
    return loaded or KVScales.unit(model.num_kv_layers)
