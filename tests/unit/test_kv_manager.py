from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from loopserve.engine.kv_manager import NULL_PAGE, KVCacheManager
from tests.unit.fake_model import FakeLoopedModel, make_engine, params, prompt


def test_reserve_grow_release_free() -> None:
    kv = KVCacheManager(num_pages=20, block_size=4)
    kv.reserve("a", num_planes=2, num_pages=6)
    assert kv.num_available_pages == 19 - 6
    start, pages = kv.grow("a", 0, 9)  # 3 pages
    assert start == 0 and len(pages) == 3 and NULL_PAGE not in pages
    assert kv.grow("a", 0, 12) == (3, [])  # still covered
    assert kv.slot("a", 0, 5) == pages[1] * 4 + 1
    kv.grow("a", 1, 12)
    with pytest.raises(RuntimeError, match="more pages than it reserved"):
        kv.grow("a", 1, 13)
    kv.release_plane("a", 1)
    with pytest.raises(ValueError, match="already freed"):
        kv.grow("a", 1, 4)
    kv.free("a")
    kv.check_invariants()
    assert kv.num_free_pages == 19 and kv.num_available_pages == 19


def test_reservations_cannot_exceed_free_pages() -> None:
    kv = KVCacheManager(num_pages=10, block_size=4)
    kv.reserve("a", 1, 8)
    assert not kv.can_reserve(2)
    with pytest.raises(ValueError, match="only 1 are available"):
        kv.reserve("b", 1, 2)
    kv.free("a")
    assert kv.can_reserve(9)


events = st.lists(
    st.tuples(
        st.sampled_from(["add", "add", "step", "step", "step", "abort"]),
        st.integers(1, 60),  # prompt length
        st.integers(1, 12),  # max tokens
        st.integers(1, 4),  # min loops
    ),
    min_size=1,
    max_size=60,
)


@settings(max_examples=60, deadline=None)
@given(
    events=events,
    layout=st.sampled_from(["full", "shared"]),
    mode=st.sampled_from(["ouro", "ouro_delayed", "trace"]),
    scheduling=st.sampled_from(["refill", "no_refill"]),
    chunk=st.sampled_from([1, 5, 16]),
    hazards=st.dictionaries(st.integers(1, 4), st.sampled_from([0.0, 0.3, 1.0])),
)
def test_invariants_hold_under_random_arrivals_and_aborts(
    events: list[tuple[str, int, int, int]],
    layout: str,
    mode: str,
    scheduling: str,
    chunk: int,
    hazards: dict[int, float],
) -> None:
    engine, _ = make_engine(
        FakeLoopedModel(hazards=hazards),
        num_kv_pages=60,
        kv_layout=layout,
        exit_mode=mode,
        scheduling=scheduling,
        prefill_chunk_size=chunk,
        max_num_seqs=4,
        max_num_batched_tokens=16,
    )
    added: list[str] = []
    for index, (kind, prompt_len, max_tokens, min_loops) in enumerate(events):
        if kind == "add":
            request_params = params(max_tokens, exit_threshold=0.5, min_loops=min_loops)
            try:
                added.append(engine.add_request(prompt(prompt_len), request_params, f"r{index}"))
            except ValueError:
                continue  # can never fit in 60 pages: rejected up front, nothing held
        elif kind == "abort" and added:
            engine.abort(added[prompt_len % len(added)])
        else:
            engine.step()
        engine.kv.check_invariants()
    for _ in range(2000):
        if not engine.has_unfinished_requests():
            break
        engine.step()
        engine.kv.check_invariants()
    else:
        raise AssertionError("work is left but the engine makes no progress (deadlock)")
    assert engine.kv.num_used_pages == 0
    assert engine.kv.num_available_pages == engine.kv.num_usable_pages
