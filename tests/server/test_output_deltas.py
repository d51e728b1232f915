"""`output_deltas`: a step's outputs, sent as what each added (through pickle, as over the engine
process's pipe), come back equal to the engine's, step after step: long outputs, stop strings
cutting text, logprobs, several tokens a step (speculation), aborts and finishes."""

from __future__ import annotations

import pickle

from loopserve.config import EngineConfig
from loopserve.engine.engine import Engine
from loopserve.entrypoints.openai.output_deltas import DeltaDecoder, DeltaEncoder
from loopserve.outputs import RequestOutput
from loopserve.sampling_params import SamplingParams


def _requests(engine: Engine) -> None:
    prompts = [[11, 22, 33, 44], [5] * 30, [101, 7, 9], [3, 1, 4, 1, 5, 9, 2, 6]]
    engine.add_request(prompts[0], SamplingParams(max_tokens=40, temperature=0), "long")
    engine.add_request(
        prompts[1], SamplingParams(max_tokens=20, temperature=1.0, seed=3, logprobs=2), "logprobs"
    )
    engine.add_request(prompts[2], SamplingParams(max_tokens=30, stop=["e", " "]), "stop")
    engine.add_request(prompts[3], SamplingParams(max_tokens=30, temperature=0), "aborted")


def _same_as_the_engine(options: dict[str, object]) -> int:
    engine = Engine(EngineConfig.from_options(device="cpu", dtype="float32", **options))
    _requests(engine)
    encoder, decoder = DeltaEncoder(), DeltaDecoder()
    steps, checked = 0, 0
    while engine.has_unfinished_requests():
        steps += 1
        outputs: list[RequestOutput] = engine.step()
        if steps == 6:
            aborted = engine.abort("aborted")
            assert aborted is not None
            outputs.append(aborted)
        sent = pickle.loads(pickle.dumps(encoder.encode(outputs)))
        assert decoder.decode(sent) == outputs
        checked += len(outputs)
    return checked


def test_outputs_come_back_equal_step_after_step() -> None:
    assert _same_as_the_engine({}) > 60


def test_several_tokens_a_step_come_back_equal() -> None:
    speculation = {"num_speculative_tokens": 3, "draft_loops": 2, "forced_acceptance": 0.9}
    assert _same_as_the_engine({"speculative_config": speculation}) > 30


def test_a_delta_carries_what_the_step_added() -> None:
    engine = Engine(EngineConfig.from_options(device="cpu", dtype="float32"))
    engine.add_request([11, 22, 33], SamplingParams(max_tokens=50, temperature=0), "r")
    encoder = DeltaEncoder()
    deltas = []
    while engine.has_unfinished_requests():
        deltas += encoder.encode(engine.step())
    assert deltas[0].start is not None and all(delta.start is None for delta in deltas[1:])
    assert all(len(delta.token_ids) == 1 for delta in deltas)  # one token a step, not all
    assert sum(len(delta.token_ids) for delta in deltas) == 50 and deltas[-1].finished
