"""Batch invariance of the weight matmuls at Ouro-1.4B's shapes (the engine tests use a small
model, where cuBLAS keeps one reduction order at every row count).

A row's bits from cuBLAS bf16 `F.linear` (what the model runs) must not depend on how many rows
share the call. On the H200 this holds at every row count for the qkv, o and gate/up
projections and the LM head, and for the down projection (K = 5,632) only up to 64 rows: from 96
rows cuBLAS reduces it differently, so requests in decode batches of more than 64 rows can
differ from their alone runs (docs/latency.md, "Batch invariance at full size";
`scripts/invariance_probe.py` at b194bdd); on an H100 only up to 16 rows (cuBLAS picks its
kernels per GPU; measured 2026-12-06). This test holds what holds, so a torch or cuBLAS change
that narrows it is seen.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

# (N, K) of each weight, and the largest row count whose rows are bit-identical to alone (None:
# the down projection's, which depends on the GPU: `DOWN_UP_TO`).
SHAPES = {
    "qkv": ((6144, 2048), 2048),
    "o": ((2048, 2048), 2048),
    "gate_up": ((11264, 2048), 2048),
    "down": ((2048, 5632), None),
    "lm_head": ((49152, 2048), 2048),
}
DOWN_UP_TO = {"H200": 64, "H100": 16}  # by a part of the GPU's name; other GPUs: one row
ROW_COUNTS = (1, 2, 8, 16, 32, 48, 64, 96, 128, 256, 1000, 2048)


@pytest.mark.parametrize("name", list(SHAPES))
def test_rows_of_a_matmul_equal_their_alone_bits(name: str) -> None:
    (n, k), invariant_up_to = SHAPES[name]
    if invariant_up_to is None:
        gpu = torch.cuda.get_device_name()
        invariant_up_to = next((up for part, up in DOWN_UP_TO.items() if part in gpu), 1)
    generator = torch.Generator(device="cuda").manual_seed(0)
    weight = torch.randn(n, k, device="cuda", dtype=torch.bfloat16, generator=generator) * 0.02
    x = torch.randn(ROW_COUNTS[-1], k, device="cuda", dtype=torch.bfloat16, generator=generator)
    alone: dict[int, torch.Tensor] = {}
    for rows in (m for m in ROW_COUNTS if m <= invariant_up_to):
        out = F.linear(x[:rows], weight)
        for row in sorted({0, 1, rows // 2, rows - 1} & set(range(rows))):
            if row not in alone:
                alone[row] = F.linear(x[row : row + 1], weight)[0]
            assert torch.equal(out[row], alone[row]), f"{name}: row {row} of {rows}"
