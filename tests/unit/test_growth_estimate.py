"""Incremental admission's growth estimate (`engine.page_budget`, `kv_growth_estimate`): the share
of max_tokens finished requests used, the expected peak it gives, and what admission does with
it, on the real scheduler with the fake model."""

from __future__ import annotations

import random
from types import SimpleNamespace

import pytest

from loopserve.config import KVLayout, SchedulerConfig
from loopserve.engine.engine import Engine
from loopserve.engine.kv_manager import KVCacheManager
from loopserve.engine.page_budget import CLIP_TOKENS, PageBudget, UsedShare
from loopserve.kv.pages import pages_for
from tests.unit.fake_model import FakeLoopedModel, make_engine, params, prompt, run_to_completion


def holder(prompt_tokens: int, max_tokens: int, outputs: int = 0) -> SimpleNamespace:
    """What `PageBudget` reads of a request: prefilling until it has an output."""
    resolved = SimpleNamespace(max_loops=4, params=SimpleNamespace(max_tokens=max_tokens))
    return SimpleNamespace(
        num_prompt_tokens=prompt_tokens, num_output_tokens=outputs, params=resolved,
        is_prefilling=outputs == 0,
    )  # fmt: skip


def peak(pages: PageBudget, holders: list[tuple[SimpleNamespace, int]], shared: int = 0) -> int:
    """`expected_peak` of requests holding these pages (the first `shared` of each are another
    request's too)."""
    ends = [pages.expected_end(r, held, max(0, held - shared)) for r, held in holders]  # type: ignore[arg-type]
    return pages.expected_peak(ends)


def budget(layout: str = "full", share: float = 1.0) -> PageBudget:
    config = SchedulerConfig(block_size=16, kv_layout=KVLayout(layout))
    pages = PageBudget(config, KVCacheManager(200, 16), lanes=1)
    pages.used_share.value = share
    return pages


def test_the_expected_peak_by_hand() -> None:
    # Each holds its 16-token prompt in 4 planes (4 pages). At share 1, B ends after 9 tokens, A
    # after 33. Just before B's end both grew: 2 x (a partly filled page per plane, 4, and 9/16
    # of a page per plane, 2.25) = 12.5. Just before A's end B has freed its 4: 4 + 33/4 - 4.
    a, b = holder(16, 33), holder(16, 9)
    assert peak(budget(), [(a, 4), (b, 4)]) == 13
    # At share 0.5 they are expected to end after 17 and 5 tokens: 8 + 0.5 x 5 = 10.5.
    assert peak(budget(share=0.5), [(a, 4), (b, 4)]) == 11
    # A prompt not yet held is taken at once: 4 more pages than above.
    assert peak(budget(), [(a, 0), (b, 4)]) == 17


def test_what_an_end_frees_is_what_the_request_alone_holds() -> None:
    # B (a 32-token prompt, 8 pages) ends after its one token; A grows 200 tokens, 50 pages. The
    # peak comes just before A's end, less what B gave back: 4 + 50 - 8. Were B's 8 pages
    # shared with a request still running, B's end would free none: 54.
    a, b = holder(16, 200), holder(32, 1)
    assert peak(budget(), [(a, 4), (b, 8)]) == 46
    assert peak(budget(), [(a, 4), (b, 8)], shared=8) == 54


def test_pages_shared_through_the_prefix_cache_are_not_counted_as_freed() -> None:
    """B runs long; A and A2 share its 96-token prefix and stop after 3 tokens; C comes last.
    Counting A's and A2's shared pages as freed at their ends admitted C into a preemption."""
    engine, _ = make_engine(num_kv_pages=1 + 62, exit_mode="trace", kv_watermark=0.0)
    engine.scheduler.pages.used_share.value = 1.0  # requests run to max_tokens
    prefix = list(range(100, 196))
    engine.add_request([*prefix, 400], params(80, trace_depths=(1,) * 79), request_id="B")
    engine.add_request([*prefix, 401], params(3, trace_depths=(1,) * 2), request_id="A")
    engine.add_request([*prefix, 402], params(3, trace_depths=(1,) * 2), request_id="A2")
    engine.add_request([1, 2, 3], params(80, trace_depths=(1,) * 79), request_id="C")
    run_to_completion(engine)
    assert engine.stats().prefix_hit_tokens > 0
    assert engine.stats().num_preemptions == 0


def test_a_request_is_expected_to_take_at_most_the_clip() -> None:
    """A request that leaves max_tokens at the rest of a long context counts as CLIP_TOKENS."""
    pages = budget(share=0.5)
    long, clipped = holder(16, 100_000, outputs=10), holder(16, CLIP_TOKENS + 10, outputs=10)
    assert peak(pages, [(long, 4)]) == peak(pages, [(clipped, 4)])
    share = UsedShare()
    share.observe(SimpleNamespace(num_output_tokens=CLIP_TOKENS // 2, params=long.params))
    assert share.value == pytest.approx(UsedShare.PRIOR + UsedShare.WEIGHT * (0.5 - 0.7))


@pytest.mark.parametrize("layout", ["full", "shared"])
@pytest.mark.parametrize("seed", range(40))
def test_at_share_one_the_estimate_bounds_the_true_peak(layout: str, seed: int) -> None:
    """Requests that run to max_tokens never take more than the estimate at share 1 (so none
    admitted under it is preempted): the pages each holds at every step, summed, against it."""
    rng = random.Random(seed)
    pages = budget(layout)
    planes = len(pages.layout.generated_planes(4))

    def footprint(request: SimpleNamespace, step: int) -> int:
        """Pages the request holds `step` tokens on: every plane while it prefills; once it
        decodes, the shared layout has freed the planes that hold the prompt alone."""
        positions = request.num_prompt_tokens + request.num_output_tokens + step
        at = min(positions, pages.num_positions(request))
        every = pages.layout.pages_needed(4, request.num_prompt_tokens, at, 16)
        freed = (
            0 if request.is_prefilling else (4 - planes) * pages_for(request.num_prompt_tokens, 16)
        )
        return every - freed

    holders = []
    for _ in range(rng.randint(1, 8)):
        request = holder(rng.randint(1, 80), rng.randint(1, 60), outputs=rng.choice([0, 1, 9]))
        request.num_output_tokens = min(
            request.num_output_tokens, request.params.params.max_tokens - 1
        )
        request.is_prefilling = request.num_output_tokens == 0
        now = footprint(request, 0)
        holders.append((request, rng.randint(0, now) if request.is_prefilling else now))

    def taken(request: SimpleNamespace, held: int, step: int) -> int:
        """Pages beyond `held` the request holds `step` tokens on (all freed after its end)."""
        left = request.params.params.max_tokens - request.num_output_tokens
        return -held if step > left else footprint(request, step) - held

    true_peak = max(sum(taken(r, held, step) for r, held in holders) for step in range(62))
    assert peak(pages, holders) >= true_peak


def test_a_decoding_request_in_the_shared_layout_is_not_charged_its_freed_prompt() -> None:
    # 64 prompt tokens, decoding: 4 pages in the one plane it keeps. At share 1, 16 tokens
    # more: a page and a partly filled one, not the 3 x 4 prompt pages it freed.
    decoding = holder(64, 16, outputs=1)
    assert peak(budget("shared"), [(decoding, 5)]) == 2


def test_the_used_share_follows_finished_requests_and_not_aborted_ones() -> None:
    # The fake model's tokens count up from the prompt's last: from 5, EOS (10) is the 5th.
    engine, _ = make_engine(FakeLoopedModel(eos_token_ids=(10,)), exit_mode="trace")
    share = engine.scheduler.pages.used_share
    assert share.value == UsedShare.PRIOR
    engine.add_request(prompt(5), params(20), request_id="stops")
    run_to_completion(engine)
    expected = UsedShare.PRIOR + UsedShare.WEIGHT * (5 / 20 - UsedShare.PRIOR)
    assert share.value == pytest.approx(expected)
    engine.add_request(prompt(5), params(20), request_id="aborted")
    engine.step()
    engine.abort("aborted")
    assert share.value == pytest.approx(expected)


def test_a_stop_found_after_the_request_finished_amends_its_share() -> None:
    request = holder(16, 20, outputs=10)
    amended, direct = UsedShare(), UsedShare()
    amended.observe(request)  # type: ignore[arg-type]
    request.num_output_tokens = 5  # a stop string in its 5th output
    amended.amend(request, 10)  # type: ignore[arg-type]
    direct.observe(request)  # type: ignore[arg-type]
    assert amended.value == pytest.approx(direct.value)


def preempting_run(estimate: str) -> tuple[Engine, dict[str, list[int]]]:
    """Eight requests that run to max_tokens on a cache that holds three at their full length."""
    engine, _ = make_engine(
        num_kv_pages=1 + 4 * 4 * 3, exit_mode="trace", kv_growth_estimate=estimate
    )
    for index in range(8):
        engine.add_request(prompt(30), params(30, trace_depths=(1,) * 29), request_id=str(index))
    done = run_to_completion(engine)
    return engine, {name: output.outputs[0].token_ids for name, output in done.items()}


def test_the_learned_estimate_preempts_less_and_changes_no_token() -> None:
    plain, plain_tokens = preempting_run("none")
    learned, learned_tokens = preempting_run("learned")
    assert plain.stats().num_preemptions > 0
    assert learned.stats().num_preemptions < plain.stats().num_preemptions
    assert learned_tokens == plain_tokens
    assert learned.scheduler.pages.used_share.value > UsedShare.PRIOR  # they ran to max_tokens


def peak_running(allocation: str) -> int:
    """Requests that stop at EOS after a quarter of max_tokens: the most that ran at once."""
    engine, _ = make_engine(
        FakeLoopedModel(eos_token_ids=(40,)), num_kv_pages=1 + 4 * 8 * 4,
        exit_mode="trace", kv_allocation=allocation, max_num_seqs=16,
    )  # fmt: skip
    for index in range(32):
        engine.add_request(prompt(30), params(40), request_id=str(index))
    most = 0
    while engine.has_unfinished_requests():
        engine.step()
        most = max(most, engine.stats().num_running)
    return most


def test_requests_that_stop_early_run_more_at_once_than_reserved_pages_allow() -> None:
    assert peak_running("incremental") > peak_running("reserve")
