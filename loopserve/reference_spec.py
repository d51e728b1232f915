"""Each family's fixed-depth forward written from docs/looped-models.md §1 alone: the checkpoint's
tensors (HF names), no model code, every op in fp32, no cache.

Owns: `spec_logits`, the independent statement of each family's math that the models' own staged
forward (`reference.dense_logits`) is held to by tests/e2e/test_reference.py. Must not: import a
model class, or share code with one beyond plain attention (`reference.attend`).
"""

from __future__ import annotations

import torch

from loopserve.models.huginn_config import HuginnConfig
from loopserve.models.model_config import LoopedConfig
from loopserve.reference import attend


def spec_logits(
    config: LoopedConfig,
    weights: dict[str, torch.Tensor],
    token_ids: list[int],
    num_loops: int,
    initial_state: torch.Tensor | None = None,
) -> torch.Tensor:
    """The fixed-depth forward of any family written from docs/looped-models.md §1 alone: the
    checkpoint's tensors (HF names), no model code, every op in fp32, no cache. Returns the
    logits [N, V] of every position; `dense_logits` of the loaded model must agree with it.
    Huginn's random initial state [N, H] is an input (`initial_state`: the seeded draw)."""
    w = {name: tensor.float() for name, tensor in weights.items()}
    if isinstance(config, HuginnConfig):
        assert initial_state is not None, "Huginn's spec forward needs the initial state"
        return _huginn_spec_logits(config, w, token_ids, num_loops, initial_state.float())
    eps, heads, kv_heads = (
        config.rms_norm_eps,
        config.num_attention_heads,
        config.num_key_value_heads,
    )
    head_dim = config.head_dim

    def norm(x: torch.Tensor, name: str) -> torch.Tensor:
        return w[name] * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))

    positions = torch.arange(len(token_ids), dtype=torch.float32)
    inverse = 1.0 / config.rope_theta ** (torch.arange(0, head_dim, 2).float() / head_dim)
    angles = torch.cat([positions[:, None] * inverse] * 2, dim=-1)  # [N, D]

    def rotate(x: torch.Tensor) -> torch.Tensor:  # rotate-half RoPE of [N, heads, D]
        half = torch.cat((-x[..., head_dim // 2 :], x[..., : head_dim // 2]), dim=-1)
        return x * angles.cos()[:, None] + half * angles.sin()[:, None]

    def attention(x: torch.Tensor, prefix: str) -> torch.Tensor:
        q = (x @ w[f"{prefix}.q_proj.weight"].T).view(len(x), heads, head_dim)
        k = (x @ w[f"{prefix}.k_proj.weight"].T).view(len(x), kv_heads, head_dim)
        v = (x @ w[f"{prefix}.v_proj.weight"].T).view(len(x), kv_heads, head_dim)
        out = attend(rotate(q), rotate(k), v, causal=True)
        return out.reshape(len(x), heads * head_dim) @ w[f"{prefix}.o_proj.weight"].T

    def mlp(x: torch.Tensor, prefix: str) -> torch.Tensor:
        gate, up = x @ w[f"{prefix}.gate_proj.weight"].T, x @ w[f"{prefix}.up_proj.weight"].T
        return (torch.nn.functional.silu(gate) * up) @ w[f"{prefix}.down_proj.weight"].T

    sandwich = config.family == "ouro"  # Ouro: four norms a layer; Nanbeige: pre-norm
    skip = bool(getattr(config, "skip_loop_final_norm", False))
    hidden = w["model.embed_tokens.weight"][torch.tensor(token_ids)]
    for _ in range(num_loops):
        for layer in range(config.num_hidden_layers):
            p = f"model.layers.{layer}"
            update = attention(norm(hidden, f"{p}.input_layernorm.weight"), f"{p}.self_attn")
            if sandwich:
                update = norm(update, f"{p}.input_layernorm_2.weight")
            hidden = hidden + update
            update = mlp(norm(hidden, f"{p}.post_attention_layernorm.weight"), f"{p}.mlp")
            if sandwich:
                update = norm(update, f"{p}.post_attention_layernorm_2.weight")
            hidden = hidden + update
        if not skip:
            hidden = norm(hidden, "model.norm.weight")
    if skip:
        hidden = norm(hidden, "model.norm.weight")
    head = w.get("lm_head.weight", w["model.embed_tokens.weight"])
    return hidden @ head.T


def _huginn_spec_logits(
    config: HuginnConfig,
    w: dict[str, torch.Tensor],
    token_ids: list[int],
    num_loops: int,
    state: torch.Tensor,
) -> torch.Tensor:
    """Huginn-0125 in the checkpoint's own layout: adjacent-pair RoPE on Wqkv's q and k."""
    heads, head_dim, eps = config.num_attention_heads, config.head_dim, config.rms_norm_eps
    positions = torch.arange(len(token_ids), dtype=torch.float32)
    inverse = 1.0 / config.rope_theta ** (torch.arange(0, head_dim, 2).float() / head_dim)
    angles = positions[:, None] * inverse  # [N, D/2]: pair i of a head turns at inverse[i]
    cos, sin = angles.cos()[:, None], angles.sin()[:, None]

    def norm(x: torch.Tensor, name: str) -> torch.Tensor:
        return w[name] * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))

    def rotate_pairs(x: torch.Tensor) -> torch.Tensor:  # [N, heads, D], pairs (2i, 2i + 1)
        even, odd = x[..., 0::2], x[..., 1::2]
        return torch.stack([even * cos - odd * sin, odd * cos + even * sin], -1).flatten(-2)

    def block(x: torch.Tensor, prefix: str) -> torch.Tensor:  # a SandwichBlock
        normed = norm(x, f"{prefix}.norm_1.weight")
        qkv = (normed @ w[f"{prefix}.attn.Wqkv.weight"].T).view(len(x), 3, heads, head_dim)
        q, k, v = qkv.unbind(1)
        if f"{prefix}.attn.qk_bias" in w:
            q, k = q + w[f"{prefix}.attn.qk_bias"][0], k + w[f"{prefix}.attn.qk_bias"][1]
        attended = attend(rotate_pairs(q), rotate_pairs(k), v, causal=True).reshape(len(x), -1)
        x = norm(x + attended @ w[f"{prefix}.attn.proj.weight"].T, f"{prefix}.norm_2.weight")
        gate, up = (norm(x, f"{prefix}.norm_3.weight") @ w[f"{prefix}.mlp.fc.weight"].T).chunk(
            2, -1
        )
        update = (torch.nn.functional.silu(gate) * up) @ w[f"{prefix}.mlp.proj.weight"].T
        return norm(x + update, f"{prefix}.norm_4.weight")

    e = w["transformer.wte.weight"][torch.tensor(token_ids)] * config.embed_scale
    for index in range(config.prelude_layers):
        e = block(e, f"transformer.prelude.{index}")
    for _ in range(num_loops):
        x = torch.cat([state, e], dim=-1) @ w["transformer.adapter.weight"].T
        for index in range(config.num_hidden_layers):
            x = block(x, f"transformer.core_block.{index}")
        state = x
    x = norm(state, "transformer.ln_f.weight")
    for index in range(config.coda_layers):
        x = block(x, f"transformer.coda.{index}")
    x = norm(x, "transformer.ln_f.weight")
    return x @ w.get("lm_head.weight", w["transformer.wte.weight"]).T
