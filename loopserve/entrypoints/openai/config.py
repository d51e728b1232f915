"""`ServerConfig`: how the HTTP server is exposed and limited (frozen intent, as the user gave it).

Owns: the server's own settings and their validation, whose errors name both the field and the
`loopserve serve` flag that sets it (`shutdown_timeout_s (--shutdown-timeout)`). Must not: hold
engine settings (those are `EngineConfig`) or anything resolved at run time.
"""

from __future__ import annotations

from dataclasses import dataclass

from loopserve.entrypoints.reasoning import PARSERS
from loopserve.entrypoints.tool_calls import PARSERS as TOOL_CALL_PARSERS
from loopserve.sampling_params import MAX_LOGPROBS


@dataclass(frozen=True, slots=True)
class ServerConfig:
    # Address to bind; loopback unless the user asks for more.
    host: str = "127.0.0.1"
    port: int = 8000
    # Names clients may put in `model`; the first is reported when a request gives none.
    served_model_names: tuple[str, ...] = ("ouro-tiny",)
    # When set, every endpoint but /health needs `Authorization: Bearer <api_key>`.
    api_key: str | None = None
    # Completion requests in flight at once (streams count until they end); more get 429.
    max_concurrent_requests: int = 256
    # Largest request body accepted; larger bodies get 413.
    max_request_bytes: int = 8 * 2**20
    # JSON bodies: nesting depth, characters of one number, and objects (`{...}`) in all (the
    # objects bound the work of validating a body).
    max_json_depth: int = 32
    max_json_number_digits: int = 64
    max_json_objects: int = 10_000
    # Choices one request may ask for (`n` times the number of prompts).
    max_choices_per_request: int = 128
    # Stop strings of one request: how many, and their UTF-8 bytes in all (every generated token
    # of every choice is checked against them).
    max_stop_strings: int = 32
    max_stop_bytes: int = 4096
    # Log-probability alternatives per token (`logprobs`, `top_logprobs`).
    max_logprobs: int = MAX_LOGPROBS
    # UTF-8 bytes of one text prompt (chat: of the messages' text, and of the rendered prompt),
    # checked before tokenizing. None: the longest text that can fit the context (the context
    # length times the longest token's bytes), so no prompt that fits is refused.
    max_prompt_bytes: int | None = None
    # On SIGTERM: seconds to let in-flight requests finish before aborting them.
    shutdown_timeout_s: int = 30
    # Jinja chat template overriding the checkpoint's (the template text itself).
    chat_template: str | None = None
    # How chat replies split reasoning from the answer (`entrypoints.reasoning.PARSERS`; `auto`:
    # `deepseek_r1` when the chat template writes `<think>`).
    reasoning_parser: str = "auto"
    # How chat replies' tool calls are found (`entrypoints.tool_calls.PARSERS`; `auto`: `hermes`
    # when the chat template writes `<tool_call>`).
    tool_call_parser: str = "auto"
    # uvicorn's log level.
    log_level: str = "info"
    # Run the engine in a process of its own (`engine_process`), apart from the HTTP event loop:
    # the two no longer share an interpreter lock (on an H100 at C=128: served throughput 0.959
    # of offline, against 0.891 with the engine in a thread of the server; docs/server.md).
    # False: an engine thread in the server's process. The single-process server's only: a Ray
    # replica keeps its engine in its actor process whatever this says.
    engine_process: bool = True

    def __post_init__(self) -> None:
        if not self.served_model_names or any(not name for name in self.served_model_names):
            raise _invalid("served_model_names", "must be non-empty names", self.served_model_names)
        if not 0 <= self.port < 65536:
            raise _invalid("port", "must be in [0, 65535] (0: any free port)", self.port)
        if self.api_key is not None and not self.api_key:
            raise ValueError(
                f"{option_name('api_key')} must not be empty (leave it unset for no authentication)"
            )
        if self.max_request_bytes < 1024:
            raise _invalid("max_request_bytes", "must be at least 1024", self.max_request_bytes)
        for name in _AT_LEAST_ONE:
            if getattr(self, name) < 1:
                raise _invalid(name, "must be at least 1", getattr(self, name))
        if not 0 <= self.max_logprobs <= MAX_LOGPROBS:
            raise _invalid("max_logprobs", f"must be in [0, {MAX_LOGPROBS}]", self.max_logprobs)
        if self.max_prompt_bytes is not None and self.max_prompt_bytes < 1:
            raise _invalid("max_prompt_bytes", "must be at least 1", self.max_prompt_bytes)
        if self.reasoning_parser not in PARSERS:
            raise _invalid("reasoning_parser", f"must be one of {PARSERS}", self.reasoning_parser)
        if self.tool_call_parser not in TOOL_CALL_PARSERS:
            raise _invalid(
                "tool_call_parser", f"must be one of {TOOL_CALL_PARSERS}", self.tool_call_parser
            )
        if self.shutdown_timeout_s < 0:
            raise _invalid("shutdown_timeout_s", "must be >= 0 (seconds)", self.shutdown_timeout_s)

    @property
    def default_model_name(self) -> str:
        return self.served_model_names[0]


# Settings that must be at least 1.
_AT_LEAST_ONE = (
    "max_concurrent_requests",
    "max_json_depth",
    "max_json_number_digits",
    "max_json_objects",
    "max_choices_per_request",
    "max_stop_strings",
    "max_stop_bytes",
)

# The `loopserve serve` flags whose names are not the field's (`--max-json-depth` sets
# max_json_depth; these differ).
_FLAGS = {
    "served_model_names": "--served-model-name",
    "shutdown_timeout_s": "--shutdown-timeout",
    "log_level": "--uvicorn-log-level",
}


def option_name(name: str) -> str:
    """How errors name a setting: the field and its flag (`port (--port)`)."""
    return f"{name} ({_FLAGS.get(name, '--' + name.replace('_', '-'))})"


def _invalid(name: str, problem: str, value: object) -> ValueError:
    return ValueError(f"{option_name(name)} {problem}, got {value!r}")
