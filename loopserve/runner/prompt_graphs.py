"""CUDA graphs of one prompt loop (every layer over a step's packed chunks), one per token bucket.

Owns: the token buckets, the static inputs a prompt loop's graph reads (hidden states, RoPE rows,
padded attention metadata: kv/metadata.py), lazy capture into one memory pool and replay. Must
not: change what a loop computes for the real tokens; tokens past them belong to no sequence,
write into the null page and are dropped.

Eager prompt loops are bound by the host (hundreds of launches per loop, each slower to issue than
the GPU is to run it); a replay issues one. A pass fits a graph when its tokens fit the largest
bucket, its sequences the slots, and no chunk is a single token (the decode kernel owns those).
On the CPU (tests, with triton's interpreter) nothing is captured: the padded pass runs eagerly.
"""

from __future__ import annotations

import dataclasses

import torch

from loopserve.attention.base import AttentionBackend
from loopserve.attention.paged import PagedAttention
from loopserve.kv.storage import KVStorage
from loopserve.models.layers import LoopContext
from loopserve.models.looped import LoopedForCausalLM
from loopserve.runner.block_tables import BlockTables, PromptPass
from loopserve.runner.graph_capture import Captured, capture

# Padded token counts that get a graph: at most a quarter of a replay is padding, an eighth from
# 1024 tokens. Passes beyond the largest bucket that fits `max_tokens` run eagerly.
TOKEN_BUCKETS: tuple[int, ...] = (16, 32, 64, 128, 192, 256, 384, 512, 640, 768, 896, 1024)
TOKEN_BUCKETS += (1280, 1536, 1792, 2048, *range(2560, 8192 + 1, 512))


def token_bucket(tokens: int, max_tokens: int) -> int | None:
    """The padded token count whose graph runs a pass of `tokens`, None when none is that large
    (graphs are sized for at most `max_tokens`, the prompt tokens a step may hold)."""
    return next((b for b in TOKEN_BUCKETS if tokens <= b and b <= max_tokens), None)


class GraphedPromptLoop:
    def __init__(
        self,
        model: LoopedForCausalLM,
        kv: KVStorage,
        backend: AttentionBackend,
        block_tables: BlockTables,
        max_tokens: int,
        max_sequences: int,
    ) -> None:
        """Graphs for passes of up to `max_tokens` tokens (rounded down to a bucket) in up to
        `max_sequences` sequences."""
        if not backend.supports_prompt_graphs:
            raise ValueError(f"the {backend.name} backend does not take padded prompt passes")
        self.model = model
        self.kv = kv
        self.backend = backend
        self.block_tables = block_tables
        self.max_tokens = max((b for b in TOKEN_BUCKETS if b <= max_tokens), default=0)
        device, config = block_tables.device, model.config
        self.capture = device.type == "cuda"
        self._metadata = block_tables.static_prefill_metadata(max_sequences, self.max_tokens)
        tokens, dtype = self.max_tokens, model.dtype
        self._hidden = torch.zeros((tokens, model.carried_size), dtype=dtype, device=device)
        self._cos = torch.zeros((tokens, config.head_dim), dtype=dtype, device=device)
        self._sin = torch.zeros_like(self._cos)
        # Output of each graph: [bucket, H] the loop's output.
        self._graphs: dict[int, Captured[torch.Tensor]] = {}
        self._pool = torch.cuda.graph_pool_handle() if self.capture else None

    @property
    def num_captured(self) -> int:
        return len(self._graphs)

    def fits(self, prompt: PromptPass) -> bool:
        """Whether a graph can run this pass (else the caller runs it eagerly)."""
        return (
            prompt.positions.shape[0] <= self.max_tokens
            and len(prompt.seq_lens) <= self._metadata.num_sequences
            and min(prompt.query_lens) > 1
        )

    def run(
        self,
        hidden: torch.Tensor,  # [T, H]
        cos: torch.Tensor,  # [T, D]
        sin: torch.Tensor,  # [T, D]
        prompt: PromptPass,
    ) -> torch.Tensor:
        """`model.run_loop` of one pass that `fits`: [T, H], valid until the next `run`."""
        tokens = hidden.shape[0]
        bucket = token_bucket(tokens, self.max_tokens)
        if bucket is None:
            raise ValueError(f"a prompt pass of {tokens} tokens has no graph bucket")
        self._hidden[:tokens].copy_(hidden)
        self._cos[:tokens].copy_(cos)
        self._sin[:tokens].copy_(sin)
        static = dataclasses.replace(
            self._metadata, slot_mapping=self._metadata.slot_mapping[:bucket]
        )
        # Built (and the backend prepared: its tile map uploaded) before any capture, so no
        # host-to-device copy of this pass's values is captured into a graph.
        attention = PagedAttention(
            self.backend, self.kv, self.block_tables.padded_prefill_metadata(prompt, static)
        )
        if not self.capture:
            return self._loop(bucket, attention)[:tokens]
        captured = self._graphs.get(bucket)
        if captured is None:
            # The warm-up's K/V are written again, identically, by the replay that follows.
            captured = capture(lambda: self._loop(bucket, attention), self._pool)
            self._graphs[bucket] = captured
        return captured.replay()[:tokens]

    def _loop(self, bucket: int, attention: PagedAttention) -> torch.Tensor:
        """One loop over the static buffers' first `bucket` tokens (what a graph captures)."""
        context = LoopContext(self._cos[:bucket], self._sin[:bucket], attention)
        return self.model.run_loop(self._hidden[:bucket], context)
