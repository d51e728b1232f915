"""`LLM.chat` with tools: the tools and tool messages reach the chat template, a reply without a
call is content with no calls, a reply holding Hermes `<tool_call>` blocks gives parsed
`tool_calls` and the text around them as `content`, `required` and named choices force a call that
parses; bad tools and choices, and tools without a parser, are refused before anything is
generated."""

from __future__ import annotations

import json
from collections.abc import Iterator

import pytest

from loopserve import LLM, SamplingParams
from loopserve.outputs import CompletionOutput, RequestMetrics, RequestOutput
from loopserve.structured_outputs import StructuredOutputsParams
from tests.real_ouro import ANSWER, write_ouro_like_checkpoint
from tests.server.test_tool_calls_chat import HI, TOOLS_TEMPLATE, WEATHER

# get_weather's arguments, bounded so that a model always finishes writing them.
BOUNDED = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 8}},
    "required": ["city"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def llm(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LLM]:
    llm = LLM(str(write_ouro_like_checkpoint(tmp_path_factory.mktemp("ouro-chat-tools"))))
    yield llm
    del llm


def chat(llm: LLM, **options: object) -> RequestOutput:
    (output,) = llm.chat(HI, chat_template=TOOLS_TEMPLATE, tool_call_parser="hermes", **options)  # type: ignore[arg-type]
    return output


def test_tools_and_tool_messages_reach_the_template(llm: LLM) -> None:
    offered = chat(llm, tools=[WEATHER])
    assert offered.prompt is not None and offered.prompt.startswith(
        "tools: get_weather<|im_start|>"
    )
    declined = chat(llm, tools=[WEATHER], tool_choice="none")
    assert declined.prompt is not None and "get_weather" not in declined.prompt
    call = {"id": "call_1", "type": "function",
            "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}  # fmt: skip
    turns = [
        *HI,
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
    ]
    (answered,) = llm.chat(
        turns,  # type: ignore[arg-type]
        chat_template=TOOLS_TEMPLATE,
        tools=[WEATHER],
        tool_call_parser="hermes",
    )
    assert answered.prompt is not None and "[call_1]" in answered.prompt


def test_a_reply_without_a_call_is_content(llm: LLM) -> None:
    sequence = chat(llm, tools=[WEATHER]).outputs[0]
    assert (sequence.text, sequence.content, sequence.tool_calls) == (ANSWER, ANSWER, [])
    assert chat(llm).outputs[0].tool_calls is None  # no tools offered


def test_calls_in_a_reply_are_parsed(llm: LLM, monkeypatch: pytest.MonkeyPatch) -> None:
    """The scripted model cannot write a call: its generation is replaced by a reply that does."""
    reply = (
        'Let me look.<tool_call>{"name": "get_weather", "arguments": {"city": "Oslo"}}'
        "</tool_call> Done."
    )

    def generate(*args: object, **kwargs: object) -> list[RequestOutput]:
        sequence = CompletionOutput(0, reply, [5], [4], None, "stop")
        return [RequestOutput("0", None, [1], [sequence], True, RequestMetrics(0.0))]

    monkeypatch.setattr(llm, "_generate", generate)
    sequence = chat(llm, tools=[WEATHER]).outputs[0]
    assert sequence.content == "Let me look. Done."
    assert sequence.tool_calls is not None and len(sequence.tool_calls) == 1
    (call,) = sequence.tool_calls
    assert (call.name, call.arguments) == ("get_weather", '{"city": "Oslo"}')
    assert call.id.startswith("call_") and sequence.text == reply


def test_a_required_tool_choice_gives_a_call_that_parses(llm: LLM) -> None:
    """The scripted model, which never writes a call by itself, writes one when it must."""
    import jsonschema

    tool = {**WEATHER, "function": {**WEATHER["function"], "parameters": BOUNDED}}
    params = SamplingParams(max_tokens=80, temperature=0.0)
    for choice in ("required", {"type": "function", "function": {"name": "get_weather"}}):
        sequence = chat(
            llm, tools=[tool], tool_choice=choice, parallel_tool_calls=False,
            sampling_params=params,
        ).outputs[0]  # fmt: skip
        assert sequence.finish_reason == "stop" and sequence.tool_calls, sequence.text
        (call,) = sequence.tool_calls
        assert call.name == "get_weather" and sequence.content == ""
        jsonschema.validate(json.loads(call.arguments), BOUNDED)


@pytest.mark.parametrize(
    ("options", "message"),
    [
        (
            {"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "f"}}},
            "not among the tools",
        ),
        ({"tools": [WEATHER], "tool_choice": "sometimes"}, "tool_choice must be one of"),
        (
            {
                "tools": [WEATHER],
                "tool_choice": "required",
                "sampling_params": SamplingParams(
                    structured_outputs=StructuredOutputsParams(regex="a")
                ),
            },
            "leave structured_outputs unset",
        ),
        ({"tools": [{"type": "function", "function": {}}]}, "each tool must be"),
        ({"tools": "get_weather"}, "tools must be a non-empty list"),
        ({"tools": [WEATHER], "tool_call_parser": "none"}, "no tool-call parser runs"),
    ],
)
def test_bad_tool_requests_are_refused(llm: LLM, options: dict[str, object], message: str) -> None:
    parser = options.pop("tool_call_parser", "hermes")
    with pytest.raises(ValueError, match=message):
        llm.chat(HI, chat_template=TOOLS_TEMPLATE, tool_call_parser=parser, **options)  # type: ignore[arg-type]
