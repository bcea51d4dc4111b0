"""The prefix cache's KV events: what the allocator records, what the engine drains, and the
numbers a request's token events carry about its cache hit.

H0, H1, ... are block hashes; block ids are named as the allocator hands them out (a
fresh pool gives 0, 1, 2, ...).
"""

from __future__ import annotations

from collections.abc import Mapping

import pytest

from tests.test_block_allocator import BLOCK_BYTES, replay_events
from workers.engine.block_allocator import BlockAllocator
from workers.engine.block_hash import BlockHash, hash_blocks
from workers.engine.cache_events import CacheEventLog
from workers.engine.config import SchedulerConfig
from workers.engine.engine import KVPool, LLMEngine, ModelLimits
from workers.engine.plan import SampledToken, StepPlan, TokenEvent
from workers.engine.request import Resume
from workers.engine.sampling import SamplingParams

H0, H1, H2, H3 = (BlockHash(bytes([i]) * 32) for i in range(4))
STORED, EVICTED = True, False


def test_the_log_keeps_net_changes_in_order() -> None:
    log = CacheEventLog()
    assert log.drain() == []
    log.record(STORED, H0)
    log.record(STORED, H1)
    log.record(EVICTED, H0)  # cancels the store of H0: nothing about H0 travels
    log.record(STORED, H2)
    assert len(log) == 2
    assert log.drain() == [(STORED, H1), (STORED, H2)]
    assert log.drain() == []
    log.record(EVICTED, H1)
    log.record(STORED, H1)  # evicted and cached again: the map as it was
    log.record(EVICTED, H2)
    assert log.drain() == [(EVICTED, H2)]
    log.record(EVICTED, H3)
    with pytest.raises(AssertionError, match="twice"):
        log.record(EVICTED, H3)  # a hash is only ever evicted while cached


def test_the_allocator_records_every_hash_stored_and_dropped() -> None:
    allocator = BlockAllocator(num_blocks=3, block_bytes=BLOCK_BYTES)
    assert allocator.allocate(3) == [0, 1, 2]
    assert allocator.cache_full_block(0, H0)
    assert allocator.cache_full_block(1, H1)
    assert not allocator.cache_full_block(2, H1)  # a duplicate stays private: no event
    assert allocator.cache_full_block(0, H0)  # again under its own hash: no event
    assert allocator.drain_events() == [(STORED, H0), (STORED, H1)]
    assert allocator.cached_hashes() == (H0, H1)

    allocator.release([2, 1, 0])  # 2 is freed; LRU: 1 0 (nothing dropped, no event)
    assert allocator.drain_events() == []
    assert allocator.allocate(2) == [2, 1]  # the free block, then 1: H1 dropped
    assert allocator.drain_events() == [(EVICTED, H1)]
    assert allocator.cache_full_block(1, H2)
    allocator.release([1])  # LRU: 0 1
    assert allocator.evict_all() == 2
    assert allocator.drain_events() == [(EVICTED, H0)]  # H2 stored and dropped since: nets out
    assert allocator.cached_hashes() == ()


def test_replaying_the_drained_events_follows_the_hash_map() -> None:
    allocator = BlockAllocator(num_blocks=2, block_bytes=BLOCK_BYTES)
    replayed: set[BlockHash] = set()
    table = allocator.allocate(2)
    assert table == [0, 1]
    allocator.cache_full_block(0, H0)
    allocator.cache_full_block(1, H1)
    replay_events(replayed, allocator.drain_events())
    assert replayed == {H0, H1}
    allocator.release(reversed(table))  # LRU: 1 0
    assert allocator.allocate(1) == [1]  # H1 dropped
    allocator.cache_full_block(1, H3)
    replay_events(replayed, allocator.drain_events())
    assert replayed == set(allocator.cached_hashes()) == {H0, H3}


# -- the engine ------------------------------------------------------------------------

BLOCK_SIZE = 4
PROMPT = list(range(10, 20))  # 10 tokens: blocks 10..13 | 14..17 | 18 19


class ZeroRunner:
    """Samples token 1 for every chunk that samples; computes nothing."""

    def execute(self, plan: StepPlan) -> Mapping[str, SampledToken]:
        return {c.request_id: SampledToken(1) for c in plan.chunks if c.sample}


def make_engine(num_blocks: int = 16, enable_prefix_caching: bool = True) -> LLMEngine:
    config = SchedulerConfig(
        max_model_len=num_blocks * BLOCK_SIZE,
        block_size=BLOCK_SIZE,
        max_num_batched_tokens=64,
        enable_prefix_caching=enable_prefix_caching,
    )
    return LLMEngine(ZeroRunner(), config, KVPool(num_blocks, 64), ModelLimits(vocab_size=100, max_model_len=1024))


def run_all(engine: LLMEngine) -> list[TokenEvent]:
    events: list[TokenEvent] = []
    while engine.has_unfinished:
        events.extend(engine.step())
    return events


def test_the_engine_drains_what_its_requests_cached() -> None:
    engine = make_engine()
    prompt_hashes = hash_blocks(PROMPT, BLOCK_SIZE)
    engine.add_request("a", PROMPT, SamplingParams(max_tokens=3))
    engine.step()  # the prefill writes blocks 0 and 1 in full: both cached after commit
    assert engine.drain_kv_events() == [(STORED, prompt_hashes[0]), (STORED, prompt_hashes[1])]
    run_all(engine)  # 10 prompt + 2 fed-back outputs = 12 tokens: a third block fills
    third = hash_blocks([*PROMPT, 1, 1], BLOCK_SIZE)[2]
    assert engine.drain_kv_events() == [(STORED, third)]
    assert engine.cached_block_hashes() == (*prompt_hashes, third)
    engine.allocator.evict_all()  # finished: all three were evictable, released tail first
    assert engine.drain_kv_events() == [(EVICTED, third), (EVICTED, prompt_hashes[1]), (EVICTED, prompt_hashes[0])]
    assert engine.cached_block_hashes() == ()


def test_with_prefix_caching_off_there_are_no_events() -> None:
    engine = make_engine(enable_prefix_caching=False)
    engine.add_request("a", PROMPT, SamplingParams(max_tokens=3))
    engine.add_request("b", PROMPT, SamplingParams(max_tokens=3))
    run_all(engine)
    assert engine.drain_kv_events() == [] and engine.cached_block_hashes() == ()


def test_every_token_event_carries_the_requests_cached_prompt_tokens() -> None:
    engine = make_engine()
    engine.add_request("a", PROMPT, SamplingParams(max_tokens=3))
    first = run_all(engine)
    assert [e.num_cached_tokens for e in first] == [0, 0, 0]
    engine.add_request("b", PROMPT, SamplingParams(max_tokens=3))
    engine.add_request("c", PROMPT, SamplingParams(max_tokens=5))
    second = run_all(engine)
    assert {e.request_id for e in second} == {"b", "c"}
    assert all(e.num_cached_tokens == 8 for e in second)  # blocks 0 and 1 were a hit
    engine.add_request("d", PROMPT, SamplingParams(max_tokens=5))
    engine.step()
    cancelled = engine.abort("d")
    assert cancelled is not None and cancelled.num_cached_tokens == 8


def test_a_resumed_request_reports_what_its_new_placement_hit() -> None:
    engine = make_engine()
    engine.add_request("a", PROMPT[:6], SamplingParams(max_tokens=3))  # its block 1 ends 14 15 1 1
    run_all(engine)
    # Moved here with 3 outputs already: 13 known tokens, of which block 0 is cached.
    engine.add_request("moved", PROMPT, SamplingParams(max_tokens=6), resume=Resume((1, 1, 1)))
    events = run_all(engine)
    assert events and all(e.num_cached_tokens == 4 for e in events)
    assert events[0].offset == 3
