"""The contract between the runner and every attention backend for one pass through the stack.

Owns: `AttentionMetadata`, built by the runner once per loop of a step and shared by every layer.
Must not: hold anything a backend would have to recompute per layer.

A pass covers S sequences packed into T query tokens. Sequence s has query tokens
`q[query_start[s]:query_start[s+1]]`, which are the *last* query_len(s) positions of a context of
`seq_lens[s]` tokens (the new tokens' K/V are written before attention, so they are part of it).
Query token i of sequence s sits at position `seq_lens[s] - query_len(s) + i` and attends causally
to positions <= its own. Each sequence reads pages `page_table[s, :ceil(seq_lens[s] / block)]` of
the plane the runner chose for it; the rest of the row is the null page. Padding rows have
query_len 1, seq_len 0 and write into the null page.

A *padded* prompt pass (`padded=True`, the static buffers of a prompt CUDA graph) has tensors sized
for more than it holds: sequences past the last real one have query length 0, tokens past
`query_start[-1]` belong to no sequence, write into the null page and get a zero output, and rows
of `page_table` past the last real sequence are not read. Only backends that declare
`supports_prompt_graphs` are handed one.

A pass with `rope` (the cos and sin rows of its tokens, [T, D]) hands the backend unrotated q
and k: the backend applies RoPE itself, with the bits of the model's own rotary op. Only decode
passes of backends whose `decode_rotary` is true get one (`PagedAttention` checks).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(slots=True)
class AttentionMetadata:
    query_start: torch.Tensor  # [S + 1] int32, cumulative query lengths
    seq_lens: torch.Tensor  # [S] int32, context length after this pass's writes
    page_table: torch.Tensor  # [S, P] int32 page ids, padded with the null page
    slot_mapping: torch.Tensor  # [T] int64 flat KV slot written by each query token
    max_query_len: int
    max_seq_len: int
    # Host copies for backends that loop over sequences on the host (the torch reference). None
    # when the lengths only exist on the device (the device-resident decode step): backends that
    # support CUDA graphs must not need them for decode passes.
    query_start_host: list[int] | None
    seq_lens_host: list[int] | None
    padded: bool = False
    rope: tuple[torch.Tensor, torch.Tensor] | None = None

    @property
    def num_sequences(self) -> int:
        return self.seq_lens.shape[0]

    @property
    def is_decode(self) -> bool:
        """Every sequence has exactly one query token."""
        return self.max_query_len == 1
