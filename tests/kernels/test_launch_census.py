"""The launch census counts what one decode loop launches (CPU, triton interpreter; the
directory's conftest sets it)."""

from __future__ import annotations

import pytest

from loopserve.bench.launch_census import decode_step_census, per_layer
from tests.kernels.conftest import ON_GPU

pytestmark = pytest.mark.skipif(ON_GPU, reason="the census runs the interpreter on the CPU")


def test_launches_per_layer_and_per_step_do_not_grow() -> None:
    one, two = decode_step_census(1, rows=1), decode_step_census(2, rows=1)
    layer = per_layer(one, two)
    # Per layer (bf16, one row): qkv, o, gate/up and down matmuls (kernels/gemv.py, SiLU * up
    # fused into the down one), the decode kernel (KV write fused), RoPE of q and k in one
    # launch, two residual-add + norm kernels.
    assert layer == 8, two.by_op
    assert two.by_op["triton:_gemv_kernel"] == 8
    assert two.by_op["triton:_rotary_kernel"] == 2 and two.by_op["triton:_decode_kernel"] == 2
    # Per step (depth policy, metadata, gate, LM head, sampling, state): may only shrink.
    assert one.launches - layer <= 126, one.by_site.most_common(20)
