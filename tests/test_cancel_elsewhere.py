"""A cancel asked through a router that does not own the request (router/ownership.py), on
a real redis-server: the request is marked and its owner is told on its channel, once per
ask, only while the request has not ended; an owner that subscribes again finds the marks
of what it missed.

Across routers, end to end: tests/test_two_routers.py::
test_a_request_waiting_in_its_owners_queue_is_cancelled_through_the_other_router."""

from __future__ import annotations

import asyncio
import dataclasses
from pathlib import Path

from cluster.redis_server import EmbeddedRedis, RedisServerConfig
from router.ownership import Ownership
from router.state import RequestRecord, RequestStatus, RequestStore, StoreConfig


def _record(request_id: str, owner: str) -> RequestRecord:
    return RequestRecord(request_id=request_id, status=RequestStatus.QUEUED, prompt_ids=[1, 2, 3],
                         sampling={"max_tokens": 4}, created_at=1.0, router_id=owner)


def test_an_ask_marks_the_request_and_reaches_its_owner_once(store_config: StoreConfig) -> None:
    async def scenario() -> None:
        store = RequestStore(store_config)
        owner, peer = Ownership(store, "router-a", 5.0), Ownership(store, "router-b", 5.0)
        asks = owner.cancel_requests()
        try:
            assert await anext(asks) is None  # subscribed: check what was missed
            await store.create(_record("queued", "router-a"))
            await store.create(_record("orphan", ""))
            await store.create(_record("done", "router-a"))
            await store.finish("done", RequestStatus.FINISHED, finish_reason="length")

            assert await peer.ask_to_cancel("queued") == (RequestStatus.QUEUED, "router-a")
            assert await asyncio.wait_for(anext(asks), 5) == "queued"
            marked = await store.get("queued")
            assert marked is not None and marked.cancel_requested and marked.status is RequestStatus.QUEUED

            # No owner: marked for whoever adopts it, nobody told. Ended: left as it is.
            assert await peer.ask_to_cancel("orphan") == (RequestStatus.QUEUED, "")
            assert await peer.ask_to_cancel("done") == (RequestStatus.FINISHED, "router-a")
            assert await peer.ask_to_cancel("never-made") is None
            done = await store.get("done")
            assert done is not None and not done.cancel_requested
            assert await owner.cancel_marked(["queued", "orphan", "done", "never-made"]) == ["queued", "orphan"]

            # Nothing else was published to router-a: the next message is the next ask.
            await store.create(_record("second", "router-a"))
            await peer.ask_to_cancel("second")
            assert await asyncio.wait_for(anext(asks), 5) == "second"
        finally:
            await asks.aclose()
            await store.close()

    asyncio.run(scenario())


def test_the_mark_round_trips_in_the_record(store_config: StoreConfig) -> None:
    async def scenario() -> None:
        store = RequestStore(store_config)
        try:
            original = dataclasses.replace(_record("r", "router-a"), cancel_requested=True)
            assert await store.create(original) is None
            assert await store.get("r") == original
            assert await store.create(_record("plain", "router-a")) is None
            plain = await store.get("plain")
            assert plain is not None and not plain.cancel_requested
        finally:
            await store.close()

    asyncio.run(scenario())


def test_a_router_back_from_a_redis_outage_holds_its_lease_before_it_adopts(tmp_path: Path) -> None:
    """The fresh-clone flake of test_a_router_that_starts_while_redis_is_down_adopts_once_
    redis_returns: adoption once Redis returned ran before the next lease renewal (every
    TTL/4), so the adopted request could finish while no lease named its router. Here
    Redis is down at the first tries; the lease must exist every time adopt() runs."""
    from router.moves import Mover

    redis_server = EmbeddedRedis(RedisServerConfig(state_dir=tmp_path / "redis"))
    redis_server.start()

    async def scenario() -> None:
        store = RequestStore(StoreConfig(url=redis_server.url, prefix="outage"))
        ownership = Ownership(store, "router-a", 5.0)
        leases_at_adopt: list[dict[str, str]] = []

        class _Router:
            pass

        router = _Router()
        router.ownership = ownership  # type: ignore[attr-defined]
        mover = Mover(router)  # type: ignore[arg-type]

        async def adopt(include_own: bool = False) -> int:
            leases_at_adopt.append(await ownership.live_routers())
            return 0

        mover.adopt = adopt  # type: ignore[method-assign]
        redis_server.stop()
        try:
            returning = asyncio.ensure_future(mover.adopt_when_redis_returns())
            await asyncio.sleep(1.2)  # two or three tries against the stopped server
            assert not returning.done() and leases_at_adopt == []
            redis_server.restart()
            await asyncio.wait_for(returning, 30)
            assert leases_at_adopt == [{"router-a": ""}]
        finally:
            await store.close()

    try:
        asyncio.run(scenario())
    finally:
        redis_server.stop()
