"""A speculating decode step's fused coda (kernels/lanes_state.py) is its torch path, bit for bit.

`runner.speculation.SpeculativeLanes.step` exists twice: as torch (the reference and the CPU
path) and, where the decode step's bookkeeping is fused, as the prologue, the exit decision with
proposals and the lanes' coda. Two speculating decode steps over one model get the same random
requests (every exit mode, random thresholds, sampled and greedy, log-probs, stop ids, short
`max_tokens`; a finished request's slot gets a new one at once), one runs the torch path and one
the kernels, and after every step the record, every state tensor (the lanes' included) and the
KV cache must agree bitwise. Random weights almost never propose the final token, so the cases
also run with the stack's sublayer outputs scaled down (every loop's logits then nearly equal:
most proposals are kept, some flip) and with `forced_acceptance`. On the CPU the kernels run in
triton's interpreter; `-m gpu` runs them compiled, in bf16 and through CUDA graphs.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import pytest
import torch

from loopserve.attention.torch_backend import TorchAttentionBackend
from loopserve.attention.triton_backend import TritonAttentionBackend
from loopserve.config import SchedulerConfig
from loopserve.depth.policy import ExitMode, Scheduling
from loopserve.engine.scheduler_output import SlotStart
from loopserve.kv.pages import NULL_PAGE
from loopserve.models.ouro import OuroForCausalLM
from loopserve.runner.cuda_graphs import GraphedDecodeStep
from loopserve.runner.decode_step import DecodeStep
from loopserve.runner.speculation import SpeculativeLanes
from loopserve.runner.step_record import STOPPED
from loopserve.sampling_params import ResolvedParams, SamplingParams
from loopserve.speculative_config import SpeculativeConfig
from tests.kernels.conftest import ON_GPU
from tests.kernels.tiny_setup import attention_spec, paged_kv, shuffled_pages, tiny_model

SLOTS, PAGES, BLOCK, STEPS = 5, 10, 4, 14


@dataclass
class Pair:
    reference: DecodeStep  # the torch path
    fused: DecodeStep  # the kernels
    generator: torch.Generator


def _pair(
    device: torch.device,
    dtype: torch.dtype,
    speculative: SpeculativeConfig,
    scheduling: Scheduling,
    exit_mode: ExitMode,
    seed: int,
    agreeing: bool,
) -> Pair:
    model = tiny_model(device, dtype, seed)
    if agreeing:
        _quiet_sublayers(model)
    backend_class = TritonAttentionBackend if device.type == "cuda" else TorchAttentionBackend
    backend = backend_class(attention_spec(model, device, BLOCK))
    scheduler = replace(
        SchedulerConfig(),
        max_num_seqs=SLOTS,
        block_size=BLOCK,
        scheduling=scheduling,
        exit_mode=exit_mode,
        speculative_config=speculative,
    )
    generator = torch.Generator().manual_seed(seed)
    pages = shuffled_pages(SLOTS, model.config.num_loops, PAGES, generator)
    steps = []
    for fused in (False, True):
        kv, tables = paged_kv(
            model, pages, BLOCK, device, generator, speculative.lanes(model.config.num_loops)
        )
        step = DecodeStep(model, kv, backend, tables, scheduler, PAGES * BLOCK, fused)
        step.speculate(SpeculativeLanes(step, speculative, SLOTS))
        steps.append(step)
    steps[1].kv.cache.copy_(steps[0].kv.cache)
    assert steps[0].speculation is not None and steps[0].speculation.coda is None
    assert steps[1].speculation is not None and steps[1].speculation.coda is not None
    return Pair(steps[0], steps[1], generator)


def _quiet_sublayers(model: OuroForCausalLM) -> None:
    """Scale the norms on each sublayer's output down: a loop then barely moves the hidden
    state, and a proposal from loop d is mostly the token the last loop samples."""
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if name.endswith(("input_layernorm_2.weight", "post_attention_layernorm_2.weight")):
                parameter.mul_(0.02)


def _request(pair: Pair, slot: int) -> SlotStart:
    """A random request at a random position, with room for every token and lane it can add."""
    generator = pair.generator

    def draw(high: int) -> int:
        return int(torch.randint(0, high, (), generator=generator))

    loops = pair.reference.model.config.num_loops
    vocab = pair.reference.vocab_size
    max_tokens = 1 + draw(10)
    sampled = draw(2) == 1
    params = SamplingParams(
        max_tokens=max_tokens,
        temperature=0.8 if sampled else 0.0,
        top_k=1 + draw(vocab) if sampled and draw(2) else -1,
        logprobs=draw(3) if draw(2) else None,
        stop_token_ids=[draw(vocab) for _ in range(draw(3))],
        ignore_eos=True,
        trace_depths=[1 + draw(loops) for _ in range(max_tokens)],
    )
    resolved = ResolvedParams(
        params=params,
        seed=draw(1000),
        min_loops=1 + draw(2),
        max_loops=loops,
        exit_threshold=[1.0, 0.3, 0.5, 0.7][draw(4)],
        eos_token_ids=frozenset(),
    )
    position = draw(PAGES * BLOCK - 2 * max_tokens - 2 * pair.reference.lanes)
    return SlotStart(slot, draw(vocab), position, draw(3), resolved)


def _assert_bitwise(name: str, expected: torch.Tensor, actual: torch.Tensor) -> None:
    assert expected.dtype == actual.dtype and expected.shape == actual.shape, name
    same = expected.contiguous().view(torch.uint8) == actual.contiguous().view(torch.uint8)
    assert bool(same.all()), f"{name}: {expected} != {actual}"


def check_lanes_match_torch(
    device: torch.device,
    dtype: torch.dtype,
    speculative: SpeculativeConfig,
    scheduling: Scheduling,
    exit_mode: ExitMode,
    seed: int,
    agreeing: bool,
    graphed: bool = False,
) -> dict[str, int]:
    """STEPS steps of both paths over SLOTS slots, refilled as requests finish; returns how
    many tokens were reported and proposals kept (so a case shows what it exercised)."""
    pair = _pair(device, dtype, speculative, scheduling, exit_mode, seed, agreeing)
    starts = [_request(pair, slot) for slot in range(SLOTS)]
    graphs = GraphedDecodeStep(pair.fused, SLOTS) if graphed else None
    seen = {"reported": 0, "confirmed": 0, "proposed": 0}
    lanes = pair.reference.lanes
    for step in range(STEPS):
        for decode in (pair.reference, pair.fused):
            if starts:  # as the runner: only when there are any
                decode.start(starts)
        kind = pair.reference.sampling_kind(list(range(SLOTS)))
        expected = pair.reference.step(SLOTS, kind)
        actual = pair.fused.step(SLOTS, kind) if graphs is None else graphs.run(SLOTS, kind)
        _assert_bitwise(f"record, step {step}", expected, actual)
        names = ["active", "waiting", "stop_next", "loop", "position", "token", "output_count"]
        names += ["survival", "hidden", "exit_memory", "constrained"]
        names += ["done", "proposal", "out_token", "out_depth", "exit_logprobs", "head"]
        for name, want, got in zip(
            names, pair.reference.state_tensors(), pair.fused.state_tensors(), strict=True
        ):
            _assert_bitwise(f"{name}, step {step}", want, got)
        real = torch.arange(pair.reference.kv.num_pages, device=device) != NULL_PAGE
        want, got = pair.reference.kv.cache[:, :, real], pair.fused.kv.cache[:, :, real]
        _assert_bitwise(f"KV cache, step {step}", want, got)
        record = expected.cpu()
        seen["reported"] += int(record[:, 2].sum())
        seen["proposed"] += int(record[:, -2].sum())
        seen["confirmed"] += int(record[:, -1].sum())
        finished = record[:, STOPPED].view(SLOTS, lanes).amax(1) > 0
        done = [slot for slot in range(SLOTS) if finished[slot]]
        for decode in (pair.reference, pair.fused):
            if done:
                decode.stop(done)
        starts = [_request(pair, slot) for slot in done]
    return seen


CASES = [
    # (speculative tokens, draft loops, forced acceptance, agreeing weights)
    (3, 2, None, True),
    (2, 1, None, True),
    (3, 2, None, False),
    (4, 2, 0.7, False),
]


@pytest.mark.parametrize("scheduling", list(Scheduling))
@pytest.mark.parametrize("exit_mode", list(ExitMode))
@pytest.mark.parametrize("case", CASES, ids=["k3d2", "k2d1", "k3d2-random", "k4d2-forced"])
def test_lanes_coda_is_the_torch_step_bitwise(
    device: torch.device,
    scheduling: Scheduling,
    exit_mode: ExitMode,
    case: tuple[int, int, float | None, bool],
) -> None:
    tokens, draft, forced, agreeing = case
    speculative = SpeculativeConfig(
        num_speculative_tokens=tokens, draft_loops=draft, forced_acceptance=forced
    )
    seen = check_lanes_match_torch(
        device, torch.float32, speculative, scheduling, exit_mode, 0, agreeing
    )
    assert seen["reported"] > 0 and seen["proposed"] > 0
    if agreeing or forced is not None:
        assert seen["confirmed"] > 0  # the ring kept proposals, not only dropped them


@pytest.mark.gpu
@pytest.mark.parametrize("graphed", [False, True], ids=["eager", "graphed"])
@pytest.mark.parametrize("scheduling", list(Scheduling))
def test_lanes_coda_is_the_torch_step_bitwise_on_gpu(scheduling: Scheduling, graphed: bool) -> None:
    """Compiled for the GPU in bf16, eagerly and replayed from CUDA graphs."""
    assert ON_GPU
    for tokens, draft, forced, agreeing in CASES:
        speculative = SpeculativeConfig(
            num_speculative_tokens=tokens, draft_loops=draft, forced_acceptance=forced
        )
        for seed in range(2):
            check_lanes_match_torch(
                torch.device("cuda"), torch.bfloat16, speculative, scheduling, ExitMode.OURO,
                seed, agreeing, graphed,
            )  # fmt: skip
