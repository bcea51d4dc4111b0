"""A router without a bearer token never serves beside routers of its cluster that require
one (`{prefix}:routers:guard`, router/ownership.py): refused at its start, or stopped once
it finds one later; a router that requires a token beside open ones says so. Routers as
they live: Redis down at a start, a cluster older than the guard hash's TTL, the order
routers start in (a review's finds). Real redis-servers of each test's own; no Ray."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from pathlib import Path

import pytest

import router.ownership as ownership_module
from cluster.redis_server import EmbeddedRedis, RedisServerConfig
from router.core import Router, RouterConfig
from router.ownership import UnguardedBesideGuarded
from router.state import RequestStore, StoreConfig

LEASE_TTL_S = 1.0  # renewals every 0.25 s


def _router(url: str, router_id: str) -> Router:
    store = RequestStore(StoreConfig(url=url, prefix="guard", socket_timeout=0.5))
    router = Router(RouterConfig(lease_ttl_s=LEASE_TTL_S), store, router_id)

    async def adopt(*args: object, **kwargs: object) -> int:  # no workers here: nothing to adopt
        return 0

    router.moves.adopt = adopt  # type: ignore[method-assign]
    return router


async def _close(*routers: Router) -> None:
    for router in routers:
        await router.close(timeout_s=2.0)
        await router.store.close()


async def _until(condition: Callable[[], bool], what: str, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"waited {timeout_s} s for {what}"
        await asyncio.sleep(0.05)


def test_a_guarded_router_stays_guarded_past_the_guard_hash_s_ttl(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The guard was written once, at a start, with a 7-day TTL: a cluster whose routers had
    all run longer had none, and an open router started beside them. Every renewal writes
    it again. (7 days scaled to 1 s.)"""
    monkeypatch.setattr(ownership_module, "GUARDS_TTL_S", 1)
    with EmbeddedRedis(RedisServerConfig(state_dir=tmp_path / "redis")) as server:

        async def scenario() -> None:
            guarded, joining = _router(server.url, "host:50051"), _router(server.url, "host:50052")
            try:
                await guarded.check_store_at_start(guarded=True)
                await guarded.start_ownership("host:50051")
                await asyncio.sleep(2.5)  # "7 days" of renewals
                with pytest.raises(UnguardedBesideGuarded, match="host:50051 at host:50051 require a bearer token"):
                    await joining.check_store_at_start(guarded=False)
            finally:
                await _close(guarded, joining)

        asyncio.run(scenario())


def test_redis_down_at_either_start_does_not_let_an_open_router_serve_beside_a_guarded_one(tmp_path: Path) -> None:
    """A guarded router that started while Redis was down never wrote its guard (its lease was
    taken later by the renewals), and an open one started beside it; an open router whose
    start-time check Redis hid served on unchecked. Now every renewal writes the guard and
    compares: the open router finds the guarded one once Redis is back, and is stopped
    (Cluster.wait_for_failure), naming it."""
    server = EmbeddedRedis(RedisServerConfig(state_dir=tmp_path / "redis"))
    server.start()
    try:

        async def scenario() -> None:
            guarded, opened = _router(server.url, "host:50051"), _router(server.url, "host:50052")
            try:
                await asyncio.to_thread(server.stop)
                await guarded.check_store_at_start(guarded=True)  # Redis down: warned, not refused
                await guarded.start_ownership("host:50051")
                await opened.check_store_at_start(guarded=False)  # nothing to compare with: it starts
                await opened.start_ownership("host:50052")
                assert not opened.unguarded.is_set()
                await asyncio.to_thread(server.restart)
                await _until(opened.unguarded.is_set, "the open router to find the guarded one")
                assert "host:50051 at host:50051 require a bearer token, and this one has none" \
                    in opened.unguarded_problem
                assert not guarded.unguarded.is_set()
            finally:
                await _close(guarded, opened)

        asyncio.run(scenario())
    finally:
        server.stop()


@pytest.mark.parametrize("order", ["open-router-first", "started-side-by-side"])
def test_a_guarded_router_beside_an_open_one_says_so_and_the_open_one_stops(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, order: str
) -> None:
    """A router that requires a token beside a live open one said nothing: the workers were
    served to anyone through the open one while its operator believed them guarded. Side by
    side (`kvserve up` checks before its model loads and takes its lease after), the open
    one's own check could not have seen the guarded one. The guarded one warns, naming the
    open one, and the open one finds the guarded one at a renewal and is stopped."""
    caplog.set_level(logging.WARNING, logger="kvserve.router")
    with EmbeddedRedis(RedisServerConfig(state_dir=tmp_path / "redis")) as server:

        async def scenario() -> None:
            guarded, opened = _router(server.url, "host:50051"), _router(server.url, "host:50052")
            try:
                if order == "open-router-first":
                    await opened.check_store_at_start(guarded=False)
                    await opened.start_ownership("host:50052")
                    await guarded.check_store_at_start(guarded=True)
                    await guarded.start_ownership("host:50051")
                else:
                    await guarded.check_store_at_start(guarded=True)  # `kvserve up`, loading its model
                    await opened.check_store_at_start(guarded=False)  # a joined `kvserve router`: passes
                    await opened.start_ownership("host:50052")
                    await guarded.start_ownership("host:50051")
                await _until(opened.unguarded.is_set, "the open router to find the guarded one")
                await _until(lambda: any("host:50052" in r.getMessage() for r in caplog.records),
                             "the guarded router's warning")
            finally:
                await _close(guarded, opened)

        asyncio.run(scenario())
    said = [r.getMessage() for r in caplog.records if "host:50052 at host:50052" in r.getMessage()]
    assert len(said) == 1 and "serve this cluster without a bearer token, beside this one" in said[0], said
