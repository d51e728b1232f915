"""Engine replicas that speculate, through real HTTP: `speculative_config` given as the
`--speculative-config` flag gives it (JSON text) reaches every replica's engine; streamed and
whole answers, completions and chat, equal one engine's without speculation (text, token ids,
exit depths, greedy, at fixed depth and with exits); a stream carries one event per token; and
the ingress's /metrics counts each replica's proposed and confirmed tokens."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from typing import Any

import pytest

from loopserve.models.builtin import BUILTIN_MODEL_DIR

from ..server.server_testing import RunningServer, serve_in_thread
from .conftest import API_KEY, ENGINE_OPTIONS, NUM_REPLICAS, running_fleet
from .fleet_client import generate_all, replica_samples, request_body, wait_for

pytestmark = pytest.mark.slow

SPECULATIVE_CONFIG = json.dumps({"num_speculative_tokens": 2, "draft_loops": 2})
# float32: speculating lanes are extra rows in a step's batch, and where a CPU computes the
# built-in model's bfloat16 weights natively a batch's size may change a row's bits; in float32
# speculation gives exactly the outputs of decoding without it (docs/speculation.md).
PLAIN_OPTIONS = ENGINE_OPTIONS | {"dtype": "float32"}
NUM_PROMPTS = 6
MAX_TOKENS = 24


@pytest.fixture(scope="module")
def speculating(serve_port: int) -> Iterator[RunningServer]:
    options = PLAIN_OPTIONS | {"speculative_config": SPECULATIVE_CONFIG}
    with running_fleet(serve_port, options) as running:
        yield running


@pytest.fixture(scope="module")
def plain() -> Iterator[RunningServer]:
    """One engine without speculation in this process, with the replicas' other settings."""
    with serve_in_thread(BUILTIN_MODEL_DIR, engine=PLAIN_OPTIONS, api_key=API_KEY) as running:
        yield running


def _body(index: int, stream: bool) -> dict[str, Any]:
    """Prompt `index` (chat for odd ones; the gate's exits at 0.5 for every third, else fixed
    depth), streamed or not."""
    exits: dict[str, Any] = {"exit_threshold": 0.5} if index % 3 == 0 else {}
    body = request_body(index, stream=stream, chat=index % 2 == 1)
    return body | exits | {"max_tokens": MAX_TOKENS, "return_token_ids": True}


def test_speculating_replicas_answer_as_one_plain_engine(
    speculating: RunningServer, plain: RunningServer
) -> None:
    bodies = [_body(index, stream) for index in range(NUM_PROMPTS) for stream in (True, False)]
    served = asyncio.run(generate_all(speculating, bodies))
    expected = asyncio.run(generate_all(plain, [body | {"stream": False} for body in bodies]))
    for body, got, want in zip(bodies, served, expected, strict=True):
        assert got["status"] == 200 and got["error"] is None, (body, got)
        assert want["finish_reason"] == "length" and len(want["token_ids"]) == MAX_TOKENS, want
        for field in ("text", "token_ids", "exit_depths", "finish_reason"):
            assert got[field] == want[field], (field, body, got, want)
        if body["stream"]:  # a chat stream opens with the role's event, which has no token
            assert got["event_tokens"] == [0] * ("messages" in body) + [1] * MAX_TOKENS, got
    assert {result["replica"] for result in served} == {str(index) for index in range(NUM_REPLICAS)}

    generated = sum(len(result["token_ids"]) for result in served)
    wait_for(
        lambda: speculating.metrics()["loopserve:generation_tokens_total"] >= generated,
        10,
        "the replicas' reports",
    )
    drafted = replica_samples(speculating, "loopserve:spec_decode_num_draft_tokens_total")
    accepted = replica_samples(speculating, "loopserve:spec_decode_num_accepted_tokens_total")
    assert drafted.keys() == accepted.keys() == {str(index) for index in range(NUM_REPLICAS)}
    for replica, count in drafted.items():  # every replica's engine speculated
        assert 0 < accepted[replica] <= count, (drafted, accepted)
    fleet = speculating.metrics()
    assert fleet["loopserve:spec_decode_num_draft_tokens_total"] == sum(drafted.values())
    assert fleet["loopserve:spec_decode_num_accepted_tokens_total"] == sum(accepted.values())
    assert sum(accepted.values()) < sum(drafted.values())
    chains = replica_samples(speculating, "loopserve:spec_decode_num_drafts_total")
    assert all(count > 0 for count in chains.values()), chains
    assert fleet["loopserve:spec_decode_num_drafts_total"] == sum(chains.values())
