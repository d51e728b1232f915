"""Self-speculative decoding's settings, as vLLM's `speculative_config` (docs/speculation.md).

Owns: `SpeculativeConfig`, its validation (errors name the key) and its parsing from a dict or
JSON text (the `--speculative-config` flag), and the models it refuses. Must not: import torch.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, fields
from typing import Any

SPECULATIVE_METHODS = ("draft_loops",)
MAX_SPECULATIVE_TOKENS = 16
# How errors name the setting: the field and its flag, as `config.option_name` does.
SETTING = "speculative_config (--speculative-config)"


@dataclass(frozen=True, slots=True)
class SpeculativeConfig:
    """Self-speculative decoding (docs/speculation.md), configured as vLLM's
    `speculative_config`: a token that has run `draft_loops` loops without exiting proposes the
    next token from that depth, which starts running at once; it is kept when the token's own
    exit decision samples the same token. At most `num_speculative_tokens` proposed tokens of a
    request run ahead of its last final one."""

    method: str = "draft_loops"
    num_speculative_tokens: int = 4
    draft_loops: int = 2
    # Benchmarks only: keep each proposal with this probability (seeded per request and token)
    # whatever the tokens, the proposal then standing for the token; outputs are not the
    # model's. Random weights almost never propose the right token, so this is how a benchmark
    # on them measures the mechanism at a given acceptance (recorded as such).
    forced_acceptance: float | None = None
    # vLLM's name: speculation is off in steps where more requests than this decode (their
    # tokens then run as without speculation; None: never off). Measured on the H200 with
    # Ouro-1.4B at 85 % acceptance (docs/speculation.md): it pays up to 16 requests at fixed
    # depth and with exits (1.64x at 1, 1.19x at 8, 1.11x at 16), and at 32 no longer with exits.
    disable_by_batch_size: int | None = 16

    def __post_init__(self) -> None:
        if self.method not in SPECULATIVE_METHODS:
            raise ValueError(
                f"{SETTING} method must be one of {SPECULATIVE_METHODS} (the model's "
                f"own first loops draft), got {self.method!r}"
            )
        for name, low, high in (
            ("num_speculative_tokens", 1, MAX_SPECULATIVE_TOKENS),
            ("draft_loops", 1, None),
        ):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < low:
                raise ValueError(f"{SETTING} {name} must be an integer >= {low}, got {value!r}")
            if high is not None and value > high:
                raise ValueError(f"{SETTING} {name} must be at most {high}, got {value}")
        limit = self.disable_by_batch_size
        if limit is not None and (
            not isinstance(limit, int) or isinstance(limit, bool) or limit < 1
        ):
            raise ValueError(
                f"{SETTING} disable_by_batch_size must be an integer >= 1 (or null: "
                f"never off), got {limit!r}"
            )
        forced = self.forced_acceptance
        if forced is not None and not (isinstance(forced, (int, float)) and 0.0 <= forced <= 1.0):
            raise ValueError(
                f"{SETTING} forced_acceptance must be a probability in [0, 1] (or "
                f"null), got {forced!r}"
            )

    def speculates_with(self, decoding: int, speculating: bool) -> bool:
        """Whether a step with `decoding` requests decoding speculates, given whether the last
        step did. Off above `disable_by_batch_size`; once off, on again only at a quarter of it
        fewer (rounded down: no margin below 4), since every switch starts each decoding token
        again at loop 1 and a batch that hovers at the limit would switch at every arrival and
        finish (72 switches for 60 requests at 9 in flight over a limit of 8, the built-in model
        on the CPU; docs/speculation.md)."""
        limit = self.disable_by_batch_size
        if limit is None:
            return True
        return decoding <= (limit if speculating else limit - limit // 4)

    def check_model(self, num_loops: int, family: str, num_stage_layers: int) -> None:
        """Refuse a model it cannot serve exactly."""
        if num_stage_layers:
            raise ValueError(
                f"{SETTING} cannot serve {family} models: their prelude and coda "
                "layers keep one version of each token's K/V, written when it exits, and a "
                "proposed token may exit before the token it follows"
            )
        if self.draft_loops >= num_loops:
            raise ValueError(
                f"{SETTING} draft_loops {self.draft_loops} must be below the model's "
                f"loop count ({num_loops}): a proposal is the output after draft_loops loops, "
                "checked by the loops after it"
            )

    def lanes(self, num_loops: int) -> int:
        """Decode rows one request holds on a model of `num_loops` loops: one per token it can
        have in flight, its oldest unfinished one's and one per proposal (at most K).

        More than `num_loops - draft_loops + 1` are never in flight, whatever the exit rules, so
        more rows would only be computed idle (docs/speculation.md, "Lanes"): a request's oldest
        unfinished token has a successor only once it has run `draft_loops` loops, each step
        adds at most one token behind it, and it finishes by loop `num_loops`. So after it has
        run r loops at most r - draft_loops + 2 tokens are in flight, and r < num_loops while
        it is unfinished."""
        return min(self.num_speculative_tokens + 1, num_loops - self.draft_loops + 1)

    @classmethod
    def parse(cls, value: Any) -> SpeculativeConfig | None:
        """A config from a dict, its JSON text (`--speculative-config '{...}'`), or itself."""
        if value is None or isinstance(value, cls):
            return value
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as error:
                raise ValueError(
                    f"{SETTING} must be a JSON object, such as "
                    '{"method": "draft_loops", "num_speculative_tokens": 4, "draft_loops": 2}: '
                    f"{error}"
                ) from None
        if not isinstance(value, dict):
            raise ValueError(f"{SETTING} must be a dict, got {type(value).__name__}")
        known = {item.name for item in fields(cls)}
        unknown = sorted(set(value) - known)
        if unknown:
            raise ValueError(f"{SETTING} has unknown key(s) {unknown}; known: {sorted(known)}")
        return cls(**value)
