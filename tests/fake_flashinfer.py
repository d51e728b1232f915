"""A CPU stand-in for the `flashinfer` package, for testing the FlashInfer backends' glue.

Owns: FlashInfer's calling conventions for the three entry points the backends use
(`BatchDecodeWithPagedKVCacheWrapper`, `BatchPrefillWithPagedKVCacheWrapper`, `xqa`), each
computing float64 attention from exactly the inputs the real kernels read (page lists, dense page
tables, device lengths), and a record of every call. Must not: be taken for evidence about
FlashInfer's kernels; it checks the page lists, plans, scales and shapes loopserve hands them.

Its "kernels" read tensors inside `torch._C.DisableTorchFunctionSubclass()`, so a test may wrap
device lengths in a tensor subclass that fails on any host read by the backend itself.
"""

from __future__ import annotations

import importlib.machinery
import math
import sys
import types
from dataclasses import dataclass, field
from typing import Any

import pytest
import torch


@dataclass
class Calls:
    """Every call into the fake, in order: (entry point, details)."""

    log: list[tuple[str, dict[str, Any]]] = field(default_factory=list)

    def named(self, name: str) -> list[dict[str, Any]]:
        return [details for entry, details in self.log if entry == name]


def _host(tensor: torch.Tensor) -> list[Any]:
    with torch._C.DisableTorchFunctionSubclass():
        return tensor.tolist()


def _attend(
    q: torch.Tensor,  # [Q, Nq, D]: the last Q positions of the context
    keys: torch.Tensor,  # [C, Nkv, D]
    values: torch.Tensor,  # [C, Nkv, D]
    scale: float,
) -> torch.Tensor:
    """Causal softmax attention in float64; zeros for an empty context."""
    with torch._C.DisableTorchFunctionSubclass():
        queries, context = q.shape[0], keys.shape[0]
        if context == 0:
            return torch.zeros(q.shape, dtype=torch.float64)
        group = q.shape[1] // keys.shape[1]
        keys = keys.double().repeat_interleave(group, dim=1)
        values = values.double().repeat_interleave(group, dim=1)
        scores = torch.einsum("qhd,khd->hqk", q.double(), keys) * scale
        positions = torch.arange(context - queries, context)
        hidden = torch.arange(context)[None, :] > positions[:, None]
        weights = scores.masked_fill(hidden, float("-inf")).softmax(dim=-1)
        return torch.einsum("hqk,khd->qhd", weights, values)


def _scaled(scale: float, k_scale: float | None, v_scale: float | None) -> tuple[float, float]:
    """FlashInfer's fp8 reads: the scores' scale times `k_scale`, the output times `v_scale`."""
    return scale * (1.0 if k_scale is None else k_scale), 1.0 if v_scale is None else v_scale


def _paged_context(cache: torch.Tensor, pages: list[int], length: int) -> torch.Tensor:
    with torch._C.DisableTorchFunctionSubclass():
        return cache[torch.tensor(pages, dtype=torch.long)].flatten(0, 1)[:length]


def _csr_context(
    caches: tuple[torch.Tensor, torch.Tensor],
    indptr: list[int],
    indices: list[int],
    last: list[int],
    page_size: int,
    row: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Row `row`'s keys and values from FlashInfer's page lists (CSR pages, last page's length)."""
    count = indptr[row + 1] - indptr[row]
    length = 0 if count == 0 else (count - 1) * page_size + last[row]
    pages = indices[indptr[row] : indptr[row + 1]]
    return _paged_context(caches[0], pages, length), _paged_context(caches[1], pages, length)


class BatchDecodeWithPagedKVCacheWrapper:
    calls: Calls
    split = False  # a test sets it to see a split plan rejected
    resolves_to = "fa2"

    def __init__(
        self,
        float_workspace_buffer: torch.Tensor,
        kv_layout: str = "NHD",
        use_cuda_graph: bool = False,
        use_tensor_cores: bool = False,
        paged_kv_indptr_buffer: torch.Tensor | None = None,
        paged_kv_indices_buffer: torch.Tensor | None = None,
        paged_kv_last_page_len_buffer: torch.Tensor | None = None,
        backend: str = "auto",
    ) -> None:
        self.calls.log.append(("decode_init", {"graph": use_cuda_graph, "backend": backend}))
        self.device = float_workspace_buffer.device
        self._use_cuda_graph = use_cuda_graph
        self._use_tensor_cores = use_tensor_cores
        self._paged_kv_indptr_buf = paged_kv_indptr_buffer
        self._paged_kv_indices_buf = paged_kv_indices_buffer
        self._paged_kv_last_page_len_buf = paged_kv_last_page_len_buffer

    @property
    def use_tensor_cores(self) -> bool:
        return self._use_tensor_cores

    @property
    def resolved_backend(self) -> str:
        return self.resolves_to

    def reset_workspace_buffer(self, float_workspace: torch.Tensor, int_workspace: Any) -> None:
        self.calls.log.append(("decode_reset_workspace", {}))

    def plan(
        self,
        indptr: torch.Tensor,
        indices: torch.Tensor,
        last_page_len: torch.Tensor,
        num_qo_heads: int,
        num_kv_heads: int,
        head_dim: int,
        page_size: int,
        **options: Any,
    ) -> None:
        inputs = {"indptr": indptr, "indices": indices, "last_page_len": last_page_len}
        self.calls.log.append(
            ("decode_plan", {"devices": {k: t.device.type for k, t in inputs.items()}, **options})
        )
        if self._use_cuda_graph:
            assert self._paged_kv_indptr_buf is not None
            assert self._paged_kv_indices_buf is not None
            assert self._paged_kv_last_page_len_buf is not None
            self._paged_kv_indptr_buf.copy_(indptr)
            self._paged_kv_last_page_len_buf.copy_(last_page_len)
            self._paged_kv_indices_buf[: len(indices)].copy_(indices)
        else:
            self._paged_kv_indptr_buf = indptr.clone().to(self.device)
            self._paged_kv_indices_buf = indices.clone().to(self.device)
            self._paged_kv_last_page_len_buf = last_page_len.clone().to(self.device)
        rows = len(last_page_len)
        length = 15 if self._use_tensor_cores else 10
        self._plan_info = [rows] + [0] * (length - 2) + [int(self.split)]
        self._sm_scale = options.get("sm_scale") or head_dim**-0.5
        self._page_size = page_size

    def run(
        self,
        q: torch.Tensor,
        paged_kv_cache: tuple[torch.Tensor, torch.Tensor],
        out: Any = None,
        k_scale: float | None = None,
        v_scale: float | None = None,
    ) -> torch.Tensor:
        assert self._paged_kv_indptr_buf is not None and self._paged_kv_indices_buf is not None
        assert self._paged_kv_last_page_len_buf is not None
        indptr, indices = _host(self._paged_kv_indptr_buf), _host(self._paged_kv_indices_buf)
        last = _host(self._paged_kv_last_page_len_buf)
        self.calls.log.append(
            ("decode_run", {"rows": q.shape[0], "k_scale": k_scale, "v_scale": v_scale})
        )
        sm_scale, out_scale = _scaled(self._sm_scale, k_scale, v_scale)
        assert q.shape[0] == len(last), "q rows must equal the planned batch"
        for row in range(q.shape[0]):
            keys, values = _csr_context(paged_kv_cache, indptr, indices, last, self._page_size, row)
            result = _attend(q[row : row + 1], keys, values, sm_scale) * out_scale
            out[row : row + 1] = result.to(out.dtype)
        return out


class BatchPrefillWithPagedKVCacheWrapper:
    calls: Calls

    def __init__(
        self, float_workspace_buffer: torch.Tensor, kv_layout: str = "NHD", backend: str = "auto"
    ) -> None:
        self.calls.log.append(("prefill_init", {"backend": backend}))
        self._backend = backend

    def plan(
        self,
        qo_indptr: torch.Tensor,
        paged_kv_indptr: torch.Tensor,
        paged_kv_indices: torch.Tensor,
        paged_kv_last_page_len: torch.Tensor,
        num_qo_heads: int,
        num_kv_heads: int,
        head_dim: int,
        page_size: int,
        **options: Any,
    ) -> None:
        self.calls.log.append(("prefill_plan", dict(options)))
        self._qo = _host(qo_indptr)
        self._kv = _host(paged_kv_indptr)
        self._indices = _host(paged_kv_indices)
        self._last = _host(paged_kv_last_page_len)
        self._page_size = page_size
        self._sm_scale = options.get("sm_scale") or head_dim**-0.5
        assert options.get("causal"), "prompt passes are causal"
        self._plan_info = [0] * 15 if self._backend == "fa2" else [0] * 3

    def run(
        self,
        q: torch.Tensor,
        paged_kv_cache: tuple[torch.Tensor, torch.Tensor],
        out: Any = None,
        k_scale: float | None = None,
        v_scale: float | None = None,
    ) -> torch.Tensor:
        self.calls.log.append(
            ("prefill_run", {"tokens": q.shape[0], "k_scale": k_scale, "v_scale": v_scale})
        )
        sm_scale, out_scale = _scaled(self._sm_scale, k_scale, v_scale)
        assert q.shape[0] == self._qo[-1] == out.shape[0]
        for row in range(len(self._last)):
            begin, end = self._qo[row], self._qo[row + 1]
            keys, values = _csr_context(
                paged_kv_cache, self._kv, self._indices, self._last, self._page_size, row
            )
            attended = _attend(q[begin:end], keys, values, sm_scale) * out_scale
            out[begin:end] = attended.to(out.dtype)
        return out


def xqa(
    q: torch.Tensor,  # [S, 1, Nq, D]
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    page_table: torch.Tensor,  # [S, P]
    seq_lens: torch.Tensor,  # [S, 1]
    output: torch.Tensor,  # [S, 1, Nq, D]
    workspace_buffer: torch.Tensor,
    semaphores: torch.Tensor,
    num_kv_heads: int,
    page_size: int,
    q_scale: float = 1.0,
    kv_layout: str = "NHD",
    **options: Any,
) -> None:
    calls: Calls = getattr(sys.modules[__name__], "xqa_calls")  # noqa: B009 - set by install()
    calls.log.append(("xqa", {"layout": kv_layout, **options}))
    assert q.dim() == 4 and q.shape[1] == 1 and q.is_contiguous() and output.shape == q.shape
    assert page_table.dtype == torch.int32 and seq_lens.shape == (q.shape[0], 1)
    scale = q_scale / math.sqrt(q.shape[-1])
    table, lengths = _host(page_table), _host(seq_lens)
    for row in range(q.shape[0]):
        length = lengths[row][0]
        if length == 0:  # as the real kernel leaves a row of no context (seen on the H200)
            output[row, 0] = float("nan")
            continue
        pages = table[row][: -(-length // page_size)]
        keys = _paged_context(k_cache, pages, length)
        values = _paged_context(v_cache, pages, length)
        output[row, 0] = _attend(q[row, 0][None], keys, values, scale)[0].to(output.dtype)


def install(monkeypatch: pytest.MonkeyPatch) -> Calls:
    """Put the fake in `sys.modules["flashinfer"]` for one test; returns its call record."""
    calls = Calls()
    module = types.ModuleType("flashinfer")
    module.__spec__ = importlib.machinery.ModuleSpec("flashinfer", None)
    module.__version__ = "0.0.0+fake"  # type: ignore[attr-defined]
    for wrapper in (BatchDecodeWithPagedKVCacheWrapper, BatchPrefillWithPagedKVCacheWrapper):
        subclass = type(wrapper.__name__, (wrapper,), {"calls": calls})
        setattr(module, wrapper.__name__, subclass)
    module.xqa = xqa  # type: ignore[attr-defined]
    monkeypatch.setattr(sys.modules[__name__], "xqa_calls", calls, raising=False)
    monkeypatch.setitem(sys.modules, "flashinfer", module)
    return calls


class DeviceOnly(torch.Tensor):
    """A tensor that fails whenever loopserve code reads it (or anything computed from it) on the
    host: `.tolist()`, `.item()`, `.cpu()`, `.numpy()`, `.to("cpu")`, truth tests, `int(...)`."""

    FORBIDDEN = frozenset(
        {
            torch.Tensor.tolist,
            torch.Tensor.item,
            torch.Tensor.cpu,
            torch.Tensor.numpy,
            torch.Tensor.__bool__,
            torch.Tensor.__int__,
            torch.Tensor.__float__,
            torch.Tensor.__index__,
        }
    )

    @classmethod
    def __torch_function__(
        cls, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None
    ) -> Any:
        kwargs = kwargs or {}
        if func in cls.FORBIDDEN or (func is torch.Tensor.to and _names_cpu(args, kwargs)):
            raise AssertionError(f"host read of a device tensor: {func.__name__}")
        return super().__torch_function__(func, types, args, kwargs)


def _names_cpu(args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    targets = [*args[1:], kwargs.get("device")]
    return any(str(target) == "cpu" for target in targets if target is not None)
