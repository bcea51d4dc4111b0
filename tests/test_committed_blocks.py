"""EngineStats.num_committed_blocks with the prefix cache: a block shared by several
requests is committed once.

    committed = used blocks + sum over unfinished requests of (blocks at max_tokens - blocks in its table)
                - the cached blocks waiting requests would share (held now, or taken by an earlier one)

Block size 4; PROMPT is 10 tokens (10..13 | 14..17 | 18 19) and max_tokens 7, so a
request holds at most blocks_for_tokens(10 + 7 - 1) = 4 blocks.
"""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.test_cache_events import BLOCK_SIZE, PROMPT, ZeroRunner, run_all
from workers.engine.config import SchedulerConfig
from workers.engine.engine import KVPool, LLMEngine, ModelLimits
from workers.engine.errors import InvalidRequestError
from workers.engine.sampling import SamplingParams

NEED = 4  # blocks a PROMPT request with max_tokens 7 holds at its longest
PARAMS = SamplingParams(max_tokens=7)


def make_engine(num_blocks: int = 16, enable_prefix_caching: bool = True, max_num_seqs: int = 8,
                max_num_batched_tokens: int = 64) -> LLMEngine:
    config = SchedulerConfig(
        max_model_len=num_blocks * BLOCK_SIZE,
        block_size=BLOCK_SIZE,
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=max_num_batched_tokens,
        enable_prefix_caching=enable_prefix_caching,
    )
    return LLMEngine(ZeroRunner(), config, KVPool(num_blocks, 64), ModelLimits(vocab_size=100, max_model_len=1024))


def warm(engine: LLMEngine) -> None:
    """Run one PROMPT request to the end: its 16 computed tokens fill blocks 0 1 2 3, which
    stay cached (evictable); the free queue now starts at block 4."""
    engine.add_request("warm", PROMPT, PARAMS)
    run_all(engine)
    assert engine.stats().num_committed_blocks == 0 and engine.stats().num_evictable_blocks == 4


def run_never_rising(engine: LLMEngine, committed: int) -> None:
    """Step to the end: what was committed is what the requests then take, so the count
    never rises, and it ends at 0."""
    while engine.has_unfinished:
        engine.step()
        now = engine.stats().num_committed_blocks
        assert now <= committed, (now, committed)
        committed = now
    assert committed == 0


def test_two_requests_sharing_two_cached_blocks_commit_two_fewer() -> None:
    engine = make_engine()
    warm(engine)
    engine.add_request("a", PROMPT, PARAMS)
    engine.add_request("b", PROMPT, PARAMS)
    # Waiting, both hit the evictable blocks 0 1: a takes them, b shares them.
    assert engine.stats().num_committed_blocks == NEED + (NEED - 2)
    engine.step()
    # Both hit blocks 0 1 (the warm request's) and compute 18 19 into a block each:
    #   a: 0 1 | 4     b: 0 1 | 5     used 4; each grows by 4 - 3 = 1 more
    assert engine.scheduler.block_table("a") == (0, 1, 4) and engine.scheduler.block_table("b") == (0, 1, 5)
    stats = engine.stats()
    assert (stats.num_used_blocks, stats.num_committed_blocks) == (4, 4 + 1 + 1)
    assert stats.num_committed_blocks == 2 * NEED - 2
    assert stats.num_uncommitted_blocks == 16 - 6
    # They run on: tables grow into what was committed, and the total does not move.
    engine.step()
    engine.step()
    assert engine.stats().num_committed_blocks == 6
    run_all(engine)
    assert engine.stats().num_committed_blocks == 0


def test_with_caching_off_every_request_commits_its_whole_need() -> None:
    engine = make_engine(enable_prefix_caching=False)
    engine.add_request("a", PROMPT, PARAMS)
    engine.add_request("b", PROMPT, PARAMS)
    committed = []
    while engine.has_unfinished:
        committed.append(engine.stats().num_committed_blocks)
        engine.step()
    assert committed == [2 * NEED] * len(committed) and len(committed) == 7
    assert engine.stats().num_committed_blocks == 0


def test_a_waiting_request_does_not_count_the_blocks_a_running_one_holds_for_it() -> None:
    engine = make_engine(max_num_seqs=1)
    warm(engine)
    engine.add_request("a", PROMPT, PARAMS)
    engine.add_request("b", PROMPT, PARAMS)  # one sequence at a time: b waits behind a
    engine.step()
    stats = engine.stats()
    assert (stats.num_running, stats.num_waiting) == (1, 1)
    # a holds 0 1 | 4 and grows by 1; b holds nothing and will hit 0 1, which a holds (used).
    assert (stats.num_used_blocks, stats.num_committed_blocks) == (3, 3 + 1 + (NEED - 2))
    # b's admission leaves the count where it was: it takes exactly what was committed for it.
    run_all(engine)
    assert engine.stats().num_committed_blocks == 0


def test_a_sharer_waiting_for_a_prefix_still_being_computed_counts_it_once() -> None:
    engine = make_engine(max_num_batched_tokens=4)  # PROMPT's prefill takes three steps
    engine.add_request("a", PROMPT, PARAMS)
    engine.add_request("b", PROMPT, PARAMS)
    assert engine.stats().num_committed_blocks == 2 * NEED  # nothing cached nor running yet
    engine.step()
    # a computed block 0 (cached now) and holds nothing more yet; b waits for a's block 1
    # rather than computing it too, and counts neither: 0 is held, 1 is a's to compute.
    stats = engine.stats()
    assert (stats.num_running, stats.num_waiting) == (1, 1)
    assert stats.num_committed_blocks == 1 + (NEED - 1) + (NEED - 2)
    run_never_rising(engine, stats.num_committed_blocks)


def test_waiting_requests_take_an_evictable_block_once_and_a_foreign_prefix_in_full() -> None:
    engine = make_engine(max_num_seqs=1)
    warm(engine)  # PROMPT's blocks 0 1 cached, evictable
    other = [50 + i for i in range(10)]  # nothing of it cached
    engine.add_request("c", other, PARAMS)  # runs: the only sequence slot
    for request_id in ("d", "e", "f"):
        engine.add_request(request_id, PROMPT, PARAMS)
    engine.add_request("g", other, PARAMS)
    engine.step()
    stats = engine.stats()
    assert (stats.num_running, stats.num_waiting) == (1, 4)
    # c holds 3 blocks (it hit nothing: 10 tokens, blocks 4 5 6), grows by 1. d takes the
    # evictable 0 1 (4), e and f share them (2 each); g hits c's two full blocks (2).
    assert engine.scheduler.block_table("c") == (4, 5, 6)
    assert stats.num_committed_blocks == 3 + 1 + NEED + 2 * (NEED - 2) + (NEED - 2)
    # Every count is what admission then takes: the total only falls as requests end.
    run_never_rising(engine, stats.num_committed_blocks)


def test_uncommitted_is_never_negative() -> None:
    engine = make_engine(num_blocks=8)
    long = SamplingParams(max_tokens=14)  # 10 + 14 - 1 = 23 tokens: 6 blocks each
    engine.add_request("a", PROMPT, long)
    engine.add_request("b", PROMPT[::-1], long)
    stats = engine.stats()
    assert stats.num_committed_blocks == 12 and stats.num_uncommitted_blocks == 0


@settings(max_examples=60, deadline=None)
@given(
    st.lists(
        st.tuples(
            st.sampled_from(["add", "step", "step", "abort"]),
            st.integers(0, 2),  # which prompt family
            st.integers(1, 9),  # max_tokens
        ),
        max_size=40,
    ),
    st.booleans(),
)
def test_committed_lies_between_used_and_the_sum_of_needs(operations: list[tuple[str, int, int]], caching: bool) -> None:
    """Shared blocks count once, so committed never exceeds the old per-request sum, which
    it equals with the cache off; it never drops below what is held."""
    engine = make_engine(num_blocks=12, enable_prefix_caching=caching, max_num_seqs=3)
    needs: dict[str, int] = {}
    for index, (operation, family, max_tokens) in enumerate(operations):
        if operation == "add":
            prompt = [20 * family + i for i in range(6)] + [90 + index % 8]
            engine.add_request(f"r{index}", prompt, SamplingParams(max_tokens=max_tokens))
            needs[f"r{index}"] = engine.blocks_needed(len(prompt), max_tokens)
        elif operation == "abort" and needs:
            engine.abort(sorted(needs)[family % len(needs)])
        else:
            engine.step()
        needs = {r: n for r, n in needs.items() if engine.scheduler.get_request(r) is not None}
        stats = engine.stats()
        assert stats.num_used_blocks <= stats.num_committed_blocks <= sum(needs.values())
        if not caching:
            assert stats.num_committed_blocks == sum(needs.values())
        assert 0 <= stats.num_uncommitted_blocks <= stats.num_total_blocks


def test_a_request_commits_its_prompt_and_reserve_tokens_and_then_only_what_it_outgrows_them_by() -> None:
    """reserve_tokens (the router's --kv-reserve-ratio of max_tokens): PROMPT (10 tokens)
    with 3 reserved commits blocks_for_tokens(10 + 3 - 1) = 3, not NEED = 4; once its
    13th token needs a 4th block it holds 4, and the count is what it holds."""
    engine = make_engine(enable_prefix_caching=False)
    engine.add_request("a", PROMPT, PARAMS, reserve_tokens=3)
    engine.add_request("b", PROMPT, PARAMS)  # beside it, at max_tokens
    seen = []
    while engine.has_unfinished:
        stats = engine.stats()
        seen.append((engine.scheduler.num_table_blocks("a"), stats.num_committed_blocks))
        engine.step()
    # Before its prefill nothing is held (a: 3, b: 4); after it, 3 blocks each and b grows
    # to 4; from the step its 13th token is fed, a holds and commits its 4th block.
    assert seen[0] == (0, 3 + NEED)
    assert seen[1] == (3, 3 + NEED)
    assert seen[-1] == (NEED, 2 * NEED)
    assert [held for held, _ in seen] == sorted(held for held, _ in seen)  # it only grows
    assert all(committed == max(held, 3) + NEED for held, committed in seen)
    assert engine.stats().num_committed_blocks == 0


@pytest.mark.parametrize("reserve", [0, -1, 8, True, 3.0, "3"])
def test_a_reserve_outside_one_to_max_tokens_names_its_field_and_costs_nothing(reserve: object) -> None:
    engine = make_engine(enable_prefix_caching=False)
    before = engine.stats()
    with pytest.raises(InvalidRequestError) as raised:
        engine.add_request("a", PROMPT, PARAMS, reserve_tokens=reserve)  # type: ignore[arg-type]
    assert raised.value.field == "reserve_tokens" and "max_tokens=7" in str(raised.value)
    assert engine.stats() == before and not engine.has_unfinished
    engine.add_request("a", PROMPT, PARAMS, reserve_tokens=7)  # the id was not taken; 7 = all of max_tokens
    assert engine.stats().num_committed_blocks == NEED
