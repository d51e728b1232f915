"""A speculating request holds `SpeculativeConfig.lanes` decode rows, at most
num_loops - draft_loops + 1 of them however large K is, because no more tokens can be in flight
(the proof is in `SpeculativeConfig.lanes`). Held to it here: with every proposal kept
(`forced_acceptance` 1, so rings grow as long as they can) and exits at every depth, a request
runs the same steps and reports the same tokens with that many lanes as with K + 1 (a kept
proposal stands for its token, so any difference in what ran would show in the tokens); and one
lane fewer costs steps, so the runs do fill every lane."""

from __future__ import annotations

from pathlib import Path

import pytest

from loopserve.config import EngineConfig
from loopserve.engine.engine import Engine
from loopserve.sampling_params import SamplingParams
from loopserve.speculative_config import SpeculativeConfig
from tests.e2e.test_engine_vs_reference import PROMPTS

K = 8
# Trace mode with many depth-1 exits: a token that exits before the one in front of it keeps
# its lane until that one is done, which is what makes rings longer than at fixed depth.
MODES = {
    "fixed": {"exit_mode": "ouro"},
    "gate": {"exit_mode": "ouro", "threshold": 0.6},
    "trace": {"exit_mode": "trace", "trace_distribution": (0.5, 0.1, 0.1, 0.3)},
}


def run(checkpoint: Path, mode: str, draft_loops: int) -> tuple[list[list[int]], int]:
    """Every prompt at once, greedy: (each request's tokens, the engine's steps)."""
    settings = dict(MODES[mode])
    threshold = settings.pop("threshold", 1.0)
    speculative = {
        "num_speculative_tokens": K,
        "draft_loops": draft_loops,
        "forced_acceptance": 1.0,
        "disable_by_batch_size": None,
    }
    engine = Engine(
        EngineConfig.from_options(
            model=str(checkpoint),
            max_num_seqs=len(PROMPTS),
            num_kv_pages=256,
            speculative_config=speculative,
            **settings,
        )
    )
    params = SamplingParams(max_tokens=12, temperature=0.0, exit_threshold=threshold)
    for index, prompt in enumerate(PROMPTS):
        engine.add_request(prompt, params, request_id=str(index))
    tokens: dict[str, list[int]] = {}
    while len(tokens) < len(PROMPTS):
        for output in engine.step():
            if output.finished:
                tokens[output.request_id] = output.outputs[0].token_ids
    return [tokens[str(index)] for index in range(len(PROMPTS))], engine.stats().steps


def with_lanes(monkeypatch: pytest.MonkeyPatch, lanes: int) -> None:
    monkeypatch.setattr(SpeculativeConfig, "lanes", lambda self, num_loops: lanes)


@pytest.mark.parametrize("mode", sorted(MODES))
@pytest.mark.parametrize("draft_loops", [1, 2, 3])
def test_more_lanes_than_can_be_in_flight_change_nothing(
    tiny_checkpoint: Path, monkeypatch: pytest.MonkeyPatch, mode: str, draft_loops: int
) -> None:
    lanes = SpeculativeConfig(num_speculative_tokens=K, draft_loops=draft_loops).lanes(4)
    assert lanes == 4 - draft_loops + 1 < K + 1
    capped = run(tiny_checkpoint, mode, draft_loops)
    with_lanes(monkeypatch, K + 1)
    assert run(tiny_checkpoint, mode, draft_loops) == capped


@pytest.mark.parametrize(("mode", "draft_loops"), [("fixed", 1), ("trace", 2), ("gate", 1)])
def test_one_lane_fewer_costs_steps(
    tiny_checkpoint: Path, monkeypatch: pytest.MonkeyPatch, mode: str, draft_loops: int
) -> None:
    """The runs above do fill every lane, so their equality means something. (Kept proposals
    stand for the tokens here, so the tokens depend on which proposals ran: they differ too.)"""
    _, steps = run(tiny_checkpoint, mode, draft_loops)
    with_lanes(monkeypatch, 4 - draft_loops)
    _, fewer_lanes_steps = run(tiny_checkpoint, mode, draft_loops)
    assert fewer_lanes_steps > steps
