"""The decode step's fused bookkeeping (kernels/decode_state.py) is its torch path, bit for bit.

The depth policy, the decode plane, the attention metadata, the stop test, the record and the
state updates exist twice: as torch (depth/, kv/layout.py, runner/block_tables.py,
runner/decode_step.py; the reference and the CPU path) and as the prologue and coda kernels (the
CUDA path). These tests are what ties them: two decode steps over one model start from the same
random slot states (every slot rule, thresholds on the exact fp32 boundary of the exit test,
rows whose sampled token is a stop id or whose token count reaches max_tokens), one runs the
torch path and one the kernels, and every state tensor, the record and the KV cache must agree
bitwise after each of several steps, for both schedulings and both KV layouts. On the CPU the
kernels run in triton's interpreter; `-m gpu` runs them compiled, through CUDA graphs too.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import pytest
import torch

from loopserve.attention.base import AttentionBackend
from loopserve.attention.flashinfer.fa2 import FlashInferFA2Backend
from loopserve.attention.torch_backend import TorchAttentionBackend
from loopserve.attention.triton_backend import TritonAttentionBackend
from loopserve.config import SchedulerConfig
from loopserve.depth import policy
from loopserve.depth.policy import Scheduling, SlotRule
from loopserve.kernels import decode_state
from loopserve.kv.layout import KVLayout
from loopserve.kv.pages import NULL_PAGE
from loopserve.models.ops import ModelOps, TritonOps
from loopserve.models.ouro import OuroForCausalLM
from loopserve.runner.cuda_graphs import GraphedDecodeStep
from loopserve.runner.decode_slots import MAX_STOP_TOKEN_IDS, SamplingKind
from loopserve.runner.decode_step import DecodeStep
from tests import fake_flashinfer
from tests.kernels.conftest import ON_GPU
from tests.kernels.tiny_setup import attention_spec, paged_kv, shuffled_pages, tiny_model

SLOTS, ROWS, PAGES, BLOCK, TRACE_WIDTH, STEPS = 12, 8, 6, 4, 5, 4
GREEDY = SamplingKind(all_greedy=True, needs_filter=False, any_logprobs=False, num_logprobs=0)
SAMPLED = SamplingKind(all_greedy=False, needs_filter=True, any_logprobs=True, num_logprobs=20)
# Structured outputs: token bitmasks, rows held for theirs, deferred constraints that begin.
CONSTRAINED = replace(SAMPLED, needs_filter=False, constrained=True)
KINDS = {"greedy": GREEDY, "sampled": SAMPLED, "constrained": CONSTRAINED}


@dataclass
class Pair:
    reference: DecodeStep  # the torch path
    fused: DecodeStep  # the prologue and coda kernels
    model: OuroForCausalLM


def _pair(
    device: torch.device,
    dtype: torch.dtype,
    layout: KVLayout,
    scheduling: Scheduling,
    seed: int,
    backend_class: type[AttentionBackend] | None = None,
) -> Pair:
    model = tiny_model(device, dtype, seed)
    if backend_class is None:
        backend_class = TritonAttentionBackend if device.type == "cuda" else TorchAttentionBackend
    backend = backend_class(attention_spec(model, device, BLOCK))
    scheduler = replace(SchedulerConfig(), max_num_seqs=SLOTS, kv_layout=layout)
    scheduler = replace(scheduler, scheduling=scheduling, block_size=BLOCK)
    generator = torch.Generator().manual_seed(seed)
    pages = shuffled_pages(SLOTS, model.config.num_loops, PAGES, generator)
    steps = []
    for fused in (False, True):
        kv, tables = paged_kv(model, pages, BLOCK, device, generator)
        steps.append(DecodeStep(model, kv, backend, tables, scheduler, TRACE_WIDTH, fused))
    steps[1].kv.cache.copy_(steps[0].kv.cache)
    return Pair(steps[0], steps[1], model)


def _randomise(step: DecodeStep, generator: torch.Generator, kind: SamplingKind) -> None:
    """Random but consistent slot states: every rule, depth and counter case."""
    planes = step.block_tables.tables.shape[1]

    def ints(low: int, high: torch.Tensor | int) -> torch.Tensor:
        span = torch.as_tensor(high) - low + 1
        return low + (torch.rand(SLOTS, generator=generator) * span).long()

    def put(target: torch.Tensor, values: torch.Tensor) -> None:
        target.copy_(values.to(target.dtype))

    max_loops = ints(1, planes)
    put(step.max_loops, max_loops)
    put(step.loop, ints(1, max_loops))
    put(step.min_loops, ints(1, max_loops))
    put(step.rule, ints(0, 3))
    put(step.threshold, torch.rand(SLOTS, generator=generator).where(ints(0, 3) > 0, 1.0))
    put(step.survival, torch.rand(SLOTS, generator=generator).where(ints(0, 4) > 0, 1.0))
    put(step.stop_next, ints(0, 1))
    put(step.active, ints(0, 5) > 0)
    put(step.waiting, ints(0, 3) == 0)
    put(step.position, ints(0, PAGES * BLOCK - 1 - STEPS))  # room for STEPS exits
    put(step.token, ints(0, step.vocab_size - 1))
    count = ints(0, TRACE_WIDTH + 2)
    put(step.output_count, count)
    put(step.max_tokens, count + ints(0, 2))
    stop_ids = torch.randint(0, step.vocab_size, (SLOTS, MAX_STOP_TOKEN_IDS), generator=generator)
    put(step.stop_ids, stop_ids.where(torch.rand(stop_ids.shape, generator=generator) < 0.5, -1))
    # neighbouring decode indices always have different depths
    index = torch.arange(TRACE_WIDTH)[None, :] + ints(0, planes)[:, None]
    put(step.trace_depths, index % planes + 1)
    put(step.hidden, torch.randn(step.hidden.shape, generator=generator))
    put(step.greedy, ints(0, 1) if not kind.all_greedy else torch.ones(SLOTS))
    put(step.temperature, 0.5 + torch.rand(SLOTS, generator=generator))
    put(step.top_k, ints(1, step.vocab_size))
    put(step.top_p, 0.5 + torch.rand(SLOTS, generator=generator) / 2)
    put(step.seed, ints(0, 1000))
    step.logprob_counts = [3 if kind.any_logprobs and s % 2 else None for s in range(SLOTS)]
    if kind.constrained:
        masks = step.masks
        put(masks.constrained, ints(0, 2) > 0)
        # A bitmask for the token each row samples next, or for an earlier one (held rows).
        put(masks.mask_index, count - (ints(0, 2) == 0).long())
        put(masks.begin_after, ints(0, step.vocab_size - 1).where(ints(0, 1) > 0, -1))
        bits = torch.randint(-(2**31), 2**31, masks.token_mask.shape, generator=generator)
        put(masks.token_mask, bits)


def _copy_state(source: DecodeStep, target: DecodeStep) -> None:
    for name in decode_state.SlotState.__annotations__:
        getattr(target, name).copy_(getattr(source, name))
    for name in ("greedy", "temperature", "top_k", "top_p", "min_p", "seed"):
        getattr(target, name).copy_(getattr(source, name))
    target.logprob_counts = list(source.logprob_counts)
    for name in ("constrained", "mask_index", "begin_after", "token_mask"):
        getattr(target.masks, name).copy_(getattr(source.masks, name))


def _on_the_boundary(pair: Pair, kind: SamplingKind, generator: torch.Generator) -> None:
    """Make some rows evaluate the gate, run the torch path once to learn each row's hazard and
    token, then put those rows' thresholds exactly on (or one ulp beside) 1 - S * (1 - λ) and
    some rows' token in their stop ids."""
    reference = pair.reference
    planes = reference.block_tables.tables.shape[1]
    gated = torch.zeros(SLOTS, dtype=torch.bool)
    gated[:ROWS] = torch.rand(ROWS, generator=generator) < 0.6
    delayed = torch.rand(SLOTS, generator=generator) < 0.5
    rule = torch.where(delayed, int(SlotRule.DELAYED_GATE), int(SlotRule.GATE))
    loop = torch.randint(1, planes, (SLOTS,), generator=generator)
    for name, value in [
        ("rule", rule), ("loop", loop), ("max_loops", planes), ("min_loops", 1),
        ("stop_next", False), ("active", True), ("waiting", False),
    ]:  # fmt: skip
        target = getattr(reference, name)
        value = torch.as_tensor(value).to(target.dtype)
        target.copy_(torch.where(gated.to(target.device), value.to(target.device), target))
    state = [*reference.state_tensors(), reference.kv.cache]
    saved = [tensor.clone() for tensor in state]
    hazards: list[torch.Tensor] = []
    gate = pair.model.exit_probability

    def recorded(hidden: torch.Tensor, previous: torch.Tensor, threshold: object) -> torch.Tensor:
        hazards.append(gate(hidden, previous, threshold))  # type: ignore[arg-type]
        return hazards[-1]

    pair.model.exit_probability = recorded  # type: ignore[method-assign]
    try:
        record = reference.step(ROWS, kind)
    finally:
        del pair.model.exit_probability
    for tensor, copy in zip(state, saved, strict=True):
        tensor.copy_(copy)
    device = reference.device
    cdf = 1.0 - reference.survival[:ROWS] * (1.0 - hazards[0])
    nudge = torch.randint(-1, 2, (ROWS,), generator=generator).to(device)
    nudge = nudge.where(torch.rand(ROWS, generator=generator).to(device) < 0.5, 0)
    exact = torch.where(nudge == 0, cdf, torch.nextafter(cdf, cdf + nudge))
    chosen = gated[:ROWS].to(device)
    reference.threshold[:ROWS] = torch.where(chosen, exact, reference.threshold[:ROWS])
    tokens = record[:, 3].long()
    stops = (torch.rand(ROWS, generator=generator) < 0.4).to(device)
    reference.stop_ids[:ROWS, 0] = torch.where(stops, tokens, reference.stop_ids[:ROWS, 0])


def _assert_bitwise(name: str, expected: torch.Tensor, actual: torch.Tensor) -> None:
    assert expected.dtype == actual.dtype and expected.shape == actual.shape, name
    same = expected.contiguous().view(torch.uint8) == actual.contiguous().view(torch.uint8)
    assert bool(same.all()), f"{name}: {expected} != {actual}"


def check_fused_matches_torch(
    device: torch.device,
    dtype: torch.dtype,
    layout: KVLayout,
    scheduling: Scheduling,
    kind: SamplingKind,
    seed: int,
    graphed: bool = False,
    backend_class: type[AttentionBackend] | None = None,
    ops: ModelOps | None = None,
) -> None:
    """STEPS steps of both paths from one random state; `graphed`: the fused one by replaying
    CUDA graphs (a bucket of exactly ROWS rows)."""
    pair = _pair(device, dtype, layout, scheduling, seed, backend_class)
    if ops is not None:
        pair.model.ops = ops
    generator = torch.Generator().manual_seed(seed)
    _randomise(pair.reference, generator, kind)
    _on_the_boundary(pair, kind, generator)
    _copy_state(pair.reference, pair.fused)
    graphs = GraphedDecodeStep(pair.fused, SLOTS) if graphed else None
    for step in range(STEPS):
        expected = pair.reference.step(ROWS, kind)
        actual = pair.fused.step(ROWS, kind) if graphs is None else graphs.run(ROWS, kind)
        _assert_bitwise(f"record, step {step}", expected, actual)
        names = ["active", "waiting", "stop_next", "loop", "position", "token", "output_count"]
        names += ["survival", "hidden", "exit_memory", "constrained"]
        for name, want, got in zip(
            names, pair.reference.state_tensors(), pair.fused.state_tensors(), strict=True
        ):
            _assert_bitwise(f"{name}, step {step}", want, got)
        # Every page but the null page, which collects the writes of rows that do not run and
        # of copies nobody needs: many slots land on it in one index_put, in no fixed order on
        # a GPU, and nothing reads it.
        real = torch.arange(pair.reference.kv.num_pages, device=device) != NULL_PAGE
        want, got = pair.reference.kv.cache[:, :, real], pair.fused.kv.cache[:, :, real]
        _assert_bitwise(f"KV cache, step {step}", want, got)


@pytest.mark.parametrize("layout", list(KVLayout))
@pytest.mark.parametrize("scheduling", list(Scheduling))
@pytest.mark.parametrize("kind", list(KINDS.values()), ids=list(KINDS))
def test_fused_step_is_the_torch_step_bitwise(
    device: torch.device, layout: KVLayout, scheduling: Scheduling, kind: SamplingKind
) -> None:
    for seed in range(2):
        check_fused_matches_torch(device, torch.float32, layout, scheduling, kind, seed)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16] if ON_GPU else [torch.float32])
def test_rope_in_the_decode_kernel_is_the_torch_step_bitwise(
    device: torch.device, dtype: torch.dtype
) -> None:
    """With the Triton backend and ops (the interpreter on a CPU) the fused step hands the decode
    kernel unrotated q and k (`metadata.rope`), the torch step rotates them with the ops' rotary
    kernel first: the same records, states and KV cache."""
    check_fused_matches_torch(
        device, dtype, KVLayout.FULL, Scheduling.REFILL, SAMPLED, seed=1,
        backend_class=TritonAttentionBackend, ops=TritonOps(),
    )  # fmt: skip


@pytest.mark.skipif(ON_GPU, reason="the stand-in flashinfer runs on the CPU")
@pytest.mark.parametrize("layout", list(KVLayout))
def test_flashinfer_reads_the_fused_metadata_as_the_torch_one(
    layout: KVLayout, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The FlashInfer FA2 backend's glue (page lists, plans from device lengths; the stand-in
    module of tests/fake_flashinfer.py computes from exactly what the real kernels read) gives the
    same steps from the prologue's metadata as from the torch path's."""
    fake_flashinfer.install(monkeypatch)
    cpu = torch.device("cpu")
    for seed in range(2):
        check_fused_matches_torch(
            cpu, torch.float32, layout, Scheduling.REFILL, GREEDY, seed,
            backend_class=FlashInferFA2Backend,
        )  # fmt: skip


@pytest.mark.gpu
@pytest.mark.parametrize("graphed", [False, True], ids=["eager", "graphed"])
@pytest.mark.parametrize("layout", list(KVLayout))
@pytest.mark.parametrize("scheduling", list(Scheduling))
@pytest.mark.parametrize("kind", list(KINDS.values()), ids=list(KINDS))
def test_fused_step_is_the_torch_step_bitwise_on_gpu(
    layout: KVLayout, scheduling: Scheduling, kind: SamplingKind, graphed: bool
) -> None:
    """Compiled for the GPU in bf16, RoPE rows included (the table holds torch's own CUDA
    cos/sin), eagerly and replayed from CUDA graphs."""
    for seed in range(4):
        check_fused_matches_torch(
            torch.device("cuda"), torch.bfloat16, layout, scheduling, kind, seed, graphed
        )


@pytest.mark.parametrize("layout", list(KVLayout))
@pytest.mark.parametrize("scheduling", list(Scheduling))
def test_prologue_is_the_torch_metadata_rope_and_input(
    device: torch.device, layout: KVLayout, scheduling: Scheduling
) -> None:
    pair = _pair(device, torch.float32, layout, scheduling, seed=5)
    step = pair.reference
    _randomise(step, torch.Generator().manual_seed(5), GREEDY)
    _copy_state(step, pair.fused)
    assert pair.fused.kernels is not None
    start = pair.fused.kernels.prologue(ROWS)
    ran, waiting = policy.runs(step.active[:ROWS], step.waiting[:ROWS], scheduling)
    loop, position = step.loop[:ROWS], step.position[:ROWS]
    plane = layout.decode_plane(loop, step.max_loops[:ROWS])
    metadata = step.block_tables.decode_metadata(ran, plane, position, host_lengths=False)
    cos, sin = pair.model.rope(position)
    embedded = pair.model.embed(step.token[:ROWS])
    hidden = torch.where((loop == 1)[:, None], embedded, step.hidden[:ROWS])
    pairs = {
        "ran": (ran, start.ran),
        "waiting": (waiting, start.waiting),
        "seq_lens": (metadata.seq_lens, start.seq_lens),
        "slot_mapping": (metadata.slot_mapping, start.slot_mapping),
        "page_table": (metadata.page_table, start.page_table),
        "cos": (cos, start.cos),
        "sin": (sin, start.sin),
        "hidden": (hidden, start.hidden),
    }
    for name, (want, got) in pairs.items():
        _assert_bitwise(name, want, got)


def test_kernel_rule_ids_are_the_policy_s() -> None:
    assert decode_state._GATE == SlotRule.GATE
    assert decode_state._DELAYED_GATE == SlotRule.DELAYED_GATE
    assert decode_state._TRACE == SlotRule.TRACE
