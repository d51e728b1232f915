"""`speculative_config` at the boundary: what it accepts (a dict, its JSON text, the flag), and
what it refuses, by name, before anything is loaded where it can: bad keys and values, the
shared layout, a draft depth that leaves no loop to check it, prelude/coda families, and
structured outputs (not served with speculation yet)."""

from __future__ import annotations

from pathlib import Path

import pytest

from loopserve import LLM, SamplingParams
from loopserve.config import EngineConfig, SchedulerConfig, option_name
from loopserve.entrypoints.cli import main
from loopserve.speculative_config import SpeculativeConfig
from loopserve.structured_outputs import StructuredOutputsParams
from tests.published_configs import write_huginn_checkpoint


def test_a_dict_and_its_json_give_the_same_config() -> None:
    given = {"method": "draft_loops", "num_speculative_tokens": 3, "draft_loops": 1}
    from_dict = EngineConfig.from_options(speculative_config=given).scheduler.speculative_config
    text = '{"method": "draft_loops", "num_speculative_tokens": 3, "draft_loops": 1}'
    from_text = EngineConfig.from_options(speculative_config=text).scheduler.speculative_config
    assert from_dict == from_text == SpeculativeConfig(num_speculative_tokens=3, draft_loops=1)
    assert SchedulerConfig().speculative_config is None


@pytest.mark.parametrize(
    ("num_loops", "tokens", "draft_loops", "lanes"),
    [(4, 4, 2, 3), (4, 1, 2, 2), (4, 8, 1, 4), (4, 8, 3, 2), (2, 4, 1, 2), (8, 2, 2, 3)],
)
def test_lanes_are_what_can_be_in_flight(
    num_loops: int, tokens: int, draft_loops: int, lanes: int
) -> None:
    """K + 1 rows, but never more than num_loops - draft_loops + 1 (the most tokens a request
    can have in flight): more would only run idle."""
    config = SpeculativeConfig(num_speculative_tokens=tokens, draft_loops=draft_loops)
    assert config.lanes(num_loops) == lanes
    scheduler = SchedulerConfig(speculative_config=config, max_num_seqs=3)
    assert scheduler.max_decode_rows(num_loops) == 3 * lanes


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ("{bad", r"must be a JSON object, such as \{.*Expecting"),
        ([1], "must be a dict, got list"),
        ({"num_speculative_token": 2}, r"unknown key\(s\) \['num_speculative_token'\]"),
        ({"method": "ngram"}, r"method must be one of \('draft_loops',\)"),
        ({"num_speculative_tokens": 0}, "num_speculative_tokens must be an integer >= 1, got 0"),
        ({"num_speculative_tokens": 17}, "num_speculative_tokens must be at most 16, got 17"),
        ({"draft_loops": True}, "draft_loops must be an integer >= 1, got True"),
        ({"draft_loops": 1.5}, "draft_loops must be an integer >= 1, got 1.5"),
        ({"disable_by_batch_size": 0}, "disable_by_batch_size must be an integer >= 1"),
        ({"forced_acceptance": 1.5}, "forced_acceptance must be a probability in"),
    ],
)
def test_bad_configs_are_refused_by_name(value: object, message: str) -> None:
    with pytest.raises(ValueError, match=message) as refused:
        EngineConfig.from_options(speculative_config=value)
    assert str(refused.value).startswith(f"{option_name('speculative_config')} ")


def test_the_shared_layout_is_refused_with_both_flags() -> None:
    with pytest.raises(ValueError, match=r"speculative_config \(--speculative-config\) needs "):
        EngineConfig.from_options(speculative_config={}, kv_layout="shared")


def test_a_draft_depth_without_a_loop_after_it_is_refused_before_the_weights(
    tiny_checkpoint: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def refuse(*args: object, **kwargs: object) -> None:
        raise AssertionError("the weights were loaded before the check")

    monkeypatch.setattr("loopserve.runner.setup.load_checkpoint", refuse)
    with pytest.raises(
        ValueError, match=r"draft_loops 4 must be below the model's loop count \(4\)"
    ):
        LLM(str(tiny_checkpoint), speculative_config={"draft_loops": 4})


def test_prelude_and_coda_families_are_refused(tmp_path: Path) -> None:
    huginn = write_huginn_checkpoint(tmp_path / "huginn")
    with pytest.raises(ValueError, match="cannot serve huginn models: their prelude and coda"):
        LLM(str(huginn), speculative_config={"draft_loops": 2})


def test_a_structured_output_request_is_refused_and_the_engine_keeps_serving() -> None:
    llm = LLM(dtype="float32", num_kv_pages=256, speculative_config={"draft_loops": 1})
    constrained = SamplingParams(
        max_tokens=4, structured_outputs=StructuredOutputsParams(regex="[0-9]+")
    )
    with pytest.raises(ValueError, match="structured outputs are not served with speculative"):
        llm.engine.add_request("x = ", constrained)
    [output] = llm.generate(["x = "], SamplingParams(max_tokens=4, temperature=0.0))
    assert len(output.outputs[0].token_ids) == 4
    assert llm.engine.stats().kv_pages_used == 0


def test_the_flag_takes_json(capsys: pytest.CaptureFixture[str]) -> None:
    flag = '{"num_speculative_tokens": 2, "draft_loops": 1}'
    argv = ["generate", "--prompt", "def f(", "--max-tokens", "5", "--speculative-config", flag]
    assert main([*argv, "--dtype", "float32", "--num-kv-pages", "128"]) == 0
    assert "def f(" in capsys.readouterr().out
    assert main([*argv[:-1], "{bad", "--num-kv-pages", "128"]) == 2
    assert "must be a JSON object" in capsys.readouterr().err


def test_speculation_switches_off_above_the_limit_and_back_on_a_quarter_below() -> None:
    """`SpeculativeConfig.speculates_with`: off above `disable_by_batch_size`; once off, on again
    at `limit - limit // 4` (no margin below 4); never off without a limit."""
    config = SpeculativeConfig(disable_by_batch_size=8)
    speculating = True
    decisions = []
    for decoding in (8, 9, 8, 7, 6, 8, 9, 1):
        speculating = config.speculates_with(decoding, speculating)
        decisions.append(speculating)
    assert decisions == [True, False, False, False, True, True, False, True]
    small = SpeculativeConfig(disable_by_batch_size=2)
    assert small.speculates_with(2, speculating=False) and not small.speculates_with(3, True)
    assert SpeculativeConfig(disable_by_batch_size=None).speculates_with(10_000, False)
