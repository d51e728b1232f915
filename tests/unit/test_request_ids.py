"""Request ids are unique whatever the caller passes: an id the engine generates skips every id in
use, including ids a caller chose that look like generated ones."""

from __future__ import annotations

import pytest

from tests.unit.fake_model import make_engine, params, prompt


def test_generated_ids_never_collide_with_ids_a_caller_chose() -> None:
    engine, _ = make_engine()
    chosen = [engine.add_request(prompt(), params(), request_id=f"req-{i}") for i in (0, 1, 3)]
    generated = [engine.add_request(prompt(), params()) for _ in range(3)]
    assert chosen == ["req-0", "req-1", "req-3"]
    assert len(set(chosen + generated)) == 6
    assert not set(generated) & set(chosen)


def test_an_id_in_use_is_refused() -> None:
    engine, _ = make_engine()
    generated = engine.add_request(prompt(), params())
    with pytest.raises(ValueError, match="already in use"):
        engine.add_request(prompt(), params(), request_id=generated)
