"""What a request leaves unset: generation_config.json's sampling defaults fill it (each field),
and `chat_template_kwargs` reach the chat template; through real HTTP where it matters."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path
from typing import Any

import httpx
import pytest

from loopserve.entrypoints.openai.prompts import ChoiceOptions, Prompt, plan_choices
from loopserve.entrypoints.openai.protocol import CompletionRequest
from loopserve.models.generation_config import SamplingDefaults

from .server_testing import serve_in_thread

DEFAULTS = SamplingDefaults(temperature=0.3, top_p=0.8, top_k=5, min_p=0.02, max_tokens=9)


def _params(body: dict[str, Any], defaults: SamplingDefaults = DEFAULTS) -> Any:
    request = CompletionRequest.model_validate({"prompt": [1, 2, 3], **body})
    options = ChoiceOptions(request.max_tokens, None, "prompt")
    (plan,) = plan_choices("id", [Prompt([1, 2, 3], None)], request, options, 256, defaults)
    return plan.request.params


@pytest.mark.parametrize(
    ("field", "request_value"),
    [("temperature", 0.9), ("top_p", 0.5), ("top_k", 40), ("min_p", 0.1), ("max_tokens", 4)],
)
def test_each_default_fills_only_an_unset_field(field: str, request_value: float) -> None:
    assert getattr(_params({}), field) == getattr(DEFAULTS, field)
    assert getattr(_params({field: request_value}), field) == request_value
    assert getattr(_params({field: None}), field) == getattr(DEFAULTS, field)  # null is unset


def test_without_defaults_the_old_defaults_hold() -> None:
    params = _params({}, SamplingDefaults())
    assert (params.temperature, params.top_p, params.top_k, params.min_p) == (1.0, 1.0, 0, 0.0)
    assert params.max_tokens == 256 - 3  # what is left of the context
    assert _params({}, SamplingDefaults(max_tokens=10**6)).max_tokens == 256 - 3  # capped


def test_the_checkpoints_defaults_apply_over_http(tiny_model: Path, tmp_path: Path) -> None:
    model = shutil.copytree(tiny_model, tmp_path / "model")
    generation = {"eos_token_id": 0, "temperature": 0.0, "max_new_tokens": 3}
    (model / "generation_config.json").write_text(json.dumps(generation))
    body = {"model": "tiny", "prompt": "Hello", "n": 2, "ignore_eos": True}
    with serve_in_thread(model) as server:
        choices = httpx.post(f"{server.url}/v1/completions", json=body, timeout=60).json()
        sampled = body | {"temperature": 1.0, "max_tokens": 5, "seed": 3}
        explicit = httpx.post(f"{server.url}/v1/completions", json=sampled, timeout=60).json()
    texts = [choice["text"] for choice in choices["choices"]]
    assert choices["usage"]["completion_tokens"] == 2 * 3  # max_new_tokens
    assert texts[0] == texts[1]  # temperature 0 from generation_config.json: greedy
    assert explicit["usage"]["completion_tokens"] == 2 * 5


def test_chat_template_kwargs_reach_the_template(tiny_model: Path) -> None:
    template = (
        "{% if persona is defined %}[{{ persona }}]{% endif %}"
        "{% for m in messages %}{{ m.content }}\n{% endfor %}"
    )
    chat = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}
    with serve_in_thread(tiny_model, chat_template=template) as server:

        def prompt_ids(**extra: Any) -> Any:
            body = chat | {"return_token_ids": True} | extra
            response = httpx.post(f"{server.url}/v1/chat/completions", json=body, timeout=60)
            return response.status_code, response.json()

        plain, with_kwargs = prompt_ids(), prompt_ids(chat_template_kwargs={"persona": "pirate"})
        refused = prompt_ids(chat_template_kwargs={"messages": []})
    from loopserve.tokenizer import Tokenizer

    tokenizer = Tokenizer.from_directory(tiny_model)
    assert tokenizer is not None
    assert tokenizer.decode(plain[1]["prompt_token_ids"]) == "hi\n"
    assert tokenizer.decode(with_kwargs[1]["prompt_token_ids"]) == "[pirate]hi\n"
    assert refused[0] == 400
    assert refused[1]["error"]["param"] == "chat_template_kwargs"


def test_the_readmes_chat_request_answers_on_a_default_server() -> None:
    """The built-in model ships a chat template: the README's chat example gets a 200."""
    from fastapi.testclient import TestClient

    from loopserve.config import EngineConfig
    from loopserve.engine.engine import Engine
    from loopserve.entrypoints.openai.app import build_app
    from loopserve.entrypoints.openai.config import ServerConfig

    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    match = re.search(r"/v1/chat/completions .*?\\\n\s+-d '(\{.*?\})'", readme, re.DOTALL)
    assert match is not None, "the README shows a chat request"
    body = json.loads(match.group(1))
    engine = Engine(EngineConfig.from_options(num_kv_pages=256))  # the defaults, a small cache
    with TestClient(build_app(engine, ServerConfig())) as client:
        response = client.post("/v1/chat/completions", json=body)
    assert response.status_code == 200, response.text
    (choice,) = response.json()["choices"]
    assert choice["message"]["role"] == "assistant" and choice["message"]["content"]
