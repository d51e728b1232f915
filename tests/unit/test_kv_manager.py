from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from loopserve.engine.kv_manager import KVCacheManager
from loopserve.engine.prefix_cache import block_hashes
from loopserve.kv.pages import NULL_PAGE
from tests.unit.fake_model import FakeLoopedModel, make_engine, params, prompt


def test_reserve_grow_release_free() -> None:
    kv = KVCacheManager(num_pages=20, block_size=4, prefix_caching=False)
    kv.admit("a", num_planes=2, reserve=6)
    assert kv.num_available_pages == 19 - 6
    start, pages = kv.grow("a", 0, 9)  # 3 pages, drawn from the reservation
    assert start == 0 and len(pages) == 3 and NULL_PAGE not in pages
    assert kv.grow("a", 0, 12) == (3, [])  # still covered
    assert kv.num_available_pages == 19 - 6
    kv.grow("a", 1, 16)  # 3 more from the reservation, 1 from the pool
    assert kv.num_available_pages == 19 - 7
    kv.release_plane("a", 1)
    with pytest.raises(ValueError, match="already freed"):
        kv.grow("a", 1, 4)
    kv.free("a")
    kv.check_invariants()
    assert kv.num_free_pages == 19 and kv.num_available_pages == 19


def test_pages_to_grow_over_planes_sums_each_plane() -> None:
    kv = KVCacheManager(num_pages=30, block_size=4)
    kv.admit("a", num_planes=3)
    kv.grow("a", 0, 9)  # 3 pages
    kv.grow("a", 2, 4)  # 1 page; plane 1 has none
    for tokens in (0, 4, 9, 12, 13, 20):
        alone = [kv.pages_to_grow("a", plane, tokens) for plane in range(3)]
        assert kv.pages_to_grow_planes("a", range(3), tokens) == sum(alone)
        assert kv.pages_to_grow_planes("a", (0, 2), tokens) == alone[0] + alone[2]
    assert kv.pages_to_grow_planes("a", range(3), 9) == 0 + 3 + 2


def test_growth_beyond_the_pool_is_refused() -> None:
    kv = KVCacheManager(num_pages=10, block_size=4)
    kv.admit("a", 1, reserve=8)
    with pytest.raises(ValueError, match="only 1 are available"):
        kv.admit("b", 1, reserve=2)
    kv.admit("b", 1)
    kv.grow("b", 0, 4)
    with pytest.raises(RuntimeError, match="must make room first"):
        kv.grow("b", 0, 8)
    kv.free("a")
    kv.free("b")
    kv.check_invariants()


def cached_request(kv: KVCacheManager, request_id: str, hashes: list[bytes]) -> None:
    """Admit a request of two planes whose prompt is `hashes`' blocks, all in the cache."""
    kv.admit(request_id, num_planes=2)
    for plane in range(2):
        kv.grow(request_id, plane, len(hashes) * kv.block_size)
        for block, block_hash in enumerate(hashes):
            kv.register(request_id, plane, block, block_hash)


def test_page_counts_say_what_freeing_would_give_back() -> None:
    kv = KVCacheManager(num_pages=20, block_size=4)
    hashes = block_hashes(list(range(12)), 4)  # three full blocks
    cached_request(kv, "a", hashes)
    kv.admit("b", num_planes=2)
    kv.share_prefix("b", kv.cached_prefix(hashes[:2], num_planes=2))
    # a gives back its third blocks; b nothing (every page shared) until it has its own.
    assert kv.page_counts("a") == (6, 2) and kv.page_counts("b") == (4, 0)
    kv.grow("b", 0, 12)
    assert kv.page_counts("b") == (5, 1)
    kv.free("a")
    assert kv.page_counts("b") == (5, 5)  # nobody else references its pages now


def test_prefix_pages_are_shared_counted_and_reused_last() -> None:
    kv = KVCacheManager(num_pages=12, block_size=4)
    hashes = block_hashes(list(range(12)), 4)  # three full blocks
    cached_request(kv, "a", hashes)
    hit = kv.cached_prefix(hashes[:2], num_planes=2)
    assert hit == [
        [kv.tables("a")[0][0], kv.tables("a")[1][0]],
        [kv.tables("a")[0][1], kv.tables("a")[1][1]],
    ]
    kv.admit("b", num_planes=2)
    kv.share_prefix("b", hit)
    assert kv.num_used_pages == 6  # b's tables point at a's pages
    kv.check_invariants()
    kv.free("a")
    assert kv.num_used_pages == 4 and kv.num_cached_pages == 2  # a's third blocks stay cached
    kv.free("b")
    assert kv.num_used_pages == 0 and kv.num_cached_pages == 6
    assert kv.cached_prefix(hashes, num_planes=2) != []
    # Cached pages are handed out only when the free list is empty, oldest first.
    kv.admit("c", num_planes=1)
    kv.grow("c", 0, 4 * 5)
    assert kv.num_cached_pages == 6
    kv.grow("c", 0, 4 * 6)
    assert kv.num_cached_pages == 5
    kv.check_invariants()
    assert block_hashes([1, 2, 3, 4, 9], 4) == block_hashes([1, 2, 3, 4, 7], 4)  # full blocks
    assert block_hashes([0, 2, 3, 4], 4) != block_hashes([1, 2, 3, 4], 4)


def test_reset_prefix_cache_frees_idle_blocks_and_keeps_tables() -> None:
    kv = KVCacheManager(num_pages=12, block_size=4)
    hashes = block_hashes(list(range(8)), 4)
    for request in ("a", "b"):
        kv.admit(request, num_planes=1)
        kv.grow(request, 0, 8)
        for block, block_hash in enumerate(hashes):
            kv.register(request, 0, block, block_hash)
    kv.free("a")  # b's blocks were registered second: a's pages hold the cached blocks
    assert kv.num_cached_pages == 2 and kv.cached_prefix(hashes, num_planes=1) != []
    kv.reset_prefix_cache()
    kv.check_invariants()
    assert kv.num_cached_pages == 0 and kv.cached_prefix(hashes, num_planes=1) == []
    assert kv.num_free_pages == 11 - 2 and kv.num_used_pages == 2  # b still holds its pages
    kv.free("b")
    kv.check_invariants()
    assert kv.num_free_pages == 11


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
