"""Prefix caching in the scheduler: exact scenarios with named block ids (block_size 4).

The runner is tests/prefix_cache_fakes.py's ContentKVRunner: every KV slot remembers the
context it was computed from, so a hit served from the wrong block, a block evicted
under its reader or one read before it was written fails in the runner, and every
output must still equal what the request generates alone.
"""

from __future__ import annotations

from collections.abc import Sequence

import pytest

from tests.prefix_cache_fakes import BLOCK_SIZE, drain, make_scheduler, step
from tests.test_scheduler import chunk_summary, reference_output
from workers.engine.block_allocator import BlockState
from workers.engine.plan import StepPlan
from workers.engine.request import FinishReason, Request
from workers.engine.sampling import SamplingParams

SHARED = tuple(range(10, 22))  # a common prefix: 3 blocks' worth


def make_request(request_id: str, prompt: Sequence[int], max_tokens: int = 3, cache_salt: str | None = None) -> Request:
    return Request(
        request_id=request_id,
        prompt_ids=tuple(prompt),
        params=SamplingParams(max_tokens=max_tokens, temperature=0.0),
        seed=0,
        arrival_time=0.0,
        cache_salt=cache_salt,
    )


def tail(first: int, length: int) -> tuple[int, ...]:
    """Tokens no other prompt here has (each test picks its own range)."""
    return tuple(range(first, first + length))


def assert_reference(*requests: Request) -> None:
    for request in requests:
        assert request.output_ids == reference_output(request.prompt_ids, request.params.max_tokens)


def without_tables(plans: Sequence[StepPlan]) -> list[list[tuple[str, int, int, bool]]]:
    return [[(c.request_id, c.start_position, c.num_tokens, c.sample) for c in p.chunks] for p in plans]


def test_second_request_reuses_blocks_0_1_and_computes_only_its_tail() -> None:
    scheduler, allocator, runner = make_scheduler(num_blocks=8)
    a = make_request("a", SHARED[:8] + tail(50, 2))  # 10 tokens: blocks 0 1 full, 2 partial
    scheduler.add_request(a)
    assert chunk_summary(step(scheduler, runner)) == [("a", 0, 10, (0, 1, 2), True)]
    # Committed: the two full blocks are cached (findable), the partial one is not.
    assert allocator.block_hash(0) is not None and allocator.block_hash(1) is not None
    assert allocator.block_hash(2) is None

    b = make_request("b", SHARED[:8] + tail(60, 3), max_tokens=2)  # 11 tokens
    scheduler.add_request(b)
    plan = step(scheduler, runner)
    assert chunk_summary(plan) == [("a", 10, 1, (0, 1, 2), True), ("b", 8, 3, (0, 1, 3), True)]
    assert b.num_cached_tokens == 8 and b.num_cached_prompt_tokens == 8
    assert a.num_cached_tokens == 0
    assert [allocator.refcount(block_id) for block_id in range(4)] == [2, 2, 1, 1]
    drain(scheduler, runner)
    assert_reference(a, b)
    counters = scheduler.prefix_cache_counters
    assert (counters.num_queried_tokens, counters.num_hit_tokens) == (10 + 11, 8)
    # Each ended with positions 0..11 written, so block 2 (a's) and 3 (b's) filled too.
    # a left first, releasing 2 (its tail; 1 and 0 were b's as well), then b: 3, 1, 0.
    assert allocator.evictable_blocks() == [2, 3, 1, 0]
    assert allocator.num_used_blocks == 0 and allocator.num_free_blocks == 8


@pytest.mark.parametrize(
    ("num_shared", "num_hit_blocks"),
    [(3, 0), (4, 1), (5, 1), (7, 1), (8, 2), (9, 2)],  # block_size - 1, block_size, + 1, and again
)
def test_shared_prefix_straddling_block_edges(num_shared: int, num_hit_blocks: int) -> None:
    scheduler, allocator, runner = make_scheduler(num_blocks=8)
    a = make_request("a", SHARED[:num_shared] + tail(50, 12 - num_shared), max_tokens=1)
    scheduler.add_request(a)
    assert chunk_summary(step(scheduler, runner)) == [("a", 0, 12, (0, 1, 2), True)]
    assert a.is_finished  # its three full blocks are cached and evictable: LRU 2 1 0
    assert allocator.evictable_blocks() == [2, 1, 0]

    b = make_request("b", SHARED[:num_shared] + tail(70, 12 - num_shared))
    scheduler.add_request(b)
    plan = step(scheduler, runner)
    hit = tuple(range(num_hit_blocks))
    new = tuple(range(3, 6 - num_hit_blocks))  # never-used blocks go before evictable ones
    num_cached = num_hit_blocks * BLOCK_SIZE
    assert chunk_summary(plan) == [("b", num_cached, 12 - num_cached, hit + new, True)]
    assert b.num_cached_tokens == num_cached
    drain(scheduler, runner)
    assert_reference(a, b)


def test_full_prompt_hit_still_computes_the_last_block() -> None:
    scheduler, allocator, runner = make_scheduler(num_blocks=8)
    a = make_request("a", SHARED[:8], max_tokens=1)
    scheduler.add_request(a)
    step(scheduler, runner)
    assert allocator.evictable_blocks() == [1, 0]

    # All 8 tokens are cached, but token 7's logits are needed: at most 7 tokens can
    # hit, which is one whole block. Block 1 is recomputed into block 2, a duplicate
    # that stays uncached (the hash keeps pointing at block 1).
    b = make_request("b", SHARED[:8], max_tokens=2)
    scheduler.add_request(b)
    plan = step(scheduler, runner)
    assert chunk_summary(plan) == [("b", 4, 4, (0, 2), True)]
    assert b.num_cached_tokens == 4
    assert allocator.block_hash(2) is None and allocator.block_state(1) is BlockState.EVICTABLE
    h0, h1 = allocator.block_hash(0), allocator.block_hash(1)
    assert h0 is not None and h1 is not None
    assert allocator.lookup([h0, h1]) == [0, 1]
    drain(scheduler, runner)
    assert_reference(a, b)
    assert b.output_ids[:1] == a.output_ids


def test_full_prompt_hit_of_two_blocks_computes_only_the_last_token() -> None:
    scheduler, allocator, runner = make_scheduler(num_blocks=8)
    a = make_request("a", SHARED[:9], max_tokens=1)
    scheduler.add_request(a)
    assert chunk_summary(step(scheduler, runner)) == [("a", 0, 9, (0, 1, 2), True)]
    # Block 2 held one token: never full, so free again, not cached.
    assert allocator.block_state(2) is BlockState.FREE

    b = make_request("b", SHARED[:9])
    scheduler.add_request(b)
    assert chunk_summary(step(scheduler, runner)) == [("b", 8, 1, (0, 1, 3), True)]
    assert b.num_cached_tokens == 8
    drain(scheduler, runner)
    assert_reference(a, b)


def test_a_sharer_of_a_prefix_being_computed_waits_for_it_and_then_hits_it() -> None:
    scheduler, allocator, runner = make_scheduler(num_blocks=12)
    a = make_request("a", SHARED[:8] + tail(50, 2), max_tokens=6)
    b = make_request("b", SHARED[:8] + tail(60, 2), max_tokens=6)
    e = make_request("e", tail(90, 6), max_tokens=6)  # shares nothing: not held up
    for request in (a, b, e):
        scheduler.add_request(request)
    # a computes the prefix; b's next block is among those a is computing, so b waits (in
    # its place, e overtakes it) rather than computing the same two blocks again.
    plan = step(scheduler, runner)
    assert chunk_summary(plan) == [("a", 0, 10, (0, 1, 2), True), ("e", 0, 6, (3, 4), True)]
    assert scheduler.num_waiting == 1
    # Written now: b hits both blocks and computes only its own two tokens.
    plan = step(scheduler, runner)
    assert chunk_summary(plan) == [("a", 10, 1, (0, 1, 2), True), ("e", 6, 1, (3, 4), True),
                                   ("b", 8, 2, (0, 1, 5), True)]
    assert b.num_cached_tokens == 8 and allocator.refcount(0) == allocator.refcount(1) == 2

    c = make_request("c", SHARED[:8] + tail(70, 3), max_tokens=6)
    d = make_request("d", SHARED[:8] + tail(80, 3), max_tokens=6)
    scheduler.add_request(c)
    scheduler.add_request(d)
    plan = step(scheduler, runner)
    assert [(r, start, n) for r, start, n, _, _ in chunk_summary(plan)][-2:] == [("c", 8, 3), ("d", 8, 3)]
    assert allocator.refcount(0) == allocator.refcount(1) == 4

    # a and c leave; b and d still hold blocks 0 and 1, which must not be freed under them.
    scheduler.finish_request("a", FinishReason.CANCELLED)
    scheduler.finish_request("c", FinishReason.CANCELLED)
    scheduler.check_invariants()
    assert allocator.refcount(0) == allocator.refcount(1) == 2
    assert allocator.block_state(0) is BlockState.USED
    drain(scheduler, runner)
    assert_reference(b, d, e)


def test_preempted_request_rehits_what_was_not_evicted() -> None:
    scheduler, allocator, runner = make_scheduler(num_blocks=6)
    a = make_request("a", tail(50, 4), max_tokens=13)  # 16 tokens of KV: 4 blocks
    b = make_request("b", tail(70, 8), max_tokens=6)  # 13 tokens of KV: 4 blocks
    scheduler.add_request(a)
    scheduler.add_request(b)
    plans = [step(scheduler, runner) for _ in range(5)]
    assert chunk_summary(plans[0]) == [("a", 0, 4, (0,), True), ("b", 0, 8, (1, 2), True)]
    assert chunk_summary(plans[4]) == [("a", 7, 1, (0, 3), True), ("b", 11, 1, (1, 2, 4), True)]

    # a's position 8 takes the last free block; b's position 12 finds none, and b is the
    # newest: it preempts itself. Its three blocks are full and written: they stay
    # cached, released tail first (4, 2, 1), so 4 would be evicted first.
    plan = step(scheduler, runner)
    assert chunk_summary(plan) == [("a", 8, 1, (0, 3, 5), True)]
    assert plan.preempted_ids == ("b",)
    assert allocator.evictable_blocks() == [4, 2, 1]
    assert b.num_tokens == 13

    # b could hit all three blocks and needs one more, but taking the three out of the
    # LRU leaves nothing to allocate: it waits. a's position 12 then evicts block 4.
    plans = [step(scheduler, runner) for _ in range(4)]
    assert all([c.request_id for c in p.chunks] == ["a"] for p in plans)
    assert chunk_summary(plans[-1]) == [("a", 12, 1, (0, 3, 5, 4), True)]
    assert allocator.evictable_blocks() == [2, 1]

    plans = drain(scheduler, runner)
    first_b = next(c for p in plans for c in p.chunks if c.request_id == "b")
    # Readmitted once a finished (its 4 blocks cached, LRU 2 1 4 5 3 0): blocks 1 and 2
    # are hit, 4 and 5 evicted for the rest.
    assert (first_b.start_position, first_b.num_tokens, first_b.block_table) == (8, 5, (1, 2, 4, 5))
    assert b.num_cached_tokens == 0  # at its first admission nothing was cached
    counters = scheduler.prefix_cache_counters
    # The hit rate counts first admissions only: b's readmission found its own blocks.
    assert (counters.num_queried_tokens, counters.num_hit_tokens) == (4 + 8, 0)
    assert_reference(a, b)
    assert allocator.num_used_blocks == 0


def test_a_resumed_request_counts_its_prompt_alone_in_the_hit_rate() -> None:
    """A request moved to this engine with 6 tokens of output already (its resume) hits 3
    blocks: its 8-token prompt and 4 tokens of that output. The hit rate is of prompt tokens
    (serving.proto), as the request's Usage counts them: 8 looked up, 8 found. It counted 14
    and 12, so a worker that took moved requests read other numbers than its clients'
    Usage summed (an outside check: 75 looked up for a 70-token prompt)."""
    scheduler, allocator, runner = make_scheduler(num_blocks=12)
    prompt = SHARED[:8]
    a = make_request("a", prompt, max_tokens=8)
    scheduler.add_request(a)
    drain(scheduler, runner)
    before = scheduler.prefix_cache_counters
    assert (before.num_queried_tokens, before.num_hit_tokens) == (8, 0)
    b = make_request("b", prompt, max_tokens=8)
    b.token_ids = list(prompt) + a.output_ids[:6]  # what the move resumes from
    scheduler.add_request(b)
    plan = step(scheduler, runner)
    assert chunk_summary(plan) == [("b", 12, 2, (0, 1, 2, 4), True)]  # a's 3 blocks hit, 2 tokens computed
    assert b.num_cached_prompt_tokens == 8
    drain(scheduler, runner)
    assert b.output_ids == a.output_ids
    after = scheduler.prefix_cache_counters
    assert (after.num_queried_tokens - 8, after.num_hit_tokens) == (8, 8)


def test_eviction_under_pressure_takes_the_lru_tail_first() -> None:
    scheduler, allocator, runner = make_scheduler(num_blocks=5)
    a = make_request("a", tail(10, 12), max_tokens=1)
    scheduler.add_request(a)
    step(scheduler, runner)
    assert allocator.evictable_blocks() == [2, 1, 0]  # a's tail first

    c = make_request("c", tail(40, 12), max_tokens=1)  # unrelated; needs 3 blocks
    scheduler.add_request(c)
    assert chunk_summary(step(scheduler, runner)) == [("c", 0, 12, (3, 4, 2), True)]
    assert allocator.evictable_blocks() == [1, 0, 2, 4, 3]

    # a's prompt and one more block: blocks 0 and 1 still hit, block 2's hash is gone.
    d = make_request("d", tail(10, 16), max_tokens=1)
    scheduler.add_request(d)
    assert chunk_summary(step(scheduler, runner)) == [("d", 8, 8, (0, 1, 2, 4), True)]
    assert d.num_cached_tokens == 8
    assert_reference(a, c, d)


def test_cache_salt_isolates_tenants() -> None:
    scheduler, _, runner = make_scheduler(num_blocks=12)
    first = make_request("first", SHARED[:9], max_tokens=1, cache_salt="tenant-1")
    scheduler.add_request(first)
    step(scheduler, runner)
    other = make_request("other", SHARED[:9], max_tokens=1, cache_salt="tenant-2")
    unsalted = make_request("unsalted", SHARED[:9], max_tokens=1)
    same = make_request("same", SHARED[:9], max_tokens=1, cache_salt="tenant-1")
    for request in (other, unsalted, same):
        scheduler.add_request(request)
    plan = step(scheduler, runner)
    assert [(c.request_id, c.start_position) for c in plan.chunks] == [("other", 0), ("unsalted", 0), ("same", 8)]
    assert_reference(first, other, unsalted, same)


def test_caching_off_shares_nothing() -> None:
    scheduler, allocator, runner = make_scheduler(num_blocks=8, enable_prefix_caching=False)
    a = make_request("a", SHARED[:8] + tail(50, 2))
    scheduler.add_request(a)
    step(scheduler, runner)
    b = make_request("b", SHARED[:8] + tail(60, 3), max_tokens=2)
    scheduler.add_request(b)
    plan = step(scheduler, runner)
    assert chunk_summary(plan) == [("a", 10, 1, (0, 1, 2), True), ("b", 0, 11, (3, 4, 5), True)]
    assert all(allocator.block_hash(block_id) is None for block_id in range(8))
    drain(scheduler, runner)
    assert_reference(a, b)
    assert b.num_cached_tokens == 0
    assert scheduler.prefix_cache_counters.num_queried_tokens == 0
    assert allocator.num_evictable_blocks == 0 and allocator.num_free_blocks == 8


def test_without_shared_prefixes_caching_changes_only_block_ids() -> None:
    def run(enable_prefix_caching: bool) -> list[list[tuple[str, int, int, bool]]]:
        scheduler, _, runner = make_scheduler(
            num_blocks=40, budget=8, max_num_seqs=3, enable_prefix_caching=enable_prefix_caching
        )
        for i in range(8):
            scheduler.add_request(make_request(f"r{i}", tail(100 * i + 1, 2 + (5 * i) % 9), max_tokens=2 + i % 4))
        plans = drain(scheduler, runner)
        assert scheduler.num_preemptions == 0
        return without_tables(plans)

    assert run(True) == run(False)
