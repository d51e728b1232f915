"""Small host values reach the device through `kv.transfer.to_device` on the serving path: a
`torch.tensor(values, device=...)` from pageable memory makes the host wait for the GPU's queue,
so a prompt step that made a few per loop ran host and device in turn instead of together."""

from __future__ import annotations

import ast
from pathlib import Path

import torch

import loopserve
from loopserve.kv.transfer import to_device

PACKAGE = Path(loopserve.__file__).parent
# What serves requests; the serial reference, benchmarks, training and evaluation may be simple.
SERVING = ("runner", "sample", "attention", "kernels", "engine", "kv", "depth", "models")


def _device_tensor_calls(path: Path) -> list[int]:
    """Lines of `torch.tensor(..., device=...)` / `torch.as_tensor(..., device=...)` calls."""
    lines = []
    for node in ast.walk(ast.parse(path.read_text())):
        if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Attribute):
            continue
        named = isinstance(node.func.value, ast.Name) and node.func.value.id == "torch"
        on_device = any(keyword.arg == "device" for keyword in node.keywords)
        if named and node.func.attr in ("tensor", "as_tensor") and on_device:
            lines.append(node.lineno)
    return lines


def test_the_serving_path_uploads_host_values_only_through_to_device() -> None:
    found = {
        str(path.relative_to(PACKAGE)): lines
        for part in SERVING
        for path in sorted((PACKAGE / part).rglob("*.py"))
        if (lines := _device_tensor_calls(path))
    }
    assert found == {}, f"use kv.transfer.to_device: {found}"


def test_the_check_sees_a_device_tensor_call(tmp_path: Path) -> None:
    source = tmp_path / "example.py"
    source.write_text("import torch\nx = torch.tensor([1], device='cuda')\ny = torch.tensor([1])\n")
    assert _device_tensor_calls(source) == [2]


def test_to_device_keeps_values_and_dtype_on_the_cpu() -> None:
    out = to_device([1, 2, 3], torch.int32, torch.device("cpu"))
    assert out.dtype == torch.int32 and out.tolist() == [1, 2, 3]
