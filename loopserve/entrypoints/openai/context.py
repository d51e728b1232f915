"""What every request handler shares: settings, model facts, the engine link and helpers.

Owns: `ModelInfo` (immutable facts read from the engine before its thread starts) and
`ServingContext`, built once per app, plus the served-model check and `off_loop`, which runs a
request's CPU work (parsing, validation, chat templates, tokenizing) on the app's worker threads.
Must not: hold per-request state or the `Engine` itself (handlers reach the engine only through
an `EngineLink`: the engine thread, or the engine process).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from concurrent.futures import Executor
from dataclasses import dataclass
from typing import Any, TypeVar

from loopserve.engine.engine import Engine
from loopserve.entrypoints.openai.body import BodyLimits
from loopserve.entrypoints.openai.chat_template import ChatTemplate
from loopserve.entrypoints.openai.config import ServerConfig
from loopserve.entrypoints.openai.engine_thread import EngineLink
from loopserve.entrypoints.openai.errors import OpenAIError
from loopserve.entrypoints.openai.limits import RequestLimits
from loopserve.entrypoints.openai.logprobs import LogprobFormatter
from loopserve.entrypoints.openai.metrics import ServerMetrics
from loopserve.models.generation_config import SamplingDefaults
from loopserve.tokenizer import Tokenizer

_Result = TypeVar("_Result")


@dataclass(frozen=True, slots=True)
class ModelInfo:
    tokenizer: Tokenizer | None  # None: prompts must be token ids and outputs have no text
    max_model_len: int
    num_loops: int
    dtype: str  # what the engine runs in, stores K/V as, and stores the layers' weights as
    kv_cache_dtype: str
    kv_cache_scales: str | None  # fp8 K/V: where the per-layer scales came from
    quantization: str
    vocab_size: int  # token ids are in [0, vocab_size)
    eos_token_ids: frozenset[int]  # a request that does not ignore EOS stops on these
    max_stop_token_ids: int  # end-of-sequence plus stop token ids one request may have
    root: str  # the checkpoint directory
    sampling_defaults: SamplingDefaults  # for request fields left unset (generation_config.json)

    @classmethod
    def of(cls, engine: Engine) -> ModelInfo:
        """Read from an engine whose thread has not started yet."""
        return cls(
            tokenizer=engine.tokenizer,
            max_model_len=engine.max_model_len,
            num_loops=engine.model_config.num_loops,
            dtype=engine.info.dtype,
            kv_cache_dtype=engine.info.kv_cache_dtype or engine.info.dtype,
            kv_cache_scales=engine.info.kv_cache_scales,
            quantization=engine.info.quantization,
            vocab_size=engine.model_config.vocab_size,
            eos_token_ids=frozenset(engine.eos_token_ids),
            max_stop_token_ids=engine.info.max_stop_token_ids,
            root=str(engine.config.model) if engine.config.model is not None else "built-in",
            sampling_defaults=engine.sampling_defaults,
        )


@dataclass(frozen=True, slots=True)
class ServingContext:
    config: ServerConfig
    model: ModelInfo
    engine: EngineLink
    metrics: ServerMetrics
    chat_template: ChatTemplate | None
    splits_reasoning: bool  # chat replies carry `reasoning_content` apart from `content`
    parses_tool_calls: bool  # chat replies to requests with tools are parsed for calls
    logprobs: LogprobFormatter
    started: int  # Unix time the server started (the models' `created`)
    limits: RequestLimits
    body_limits: BodyLimits
    workers: Executor  # threads for the CPU work of requests, off the event loop

    async def off_loop(self, function: Callable[..., _Result], *args: Any) -> _Result:
        """`function(*args)` on a worker thread, so the event loop keeps serving other clients."""
        return await asyncio.get_running_loop().run_in_executor(self.workers, function, *args)

    def served_name(self, requested: str | None) -> str:
        """The model name to report; a 404 OpenAIError for a model this server does not serve."""
        if requested is None or requested == "":
            return self.config.default_model_name
        if requested not in self.config.served_model_names:
            served = ", ".join(self.config.served_model_names)
            raise OpenAIError(
                404,
                f"The model `{requested}` does not exist. This server serves: {served}.",
                param="model",
                code="model_not_found",
            )
        return requested
