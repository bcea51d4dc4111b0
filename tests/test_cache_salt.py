"""GenerateRequest.cache_salt on the router's side: the salted prompt hashes a request is
placed and committed by, and the salt a move or an adoption must keep (the engine's own
isolation is tests/test_prefix_cache.py's; through a cluster, tests/test_cluster_prefix.py)."""

from __future__ import annotations

import asyncio
import uuid
from types import SimpleNamespace
from typing import Any

from cluster.redis_server import EmbeddedRedis
from router.moves import Mover
from router.records import RequestRecord
from router.state import RequestStatus, RequestStore, StoreConfig
from router.validation import ClusterLimits, prompt_block_hashes
from workers.engine.block_hash import hash_blocks, request_extra_keys

BLOCK = 16
PROMPT = tuple((5 * i + 1) % 200 for i in range(3 * BLOCK + 2))


def test_the_router_hashes_a_salted_prompt_as_the_engine_does() -> None:
    plain = prompt_block_hashes(PROMPT, BLOCK)
    salted = prompt_block_hashes(PROMPT, BLOCK, "tenant-a")
    assert len(plain) == len(salted) == 3
    assert not set(plain) & set(salted)  # not one block shared across salts
    assert salted != prompt_block_hashes(PROMPT, BLOCK, "tenant-b")
    assert salted == tuple(hash_blocks(PROMPT[:-1], BLOCK, request_extra_keys("tenant-a")))
    assert plain == tuple(hash_blocks(PROMPT[:-1], BLOCK, request_extra_keys(None)))


def test_a_salted_record_keeps_its_salt_through_redis_and_an_adoption(redis_server: EmbeddedRedis) -> None:
    """A restarted router rebuilds a request from its record: without the salt it would be
    placed by (and share) the unsalted blocks of another tenant's prompt."""

    async def scenario() -> list[Any]:
        store = RequestStore(StoreConfig(url=redis_server.url, prefix=f"salt-{uuid.uuid4().hex[:8]}"))
        router = SimpleNamespace(store=store, limits=ClusterLimits(vocab_size=256, max_model_len=512, block_size=BLOCK,
                                                                  max_worker_blocks=64))
        trackers = []
        try:
            for request_id, salt in (("salted", "tenant-a"), ("plain", "")):
                record = RequestRecord(request_id, RequestStatus.RUNNING, list(PROMPT), {"max_tokens": 8},
                                       cache_salt=salt)
                assert await store.create(record) is None
                stored = await store.get(request_id)
                assert stored is not None and stored.cache_salt == salt
                trackers.append(await Mover(router)._tracker_from_record(stored))  # type: ignore[arg-type]
        finally:
            await store.close()
        return trackers

    salted, plain = asyncio.run(scenario())
    assert salted.cache_salt == "tenant-a" and salted.block_hashes == prompt_block_hashes(PROMPT, BLOCK, "tenant-a")
    assert plain.cache_salt is None and plain.block_hashes == prompt_block_hashes(PROMPT, BLOCK)
