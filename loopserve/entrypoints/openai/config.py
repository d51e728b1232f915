"""`ServerConfig`: how the HTTP server is exposed and limited (frozen intent, as the user gave it).

Owns: the server's own settings and their validation. Must not: hold engine settings (those are
`EngineConfig`) or anything resolved at run time.
"""

from __future__ import annotations

from dataclasses import dataclass


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
    # Choices one request may ask for (`n` times the number of prompts).
    max_choices_per_request: int = 128
    # On SIGTERM: seconds to let in-flight requests finish before aborting them.
    shutdown_timeout_s: int = 30
    # Jinja chat template overriding the checkpoint's (the template text itself).
    chat_template: str | None = None
    # uvicorn's log level.
    log_level: str = "info"

    def __post_init__(self) -> None:
        if not self.served_model_names or any(not name for name in self.served_model_names):
            raise ValueError("served_model_names must be non-empty names")
        if not 0 <= self.port < 65536:
            raise ValueError(f"port must be in [0, 65535], got {self.port}")
        if self.api_key is not None and not self.api_key:
            raise ValueError("api_key must not be empty (leave it unset for no authentication)")
        if self.max_concurrent_requests < 1:
            raise ValueError("max_concurrent_requests must be at least 1")
        if self.max_request_bytes < 1024:
            raise ValueError("max_request_bytes must be at least 1024")
        if self.max_choices_per_request < 1:
            raise ValueError("max_choices_per_request must be at least 1")
        if self.shutdown_timeout_s < 0:
            raise ValueError("shutdown_timeout_s must be >= 0")

    @property
    def default_model_name(self) -> str:
        return self.served_model_names[0]
