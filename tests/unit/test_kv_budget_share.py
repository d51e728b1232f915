"""The GPU KV budget is this engine's `gpu_memory_utilization` share of the GPU, as in vLLM (so
engines sharing a GPU each get theirs), never more than is free; the CUDA calls are stubbed."""

from __future__ import annotations

import logging

import pytest
import torch

from loopserve.config import EngineConfig
from loopserve.runner import kv_budget

GIB = 2**30
PEAK = 2 * GIB
MARGIN = 1 * GIB


@pytest.fixture
def model() -> torch.nn.Module:
    return torch.nn.Linear(256, 256)  # its weights: 263,168 bytes


def _budget(
    monkeypatch: pytest.MonkeyPatch,
    model: torch.nn.Module,
    free_gib: float,
    utilization: float,
    cuda_graphs: bool = False,
) -> int:
    monkeypatch.setattr(kv_budget, "profile_step_peak", lambda *args: PEAK)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device: (int(free_gib * GIB), 100 * GIB))
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device: 0)
    config = EngineConfig.from_options(
        model="ouro-tiny", gpu_memory_utilization=utilization, cuda_graphs=cuda_graphs
    )
    return kv_budget.gpu_kv_budget(config, model, torch.device("cuda"))  # type: ignore[arg-type]


def test_an_engine_alone_gets_its_share_less_weights_peak_and_margin(
    monkeypatch: pytest.MonkeyPatch, model: torch.nn.Module
) -> None:
    weights = 256 * 256 * 4 + 256 * 4
    assert _budget(monkeypatch, model, 99.0, 0.9) == 90 * GIB - weights - PEAK - MARGIN


def test_a_second_engine_on_the_gpu_gets_its_own_share(
    monkeypatch: pytest.MonkeyPatch, model: torch.nn.Module
) -> None:
    """Another engine already holds 45 GiB: this one's 0.45 share still fits beside it."""
    weights = 256 * 256 * 4 + 256 * 4
    assert _budget(monkeypatch, model, 54.0, 0.45) == 45 * GIB - weights - PEAK - MARGIN


def test_a_share_beyond_what_is_free_gets_what_is_free_and_says_so(
    monkeypatch: pytest.MonkeyPatch, model: torch.nn.Module, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.WARNING, logger=kv_budget.__name__):
        budget = _budget(monkeypatch, model, 54.0, 0.9)
    assert budget == 54 * GIB - PEAK - MARGIN
    assert "only 51.0 GiB is free" in caplog.text


def test_with_cuda_graphs_the_step_peak_is_held_twice(
    monkeypatch: pytest.MonkeyPatch, model: torch.nn.Module
) -> None:
    """Prompt-loop graphs keep their activations in their own pool, beside the eager ones."""
    weights = 256 * 256 * 4 + 256 * 4
    budget = _budget(monkeypatch, model, 99.0, 0.9, cuda_graphs=True)
    assert budget == 90 * GIB - weights - 2 * PEAK - MARGIN
