"""Token streams for training and evaluation, and the seeded batch sampler.

Owns: turning tokenized documents into one flat token stream (every document followed by the
separator token), drawing random training windows from it reproducibly, and cutting it into fixed
evaluation windows. Must not: know the model or the training objective.
"""

from __future__ import annotations

import torch


def token_stream(documents: list[list[int]], separator_id: int) -> torch.Tensor:
    """ids [N] int64: each document's tokens followed by `separator_id` (the end-of-text token)."""
    ids: list[int] = []
    for document in documents:
        ids.extend(document)
        ids.append(separator_id)
    return torch.tensor(ids, dtype=torch.int64)


class BatchSampler:
    """Random windows of a token stream, drawn from a seeded generator (same seed, same batches)."""

    def __init__(self, stream: torch.Tensor, seq_len: int, seed: int) -> None:
        if stream.numel() < seq_len + 2:
            raise ValueError(
                f"the training stream has {stream.numel()} tokens, fewer than one window of "
                f"{seq_len + 1}; use more corpus files or a shorter seq_len"
            )
        self._stream = stream  # [N] on the training device
        self._seq_len = seq_len
        self._generator = torch.Generator().manual_seed(seed)
        self._offsets = torch.arange(seq_len + 1)  # [S+1]

    def next_batch(self, batch_size: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(inputs [B, S], targets [B, S]); targets are the inputs shifted by one token."""
        last_start = self._stream.numel() - self._seq_len - 1
        starts = torch.randint(0, last_start + 1, (batch_size,), generator=self._generator)
        index = (starts[:, None] + self._offsets[None, :]).to(self._stream.device)  # [B, S+1]
        windows = self._stream[index]
        return windows[:, :-1], windows[:, 1:]


def eval_windows(stream: torch.Tensor, seq_len: int, max_tokens: int | None) -> torch.Tensor:
    """Consecutive non-overlapping windows [W, S] from the start of the stream.

    At most `max_tokens` tokens are used (None: the whole stream); a partial last window is
    dropped. Within a window, token 0 is context only and tokens 1..S-1 are predicted.
    """
    usable = stream.numel() if max_tokens is None else min(stream.numel(), max_tokens)
    count = usable // seq_len
    if count == 0:
        raise ValueError(
            f"{usable} evaluation tokens do not fill one window of {seq_len}; use more files, "
            "more tokens or a shorter window"
        )
    return stream[: count * seq_len].view(count, seq_len)
