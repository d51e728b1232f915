"""`kernels.pdl.pdl_supported`: programmatic dependent launches only on a CUDA GPU of SM90 or
later with a triton that has grid dependency control; and `launch_options` passes `launch_pdl`
only when it is set (older triton refuses the keyword)."""

from __future__ import annotations

import pytest
import torch

from loopserve.kernels import pdl


def test_only_cuda_sm90_or_later_with_grid_dependency_control(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    assert not pdl.pdl_supported("cpu")
    majors = {"now": 9}
    monkeypatch.setattr(pdl, "_major", lambda index: majors["now"])
    has_gdc = {"now": True}
    monkeypatch.setattr(pdl, "_triton_has_gdc", lambda: has_gdc["now"])
    assert pdl.pdl_supported(torch.device("cuda", 0))
    majors["now"] = 8  # Ampere, Ada
    assert not pdl.pdl_supported("cuda")
    majors["now"], has_gdc["now"] = 10, False  # Blackwell, an old triton
    assert not pdl.pdl_supported("cuda")
    has_gdc["now"] = True
    assert pdl.pdl_supported("cuda")


def test_the_launch_keyword_only_when_set() -> None:
    assert pdl.launch_options(False) == {}
    assert pdl.launch_options(True) == {"launch_pdl": True}
