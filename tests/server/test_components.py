"""The server's parts on their own: the engine thread (with a fake engine), stream deltas with
stop strings, Prometheus rendering, chat templates, request validation and lazy imports."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import threading
from typing import Any

import pytest

from loopserve.engine.engine import EngineStats
from loopserve.entrypoints.openai.chat_template import (
    ChatTemplate,
    ChatTemplateError,
    load_chat_template,
)
from loopserve.entrypoints.openai.choice_state import ChoiceState
from loopserve.entrypoints.openai.engine_thread import (
    EngineDeadError,
    EngineRequest,
    EngineThread,
)
from loopserve.entrypoints.openai.errors import OpenAIError
from loopserve.entrypoints.openai.metrics import Histogram, ServerMetrics, metric_header
from loopserve.entrypoints.openai.protocol import ChatCompletionRequest, parse_request
from loopserve.outputs import CompletionOutput, RequestMetrics, RequestOutput
from loopserve.sampling_params import SamplingParams


def _output(
    request_id: str, tokens: int, text: str, finished: bool = False, reason: str = "length"
) -> RequestOutput:
    completion = CompletionOutput(
        index=0,
        text=text,
        token_ids=list(range(tokens)),
        exit_depths=[4] * tokens,
        logprobs=None,
        finish_reason=reason if finished else None,
        new_token_ids=[tokens - 1] if tokens else [],
        new_text="",
    )
    return RequestOutput(
        request_id=request_id,
        prompt=None,
        prompt_token_ids=[1],
        outputs=[completion],
        finished=finished,
        metrics=RequestMetrics(arrival_time=0.0, first_token_time=0.5, finished_time=1.0),
    )


class FakeEngine:
    """Each request yields `length` one-token outputs; prompts holding -1 are rejected."""

    def __init__(self, length: int = 3, fail_on_step: bool = False) -> None:
        self.length = length
        self.fail_on_step = fail_on_step
        self.running: dict[str, int] = {}
        self.aborted: list[str] = []
        self.idle_checks = 0

    def add_request(self, prompt: list[int], params: SamplingParams, request_id: str) -> str:
        if -1 in prompt:
            raise ValueError("bad prompt")
        self.running[request_id] = 0
        return request_id

    def abort(self, request_id: str) -> RequestOutput | None:
        if self.running.pop(request_id, None) is None:
            return None
        self.aborted.append(request_id)
        return _output(request_id, 0, "", finished=True, reason="abort")

    def has_unfinished_requests(self) -> bool:
        self.idle_checks += 1
        return bool(self.running)

    def step(self) -> list[RequestOutput]:
        if self.fail_on_step:
            raise RuntimeError("boom")
        outputs = []
        for request_id in list(self.running):
            self.running[request_id] += 1
            done = self.running[request_id] == self.length
            outputs.append(_output(request_id, self.running[request_id], "x", finished=done))
            if done:
                del self.running[request_id]
        return outputs

    def stats(self) -> EngineStats:
        return EngineStats(
            num_running=len(self.running), num_waiting=0, kv_pages_total=10, kv_pages_used=0,
            kv_pages_free=10, kv_pages_cached=0, steps=0, decode_steps=0,
            mean_rows_per_decode_step=0.0, row_loops_by_loop={}, rows_per_step={},
            prefill_tokens=0, generated_tokens=0, num_preemptions=3, recomputed_tokens=5,
            prefix_cache_hit_rate=0.25,
            prefix_hit_tokens=16, prefix_query_tokens=64, proposed_tokens=7, confirmed_tokens=6,
            speculative_tokens=9,
        )  # fmt: skip


def _requests(*prompts: list[int]) -> list[EngineRequest]:
    return [
        EngineRequest(f"r{index}", prompt, SamplingParams()) for index, prompt in enumerate(prompts)
    ]


async def _collect(thread: EngineThread, requests: list[EngineRequest]) -> list[RequestOutput]:
    queue: asyncio.Queue[Any] = asyncio.Queue()
    await thread.add(requests, queue)
    outputs = []
    unfinished = {request.request_id for request in requests}
    while unfinished:
        output = await asyncio.wait_for(queue.get(), 10)
        outputs.append(output)
        if output.finished:
            unfinished.discard(output.request_id)
    return outputs


def test_engine_thread_streams_outputs_and_sleeps_when_idle() -> None:
    engine = FakeEngine(length=3)
    thread = EngineThread(engine, ServerMetrics(num_loops=4))  # type: ignore[arg-type]

    async def scenario() -> None:
        thread.start(asyncio.get_running_loop())
        outputs = await _collect(thread, _requests([1], [2]))
        assert sorted((o.request_id, len(o.outputs[0].token_ids)) for o in outputs) == [
            ("r0", 1), ("r0", 2), ("r0", 3), ("r1", 1), ("r1", 2), ("r1", 3),
        ]  # fmt: skip
        checks = engine.idle_checks
        await asyncio.sleep(0.3)
        assert engine.idle_checks - checks <= 1, "the idle engine thread must sleep, not spin"

    asyncio.run(scenario())
    thread.stop(timeout=5)
    assert not thread.alive


def test_engine_thread_rejects_a_bad_request_atomically() -> None:
    engine = FakeEngine()
    thread = EngineThread(engine, ServerMetrics(num_loops=4))  # type: ignore[arg-type]

    async def scenario() -> None:
        thread.start(asyncio.get_running_loop())
        with pytest.raises(ValueError, match="bad prompt"):
            await thread.add(_requests([1], [-1]), asyncio.Queue())
        assert engine.aborted == ["r0"]  # the first was accepted, then taken back
        assert len(await _collect(thread, _requests([3]))) == 3  # still serving

    asyncio.run(scenario())
    thread.stop(timeout=5)


def test_engine_failure_reaches_clients_and_health() -> None:
    engine = FakeEngine(fail_on_step=True)
    thread = EngineThread(engine, ServerMetrics(num_loops=4))  # type: ignore[arg-type]

    async def scenario() -> None:
        thread.start(asyncio.get_running_loop())
        queue: asyncio.Queue[Any] = asyncio.Queue()
        await thread.add(_requests([1]), queue)
        items = [await asyncio.wait_for(queue.get(), 10), await asyncio.wait_for(queue.get(), 10)]
        assert items[0].outputs[0].finish_reason == "abort"  # aborted: its KV pages are freed
        assert isinstance(items[1], EngineDeadError)
        with pytest.raises(EngineDeadError):
            await thread.add(_requests([2]), asyncio.Queue())

    asyncio.run(scenario())
    assert not thread.alive and isinstance(thread.error, RuntimeError)
    assert engine.aborted == ["r0"]


def test_stop_aborts_running_requests() -> None:
    engine = FakeEngine(length=10**9)
    thread = EngineThread(engine, ServerMetrics(num_loops=4))  # type: ignore[arg-type]

    async def scenario() -> None:
        thread.start(asyncio.get_running_loop())
        queue: asyncio.Queue[Any] = asyncio.Queue()
        await thread.add(_requests([1]), queue)
        await asyncio.to_thread(thread.stop, 5)
        items = []
        while not queue.empty():
            items.append(queue.get_nowait())
        assert any(isinstance(item, RequestOutput) and item.finished for item in items)

    asyncio.run(scenario())
    assert engine.aborted == ["r0"] and not engine.running


def test_choice_state_sends_a_delta_per_token_an_output_adds() -> None:
    state = ChoiceState()
    sent = [state.deltas(_output("r", tokens, text, finished)) for tokens, text, finished in [
        (1, "ab", False), (2, "ab", False), (2, "ab", False), (3, "ab", True)
    ]]  # fmt: skip
    assert [[delta.text for delta in deltas] for deltas in sent] == [["ab"], [""], [], [""]]
    assert [len(deltas) for deltas in sent] == [1, 1, 0, 1]
    assert sent[-1][0].finish_reason == "length"
    assert state.deltas(_output("r", 3, "ab", True)) == []  # nothing after the last delta


def test_several_tokens_of_one_output_are_a_delta_each() -> None:
    """A speculating engine's output may carry several tokens: one event each, the new text
    with the last, the finish reason on the last."""
    state = ChoiceState()
    assert [d.token_ids for d in state.deltas(_output("r", 1, "a", False))] == [[0]]
    deltas = state.deltas(_output("r", 4, "abcd", True))
    assert [d.token_ids for d in deltas] == [[1], [2], [3]]
    assert [d.exit_depths for d in deltas] == [[4], [4], [4]]
    assert [d.text for d in deltas] == ["", "", "bcd"]
    assert [d.finish_reason for d in deltas] == [None, None, "length"]


def test_a_finish_without_a_token_is_one_delta() -> None:
    state = ChoiceState()
    state.deltas(_output("r", 2, "ab", False))
    [delta] = state.deltas(_output("r", 2, "ab", True, reason="abort"))
    assert (delta.token_ids, delta.finish_reason) == ([], "abort")


def test_choice_state_carries_tokens_without_visible_text() -> None:
    state = ChoiceState()
    [first] = state.deltas(_output("r", 1, "", False))  # half a UTF-8 character: no text yet
    assert first.text == "" and first.token_ids == [0]
    [delta] = state.deltas(_output("r", 2, "é", False))
    assert delta.text == "é" and delta.token_ids == [1]


def test_histogram_and_metrics_render_prometheus_text() -> None:
    histogram = Histogram((1.0, 2.0))
    for value in (0.5, 1.5, 1.5, 7.0):
        histogram.observe(value)
    lines = histogram.render("exit_depth")
    assert lines[:2] == metric_header("exit_depth")
    x = "loopserve:exit_depth"
    assert f'{x}_bucket{{le="1"}} 1' in lines and f'{x}_bucket{{le="2"}} 3' in lines
    assert f'{x}_bucket{{le="+Inf"}} 4' in lines and f"{x}_count 4" in lines
    assert f"{x}_sum 10.5" in lines
    metrics = ServerMetrics(num_loops=4)
    metrics.observe([(_output("r", 1, "a"), 1), (_output("r", 3, "abc", finished=True), 2)])
    rendered = metrics.render(FakeEngine().stats())
    assert 'loopserve:requests_finished_total{finish_reason="length"} 1' in rendered
    assert "loopserve:exit_depth_count 3" in rendered
    assert "loopserve:time_to_first_token_seconds_count 1" in rendered
    assert "loopserve:time_per_output_token_seconds_sum 0.25" in rendered
    assert "loopserve:num_preemptions_total 3" in rendered
    assert "loopserve:recomputed_tokens_total 5" in rendered
    assert "loopserve:prefix_cache_hit_rate 0.25" in rendered
    assert "loopserve:prefix_cache_hits_total 16" in rendered
    assert "loopserve:spec_decode_num_draft_tokens_total 7" in rendered
    assert "loopserve:spec_decode_num_accepted_tokens_total 6" in rendered
    assert "loopserve:spec_decode_num_drafts_total 3" in rendered  # 9 tokens, 6 confirmed


def test_chat_templates() -> None:
    template = ChatTemplate(
        "{{ bos_token }}{% for m in messages %}{{ m.content }}{% endfor %}", "<s>", None
    )
    assert template.render([{"role": "user", "content": "hi"}], True) == "<s>hi"
    refusing = ChatTemplate("{{ raise_exception('no system role') }}", None, None)
    with pytest.raises(ChatTemplateError, match="no system role"):
        refusing.render([], True)  # the chat endpoint turns it into a 400 (test_errors.py)
    with pytest.raises(ValueError, match="does not compile"):
        ChatTemplate("{% for %}", None, None)
    assert load_chat_template(None, None) is None


def test_request_validation_names_the_field() -> None:
    with pytest.raises(OpenAIError) as caught:
        parse_request(ChatCompletionRequest, {"messages": [{"role": "user"}], "n": "many"})
    assert caught.value.status == 400 and caught.value.param == "n"
    request = parse_request(
        ChatCompletionRequest,
        {"messages": [{"role": "user", "content": [{"type": "text", "text": "a"}]}], "x": 1},
    )
    assert request.messages[0].text() == "a"  # unknown fields are ignored, as in vLLM
    nulls = {"temperature": None, "n": None, "stop": None, "max_tokens": None, "stream": None}
    request = parse_request(
        ChatCompletionRequest, {"messages": [{"role": "user", "content": "x"}], **nulls}
    )
    assert (request.temperature, request.n, request.stop_strings, request.stream) == (
        None,  # unset: the checkpoint's default, else SamplingParams'
        1,
        (),
        False,
    )


def test_optional_dependencies_load_lazily() -> None:
    code = (
        "import sys, loopserve, loopserve.entrypoints.cli as cli; cli.build_parser(); "
        "heavy = {'fastapi', 'uvicorn', 'jinja2', 'aiohttp', 'starlette'} & set(sys.modules); "
        "assert not heavy, heavy"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


def test_server_thread_owns_the_engine() -> None:
    engine = FakeEngine(length=2)
    thread = EngineThread(engine, ServerMetrics(num_loops=4))  # type: ignore[arg-type]
    seen: list[str] = []
    original = engine.step

    def step() -> list[RequestOutput]:
        seen.append(threading.current_thread().name)
        return original()

    engine.step = step  # type: ignore[method-assign]

    async def scenario() -> None:
        thread.start(asyncio.get_running_loop())
        await _collect(thread, _requests([1]))

    asyncio.run(scenario())
    thread.stop(timeout=5)
    assert seen and set(seen) == {"loopserve-engine"}


def test_the_model_card_says_where_fp8_kv_scales_came_from() -> None:
    from loopserve.config import EngineConfig
    from loopserve.engine.engine import Engine
    from loopserve.entrypoints.openai.context import ModelInfo

    config = EngineConfig.from_options(
        kv_cache_dtype="fp8", calculate_kv_scales=True, dtype="float32", num_kv_pages=16
    )
    info = ModelInfo.of(Engine(config))
    assert (info.kv_cache_dtype, info.kv_cache_scales) == ("float8_e4m3fn", "calculated")


def test_path_rules_hold_below_a_mount_point() -> None:
    """Mounted under a prefix (Ray Serve's route_prefix, a proxy's root path), the key check and
    the concurrency limit pick requests by the path below it, as Starlette routes them."""
    from loopserve.entrypoints.openai.app import GENERATION_PATHS
    from loopserve.entrypoints.openai.auth import ApiKeyMiddleware
    from loopserve.entrypoints.openai.limits import ConcurrencyLimitMiddleware
    from loopserve.entrypoints.openai.paths import route_path

    assert route_path({"path": "/api/v1/models", "root_path": "/api"}) == "/v1/models"
    assert route_path({"path": "/api", "root_path": "/api"}) == "/"
    assert route_path({"path": "/v1/models", "root_path": "/api"}) == "/v1/models"  # stripped
    assert route_path({"path": "/v1/models"}) == "/v1/models"

    reached: list[str] = []

    async def inner(scope: Any, receive: Any, send: Any) -> None:
        reached.append(scope["path"])
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b""})

    def status(app: Any, path: str) -> int:
        sent: list[dict[str, Any]] = []

        async def receive() -> dict[str, Any]:
            return {"type": "http.request", "body": b"", "more_body": False}

        async def send(message: dict[str, Any]) -> None:
            sent.append(message)

        scope = {"type": "http", "method": "POST", "path": path, "root_path": "/api",
                 "headers": [], "query_string": b""}  # fmt: skip
        asyncio.run(app(scope, receive, send))
        return int(sent[0]["status"])

    guarded = ApiKeyMiddleware(inner, api_key="k")
    assert status(guarded, "/api/health") == 200
    assert status(guarded, "/api/v1/models") == 401
    limited = ConcurrencyLimitMiddleware(inner, limit=0, paths=GENERATION_PATHS)
    assert status(limited, "/api/v1/completions") == 429
    assert status(limited, "/api/v1/models") == 200
    assert reached == ["/api/health", "/api/v1/models"]
