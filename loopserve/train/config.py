"""What `train-tiny` trains and how: the model shape, both training stages and the presets.

Owns: the frozen configuration dataclasses of tiny-model training and the named presets
(`default` for a GPU, `small` for a CPU test run). Must not: import torch, or hold anything
resolved at run time (device, autocast dtype, measured throughput).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, replace
from typing import Any

from loopserve.models.ouro_config import OuroConfig


@dataclass(frozen=True, slots=True)
class ModelShape:
    """The tiny model: Ouro's architecture, scaled down to fit a 10 MB package asset in bf16."""

    # Byte-level BPE tokens, including the one special token <|endoftext|> (id 0).
    vocab_size: int = 4096
    hidden_size: int = 256
    # SwiGLU inner size (3x hidden).
    intermediate_size: int = 768
    # Two layers per loop: one loop alone is shallow, so later loops have real work to do (with
    # four, a held-out run on the H200 showed the same loss after 1 and after 4 loops).
    num_hidden_layers: int = 2
    num_attention_heads: int = 4
    num_key_value_heads: int = 4
    head_dim: int = 64
    # How many times the shared stack runs per token (HF: total_ut_steps).
    num_loops: int = 4
    # Trained on short windows, but users may generate longer.
    max_position_embeddings: int = 2048
    rope_theta: float = 10_000.0
    # Tied embeddings halve the vocabulary's share of the 10 MB budget.
    tie_word_embeddings: bool = True

    def to_ouro_config(self) -> OuroConfig:
        return OuroConfig(
            vocab_size=self.vocab_size,
            hidden_size=self.hidden_size,
            intermediate_size=self.intermediate_size,
            num_hidden_layers=self.num_hidden_layers,
            num_attention_heads=self.num_attention_heads,
            num_key_value_heads=self.num_key_value_heads,
            head_dim=self.head_dim,
            max_position_embeddings=self.max_position_embeddings,
            rope_theta=self.rope_theta,
            num_loops=self.num_loops,
            early_exit_threshold=1.0,
            tie_word_embeddings=self.tie_word_embeddings,
            bos_token_id=0,
            eos_token_ids=(0,),
        )


@dataclass(frozen=True, slots=True)
class Stage1Config:
    """Stage 1: the whole model minimises the exit-weighted loss minus an entropy bonus."""

    # At most this many steps (16k tokens each), and at most `max_epochs` passes over the corpus.
    steps: int = 2000
    # The stdlib is small on some machines (2.3M tokens on the H200's Python): more passes than
    # this overfit (held-out loss rose after ~7 epochs there while training loss kept falling).
    max_epochs: float = 6.0
    # Sequences per step (each `TrainTinyConfig.seq_len` tokens).
    batch_size: int = 32
    # AdamW peak learning rate, reached after warmup_steps, then cosine decay to min_lr_ratio.
    learning_rate: float = 3e-3
    warmup_steps: int = 100
    min_lr_ratio: float = 0.1
    # Decoupled weight decay on matrices (not on norms, the gate or its bias).
    weight_decay: float = 0.1
    # Global gradient-norm clip.
    grad_clip: float = 1.0
    # β of the entropy bonus on the per-token exit distribution (Ouro uses 0.05-0.1). With 0.05
    # the distribution collapsed onto the last loop in CPU runs; 0.1 keeps earlier loops trained.
    entropy_weight: float = 0.1
    # Initial gate bias: sigmoid(-4) ≈ 0.018, so training starts with ~95 % of the weight on the
    # last loop and the loops learn to work as depth. Started spread out (-1.1), the model settled
    # where every loop predicts about equally well and the later loops add nothing (seen on the
    # H200 and in CPU runs); started deep, per-loop loss falls steeply from loop 1 to loop 4.
    gate_bias_init: float = -4.0
    # Fraction of the stage-1 steps during which the gate does not learn: the exit distribution
    # stays at its deep start while the loops learn to work as depth. Learning from the start, the
    # gate can follow the early loops, which are the best ones for a young model, and the later
    # loops then never learn to add anything.
    gate_frozen_fraction: float = 0.3
    # Initial weight of the norms that close each residual branch (input_layernorm_2 and
    # post_attention_layernorm_2): every layer starts as a small update of the state, so a loop
    # refines what the previous loop left instead of rewriting it.
    branch_norm_init: float = 0.2
    # Std of the (tied) embedding times sqrt(hidden_size): the first loop's input is closer to the
    # unit-RMS state that later loops start from, and the initial logits have about this std.
    embedding_init_scale: float = 2.4
    # Print progress every log_every steps and the held-out loss every eval_every steps.
    log_every: int = 50
    eval_every: int = 250
    # Wall-time budget in seconds: once the steps would not fit, the cosine decay is compressed to
    # end on time and stage 1 stops early (such a run is not step-for-step reproducible).
    # None: no budget.
    time_limit_s: float | None = None


@dataclass(frozen=True, slots=True)
class Stage2Config:
    """Stage 2: the model is frozen; only the gate learns whether another loop still helps."""

    steps: int = 300
    batch_size: int = 32
    learning_rate: float = 1e-2
    # Continue-target w = sigmoid(sharpness * (improvement - margin)), improvement in nats per
    # token from one more loop (the Ouro paper's k = 50, γ = 0.005).
    sharpness: float = 50.0
    margin: float = 0.005
    log_every: int = 25


@dataclass(frozen=True, slots=True)
class TrainTinyConfig:
    model: ModelShape = field(default_factory=ModelShape)
    stage1: Stage1Config = field(default_factory=Stage1Config)
    stage2: Stage2Config = field(default_factory=Stage2Config)
    # Training window length in tokens.
    seq_len: int = 512
    seed: int = 0
    # Fraction of corpus files held out for evaluation (chosen by path hash).
    held_out_fraction: float = 0.05
    # Use only this many corpus files (None: all), for quick runs.
    max_files: int | None = None
    # Held-out tokens used by the periodic evaluation during training.
    eval_tokens: int = 32_768

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _small() -> TrainTinyConfig:
    """A CPU run for tests and CI: a few hundred files, a tiny model, about a minute."""
    model = ModelShape(
        vocab_size=512,
        hidden_size=64,
        intermediate_size=192,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=2,
        head_dim=32,
    )
    return TrainTinyConfig(
        model=model,
        stage1=Stage1Config(steps=60, batch_size=8, warmup_steps=10, log_every=10, eval_every=30),
        stage2=Stage2Config(steps=20, batch_size=8, log_every=10),
        seq_len=128,
        max_files=120,
        held_out_fraction=0.1,
        eval_tokens=4096,
    )


PRESETS = {"default": TrainTinyConfig, "small": _small}


def preset(name: str, **overrides: Any) -> TrainTinyConfig:
    """A named preset with top-level fields (seq_len, seed, ...) replaced."""
    if name not in PRESETS:
        raise ValueError(f"unknown preset {name!r}; choose one of {sorted(PRESETS)}")
    return replace(PRESETS[name](), **overrides)
