"""Constrained decoding on the device: each slot's token bitmask, and when a row must wait for it.

Owns: the per-slot constraint state of the decode step (whether a slot is constrained, its
bitmask and the output index the bitmask is for, the token after which a deferred constraint
begins) and the rule that keeps a constrained row from exiting without the bitmask of the token it
would sample. Must not: read the host during a step, or compute bitmasks (the engine's grammar
states do, `engine.constraints`).

Why a row can lack its bitmask: with asynchronous scheduling the host learns a token one step
after the device sampled it, so the bitmask of the following token reaches the device a step or
two later. A constrained row whose bitmask is for an earlier index (`mask_index != output_count`)
does not run in a step where it could exit (`policy.may_exit`); it runs unchanged once the bitmask
has arrived. Exits are decided exactly as without constraints (the row is held, never exits early
or late), so outputs equal the serial reference's; only the step a token finishes in moves. At
fixed depth a bitmask arrives long before the token's last loop and nothing is held.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from loopserve.depth import policy
from loopserve.depth.policy import RowDepth
from loopserve.engine.scheduler_output import TokenMask
from loopserve.kv.transfer import host_to_device
from loopserve.sample.sampler import host_masks, mask_words

# The columns ahead of the bitmask words in `SlotMasks.apply`'s upload.
SLOT, INDEX, BEGIN_AFTER, FLAG, WORDS = range(5)


class SlotMasks:
    """[slots] constraint state of the decode step (graph inputs: fixed tensors, updated in
    place between steps)."""

    def __init__(self, slots: int, vocab_size: int, device: torch.device) -> None:
        self.vocab_size = vocab_size
        self.device = device
        self.constrained = torch.zeros(slots, dtype=torch.bool, device=device)
        self.mask_index = torch.full((slots,), -1, dtype=torch.int32, device=device)
        self.begin_after = torch.full((slots,), -1, dtype=torch.int32, device=device)
        self.token_mask = torch.zeros(
            (slots, mask_words(vocab_size)), dtype=torch.int32, device=device
        )
        self._has_constraint = [False] * slots  # host copy: the slot's request has a constraint

    def any(self, slots: Sequence[int]) -> bool:
        return any(self._has_constraint[slot] for slot in slots)

    def reset(self, index: torch.Tensor, slots: Sequence[int]) -> None:
        """Newly started slots are free until `apply` says otherwise."""
        self.constrained[index] = False
        self.mask_index[index] = -1
        self.begin_after[index] = -1
        for slot in slots:
            self._has_constraint[slot] = False

    def apply(self, masks: Sequence[TokenMask]) -> None:
        """Write the bitmasks the engine prepared (after the step's slot starts): one upload of
        [masks, WORDS + words] int32 rows, scattered into the slots' state."""
        if not masks:
            return
        header = torch.tensor(
            [(m.slot, m.index, m.begin_after, m.words is not None) for m in masks],
            dtype=torch.int32,
        )
        host = torch.cat([header, host_masks([m.words for m in masks], self.vocab_size)], dim=1)
        rows = host_to_device(host, self.device)
        index = rows[:, SLOT].long()
        self.mask_index.index_copy_(0, index, rows[:, INDEX])
        self.begin_after.index_copy_(0, index, rows[:, BEGIN_AFTER])
        self.constrained.index_copy_(0, index, rows[:, FLAG] != 0)
        self.token_mask.index_copy_(0, index, rows[:, WORDS:])
        for mask in masks:
            self._has_constraint[mask.slot] = True

    def held(self, rows: int, row: RowDepth, output_count: torch.Tensor) -> torch.Tensor:
        """[rows] bool: constrained rows that could exit this step but lack their bitmask."""
        stale = self.mask_index[:rows] != output_count
        return self.constrained[:rows] & stale & policy.may_exit(row)

    def begin(self, rows: int, exited: torch.Tensor, tokens: torch.Tensor) -> None:
        """A deferred constraint begins once its `begin_after` token is sampled (the next token
        then waits for its first bitmask)."""
        began = exited & (tokens == self.begin_after[:rows])
        self.constrained[:rows] |= began
