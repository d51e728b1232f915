from __future__ import annotations

import logging

import pytest
import torch

from loopserve.attention.base import AttentionSpec
from loopserve.attention.registry import BackendUnavailableError, select_backend


def spec(**changes: object) -> AttentionSpec:
    fields = dict(
        device_type="cpu",
        compute_capability=None,
        dtype=torch.float32,
        head_size=64,
        num_heads=4,
        num_kv_heads=2,
        block_size=16,
        cuda_graphs=False,
    )
    return AttentionSpec(**(fields | changes))  # type: ignore[arg-type]


def test_auto_on_cpu_picks_torch_and_logs_why_others_were_skipped(caplog, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with caplog.at_level(logging.INFO, logger="loopserve.attention.registry"):
        assert select_backend("auto", spec()).name == "torch"
    assert "auto chose torch" in caplog.text


def test_explicit_choice_never_falls_back() -> None:
    with pytest.raises(
        BackendUnavailableError, match="'torch' cannot run here: does not support CUDA graphs"
    ):
        select_backend("torch", spec(cuda_graphs=True))
    with pytest.raises(BackendUnavailableError, match="unknown attention backend 'nope'"):
        select_backend("nope", spec())


def test_reasons_name_each_capability() -> None:
    cls = select_backend("torch", spec())
    reasons = cls.unsupported_reasons(spec(device_type="tpu", cuda_graphs=True))
    assert any("runs on" in r for r in reasons) and any("CUDA graphs" in r for r in reasons)
