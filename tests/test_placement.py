"""Placement policies on hand-built worker views: exact choices, reservations, no over-commit."""

from __future__ import annotations

import dataclasses

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from router.placement import (
    POLICIES,
    CacheHits,
    KVPolicy,
    PrefixPolicy,
    PrefixWeights,
    ViewColumns,
    WorkerView,
    make_policy,
)
from workers.engine.stats import EngineStats
from workers.messages import WorkerInfo
from workers.model.tokenizer import TokenizerSpec


def _view(worker_id: str, num_blocks: int, committed: int = 0) -> WorkerView:
    info = WorkerInfo(worker_id, "node", "tiny", "cpu", "float32", 258, 2048, 16, 1024, num_blocks, TokenizerSpec(None, None, ()))
    view = WorkerView(info)
    view.apply_report(_report(worker_id, num_blocks, committed), (), 0.0)
    return view


def _report(worker_id: str, num_blocks: int, committed: int) -> EngineStats:
    return EngineStats.of_pool(num_blocks, committed, 1024)


def test_kv_picks_the_most_headroom_and_counts_its_own_reservations() -> None:
    small, large = _view("small", 100), _view("large", 200)
    policy = KVPolicy(max_outstanding=100)
    picks = []
    for i in range(8):
        chosen = policy.choose([small, large], 30)
        assert chosen is not None
        chosen.place(f"r{i}", 30)
        picks.append(chosen.worker_id)
    # 200 vs 100 blocks: the free shares stay level (ties to the less loaded), so the
    # large worker takes about two of every three.
    assert picks == ["large", "small", "large", "large", "small", "large", "large", "small"]
    assert large.headroom_blocks == 200 - 5 * 30 and small.headroom_blocks == 100 - 3 * 30
    last = policy.choose([small, large], 30)
    assert last is large  # only large still has room
    last.place("r8", 30)
    assert policy.choose([small, large], 30) is None  # nobody has 30 blocks left: wait, never over-commit


def test_a_report_that_counts_a_request_drops_its_reservation() -> None:
    view = _view("w", 100)
    view.place("a", 40)
    view.place("b", 10)
    assert view.headroom_blocks == 50
    view.apply_report(_report("w", 100, committed=40), ("a",), 1.0)  # the worker took "a"
    assert view.reservations == {"b": 10} and view.headroom_blocks == 50
    view.release("b")  # "b" ended before any report counted it
    assert view.headroom_blocks == 60 and view.reserved_blocks == 0


def test_dead_and_full_workers_are_never_chosen() -> None:
    a, b = _view("a", 100), _view("b", 100)
    a.alive = False
    for name in ("kv", "kv-least-loaded", "least-requests", "round-robin", "random"):
        assert make_policy(name, 10).choose([a, b], 20) is b
    assert make_policy("kv", 10).choose([a, b], 101) is None  # larger than any pool


def test_every_policy_passes_over_a_pool_smaller_than_the_request_s_longest() -> None:
    """A request committing 10 blocks whose longest is 100 may not go to a 64-block worker,
    however free: it could never finish there (router.placement.reservation)."""
    small, large = _view("small", 64), _view("large", 200)
    for name in POLICIES:
        policy = make_policy(name, 10)
        for _ in range(3):  # round-robin's turn comes to each
            assert policy.choose([small, large], 10, None, 100) is large, name
        assert policy.choose([small, large], 10, None, 64) is not None
        assert policy.choose([small, large], 10, None, 201) is None, name
    # Not even where its prompt is cached.
    hits = CacheHits(4, {"small": 4})
    assert make_policy("prefix", 10).choose([small, large], 10, hits, 100) is large
    assert make_policy("prefix", 10).choose([small, large], 10, hits, 64) is small


def test_blind_policies_ignore_kv_but_respect_the_outstanding_cap() -> None:
    a, b = _view("a", 100, committed=95), _view("b", 100)
    rr = make_policy("round-robin", 2)
    order = []
    for i in range(4):
        chosen = rr.choose([a, b], 50)
        assert chosen is not None
        chosen.place(f"r{i}", 50)
        order.append(chosen.worker_id)
    assert order == ["a", "b", "a", "b"]  # a is over-committed: that is what the kv policy avoids
    assert rr.choose([a, b], 50) is None  # both at the cap of 2
    least = make_policy("least-requests", 10)
    a.release("r0")
    assert least.choose([a, b], 10) is a


def test_kv_least_loaded_balances_requests_among_workers_with_room() -> None:
    small, large = _view("small", 100), _view("large", 200)
    policy = make_policy("kv-least-loaded", 100)
    picks = []
    for i in range(8):
        chosen = policy.choose([small, large], 30)
        assert chosen is not None
        chosen.place(f"r{i}", 30)
        picks.append(chosen.worker_id)
    # Alternates while both have room (ties go to more headroom), then only large fits.
    assert picks == ["large", "small", "large", "small", "large", "small", "large", "large"]
    assert small.headroom_blocks == 10


def test_unknown_policy_is_refused() -> None:
    with pytest.raises(ValueError, match="placement policy"):
        make_policy("best-effort", 1)


# Workers for the definition tests: (total blocks, committed (clipped to the total),
# evictable (clipped to what is free), alive, outstanding requests).
_WORKERS = st.lists(
    st.tuples(st.sampled_from((16, 48, 100)), st.integers(0, 100), st.integers(0, 100), st.booleans(), st.integers(0, 4)),
    min_size=1,
    max_size=12,
)
Worker = tuple[int, int, int, bool, int]


def _cached_view(worker_id: str, num_blocks: int, committed: int, evictable: int) -> WorkerView:
    """A view whose report has `evictable` of its free blocks holding cached prefixes
    nobody uses (clipped to what is free)."""
    view = _view(worker_id, num_blocks, committed)
    assert view.report is not None
    evictable = min(evictable, view.report.num_free_blocks)
    view.apply_report(dataclasses.replace(view.report, num_evictable_blocks=evictable), (), 0.0)
    return view


def _views_of(workers: list[Worker]) -> list[WorkerView]:
    views = []
    for i, (total, committed, evictable, alive, load) in enumerate(workers):
        view = _cached_view(f"w{i}", total, min(committed, total), evictable)
        view.alive = alive
        view.outstanding |= {f"r{i}-{j}" for j in range(load)}
        views.append(view)
    return views


@settings(max_examples=300, deadline=None)
@given(workers=_WORKERS, need=st.integers(0, 60), longest=st.sampled_from((0, 16, 17, 48, 49, 100, 101)))
def test_kv_chooses_as_its_definition_says(workers: list[Worker], need: int, longest: int) -> None:
    """The kv pass skips a worker that cannot beat the best so far before reading the rest
    of it; the choice must still be the definition's: among live workers with room and
    under the cap whose pool holds the request's longest, the largest free share after
    the request, then the fewest outstanding, then the first (cached blocks nobody holds
    count as room)."""
    views = _views_of(workers)
    cap = 3
    eligible = [
        (-(v.headroom_blocks - need) / v.total_blocks, len(v.outstanding), i)
        for i, v in enumerate(views)
        if v.alive and v.headroom_blocks >= need and len(v.outstanding) < cap and v.total_blocks >= longest
    ]
    expected = views[min(eligible)[2]] if eligible else None
    assert KVPolicy(max_outstanding=cap).choose(views, need, None, longest) is expected
    # the vectorised pass, the same choice
    assert ViewColumns(views, min_rows=1).kv_choice(need, cap, longest) is expected


@settings(max_examples=300, deadline=None)
@given(
    workers=_WORKERS,
    need=st.integers(0, 60),
    weights=st.sampled_from(((1.0, 1.0), (1.0, 0.5), (0.0, 1.0), (2.0, 0.25))),  # load, evict
    longest=st.sampled_from((0, 16, 17, 48, 49, 100, 101)),
)
def test_a_miss_goes_where_the_prefix_policy_says(
    workers: list[Worker], need: int, weights: tuple[float, float], longest: int
) -> None:
    """With nothing of the prompt cached, `prefix` takes, among live workers with room and
    under the cap whose pool holds the request's longest, the highest -load_weight x
    kv_load - evict_weight x evicts / prompt blocks (evicts: its new blocks beyond the
    clean free ones), then the fewest outstanding, then the first; the loop and the
    vectorised pass both."""
    load_weight, evict_weight = weights
    prompt_blocks = 8
    views = _views_of(workers)
    cap = 3

    def score(v: WorkerView) -> float:
        clean = max(0, v.headroom_blocks - v.report.num_evictable_blocks)
        evicts = max(0, need - clean)
        return -load_weight * (1 - (v.headroom_blocks - need) / v.total_blocks) - evict_weight / prompt_blocks * evicts

    eligible = [
        (-score(v), len(v.outstanding), i)
        for i, v in enumerate(views)
        if v.alive and v.headroom_blocks >= need and len(v.outstanding) < cap and v.total_blocks >= longest
    ]
    expected = views[min(eligible)[2]] if eligible else None
    policy = PrefixPolicy(cap, PrefixWeights(load_weight=load_weight, evict_weight=evict_weight))
    hits = CacheHits(prompt_blocks, {})
    assert policy.choose(views, need, hits, longest) is expected
    assert policy.choose(ViewColumns(views, min_rows=1), need, hits, longest) is expected  # vectorised


@settings(max_examples=200, deadline=None)
@given(
    totals=st.lists(st.sampled_from((16, 48, 100)), min_size=1, max_size=10),
    ops=st.lists(
        st.tuples(
            st.sampled_from(("place", "release", "report", "alive")),
            st.integers(0, 9),  # which worker
            st.integers(0, 60),  # blocks (place: its need; report: committed)
            st.integers(0, 5),  # which request (place, release); alive: even is alive
        ),
        max_size=40,
    ),
    need=st.integers(0, 40),
)
def test_the_columns_follow_every_change_of_their_views(
    totals: list[int], ops: list[tuple[str, int, int, int]], need: int
) -> None:
    """ViewColumns keeps each view's numbers as arrays that the views write as they change:
    after any sequence of placements, releases, reports and deaths, the vectorised choice
    is the loop's over the same views. A change that skipped its row would show here."""
    views = [_view(f"w{i}", total) for i, total in enumerate(totals)]
    columns = ViewColumns(views, min_rows=1)
    loop = KVPolicy(max_outstanding=4)
    prefix = PrefixPolicy(max_outstanding=4)
    for op, which, blocks, request in ops:
        view = views[which % len(views)]
        if op == "place":
            view.place(f"r{request}", blocks)
        elif op == "release":
            view.release(f"r{request}")
        elif op == "report":
            report = _report(view.worker_id, view.total_blocks, min(blocks, view.total_blocks))
            report = dataclasses.replace(report, num_evictable_blocks=min(7 * request, report.num_free_blocks))
            view.apply_report(report, (), 1.0)
        else:
            view.set_alive(request % 2 == 0)
        assert columns.kv_choice(need, 4) is loop.choose(views, need)
        assert columns.miss_choice(need, 4, 1.0, 0.125) is prefix._miss_choice(views, need, 1.0, 0.125)


def test_an_older_view_columns_is_stale_once_a_newer_one_holds_its_views() -> None:
    """A view writes only the newest ViewColumns that holds it; the older one stops being
    vectorised and the kv policy passes over its columns for the loop, which reads the views."""
    a, b = _view("a", 100), _view("b", 100)
    old = ViewColumns([a, b], min_rows=1)
    new = ViewColumns([b, a], min_rows=1)
    assert new.vectorised and not old.vectorised
    a.place("r1", 60)  # writes new's row for a, not old's
    policy = KVPolicy(max_outstanding=8)
    assert policy.choose(new, 10) is b
    assert policy.choose(old, 10) is b  # the loop over the views, not old's columns
    assert old.kv_choice(10, 8) is a  # what old's own (outdated) columns would have said
    assert not ViewColumns([a, b]).vectorised  # two views: under VECTOR_MIN_WORKERS, no columns
