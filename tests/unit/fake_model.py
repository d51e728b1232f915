"""A model-free stand-in for `OuroForCausalLM`, so scheduler tests run the real decode step fast.

The hidden state of a token is [loops run, token id, 0, 0]. Every loop adds 1 to the first column
and writes K = V = [loop, token id] through the attention callable (so copy-on-exit can be read
back from the KV cache), the exit hazard after loop d is `hazards.get(d, 0)`, and the coda always
picks the token after the current one (token id + 1 mod the vocabulary).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from loopserve.config import EngineConfig
from loopserve.engine.engine import Engine
from loopserve.engine.runner_api import RunnerInfo
from loopserve.engine.scheduler_output import RunnerOutput, SchedulerOutput
from loopserve.models.layers import LoopContext
from loopserve.models.ops import TorchOps
from loopserve.models.ouro_config import OuroConfig
from loopserve.runner.model_runner import ModelRunner, PendingOutput
from loopserve.runner.setup import build_runner
from loopserve.sampling_params import SamplingParams

HIDDEN = 4


class FakeLoopedModel:
    def __init__(
        self,
        num_loops: int = 4,
        vocab_size: int = 512,
        hazards: dict[int, float] | None = None,
        eos_token_ids: tuple[int, ...] = (),
    ) -> None:
        self.config = OuroConfig(
            vocab_size=vocab_size,
            hidden_size=HIDDEN,
            intermediate_size=HIDDEN,
            num_hidden_layers=1,
            num_attention_heads=1,
            num_key_value_heads=1,
            head_dim=2,
            max_position_embeddings=1024,
            num_loops=num_loops,
            eos_token_ids=eos_token_ids,
        )
        self.hazards = hazards or {}
        self.dtype = torch.float32
        self.ops = TorchOps()  # as OuroForCausalLM's on the CPU: the decode step runs as torch
        self.has_stage_layers = False
        self.carried_size = HIDDEN
        self.num_kv_layers = 1
        self.fused_bookkeeping = True
        self.exit_needs_readout = False
        self.exit_memory_size = 0

    def start(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        seeds: torch.Tensor,
        ctx: LoopContext | None = None,
        rows: torch.Tensor | None = None,
    ) -> torch.Tensor:
        hidden = torch.zeros(input_ids.shape[0], HIDDEN)
        hidden[:, 1] = input_ids.float()
        return hidden

    def rope(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        rows = positions.shape[0]
        return torch.ones(rows, 2), torch.zeros(rows, 2)

    def run_loop(self, hidden: torch.Tensor, ctx: LoopContext) -> torch.Tensor:
        hidden = hidden.clone()
        hidden[:, 0] += 1
        marker = hidden[:, None, :2].contiguous()  # [T, 1, 2]: (loop, token id)
        ctx.attention(0, marker, marker, marker)
        return hidden

    def exit_probability(
        self, hidden: torch.Tensor, previous: torch.Tensor, threshold: object
    ) -> torch.Tensor:
        loops = hidden[:, 0].long().tolist()
        return torch.tensor([self.hazards.get(loop, 0.0) for loop in loops])

    def coda(
        self,
        hidden: torch.Tensor,
        ctx: LoopContext | None = None,
        rows: torch.Tensor | None = None,
    ) -> torch.Tensor:
        return hidden

    def compute_logits(
        self,
        hidden: torch.Tensor,
        rows: torch.Tensor | None = None,
        ctx: LoopContext | None = None,
    ) -> torch.Tensor:
        return self.head(hidden, rows)

    def head(self, hidden: torch.Tensor, rows: torch.Tensor | None = None) -> torch.Tensor:
        vocab = self.config.vocab_size
        following = (hidden[:, 1].long() + 1) % vocab
        logits = torch.full((hidden.shape[0], vocab), -30.0)
        logits[torch.arange(hidden.shape[0]), following] = 0.0
        return logits if rows is None else torch.where(rows[:, None], logits, 0.0)


@dataclass
class Step:
    scheduled: SchedulerOutput
    output: RunnerOutput

    def loops(self) -> dict[str, int]:
        """Request id -> the loop its token ran in this step's decode step."""
        decode = self.output.decode
        if decode is None:
            return {}
        return {
            self.scheduled.decode_slots[slot]: decode.loops[slot]
            for slot, ran in enumerate(decode.ran)
            if ran and slot in self.scheduled.decode_slots
        }


@dataclass
class RecordingRunner:
    """The real runner (around a fake model), with every step's input and output kept."""

    runner: ModelRunner
    steps: list[Step] = field(default_factory=list)

    @property
    def info(self) -> RunnerInfo:
        return self.runner.info

    def execute(self, scheduled: SchedulerOutput) -> _Recorded:
        return _Recorded(self.runner.execute(scheduled), scheduled, self.steps)


@dataclass
class _Recorded:
    pending: PendingOutput
    scheduled: SchedulerOutput
    steps: list[Step]

    def result(self) -> RunnerOutput:
        output = self.pending.result()
        self.steps.append(Step(self.scheduled, output))
        return output


def make_engine(
    model: FakeLoopedModel | None = None, num_kv_pages: int = 200, **options: Any
) -> tuple[Engine, RecordingRunner]:
    config = EngineConfig.from_options(num_kv_pages=num_kv_pages, **options)
    runner = RecordingRunner(build_runner(config, model=model or FakeLoopedModel()))  # type: ignore[arg-type]
    return Engine(config, runner), runner


def params(max_tokens: int = 4, **changes: Any) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, **changes)


def prompt(length: int = 5) -> list[int]:
    return list(range(1, length + 1))


def run_to_completion(engine: Engine, max_steps: int = 2000) -> dict[str, Any]:
    """Step until every request is done, checking the page books after every step; returns
    the final output of each request."""
    done = {}
    for _ in range(max_steps):
        if not engine.has_unfinished_requests():
            return done
        for output in engine.step():
            if output.finished:
                done[output.request_id] = output
        engine.kv.check_invariants()
    raise AssertionError("the engine did not finish")
