"""Prefix caching through LLMEngine with a fake runner: stats, the KV report, cache_salt,
and a resumed request hitting the blocks of its own earlier output."""

from __future__ import annotations

import pytest

from tests.prefix_cache_fakes import BLOCK_BYTES, BLOCK_SIZE, EngineRunner
from tests.test_scheduler import reference_output
from workers.config import EngineArgs
from workers.engine.block_hash import hash_blocks, request_extra_keys
from workers.engine.collect import PromptSpec, run_to_completion
from workers.engine.config import SchedulerConfig
from workers.engine.engine import KVPool, LLMEngine, ModelLimits
from workers.engine.errors import InvalidRequestError
from workers.engine.request import Resume
from workers.engine.sampling import SamplingParams
from workers.engine.stats import EngineStats
from workers.messages import AddRequest

PROMPT = tuple(range(200, 210))  # 10 tokens: 2 full blocks
GREEDY = SamplingParams(max_tokens=3, temperature=0.0)


def make_engine(num_blocks: int = 16, enable_prefix_caching: bool = True) -> tuple[LLMEngine, EngineRunner]:
    runner = EngineRunner(BLOCK_SIZE)
    config = SchedulerConfig(
        max_model_len=num_blocks * BLOCK_SIZE, block_size=BLOCK_SIZE, enable_prefix_caching=enable_prefix_caching
    )
    engine = LLMEngine(runner, config, KVPool(num_blocks, BLOCK_BYTES), ModelLimits(1000, 4096))
    runner.scheduler = engine.scheduler
    return engine, runner


def test_stats_and_kv_report_count_blocks_and_hits() -> None:
    engine, _ = make_engine()
    stats = engine.stats()
    assert (stats.num_free_blocks, stats.num_evictable_blocks, stats.num_used_blocks) == (16, 0, 0)
    assert stats.prefix_cache_hit_rate is None

    run_to_completion(engine, [PromptSpec(PROMPT, GREEDY)])
    stats = engine.stats()
    # 12 tokens of KV written (10 prompt, 2 outputs fed back): 3 full blocks, all cached.
    assert (stats.num_free_blocks, stats.num_evictable_blocks, stats.num_used_blocks) == (16, 3, 0)
    assert stats.free_kv_bytes == stats.total_kv_bytes

    engine.add_request("again", PROMPT + (1, 2), GREEDY)
    engine.step()
    stats = engine.stats()
    assert engine.scheduler.get_request("again") is not None
    assert (stats.prefix_cache_queried_tokens, stats.prefix_cache_hit_tokens) == (10 + 12, 8)
    assert stats.prefix_cache_hit_rate == pytest.approx(8 / 22)
    assert (stats.num_free_blocks, stats.num_evictable_blocks, stats.num_used_blocks) == (13, 1, 3)
    assert stats.num_free_blocks + stats.num_used_blocks == stats.num_total_blocks


def test_stats_of_a_pool_alone() -> None:
    stats = EngineStats.of_pool(10, 6, 64)
    assert (stats.num_free_blocks, stats.num_used_blocks, stats.num_uncommitted_blocks) == (4, 6, 4)
    assert stats.free_kv_bytes == 4 * 64 and stats.prefix_cache_hit_rate is None
    assert EngineStats.of_pool(10, 12, 64).num_uncommitted_blocks == 0  # over-committed: none to promise


def test_cache_salt_is_validated_and_separates_requests() -> None:
    engine, _ = make_engine()
    for bad in ("", 7):
        with pytest.raises(InvalidRequestError) as info:
            engine.add_request("bad", PROMPT, GREEDY, cache_salt=bad)  # type: ignore[arg-type]
        assert info.value.field == "cache_salt"
    assert not engine.has_unfinished
    engine.add_request("a", PROMPT, GREEDY, cache_salt="tenant-1")
    while engine.has_unfinished:
        engine.step()
    # Anyone can predict the engine's cache from the prompt alone (the router will).
    assert len(engine.allocator.lookup(hash_blocks(PROMPT, BLOCK_SIZE, request_extra_keys("tenant-1")))) == 2
    assert engine.allocator.lookup(hash_blocks(PROMPT, BLOCK_SIZE)) == []
    b = engine.add_request("b", PROMPT, GREEDY, cache_salt="tenant-2")
    c = engine.add_request("c", PROMPT, GREEDY, cache_salt="tenant-1")
    engine.step()
    assert (b.num_cached_tokens, c.num_cached_tokens) == (0, 8)
    assert AddRequest("x", PROMPT, GREEDY).cache_salt is None


def test_a_resumed_request_hits_the_blocks_of_its_output_so_far() -> None:
    engine, runner = make_engine()
    params = SamplingParams(max_tokens=8, temperature=0.0)
    whole = run_to_completion(engine, [PromptSpec(PROMPT, params, "first")])[0]
    assert whole.output_ids == reference_output(PROMPT, 8)

    # The same request moved here after 5 outputs: 15 known tokens, 3 full blocks cached
    # (the first run wrote positions 0..16), so it starts at position 12.
    request = engine.add_request("moved", PROMPT, params, resume=Resume(tuple(whole.output_ids[:5])))
    engine.step()
    chunks = runner.plans[-1].chunks
    assert [(c.request_id, c.start_position, c.num_tokens) for c in chunks] == [("moved", 12, 3)]
    assert request.num_cached_tokens == 12 and request.num_cached_prompt_tokens == 10
    while engine.has_unfinished:
        engine.step()
    assert request.output_ids == whole.output_ids


def test_caching_off_reports_zeros() -> None:
    engine, _ = make_engine(enable_prefix_caching=False)
    run_to_completion(engine, [PromptSpec(PROMPT, GREEDY), PromptSpec(PROMPT, GREEDY)])
    stats = engine.stats()
    assert (stats.num_evictable_blocks, stats.prefix_cache_queried_tokens, stats.prefix_cache_hit_tokens) == (0, 0, 0)


def test_engine_args_flag() -> None:
    assert EngineArgs().enable_prefix_caching is True
    with pytest.raises(ValueError, match="enable_prefix_caching"):
        EngineArgs(enable_prefix_caching="yes")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="enable_prefix_caching"):
        SchedulerConfig(max_model_len=8, enable_prefix_caching=1)  # type: ignore[arg-type]
