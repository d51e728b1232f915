"""Shared fixtures: tiny Ouro checkpoints written by the tests themselves."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from loopserve.models.checkpoint_writer import RandomInit, write_random_checkpoint
from loopserve.models.ouro_config import OuroConfig

# The tests' tensors are tiny: intra-op threads only contend (on 2 cores, several times slower);
# subprocesses (the CLI and server tests) inherit the setting through the environment.
torch.set_num_threads(1)
os.environ.setdefault("OMP_NUM_THREADS", "1")

# Small enough for fast CPU tests, large enough to exercise GQA, several layers and 4 loops.
TINY_CONFIG = OuroConfig(
    vocab_size=256,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=512,
    num_loops=4,
    eos_token_ids=(),
)
# A wide, centred gate: exit hazards vary a lot between tokens, so gate-driven depths vary.
VARIED_GATE = RandomInit(gate_scale=4.0, gate_bias=-0.5)


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    directory = tmp_path_factory.mktemp("tiny-ouro")
    return write_random_checkpoint(directory, TINY_CONFIG, seed=0, init=VARIED_GATE)
