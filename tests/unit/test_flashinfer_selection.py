"""The FlashInfer backends' capability declarations, rejection reasons and `auto` order, with the
hardware boundary mocked: the spec stands in for the GPU and a fake module (or its absence) for
the flashinfer package. Nothing here needs flashinfer or a GPU."""

from __future__ import annotations

import importlib.util
import logging
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import loopserve.attention.flashinfer.library as library_module
from loopserve.attention.base import AttentionSpec
from loopserve.attention.flashinfer.backend import FlashInferBackend
from loopserve.attention.flashinfer.fa2 import FlashInferFA2Backend, default_decode_kernel
from loopserve.attention.flashinfer.xqa import FlashInferXQABackend
from loopserve.attention.registry import (
    ATTENTION_BACKENDS,
    AUTO_ORDER,
    BackendUnavailableError,
    auto_order,
    select_backend,
)
from loopserve.attention.torch_backend import TorchAttentionBackend
from loopserve.attention.triton_backend import TritonAttentionBackend
from tests import fake_flashinfer

BACKENDS = (FlashInferFA2Backend, FlashInferXQABackend)


def ouro(**changes: object) -> AttentionSpec:
    """Ouro-1.4B's attention on an H200 (the spec is the only view of the hardware here)."""
    fields = dict(
        device_type="cuda",
        compute_capability=(9, 0),
        dtype=torch.bfloat16,
        head_size=128,
        num_heads=16,
        num_kv_heads=16,
        block_size=16,
        cuda_graphs=True,
    )
    return AttentionSpec(**(fields | changes))  # type: ignore[arg-type]


@pytest.fixture
def installed(monkeypatch: pytest.MonkeyPatch) -> fake_flashinfer.Calls:
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.setattr(library_module, "jit_compiler_found", lambda: True)
    return fake_flashinfer.install(monkeypatch)


@pytest.fixture
def missing(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.delitem(sys.modules, "flashinfer", raising=False)
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util,
        "find_spec",
        lambda name, *a: None if name == "flashinfer" else find_spec(name, *a),
    )


def test_registered_and_importable_without_flashinfer() -> None:
    assert {"flashinfer_fa2", "flashinfer_xqa"} <= set(ATTENTION_BACKENDS)
    code = (
        "import sys\n"
        "from loopserve.attention.registry import backend_class\n"
        "for name in ('flashinfer_fa2', 'flashinfer_xqa'):\n"
        "    backend_class(name).unsupported_reasons\n"
        "assert 'flashinfer' not in sys.modules, 'flashinfer was imported'\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_not_installed_is_a_reason_naming_the_extra(missing: None) -> None:
    for backend in BACKENDS:
        reasons = backend.unsupported_reasons(ouro())
        assert reasons == ["flashinfer is not installed (pip install 'loopserve[flashinfer]')"]


def test_installed_ouro_on_hopper_has_no_reasons(installed: fake_flashinfer.Calls) -> None:
    for backend in BACKENDS:
        assert backend.unsupported_reasons(ouro()) == [], backend.name
    assert installed.log == []  # declarations never touch the package


def test_auto_on_hopper_prefers_the_measured_order(installed: fake_flashinfer.Calls) -> None:
    assert auto_order(ouro())[:3] == ("triton", "flashinfer_fa2", "flashinfer_xqa")
    choice = select_backend("auto", ouro())
    assert (choice.backend, choice.cuda_graphs) == (TritonAttentionBackend, True)


def test_auto_elsewhere_keeps_triton_first(installed: fake_flashinfer.Calls) -> None:
    assert AUTO_ORDER[0] == "triton" and AUTO_ORDER[-1] == "torch"
    for capability in [(8, 0), (10, 0), (12, 0)]:
        choice = select_backend("auto", ouro(compute_capability=capability))
        assert choice.backend is TritonAttentionBackend, capability


NO_TRITON = "triton is not installed (pip install 'loopserve[triton]')"


@pytest.fixture
def no_triton(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(
        TritonAttentionBackend, "environment_reasons", classmethod(lambda cls, spec: [NO_TRITON])
    )


def test_auto_falls_back_only_for_logged_reasons(
    installed: fake_flashinfer.Calls, no_triton: None, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.INFO, logger="loopserve.attention.registry"):
        choice = select_backend("auto", ouro())
    assert choice.backend is FlashInferFA2Backend
    assert f"triton skipped: {NO_TRITON}" in caplog.text
    assert "flashinfer_xqa" not in caplog.text  # after FA2 on SM90: never consulted here
    # fp32, which neither FlashInfer backend takes: each says so, and torch serves it.
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="loopserve.attention.registry"):
        assert select_backend("auto", ouro(dtype=torch.float32)).backend is TorchAttentionBackend
    assert "flashinfer_fa2 skipped: dtype torch.float32 not in" in caplog.text
    assert "flashinfer_xqa skipped: dtype torch.float32 not in" in caplog.text


def test_auto_without_flashinfer_says_nothing_while_triton_serves(
    missing: None, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.INFO, logger="loopserve.attention.registry"):
        choice = select_backend("auto", ouro())
    assert choice.backend is TritonAttentionBackend
    assert "skipped" not in caplog.text


def test_auto_without_triton_or_flashinfer_says_why(
    missing: None, no_triton: None, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.INFO, logger="loopserve.attention.registry"):
        choice = select_backend("auto", ouro())
    assert choice.backend is TorchAttentionBackend
    hint = "flashinfer is not installed (pip install 'loopserve[flashinfer]')"
    assert f"triton skipped: {NO_TRITON}" in caplog.text
    assert f"flashinfer_fa2 skipped: {hint}" in caplog.text


@pytest.mark.parametrize(
    ("name", "spec", "reason"),
    [
        ("flashinfer_fa2", ouro(dtype=torch.float32), "dtype torch.float32 not in"),
        ("flashinfer_fa2", ouro(head_size=80), "head size 80 not in [64, 128]"),
        ("flashinfer_fa2", ouro(num_heads=12, num_kv_heads=8), "12 heads are not a multiple of 8"),
        ("flashinfer_fa2", ouro(compute_capability=(7, 5)), "needs compute capability >= (8, 0)"),
        ("flashinfer_fa2", ouro(device_type="cpu", compute_capability=None), "runs on ['cuda']"),
        ("flashinfer_xqa", ouro(compute_capability=(8, 0)), "is not SM9/SM10/SM12x"),
        ("flashinfer_xqa", ouro(compute_capability=(11, 0)), "is not SM9/SM10/SM12x"),
        ("flashinfer_xqa", ouro(block_size=8), "block size 8 not in [16, 32, 64, 128]"),
        ("flashinfer_xqa", ouro(dtype=torch.float16), "dtype torch.float16 not in"),
        ("flashinfer_xqa", ouro(num_heads=12, num_kv_heads=4), "3 query heads per KV head"),
    ],
)
def test_explicit_choice_never_falls_back(
    installed: fake_flashinfer.Calls, name: str, spec: AttentionSpec, reason: str
) -> None:
    with pytest.raises(BackendUnavailableError, match=f"'{name}' cannot run here") as error:
        select_backend(name, spec)
    assert reason in str(error.value)


def test_explicit_choice_without_flashinfer_names_the_extra(missing: None) -> None:
    for name in ("flashinfer_fa2", "flashinfer_xqa"):
        with pytest.raises(BackendUnavailableError, match=r"loopserve\[flashinfer\]"):
            select_backend(name, ouro())


def test_explicit_choice_is_that_backend(installed: fake_flashinfer.Calls) -> None:
    for backend in BACKENDS:
        choice = select_backend(backend.name, ouro(block_size=32, num_heads=32, num_kv_heads=8))
        assert (choice.backend, choice.cuda_graphs) == (backend, True)
    # Still graph-capable without graphs asked for; the torch reference stays eager.
    assert select_backend("torch", ouro()).backend is TorchAttentionBackend


def test_declared_capabilities() -> None:
    for backend in BACKENDS:
        assert backend.supports_cuda_graphs and backend.supports_packed_prefill
        assert backend.batch_invariant_decode and backend.determinism
        assert backend.devices == frozenset({"cuda"})
    assert FlashInferXQABackend.kv_cache_dtypes == frozenset({torch.bfloat16})
    assert FlashInferXQABackend.compute_capability_majors == frozenset({9, 10, 12})
    assert FlashInferFA2Backend.block_sizes is None  # any page size


def test_gqa_groups(installed: fake_flashinfer.Calls) -> None:
    """FA2 takes any whole group (tensor cores beyond 4); XQA powers of two up to 16."""
    group_6 = ouro(num_heads=48, num_kv_heads=8)
    assert FlashInferFA2Backend.unsupported_reasons(group_6) == []
    assert FlashInferXQABackend.unsupported_reasons(group_6) == [
        "6 query heads per KV head not in [1, 2, 4, 8, 16]"
    ]
    assert FlashInferXQABackend.unsupported_reasons(ouro(num_heads=32, num_kv_heads=4)) == []


def test_fa2_decode_kernel_by_group_size() -> None:
    assert default_decode_kernel(ouro()) == "cuda_core"
    assert default_decode_kernel(ouro(num_heads=32, num_kv_heads=8)) == "cuda_core"
    assert default_decode_kernel(ouro(num_heads=32, num_kv_heads=4)) == "tensor_core"
    assert default_decode_kernel(ouro(num_heads=48, num_kv_heads=8)) == "tensor_core"


@pytest.mark.parametrize("backend", [FlashInferFA2Backend, FlashInferXQABackend])
def test_prefill_uses_fa3_on_hopper_only(backend: type[FlashInferBackend]) -> None:
    assert backend.prefill_kernel(ouro()) == "fa3"
    assert backend.prefill_kernel(ouro(compute_capability=(10, 0))) == "fa2"
    assert backend.prefill_kernel(ouro(compute_capability=(12, 0))) == "fa2"
    assert backend.prefill_kernel(ouro(compute_capability=(8, 0))) == "fa2"


def test_no_jit_compiler_is_a_reason(
    installed: fake_flashinfer.Calls, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.undo()  # the real lookup, over an environment without nvcc
    fake_flashinfer.install(monkeypatch)
    monkeypatch.setenv("CUDA_HOME", str(tmp_path))  # no bin/nvcc there
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util,
        "find_spec",
        lambda name, *a: None if name == "flashinfer_jit_cache" else find_spec(name, *a),
    )
    reasons = FlashInferFA2Backend.unsupported_reasons(ouro())
    assert len(reasons) == 1 and "finds no nvcc (set CUDA_HOME)" in reasons[0]
    (tmp_path / "bin").mkdir()
    (tmp_path / "bin" / "nvcc").touch()
    assert FlashInferFA2Backend.unsupported_reasons(ouro()) == []
