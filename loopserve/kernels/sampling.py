"""Triton twin of the sampler's token choice: temperature, Gumbel noise and argmax in two launches.

Owns: `sample_tokens`, the token of each row for `sample.sampler.sample` when no row filters
(top-k / top-p / min-p): greedy rows take the argmax of their logits, sampled rows the argmax of
`logits / temperature + g` with `g = -log(-log(u))` and `u` the counter-based hash of
`kernels/noise.py`. Must not: differ from the torch composition in one bit or one tie. The
division is IEEE (`div_rn`, as torch divides), the logarithms are libdevice's `logf` (what
torch's CUDA `log` compiles to), and the argmax keeps torch's rules: NaN beats every number, and
among equal maxima the first index wins. tests/kernels/test_sampling.py holds the values and
tokens to torch (bit for bit on the GPU; on the CPU interpreter numpy's `log` may round a last
bit differently from torch's, so there the values are compared to 1e-6).

Why: torch runs this as ~10 launches over [rows, vocab] (the noise, two logs, two negations, the
division, the sum, two argmax reductions of ~12 µs each at one row on the H200, the select);
this is one pass over the logits (phase 1: a program per row and block of the vocabulary writes
its block's first maximum) and one small fold (phase 2: a program per row folds the blocks in
order, which gives the same first maximum as one scan).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

from loopserve.kernels.noise import row_bits, uniform

_BLOCK = 1024
_NO_INDEX = tl.constexpr(2**62)  # index of masked lanes: loses every tie


@triton.jit
def _log(x, INTERPRETED: tl.constexpr):
    """Compiled, `tl.log` of fp32 may be an approximation (not torch's bits), so this calls
    libdevice's logf by name; the interpreter (CPU tensors) has no libdevice: numpy's log."""
    if INTERPRETED:
        return tl.log(x)
    else:
        return libdevice.log(x)


@triton.jit
def _first_max(values, indices):
    """torch's argmax rule over a block: (the maximum, its first index); NaN beats numbers."""
    is_nan = values != values
    any_nan = tl.max(is_nan.to(tl.int32), axis=0) > 0
    numbers = tl.where(is_nan, float("-inf"), values)
    best = tl.max(numbers, axis=0)
    winners = tl.where(any_nan, is_nan, numbers == best)
    index = tl.min(tl.where(winners, indices, _NO_INDEX), axis=0)
    return tl.where(any_nan, float("nan"), best), index


@triton.jit
def _block_max_kernel(
    logits_ptr, temperature_ptr, greedy_ptr, seeds_ptr, counters_ptr,
    best_out, index_out, values_out,
    vocab_size, stride_logits, num_blocks,
    ALL_GREEDY: tl.constexpr, WRITE_VALUES: tl.constexpr, INTERPRETED: tl.constexpr,
    BLOCK: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0).to(tl.int64)
    block = tl.program_id(1)
    vocab = block * BLOCK + tl.arange(0, BLOCK).to(tl.int64)
    in_vocab = vocab < vocab_size
    logits = tl.load(logits_ptr + row * stride_logits + vocab, mask=in_vocab, other=float("-inf"))
    if ALL_GREEDY:
        values = logits
    else:
        bits = row_bits(tl.load(seeds_ptr + row).to(tl.int64), tl.load(counters_ptr + row))
        gumbel = -_log(-_log(uniform(bits, vocab), INTERPRETED), INTERPRETED)
        noisy = tl.math.div_rn(logits, tl.load(temperature_ptr + row)) + gumbel
        values = tl.where(tl.load(greedy_ptr + row) != 0, logits, noisy)
        # Lanes past the vocabulary never win, whatever their noise (-inf + inf would be NaN).
        values = tl.where(in_vocab, values, float("-inf"))
    if WRITE_VALUES:  # tests only: what the argmax ran over
        tl.store(values_out + row * vocab_size + vocab, values, mask=in_vocab)
    best, index = _first_max(values, tl.where(in_vocab, vocab, _NO_INDEX))
    tl.store(best_out + row * num_blocks + block, best)
    tl.store(index_out + row * num_blocks + block, index)


@triton.jit
def _fold_kernel(best_ptr, index_ptr, tokens_out, num_blocks, BLOCK_BLOCKS: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    blocks = tl.arange(0, BLOCK_BLOCKS)
    in_row = blocks < num_blocks
    best = tl.load(best_ptr + row * num_blocks + blocks, mask=in_row, other=float("-inf"))
    index = tl.load(index_ptr + row * num_blocks + blocks, mask=in_row, other=_NO_INDEX)
    _, token = _first_max(best, index)
    tl.store(tokens_out + row, token)


def sample_tokens(
    logits: torch.Tensor,  # [R, V] fp32, last dim contiguous
    temperature: torch.Tensor,  # [R] fp32 (unused by greedy rows)
    greedy: torch.Tensor,  # [R] bool
    seeds: torch.Tensor,  # [R] int64
    counters: torch.Tensor,  # [R] int64
    all_greedy: bool,
    values: torch.Tensor | None = None,  # [R, V] fp32: filled with what the argmax ran over
) -> torch.Tensor:
    """The token of each row, [R] int64: argmax(logits) for greedy rows, else
    argmax(logits / temperature + Gumbel noise of (seed, counter))."""
    rows, vocab_size = logits.shape
    tokens = torch.empty(rows, dtype=torch.int64, device=logits.device)
    if rows == 0:
        return tokens
    if logits.dtype != torch.float32 or logits.stride(1) != 1:
        raise ValueError("sample_tokens needs fp32 logits with a contiguous last dimension")
    num_blocks = triton.cdiv(vocab_size, _BLOCK)
    best = torch.empty((rows, num_blocks), dtype=torch.float32, device=logits.device)
    index = torch.empty((rows, num_blocks), dtype=torch.int64, device=logits.device)
    _block_max_kernel[(rows, num_blocks)](
        logits, temperature, greedy, seeds, counters, best, index,
        values if values is not None else best,
        vocab_size, logits.stride(0), num_blocks,
        ALL_GREEDY=all_greedy, WRITE_VALUES=values is not None,
        INTERPRETED=logits.device.type == "cpu", BLOCK=_BLOCK,
    )  # fmt: skip
    _fold_kernel[(rows,)](
        best, index, tokens, num_blocks, BLOCK_BLOCKS=triton.next_power_of_2(num_blocks)
    )
    return tokens
