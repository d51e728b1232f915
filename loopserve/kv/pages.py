"""Page arithmetic shared by the torch-free KV manager and the device page tables.

Owns: the null page and the page count of a run of tokens. Must not: import torch.

Page 0 is the null page: it is never given to a request, padding entries of page tables point at
it, and padding rows write their K/V into it, so a padded batch needs no special case anywhere.
"""

from __future__ import annotations

NULL_PAGE = 0


def pages_for(num_tokens: int, block_size: int) -> int:
    """Pages that hold `num_tokens` tokens of one plane."""
    return -(-num_tokens // block_size)
