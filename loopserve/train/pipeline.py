"""The whole `train-tiny` run: corpus, tokenizer, stage 1, stage 2, export.

Owns: the order of the steps, moving data to the training device, choosing autocast, and the
training_info.json record (configuration, corpus fingerprints, final held-out losses, the
progress history). Must not: parse command lines or define any step's internals.
"""

from __future__ import annotations

import math
import platform
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch
from tokenizers import Tokenizer

from loopserve.data import corpus
from loopserve.data.windows import BatchSampler, eval_windows, token_stream
from loopserve.train.config import TrainTinyConfig
from loopserve.train.export import check_output_directory, export_checkpoint
from loopserve.train.looped_forward import mean_loop_losses
from loopserve.train.progress import ProgressLog
from loopserve.train.stage1 import build_model, train_stage1
from loopserve.train.stage2 import train_stage2
from loopserve.train.tokenizer_training import END_OF_TEXT, train_tokenizer


def _stream(tokenizer: Tokenizer, files: list[corpus.CorpusFile]) -> torch.Tensor:
    encodings = tokenizer.encode_batch([file.text for file in files])
    return token_stream([encoding.ids for encoding in encodings], separator_id=0)


def _versions(device: torch.device) -> dict[str, str]:
    import tokenizers

    versions = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "tokenizers": tokenizers.__version__,
        "device": str(device),
    }
    if device.type == "cuda":
        versions["gpu"] = torch.cuda.get_device_name(device)
    return versions


@dataclass(slots=True)
class _Data:
    split: corpus.CorpusSplit
    tokenizer: Tokenizer
    train: torch.Tensor  # [N] token stream on the training device
    held_out: torch.Tensor  # [W, S+1] evaluation windows on the training device


def _prepare_data(
    config: TrainTinyConfig, corpus_root: Path | None, device: torch.device, log: ProgressLog
) -> _Data:
    split = corpus.load_split(corpus_root, config.held_out_fraction, config.max_files)
    tokenizer = train_tokenizer(split.train, config.model.vocab_size)
    train = _stream(tokenizer, split.train).to(device)
    held_out = eval_windows(
        _stream(tokenizer, split.held_out), config.seq_len + 1, config.eval_tokens
    )
    log.emit(
        "data",
        train_files=len(split.train),
        held_out_files=len(split.held_out),
        train_tokens=train.numel(),
        held_out_windows=held_out.shape[0],
        vocab=tokenizer.get_vocab_size(),
    )
    return _Data(split, tokenizer, train, held_out.to(device))


def _fit_to_data(config: TrainTinyConfig, data: _Data, log: ProgressLog) -> TrainTinyConfig:
    """The vocabulary the corpus supported, and at most `max_epochs` passes of stage 1."""
    vocab = data.tokenizer.get_vocab_size()
    if vocab != config.model.vocab_size:
        # A small corpus may not support as many merges as asked for; size the model to it.
        config = replace(config, model=replace(config.model, vocab_size=vocab))
    tokens_per_step = config.stage1.batch_size * config.seq_len
    epoch_steps = math.ceil(config.stage1.max_epochs * data.train.numel() / tokens_per_step)
    if epoch_steps < config.stage1.steps:
        log.message(f"stage 1 capped at {epoch_steps} steps ({config.stage1.max_epochs} epochs)")
        config = replace(config, stage1=replace(config.stage1, steps=epoch_steps))
    return config


def _training_info(
    config: TrainTinyConfig, data: _Data, device: torch.device, log: ProgressLog
) -> dict[str, Any]:
    return {
        "end_of_text": END_OF_TEXT,
        "config": config.to_dict(),
        "corpus": {
            "train": corpus.fingerprint(data.split.train),
            "held_out": corpus.fingerprint(data.split.held_out),
            "held_out_files": [file.relative_path for file in data.split.held_out],
        },
        "train_tokens": data.train.numel(),
        "versions": _versions(device),
        "progress": log.records,
    }


def train_tiny(
    config: TrainTinyConfig,
    output: Path,
    device: torch.device,
    log: ProgressLog,
    *,
    overwrite: bool = False,
    corpus_root: Path | None = None,
    save_dtype: torch.dtype = torch.bfloat16,
) -> dict[str, Any]:
    """Train the tiny looped model from scratch and write it to `output`; returns training_info.

    Args:
        corpus_root: corpus directory; None is the running interpreter's standard library.
        save_dtype: dtype of the saved weights (training is fp32, with bf16 autocast on a GPU).
    """
    check_output_directory(output, overwrite)
    torch.manual_seed(config.seed)
    data = _prepare_data(config, corpus_root, device, log)
    config = _fit_to_data(config, data, log)
    model = build_model(config.model, config.stage1, config.seed).to(device)
    autocast = torch.bfloat16 if device.type == "cuda" else None
    started = time.perf_counter()
    sampler = BatchSampler(data.train, config.seq_len, seed=config.seed)
    stage1_steps = train_stage1(model, sampler, data.held_out, config.stage1, autocast, log)
    stage1_s = time.perf_counter() - started
    if stage1_steps < config.stage1.steps:
        log.message(f"stage 1 stopped by its time limit after {stage1_steps} steps")
    gate_sampler = BatchSampler(data.train, config.seq_len, seed=config.seed + 1)
    train_stage2(model, gate_sampler, config.stage2, autocast, log)
    losses = mean_loop_losses(model, data.held_out, config.stage1.batch_size, autocast)
    log.emit("final", heldout_loop_losses=losses)
    seconds = {"stage1": round(stage1_s, 1), "total": round(time.perf_counter() - started, 1)}
    info = {
        **_training_info(config, data, device, log),
        "stage1_steps_run": stage1_steps,
        "heldout_loop_losses": losses,
        "seconds": seconds,
    }
    output.mkdir(parents=True, exist_ok=True)
    export_checkpoint(model, data.tokenizer, output, info, dtype=save_dtype)
    log.message(f"wrote {output}")
    return info
