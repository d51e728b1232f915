"""The serial reference: one request at a time, dense per-loop K/V, written to be read.

Owns: the definition-by-code of docs/looped-models.md for both KV layouts and every exit mode,
and the cache-free `dense_logits` (each family's forward written from the spec alone, with no
model code, is `loopserve.reference_spec`). Every fast path (the engine, its kernels, the
evaluators) is tested against it, and users can run it to check the engine on their own
checkpoint. Must not: batch, page, or optimise anything.

It shares with the engine only what *defines* the behaviour: the model's math, the fp32 exit test
(`depth.exit_test`), the seeded sampler and the seeded exit traces. It deliberately does not use
the engine's depth policy (`depth.policy`) or KV layouts (`kv.layout`): it is their oracle.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import partial

import torch

from loopserve.depth.exit_test import next_survival, threshold_reached
from loopserve.depth.trace import D2_6, resolved_trace_depth
from loopserve.kv.storage import K, KVFormat, KVScales, V, special_cache_dtype
from loopserve.models.layers import AttentionFn, LoopContext
from loopserve.models.looped import PROMPT_STATE_SEED, LoopedForCausalLM
from loopserve.outputs import TokenLogprobs
from loopserve.sample.sampler import SamplingBatch, sample
from loopserve.sampling_params import ResolvedParams, SamplingInfo
from loopserve.structured.grammar import GrammarState


def attend(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, causal: bool) -> torch.Tensor:
    """Plain softmax attention in fp32. q [Q, Nq, D] are the last Q of C positions keys/values
    [C, Nkv, D]; with `causal`, query i sees positions <= C - Q + i. Returns [Q, Nq, D]."""
    groups = q.shape[1] // keys.shape[1]
    keys = keys.float().repeat_interleave(groups, dim=1)
    values = values.float().repeat_interleave(groups, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q.float(), keys) * q.shape[-1] ** -0.5
    if causal:
        num_queries, context = q.shape[0], keys.shape[0]
        allowed = (
            torch.arange(context)[None, :] <= torch.arange(context - num_queries, context)[:, None]
        )
        scores = scores.masked_fill(~allowed.to(scores.device), float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(dim=-1), values).to(q.dtype)


@dataclass
class ReferenceOutput:
    token_ids: list[int] = field(default_factory=list)
    exit_depths: list[int] = field(default_factory=list)
    logits: list[torch.Tensor] = field(default_factory=list)  # [V] fp32 that produced each token
    logprobs: list[TokenLogprobs] = field(default_factory=list)
    finish_reason: str | None = None


class _DenseKV:
    """K/V per plane and layer: keys[plane][layer] is [positions, Nkv, D]."""

    def __init__(self, num_planes: int, num_layers: int, kv_format: KVFormat) -> None:
        self.kv_format = kv_format  # stored K/V are rounded as the cache rounds them
        self.keys: list[list[torch.Tensor | None]] = [
            [None] * num_layers for _ in range(num_planes)
        ]
        self.values: list[list[torch.Tensor | None]] = [
            [None] * num_layers for _ in range(num_planes)
        ]

    def stored(
        self, layer: int, k: torch.Tensor, v: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of `layer` as the cache keeps them, in their own dtype."""
        return self.kv_format.stored(k, layer, K), self.kv_format.stored(v, layer, V)

    def append(self, plane: int, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        k, v = self.stored(layer, k, v)
        old_k, old_v = self.keys[plane][layer], self.values[plane][layer]
        self.keys[plane][layer] = k if old_k is None else torch.cat([old_k, k])
        self.values[plane][layer] = v if old_v is None else torch.cat([old_v, v])

    def get(self, plane: int, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        keys, values = self.keys[plane][layer], self.values[plane][layer]
        assert keys is not None and values is not None
        return keys, values


class SerialReference:
    """Generates for one request at a time, exactly as the specification says."""

    def __init__(
        self,
        model: LoopedForCausalLM,
        kv_layout: str = "full",
        exit_mode: str = "ouro",
        trace_distribution: Sequence[float] = D2_6,
        kv_cache_dtype: str = "auto",
        kv_scales: KVScales | None = None,
    ) -> None:
        """`kv_cache_dtype` "fp8": K/V are kept as an fp8 cache keeps them (`kv.storage`), with
        the per-layer `kv_scales` (None: 1; an engine's are `KVStorage.scales`)."""
        if kv_layout not in ("full", "shared"):
            raise ValueError(f"kv_layout must be 'full' or 'shared', got {kv_layout!r}")
        if exit_mode not in ("ouro", "ouro_delayed", "trace"):
            raise ValueError(f"unknown exit_mode {exit_mode!r}")
        self.model = model
        self.kv_layout = kv_layout
        self.exit_mode = exit_mode
        self.trace_distribution = tuple(trace_distribution)
        self.kv_format = KVFormat(special_cache_dtype(kv_cache_dtype), kv_scales)
        self.device = model.device

    @torch.inference_mode()
    def generate(
        self,
        prompt_ids: list[int],
        params: ResolvedParams,
        forced_tokens: list[int] | None = None,
        grammar: GrammarState | None = None,
    ) -> ReferenceOutput:
        """Generate (or, with `forced_tokens`, teacher-force) one request's continuation;
        `grammar`, a constraint's fresh state, masks every token and ends the request ("stop")
        once complete."""
        layers = self.model.config.num_hidden_layers
        kv = _DenseKV(params.max_loops, layers, self.kv_format)
        # Prelude and coda layers (a family that has them): one version of every token.
        stages = _DenseKV(1, self.model.num_kv_layers, self.kv_format)
        out = ReferenceOutput()
        readout = self._prefill(prompt_ids, params.max_loops, kv, stages)
        # `shared`: after prefill only the final version of each token is kept.
        final = _DenseKV(1, layers, self.kv_format)
        for layer in range(layers):
            final.append(0, layer, *kv.get(params.max_loops - 1, layer))
        depth = params.max_loops
        while True:
            token = self._sample(readout, params, out, forced_tokens, grammar)
            out.exit_depths.append(depth)
            if self._finished(token, params, out, forced_tokens):
                return out
            if grammar is not None:
                grammar.accept(token)
                if grammar.complete:
                    out.finish_reason = "stop"
                    return out
            position = len(prompt_ids) + len(out.token_ids) - 1
            index = len(out.token_ids) - 1
            readout, depth = self._decode(token, position, params, index, kv, final, stages)

    def _stage_context(
        self, stages: _DenseKV, cos: torch.Tensor, sin: torch.Tensor, causal: bool
    ) -> LoopContext:
        """Attention of prelude and coda layers: each token's one version, in stage storage."""

        def attention(
            layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
        ) -> torch.Tensor:
            stages.append(0, layer, k, v)
            return attend(q, *stages.get(0, layer), causal=causal)

        return LoopContext(cos, sin, attention)

    def _prefill(
        self, prompt_ids: list[int], num_loops: int, kv: _DenseKV, stages: _DenseKV
    ) -> torch.Tensor:
        """Every prompt token through the prelude, every loop (loop d writes and reads plane
        d - 1) and the coda; returns the LM head's input of the last one [1, H]."""
        ids = torch.tensor(prompt_ids, device=self.device)
        positions = torch.arange(len(prompt_ids), device=self.device)
        cos, sin = self.model.rope(positions)
        stage = self._stage_context(stages, cos, sin, causal=True)
        seeds = torch.full_like(positions, PROMPT_STATE_SEED)
        hidden = self.model.start(ids, positions, seeds, stage)
        for loop in range(1, num_loops + 1):

            def attention(
                layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, plane: int = loop - 1
            ) -> torch.Tensor:
                kv.append(plane, layer, k, v)
                return attend(q, *kv.get(plane, layer), causal=True)

            hidden = self.model.run_loop(hidden, LoopContext(cos, sin, attention))
        return self.model.coda(hidden, stage)[-1:]

    def _decode(
        self,
        token: int,
        position: int,
        params: ResolvedParams,
        decode_index: int,
        kv: _DenseKV,
        final: _DenseKV,
        stages: _DenseKV,
    ) -> tuple[torch.Tensor, int]:
        """Run one generated token through the prelude, loops until it exits, and the coda;
        returns (the LM head's input [1, H], depth)."""
        where = torch.tensor([position], device=self.device)
        cos, sin = self.model.rope(where)
        stage = self._stage_context(stages, cos, sin, causal=False)
        seed = torch.tensor([params.seed], device=self.device)
        hidden = self.model.start(torch.tensor([token], device=self.device), where, seed, stage)
        memory = self.model.initial_exit_memory(1)
        survival = torch.ones(1, dtype=torch.float32, device=self.device)
        stop_after_this_loop = False
        written: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        for loop in range(1, params.max_loops + 1):

            def attention(
                layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, plane: int = loop - 1
            ) -> torch.Tensor:
                written[layer] = (k, v)
                if self.kv_layout == "full":
                    kv.append(plane, layer, k, v)  # its loop-d version, at position `position`
                    return attend(q, *kv.get(plane, layer), causal=False)
                # `shared`: earlier tokens through their final version, itself at this loop.
                return _attend_beside(final, layer, q, k, v)

            previous = hidden
            hidden = self.model.run_loop(hidden, LoopContext(cos, sin, attention))
            if self.model.exit_needs_readout:  # this loop's logits, its coda K/V not kept
                peek = LoopContext(cos, sin, _peeking(stages))
                logits = self.model.compute_logits(hidden, ctx=peek)
                readout_hazard, memory = self.model.readout_exit(
                    logits, memory, params.exit_threshold
                )
            if loop == params.max_loops:
                break
            if self.exit_mode == "trace":
                if loop >= resolved_trace_depth(params, decode_index, self.trace_distribution):
                    break
                continue
            if params.fixed_depth:
                continue
            if stop_after_this_loop:
                break
            if self.model.exit_needs_readout:
                hazard = readout_hazard
            else:
                hazard = self.model.exit_probability(hidden, previous, params.exit_threshold)
            survival = next_survival(survival, hazard)
            test = bool(threshold_reached(survival, loop, params.min_loops, params.exit_threshold))
            if test and self.exit_mode == "ouro":
                break
            if test and self.exit_mode == "ouro_delayed":
                stop_after_this_loop = True
        for layer, (k, v) in written.items():
            if self.kv_layout == "full":
                for plane in range(loop, params.max_loops):  # deeper planes read the exit version
                    kv.append(plane, layer, k, v)
            else:
                final.append(0, layer, k, v)
        return self.model.coda(hidden, stage), loop

    def _sample(
        self,
        readout: torch.Tensor,
        params: ResolvedParams,
        out: ReferenceOutput,
        forced_tokens: list[int] | None,
        grammar: GrammarState | None,
    ) -> int:
        logits = self.model.head(readout)  # [1, V]
        info = SamplingInfo(params.params, params.seed, len(out.token_ids))
        masks = [grammar.mask()] if grammar is not None else []
        batch = SamplingBatch.build([info], self.model.config.vocab_size, self.device, masks)
        result = sample(logits, batch)
        token = (
            int(result.tokens[0]) if forced_tokens is None else forced_tokens[len(out.token_ids)]
        )
        out.logits.append(logits[0])
        out.token_ids.append(token)
        count = params.params.logprobs
        if count is not None:
            logprobs = logits[0].log_softmax(-1)
            top = logprobs.topk(count)
            alternatives = tuple(zip(top.indices.tolist(), top.values.tolist(), strict=True))
            out.logprobs.append(TokenLogprobs(token, float(logprobs[token]), alternatives))
        return token

    def _finished(
        self, token: int, params: ResolvedParams, out: ReferenceOutput, forced: list[int] | None
    ) -> bool:
        if forced is not None:
            out.finish_reason = "length" if len(out.token_ids) == len(forced) else None
        elif token in params.eos_token_ids or token in params.params.stop_token_ids:
            out.finish_reason = "stop"
        elif len(out.token_ids) >= params.params.max_tokens:
            out.finish_reason = "length"
        return out.finish_reason is not None


def _attend_beside(
    kept: _DenseKV, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
) -> torch.Tensor:
    """One token's attention over every earlier token's kept version (plane 0 of `kept`) and
    its own current K/V, keeping nothing (its K/V read as the cache stores them, as the engine
    reads them after writing them there)."""
    keys, values = kept.get(0, layer)
    k, v = kept.stored(layer, k, v)
    keys, values = torch.cat([keys, k]), torch.cat([values, v])
    return attend(q, keys, values, causal=False)


def _peeking(stages: _DenseKV) -> AttentionFn:
    """The coda's attention for a criterion that reads every loop's logits: the token's coda
    K/V are not kept until it exits."""
    return partial(_attend_beside, stages)


@torch.inference_mode()
def dense_logits(model: LoopedForCausalLM, token_ids: list[int], num_loops: int) -> torch.Tensor:
    """Cache-free full recompute at fixed depth: logits [N, V] of every position."""
    device = model.device
    positions = torch.arange(len(token_ids), device=device)
    cos, sin = model.rope(positions)

    def attention(layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return attend(q, k, v, causal=True)

    context = LoopContext(cos, sin, attention)
    seeds = torch.full_like(positions, PROMPT_STATE_SEED)
    hidden = model.start(torch.tensor(token_ids, device=device), positions, seeds, context)
    for _ in range(num_loops):
        hidden = model.run_loop(hidden, context)
    return model.compute_logits(hidden, ctx=context)
