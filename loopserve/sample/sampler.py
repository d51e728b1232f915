"""The coda's sampling step: temperature, top-k, top-p, min-p, seeded draws and log-probs.

Owns: turning fp32 logits of the rows that exit into tokens. Must not: depend on batch composition
(every operation is row-wise, and the noise is counter-based per request), or sync with the host.
Log-probs are those of the model's raw distribution (before temperature, filtering and any
constraint's token mask). A constrained row (structured outputs) chooses only among the tokens its
bitmask allows: bit t of 32-bit word t // 32 set when token t may come next.
On CUDA with triton, rows choose their tokens in two launches (`kernels/sampling.py`, the torch
code's twin bit for bit) unless some row filters; the torch code stays the reference and the
path everywhere else.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from loopserve.kernels.availability import compiled_for
from loopserve.kv.transfer import host_to_device, to_device
from loopserve.sample.noise import gumbel_noise
from loopserve.sampling_params import SamplingInfo, SamplingParams


def effective_top_k(params: SamplingParams, vocab_size: int) -> int:
    """top_k as a rank bound: the vocabulary size when top-k is off."""
    return params.top_k if 0 < params.top_k < vocab_size else vocab_size


def effective_temperature(params: SamplingParams) -> float:
    """The divisor of the logits (1 for greedy rows, which ignore it)."""
    return params.temperature if params.temperature > 0 else 1.0


def needs_filter(params: SamplingParams, vocab_size: int) -> bool:
    """Whether a sampled row restricts its candidates (top-k, top-p or min-p)."""
    restricts = effective_top_k(params, vocab_size) < vocab_size
    return not params.greedy and (restricts or params.top_p < 1.0 or params.min_p > 0.0)


@dataclass(slots=True)
class SamplingBatch:
    """Per-row sampling settings as device tensors."""

    temperature: torch.Tensor  # [R] fp32, 1 for greedy rows (unused there)
    greedy: torch.Tensor  # [R] bool
    top_k: torch.Tensor  # [R] int64, V when unused
    top_p: torch.Tensor  # [R] fp32
    min_p: torch.Tensor  # [R] fp32
    seeds: torch.Tensor  # [R] int64
    counters: torch.Tensor  # [R] int64
    needs_filter: bool  # some row uses top-k, top-p or min-p
    all_greedy: bool
    num_logprobs: int  # the most alternatives any row asked for (0 when none)
    logprob_counts: list[int | None]  # per row: alternatives asked for, None for no log-probs
    any_logprobs: bool  # some row asked for log-probs (else none are computed)
    # Constrained rows: [R] bool, and their allowed tokens as int32 bitmasks [R, ceil(V / 32)];
    # None when no row is constrained.
    constrained: torch.Tensor | None = None
    token_mask: torch.Tensor | None = None

    @classmethod
    def build(
        cls,
        infos: Sequence[SamplingInfo],
        vocab_size: int,
        device: torch.device,
        token_masks: Sequence[bytes | None] = (),
    ) -> SamplingBatch:
        """One row per `infos` entry; `token_masks` (when given, one per row) are the constrained
        rows' bitmasks as little-endian int32 bytes, None for a free row."""
        params = [info.params for info in infos]
        constrained = token_mask = None
        if any(mask is not None for mask in token_masks):
            constrained, token_mask = mask_tensors(token_masks, vocab_size, device)
        top_k = [effective_top_k(p, vocab_size) for p in params]
        return cls(
            temperature=to_device(
                [effective_temperature(p) for p in params], torch.float32, device
            ),
            greedy=to_device([p.greedy for p in params], torch.bool, device),
            top_k=to_device(top_k, torch.int64, device),
            top_p=to_device([p.top_p for p in params], torch.float32, device),
            min_p=to_device([p.min_p for p in params], torch.float32, device),
            seeds=to_device([i.seed for i in infos], torch.int64, device),
            counters=to_device([i.output_index for i in infos], torch.int64, device),
            needs_filter=any(needs_filter(p, vocab_size) for p in params),
            all_greedy=all(p.greedy for p in params),
            num_logprobs=max((p.logprobs or 0 for p in params), default=0),
            logprob_counts=[p.logprobs for p in params],
            any_logprobs=any(p.logprobs is not None for p in params),
            constrained=constrained,
            token_mask=token_mask,
        )


def mask_words(vocab_size: int) -> int:
    """The int32 words of one row's token bitmask."""
    return (vocab_size + 31) // 32


def host_masks(masks: Sequence[bytes | None], vocab_size: int) -> torch.Tensor:
    """[R, words] int32 on the host: each row's bitmask, zeros for a free (None) row."""
    words = mask_words(vocab_size)
    free = bytes(4 * words)
    joined = bytearray(b"".join(free if mask is None else mask[: 4 * words] for mask in masks))
    return torch.frombuffer(joined, dtype=torch.int32).view(len(masks), words)


def mask_tensors(
    masks: Sequence[bytes | None], vocab_size: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """(constrained [R] bool, bitmasks [R, words] int32) on `device`; a None row is free (its
    words are zeros, unused)."""
    flags = to_device([mask is not None for mask in masks], torch.bool, device)
    return flags, host_to_device(host_masks(masks, vocab_size), device)


def apply_token_mask(
    logits: torch.Tensor, constrained: torch.Tensor, token_mask: torch.Tensor
) -> torch.Tensor:
    """logits [R, V] with the tokens a constrained row's bitmask forbids set to -inf."""
    rows, vocab = logits.shape
    shifts = torch.arange(32, dtype=torch.int32, device=logits.device)
    bits = (token_mask[:, :, None] >> shifts).reshape(rows, -1)[:, :vocab] & 1
    allowed = (bits != 0) | ~constrained[:, None]
    return logits.where(allowed, float("-inf"))


@dataclass(slots=True)
class SampleResult:
    tokens: torch.Tensor  # [R] int64
    logprobs: torch.Tensor  # [R] fp32, log-prob of the sampled token
    top_ids: torch.Tensor  # [R, K] int64
    top_logprobs: torch.Tensor  # [R, K] fp32


def _filter(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """Set logits outside each row's top-k / nucleus / min-p set to -inf. logits [R, V] fp32."""
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    probs = sorted_logits.softmax(dim=-1)
    rank = torch.arange(logits.shape[-1], device=logits.device)[None, :]
    drop = rank >= batch.top_k[:, None]
    # Nucleus: drop a token when the tokens ranked above it already reach top_p.
    drop |= (probs.cumsum(dim=-1) - probs) >= batch.top_p[:, None]
    drop |= probs < batch.min_p[:, None] * probs[:, :1]
    drop[:, 0] = False  # the most likely token always survives
    sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    return torch.empty_like(logits).scatter_(-1, order, sorted_logits)


def choose_tokens(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """The token of each row [R] int64, in torch: the rule `kernels/sampling.py` is held to."""
    if batch.all_greedy:
        return logits.argmax(dim=-1)
    scaled = logits / batch.temperature[:, None]
    if batch.needs_filter:
        scaled = _filter(scaled, batch)
    noisy = scaled + gumbel_noise(batch.seeds, batch.counters, logits.shape[-1])
    return torch.where(batch.greedy, logits.argmax(dim=-1), noisy.argmax(dim=-1))


def sample(logits: torch.Tensor, batch: SamplingBatch) -> SampleResult:
    """logits [R, V] fp32 -> tokens and log-probs (zeros when no row asked for log-probs)."""
    choice = logits
    if batch.constrained is not None and batch.token_mask is not None:
        choice = apply_token_mask(logits, batch.constrained, batch.token_mask)
    if compiled_for(choice) and not batch.needs_filter:
        from loopserve.kernels.sampling import sample_tokens

        tokens = sample_tokens(
            choice, batch.temperature, batch.greedy, batch.seeds, batch.counters, batch.all_greedy
        )
    else:
        tokens = choose_tokens(choice, batch)
    if not batch.any_logprobs:
        rows = logits.shape[0]
        nothing = logits.new_zeros(rows, 0)
        return SampleResult(tokens, logits.new_zeros(rows), nothing.long(), nothing)
    raw_logprobs = logits.log_softmax(dim=-1)
    chosen = raw_logprobs.gather(-1, tokens[:, None]).squeeze(-1)
    top_logprobs, top_ids = raw_logprobs.topk(batch.num_logprobs, dim=-1)
    return SampleResult(tokens, chosen, top_ids, top_logprobs)
