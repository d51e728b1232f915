"""The launch census counts what one decode loop launches (CPU, triton interpreter; the
directory's conftest sets it)."""

from __future__ import annotations

import pytest

from benchmarks.launch_census import decode_step_census, per_layer
from tests.kernels.conftest import ON_GPU

pytestmark = pytest.mark.skipif(ON_GPU, reason="the census runs the interpreter on the CPU")


def test_launches_per_layer_and_per_step_do_not_grow() -> None:
    one, two = decode_step_census(1, rows=1), decode_step_census(2, rows=1)
    layer = per_layer(one, two)
    # Per layer: qkv, o, gate/up (SiLU * up its epilogue: bf16, one row) and down matmuls, the
    # decode kernel (KV write and RoPE of q and k fused), two residual-add + norm kernels.
    assert layer == 7, two.by_op
    assert "triton:_silu_mul_kernel" not in two.by_op
    assert "triton:_rotary_kernel" not in two.by_op and two.by_op["triton:_decode_kernel"] == 2
    # Per step: may only shrink. The decode step's prologue, decide and coda kernels (depth
    # policy, metadata, RoPE rows, loop input; exit decision; stop test, record, state,
    # copy-on-exit slots: 126 launches before they were fused), the loop's first norm, the exit
    # gate (one row kernel with the sigmoid), the LM head (1, fp32 out, skipping rows that do not
    # exit; with the two layers' gate/up projections, the three `_matmul_kernel` launches),
    # greedy sampling, the copy-on-exit K/V copy
    # (1: on a GPU the torch copy it replaced ran two kernels per layer, which the census does
    # not see) and the host's read of the record.
    assert two.by_op["triton:_prologue_kernel"] == 1 and two.by_op["triton:_coda_kernel"] == 1
    assert two.by_op["triton:_decide_kernel"] == 1 and two.by_op["triton:_matmul_kernel"] == 1 + 2
    assert two.by_op["triton:_copy_kv_slots_kernel"] == 1
    assert one.launches - layer <= 13, one.by_site.most_common(20)
    assert "aten:sigmoid.default" not in two.by_op
