"""Causal attention within whole windows, with no KV cache: training and evaluation passes.

Owns: the `AttentionFn` for B windows of S tokens flattened to [B*S, heads, D]. Must not: know
about pages, loops or exits; the caller gives every loop the same windows.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from loopserve.models.layers import AttentionFn


def causal_attention(batch: int, seq_len: int) -> AttentionFn:
    """Causal attention within each of `batch` windows for flattened q/k/v [B*S, heads, D]."""

    def attend(layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        del layer  # every layer attends the same way
        heads, kv_heads, head_dim = q.shape[1], k.shape[1], q.shape[2]
        q4 = q.view(batch, seq_len, heads, head_dim).transpose(1, 2)  # [B, Nq, S, D]
        k4 = k.view(batch, seq_len, kv_heads, head_dim).transpose(1, 2)  # [B, Nkv, S, D]
        v4 = v.view(batch, seq_len, kv_heads, head_dim).transpose(1, 2)
        if heads != kv_heads:
            k4 = k4.repeat_interleave(heads // kv_heads, dim=1)
            v4 = v4.repeat_interleave(heads // kv_heads, dim=1)
        out = F.scaled_dot_product_attention(q4, k4, v4, is_causal=True)  # [B, Nq, S, D]
        return out.transpose(1, 2).reshape(batch * seq_len, heads, head_dim)

    return attend
