"""The two KV layouts: which plane a loop writes and reads, copy-on-exit, and what is freed when.

Owns: every rule that differs between `full` and `shared` (docs/looped-models.md §3). Must not:
import torch. The scheduler asks it with Python ints; the decode step asks the same methods with
int64 tensors (they use only arithmetic and comparisons), so both follow one definition; on CUDA
`decode_plane` and `copy_on_exit_target` also have a Triton twin (`kernels/decode_state.py`,
held to them bit for bit by tests/kernels/test_decode_state.py).

A request's K/V live in `max_loops` *planes*, one page table each; plane p holds the version its
tokens had after loop p + 1.
- Prompt tokens run every loop in both layouts: loop d writes and reads plane d - 1.
- `full`: a generated token's loop d writes and reads plane d - 1 too. When it exits at loop e,
  its K/V are copied into planes e .. max_loops - 1, so a later query at loop d reads it at version
  min(d, e). Every plane covers every position.
- `shared`: every loop of a generated token writes and reads the final plane, so a later query
  sees each earlier token at its exit version (prompt tokens at full depth). The other planes are
  only needed while the prompt is being computed and are freed as soon as it is.
"""

from __future__ import annotations

import enum
from typing import Any

from loopserve.kv.pages import pages_for


class KVLayout(str, enum.Enum):
    FULL = "full"
    SHARED = "shared"

    def decode_plane(self, loop: Any, max_loops: Any) -> Any:
        """Plane a generated token's loop `loop` (1-based) writes and reads (ints or tensors)."""
        return loop - 1 if self is KVLayout.FULL else max_loops - 1

    @staticmethod
    def prompt_plane(loop: int) -> int:
        """Plane a prompt token's loop `loop` (1-based) writes and reads, in both layouts."""
        return loop - 1

    def generated_planes(self, max_loops: int) -> range:
        """Planes that hold K/V of generated tokens (the rest hold the prompt alone)."""
        return range(max_loops) if self is KVLayout.FULL else range(max_loops - 1, max_loops)

    def prompt_only_planes(self, max_loops: int) -> range:
        """Planes freed as soon as the prompt has run every loop."""
        return range(0) if self is KVLayout.FULL else range(max_loops - 1)

    @property
    def copies_on_exit(self) -> bool:
        return self is KVLayout.FULL

    @staticmethod
    def copy_on_exit_target(plane: Any, exit_loop: Any, max_loops: Any) -> Any:
        """`full` layout: whether `plane` (0-based) receives the K/V of a token that exited after
        loop `exit_loop` (1-based): the planes deeper than the one it last wrote."""
        return (plane >= exit_loop) & (plane < max_loops)

    def pages_needed(
        self, max_loops: int, num_prompt_tokens: int, num_positions: int, block_size: int
    ) -> int:
        """Pages of a request whose K/V cover `num_positions` positions, the first
        `num_prompt_tokens` of them its prompt."""
        every_position = pages_for(num_positions, block_size)
        prompt = pages_for(num_prompt_tokens, block_size)
        generated_planes = len(self.generated_planes(max_loops))
        return generated_planes * every_position + (max_loops - generated_planes) * prompt
