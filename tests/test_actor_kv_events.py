"""The worker actor's KV events and snapshots, in process (no Ray): the tiny preset on CPU,
a KV pool small enough that prompts evict each other, and a reader that lags so that
batches are merged.

Every prompt is its family's 3-block prefix plus one full block of its own (and a partial
one), so 4 x 3 + 24 distinct full blocks pass through a 24-block pool: evictions happen
whatever the timing. (The prompts once drew from the reader's random generator too, so
their lengths, and with them whether anything was evicted, depended on how many batches
the reader had seen: a loaded CI machine once saw no eviction at all.)

Whatever the moment a snapshot is taken, applying to it every batch the stream numbered
above its seq must give the cache as it ends up; the stream's numbers run 1, 2, 3, ...
"""

from __future__ import annotations

import asyncio
import random

from workers.actor import WorkerActor
from workers.config import EngineArgs, WorkerConfig
from workers.engine.block_hash import BlockHash
from workers.engine.sampling import SamplingParams
from workers.messages import AddRequest, KVSnapshot, StepBatch

BLOCK_SIZE = 16
FAMILIES = [[(37 * f + i) % 250 + 1 for i in range(3 * BLOCK_SIZE)] for f in range(4)]  # 3-block prefixes


def _actor() -> WorkerActor:
    engine = EngineArgs(num_threads=1, kv_cache_memory=24 * 131072, block_size=BLOCK_SIZE, seed=0)  # 24 blocks
    return WorkerActor(WorkerConfig("w0", engine, report_interval_s=0.05, heartbeat_interval_s=0.05))


def _replay(snapshot: KVSnapshot, batches: list[StepBatch]) -> set[BlockHash]:
    cached = set(snapshot.hashes)
    for batch in batches:
        if batch.kv_events is not None and batch.kv_events.seq > snapshot.seq:
            for stored, block_hash in batch.kv_events.events:
                (cached.add if stored else cached.discard)(block_hash)
    return cached


async def _scenario(actor: WorkerActor) -> None:
    rng = random.Random(3)  # prompts and pauses: the same every run
    lag = random.Random(4)  # the reader's, whose draws depend on how many batches arrive
    batches: list[StepBatch] = []
    cached_tokens: dict[str, int] = {}
    finished: set[str] = set()

    async def read() -> None:
        async for batch in actor.events():
            batches.append(batch)
            for event in batch.events:
                cached_tokens.setdefault(event.request_id, event.num_cached_tokens)
                assert event.num_cached_tokens == cached_tokens[event.request_id], "it changed mid-request"
                if event.finished:
                    finished.add(event.request_id)
            if lag.random() < 0.3:
                await asyncio.sleep(0.02)  # lag: the next item merges several steps' batches

    reader = asyncio.create_task(read())
    snapshots = [await actor.kv_snapshot()]
    num_requests = 24
    for index in range(num_requests):
        own = rng.randint(BLOCK_SIZE + 1, 2 * BLOCK_SIZE - 2)  # a full block of its own, and a partial one
        prompt = FAMILIES[index % len(FAMILIES)] + [rng.randrange(1, 250) for _ in range(own)]
        await actor.add_request(AddRequest(f"r{index}", tuple(prompt), SamplingParams(max_tokens=6, temperature=0.0)))
        if index % 3 == 0:
            snapshots.append(await actor.kv_snapshot())  # some while steps run, some between
        await asyncio.sleep(rng.choice((0.0, 0.0, 0.01)))
    while len(finished) < num_requests:
        await asyncio.sleep(0.05)
    await asyncio.sleep(0.3)  # idle: whatever was pending has been handed out
    final = await actor.kv_snapshot()
    report = batches[-1].report  # idle: a heartbeat's, the engine thread's last
    reader.cancel()
    assert (report.num_running, report.num_committed_blocks) == (0, 0)
    assert report.num_evictable_blocks == len(final.hashes)  # idle: every cached block is unheld

    numbered = [b.kv_events.seq for b in batches if b.kv_events is not None]
    assert numbered == list(range(1, len(numbered) + 1)), "KV event batches are numbered without a gap"
    assert final.seq == numbered[-1]
    assert len(final.hashes) == len(set(final.hashes)) > 0
    evicted = sum(1 for b in batches if b.kv_events for stored, _ in b.kv_events.events if not stored)
    assert evicted > 0, "the pool is small enough that prompts evict each other"
    assert any(len(b.events) > 1 and b.kv_events is not None for b in batches)
    for snapshot in snapshots:
        assert _replay(snapshot, batches) == set(final.hashes), f"replay from snapshot #{snapshot.seq}"
    # Requests after the first of their family found its prefix cached (at least 2 of its 3 blocks).
    hits = [cached_tokens[f"r{i}"] for i in range(len(FAMILIES), num_requests)]
    assert sum(1 for h in hits if h >= 2 * BLOCK_SIZE) >= len(hits) // 2, hits
    assert all(h % BLOCK_SIZE == 0 for h in cached_tokens.values())


def test_snapshots_and_numbered_events_follow_the_cache() -> None:
    actor = _actor()
    try:
        asyncio.run(asyncio.wait_for(_scenario(actor), timeout=120))
    finally:
        asyncio.run(actor.stop())
