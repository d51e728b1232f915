"""Backend selection: capabilities, logged reasons, CUDA-graph fallback (the hardware is mocked
by the spec: selection never looks at a real GPU)."""

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


def hopper(**changes: object) -> AttentionSpec:
    return spec(device_type="cuda", compute_capability=(9, 0), cuda_graphs=True, **changes)


def test_auto_on_cpu_picks_torch_and_logs_why_others_were_skipped(caplog, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with caplog.at_level(logging.INFO, logger="loopserve.attention.registry"):
        choice = select_backend("auto", spec())
    assert (choice.backend.name, choice.cuda_graphs) == ("torch", False)
    assert "triton skipped: runs on ['cuda'], not cpu" in caplog.text


def test_auto_on_cuda_prefers_a_backend_that_can_be_graphed() -> None:
    choice = select_backend("auto", hopper())
    assert (choice.backend.name, choice.cuda_graphs) == ("triton", True)


def test_auto_on_cuda_runs_eagerly_when_no_graphable_backend_fits(caplog) -> None:  # type: ignore[no-untyped-def]
    """A head size the Triton backend does not cover: the torch backend, eagerly, and the log
    says why (it used to refuse to start)."""
    with caplog.at_level(logging.INFO, logger="loopserve.attention.registry"):
        choice = select_backend("auto", hopper(head_size=40))
    assert (choice.backend.name, choice.cuda_graphs) == ("torch", False)
    assert "triton skipped: head size 40 not in" in caplog.text
    assert "torch cannot be captured in CUDA graphs: the decode step runs eagerly" in caplog.text


def test_explicit_choice_never_falls_back(caplog) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(BackendUnavailableError, match="'triton' cannot run here: head size 40"):
        select_backend("triton", hopper(head_size=40))
    with pytest.raises(BackendUnavailableError, match="unknown attention backend 'nope'"):
        select_backend("nope", spec())
    # An explicit backend that cannot be graphed is still that backend, run eagerly.
    with caplog.at_level(logging.WARNING, logger="loopserve.attention.registry"):
        choice = select_backend("torch", hopper())
    assert (choice.backend.name, choice.cuda_graphs) == ("torch", False)
    assert "runs eagerly" in caplog.text


def test_nothing_can_run_is_an_error_with_every_reason() -> None:
    with pytest.raises(BackendUnavailableError, match="torch skipped: runs on") as error:
        select_backend("auto", spec(device_type="tpu"))
    assert "triton skipped" in str(error.value)


def test_reasons_name_each_capability() -> None:
    cls = select_backend("torch", spec()).backend
    reasons = cls.unsupported_reasons(spec(device_type="tpu", cuda_graphs=True))
    assert any("runs on" in r for r in reasons) and any("CUDA graphs" in r for r in reasons)
