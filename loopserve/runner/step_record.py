"""The decode step's result record: its columns, and how the host reads it.

Owns: the columns of the per-row record the decode step writes on the device (fp32: token ids
below 2**24 are exact) and copies to pinned memory each step, the columns a speculating step
adds (runner/speculation.py), and `decode_result`, which turns a record into the engine's
`DecodeResult`. Must not: compute anything on the device.

A plain step writes one row per slot: RAN, LOOP, EXITED, TOKEN, STOPPED, LOGPROB, then the top
log-probs' ids and values (K each, K = 0 unless a row asked for log-probs). A speculating step
writes `lanes` rows per slot, in ring order from its oldest unfinished token: EXITED marks the
tokens that became final this step (in order), LOOP the loop each lane ran; after the top
log-probs come DEPTH (the exit loop of the token a row reports), PROPOSED (the lane proposed a
token that got a lane this step) and CONFIRMED (the row's token was a proposal found equal to
the final token this step).
"""

from __future__ import annotations

import torch

from loopserve.engine.scheduler_output import DecodeResult
from loopserve.runner.prefill import sampled_token

RAN, LOOP, EXITED, TOKEN, STOPPED, LOGPROB = range(6)
RESULT_COLUMNS = 6
DEPTH, PROPOSED, CONFIRMED = range(3)  # after the top log-probs, in speculating records
EXTRA_COLUMNS = 3
# Top log-prob alternatives a record carries at most (the sampler's limit).
MAX_TOP_LOGPROBS = 20


def decode_result(record: torch.Tensor, counts: list[int | None], lanes: int) -> DecodeResult:
    """The record of a step (`lanes` rows per slot; the speculative record's extra columns last)
    as host values; `counts` per record row."""
    rows = record.tolist()
    extra = EXTRA_COLUMNS if lanes > 1 else 0
    top_count = (record.shape[1] - RESULT_COLUMNS - extra) // 2
    end = RESULT_COLUMNS + 2 * top_count
    result = DecodeResult(
        ran=[bool(row[RAN]) for row in rows],
        loops=[int(row[LOOP]) for row in rows],
        tokens=[[] for _ in range(len(rows) // lanes)],
        depths=[[] for _ in range(len(rows) // lanes)],
        stopped=[False] * (len(rows) // lanes),
    )
    for index, (row, count) in enumerate(zip(rows, counts, strict=True)):
        slot = index // lanes
        if extra:
            result.proposed += int(row[end + PROPOSED])
            result.confirmed += int(row[end + CONFIRMED])
        if not row[EXITED]:
            continue
        top_ids = row[RESULT_COLUMNS : RESULT_COLUMNS + top_count]
        top_logprobs = row[RESULT_COLUMNS + top_count : end]
        token = sampled_token(int(row[TOKEN]), row[LOGPROB], top_ids, top_logprobs, count)
        result.tokens[slot].append(token)
        result.depths[slot].append(int(row[end + DEPTH]) if extra else int(row[LOOP]))
        result.stopped[slot] |= bool(row[STOPPED])
    return result
