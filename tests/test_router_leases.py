"""Router leases in Redis (router/ownership.py), on a real redis-server of each test's own:
finding the live routers reads the two lease keys and nothing else, whatever else Redis
holds; a lease ends on Redis's clock; a router that stops drops its lease at once; the
keys go when the last lease in them ends. A renewal answers which routers hold a lease, and
a router looks for what dead peers left (PeerWatch) only when one of those leases ends.

The leases were keys `{prefix}:router:{id}` found by SCAN MATCH over the whole keyspace: a
lookup cost a round trip per 500 keys Redis held (every request's hash and log, for an hour),
and each router made one each renewal while a peer had requests running."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import redis

from cluster.redis_server import EmbeddedRedis, RedisServerConfig
from router.ownership import OlderRouters, Ownership, PeerWatch
from router.state import RequestStore, StoreConfig
from tests.cluster_harness import redis_command_calls

OTHER_KEYS = 20_000  # on the old SCAN, 40 round trips per lookup


def test_finding_the_live_routers_reads_only_the_lease_keys(tmp_path: Path) -> None:
    with EmbeddedRedis(RedisServerConfig(state_dir=tmp_path / "redis")) as server:
        config = StoreConfig(url=server.url, prefix="leases")
        with redis.Redis.from_url(server.url, decode_responses=True) as client:
            # Other requests' keys, under this prefix and another.
            pipe = client.pipeline(transaction=False)
            for i in range(OTHER_KEYS):
                pipe.hset(f"{'leases' if i % 2 else 'other'}:req:{i}", "status", "finished")
            pipe.execute()

            async def scenario() -> tuple[dict[str, str], dict[str, str], dict[str, int]]:
                store = RequestStore(config)
                try:
                    first, second = Ownership(store, "router-a", 30.0), Ownership(store, "router-b", 30.0)
                    first.address, second.address = "10.0.0.1:50051", "10.0.0.2:50051"
                    await first.renew()
                    await second.renew()
                    before = await first.live_routers()  # loads the script
                    client.config_resetstat()
                    live = await second.live_routers()
                    calls = redis_command_calls(client)
                    return before, live, calls
                finally:
                    await store.close()

            before, live, calls = asyncio.run(scenario())
            keys = sorted(client.scan_iter(match="leases:router*", count=1000))

    expected = {"router-a": "10.0.0.1:50051", "router-b": "10.0.0.2:50051"}
    assert before == live == expected
    # One script call; what it ran (Redis counts a script's commands too) reads the two keys.
    assert calls.pop("evalsha") == 1 and calls.pop("config") == 1, calls
    assert calls == {"time": 1, "zrangebyscore": 1, "hget": 2}, calls
    assert keys == ["leases:routers", "leases:routers:address"]


def test_a_lease_ends_on_its_ttl_and_a_stopped_router_drops_it_at_once(tmp_path: Path) -> None:
    with EmbeddedRedis(RedisServerConfig(state_dir=tmp_path / "redis")) as server:
        config = StoreConfig(url=server.url, prefix="leases")
        client = redis.Redis.from_url(server.url, decode_responses=True)

        async def scenario() -> None:
            store = RequestStore(config)
            try:
                short, long, leaving = (Ownership(store, "short", 0.4), Ownership(store, "long", 60.0),
                                        Ownership(store, "leaving", 60.0))
                answers = []
                for ownership in (short, long, leaving):
                    ownership.address = f"{ownership.router_id}:1"
                    answers.append(await ownership.renew())
                # Each renewal answers the routers holding a lease then, its own included.
                assert answers == [{"short"}, {"short", "long"}, {"short", "long", "leaving"}]
                assert set(await long.live_routers()) == {"short", "long", "leaving"}
                await leaving.release()
                assert set(await long.live_routers()) == {"short", "long"}

                await asyncio.sleep(0.6)  # past short's TTL
                assert await long.live_routers() == {"long": "long:1"}
                assert await long.renew() == {"long"}  # and drops the ended lease from both keys
                assert client.zrange("leases:routers", 0, -1) == ["long"]
                assert client.hgetall("leases:routers:address") == {"long": "long:1"}
                assert 50_000 < client.pttl("leases:routers") <= 60_000

                await short.renew()  # a router that was only stalled holds a lease again
                assert set(await long.live_routers()) == {"short", "long"}
                # The keys live as long as the longest lease in them, not the one set last.
                assert client.pttl("leases:routers") > 50_000 and client.pttl("leases:routers:address") > 50_000

                await long.release()  # short's 0.4 s lease is the last: the keys go with it
                deadline = time.monotonic() + 10
                while client.exists("leases:routers", "leases:routers:address") and time.monotonic() < deadline:
                    await asyncio.sleep(0.05)
                assert client.exists("leases:routers", "leases:routers:address") == 0
                assert await long.live_routers() == {}
            finally:
                await store.close()

        try:
            asyncio.run(scenario())
        finally:
            client.close()


def test_a_router_looks_for_orphans_only_when_a_lease_it_saw_ends() -> None:
    """PeerWatch after each renewal: a sweep (adopt(), O(requests in flight)) when this router
    becomes steady, when a lease it saw has ended, again while the last sweep has not
    finished, and every sweep_every_s; never while the same routers hold their leases."""
    watch = PeerWatch(sweep_every_s=60.0)
    me, peers = "a", {"a", "b", "c"}
    assert watch.due(peers, steady=False, now=0.0) is None  # not steady: not a look
    assert watch.due(peers, steady=True, now=1.0) == "this router's lease is steady"
    watch.swept(1.5)
    # The same leases, and a new router joining, orphan nothing: no sweep, many renewals on.
    for i in range(100):
        assert watch.due(peers | ({"d"} if i >= 50 else set()), steady=True, now=2.0 + i * 0.5) is None
    assert watch.sweeps == 1
    # d's and c's leases end: a sweep, naming them.
    assert watch.due({me, "b"}, steady=True, now=60.0) == "the lease of router(s) c, d ended"
    # The sweep failed (Redis went away): due again at the next renewal, though nothing else ended.
    assert watch.due({me, "b"}, steady=True, now=60.5) == "the lease of router(s) c, d ended"
    watch.swept(61.0)
    assert watch.due({me, "b"}, steady=True, now=61.5) is None
    # A router that only stalled comes back: not an end.
    assert watch.due({me, "b", "c"}, steady=True, now=62.0) is None
    # This router's own lease lapsed (a gap over its TTL): the peers' ends meanwhile went
    # unseen, so once steady again it sweeps, even with the same leases as before.
    assert watch.due({me, "b", "c"}, steady=False, now=80.0) is None
    assert watch.due({me, "b", "c"}, steady=True, now=90.0) == "this router's lease is steady"
    watch.swept(90.0)
    # The safety net: sweep_every_s after the last sweep.
    assert watch.due({me, "b", "c"}, steady=True, now=149.9) is None
    assert watch.due({me, "b", "c"}, steady=True, now=150.0) == "60 s since the last sweep"
    watch.swept(150.0)
    assert watch.sweeps == 4
    with pytest.raises(ValueError, match="sweep_every_s"):
        PeerWatch(sweep_every_s=0)


def test_the_owners_of_many_requests_are_read_whole_across_pipelines(tmp_path: Path) -> None:
    """owners() and cancel_marked() read in pipelines of a bounded size (so the router's loop
    runs between them): every request's answer comes back, in order, across their edges."""
    from router import ownership as module

    count = 3 * module._FIELDS_PER_PIPELINE + 7
    with EmbeddedRedis(RedisServerConfig(state_dir=tmp_path / "redis")) as server:
        config = StoreConfig(url=server.url, prefix="many")
        with redis.Redis.from_url(server.url, decode_responses=True) as client:
            pipe = client.pipeline(transaction=False)
            for i in range(count):
                if i % 7:  # every 7th request has no record
                    pipe.hset(f"many:req:r{i}", mapping={"router_id": f"router-{i % 3}", "cancel_requested": str(i % 2)})
            pipe.execute()

            async def scenario() -> tuple[dict[str, str], list[str]]:
                store = RequestStore(config)
                try:
                    ownership = Ownership(store, "router-0", 30.0)
                    ids = [f"r{i}" for i in range(count)]
                    return await ownership.owners(ids), await ownership.cancel_marked(ids)
                finally:
                    await store.close()

            owners, marked = asyncio.run(scenario())
    assert list(owners) == [f"r{i}" for i in range(count)]
    assert owners == {f"r{i}": (f"router-{i % 3}" if i % 7 else "") for i in range(count)}
    assert marked == [f"r{i}" for i in range(count) if i % 7 and i % 2]


class _OlderRouter:
    """A router of the earlier version, as Redis sees it: the key {prefix}:router:{id} that
    it renews (PX), until stopped."""

    def __init__(self, url: str, key: str, ttl_ms: int = 1500) -> None:
        self.client = redis.Redis.from_url(url, decode_responses=True)
        self.key, self.ttl_ms = key, ttl_ms
        self.stopped = threading.Event()
        self.thread = threading.Thread(target=self._renew, daemon=True)

    def _renew(self) -> None:
        while not self.stopped.is_set():
            self.client.set(self.key, "10.0.0.9:50051", px=self.ttl_ms)
            self.stopped.wait(self.ttl_ms / 4000)

    def __enter__(self) -> _OlderRouter:
        self.client.set(self.key, "10.0.0.9:50051", px=self.ttl_ms)
        self.thread.start()
        return self

    def __exit__(self, *_: object) -> None:
        """It stops as those routers did on a clean stop: its key goes (none is left in the
        session's Redis for another test's start to wait out)."""
        self.stopped.set()
        self.thread.join(timeout=5)
        self.client.delete(self.key)
        self.client.close()


def test_a_router_refuses_to_start_beside_routers_of_the_earlier_lease_format(redis_server: EmbeddedRedis) -> None:
    """Routers of the earlier version kept one key per lease ({prefix}:router:{id}); the two
    versions cannot see each other's leases. A start waits for such a lease that was left
    behind to lapse, and refuses, naming it, one that is still renewed."""
    prefix = "older"
    config = StoreConfig(url=redis_server.url, prefix=prefix)
    with redis.Redis.from_url(redis_server.url, decode_responses=True) as client:
        client.set(f"{prefix}:router:left-behind", "10.0.0.8:50051", px=800)  # its router stopped
        client.zadd(f"{prefix}:routers", {"current": 1})  # this version's keys are not taken for one
        client.hset(f"{prefix}:routers:address", "current", "x")

        async def scenario() -> tuple[dict[str, int], float, str]:
            store = RequestStore(config)
            try:
                ownership = Ownership(store, "new", 10.0)
                found = await ownership.older_routers()
                started = time.monotonic()
                with _OlderRouter(redis_server.url, f"{prefix}:router:still-running"):
                    with pytest.raises(OlderRouters) as refused:
                        await ownership.refuse_beside_older_routers(poll_s=0.1)
                waited = time.monotonic() - started
                # Once it has stopped (and the lease left behind has lapsed), a start goes ahead.
                await ownership.refuse_beside_older_routers(poll_s=0.1)
                return found, waited, str(refused.value)
            finally:
                await store.close()

        found, waited, message = asyncio.run(scenario())
    assert set(found) == {"left-behind"} and 0 < found["left-behind"] <= 800
    assert "still-running" in message and "left-behind" not in message, message
    assert "older:router:ID" in message and "docs/deploy.md" in message
    assert waited >= 1.0  # it waited out the leases' TTLs before refusing


def test_kvserve_up_says_so_and_exits_before_loading_the_model(redis_server: EmbeddedRedis, tmp_path: Path) -> None:
    """The user's path: `kvserve up` over a Redis where a router of the earlier version is
    running exits 1 with the reason, before any worker starts."""
    with _OlderRouter(redis_server.url, "kvserve:router:old-host:50051"):
        done = subprocess.run(
            [sys.executable, "-m", "cluster.cli", "up", "--redis-url", redis_server.url, "--model", "tiny",
             "--port", "0", "--metrics-port", "off", "--state-dir", str(tmp_path / "state")],
            capture_output=True, text=True, timeout=180, env={**os.environ, "RAY_DEDUP_LOGS": "0"},
        )
    assert done.returncode == 1, done.stderr[-3000:]
    assert "error: routers of an earlier kvserve version hold leases in this Redis: old-host:50051" in done.stderr
    assert "loading the model" not in done.stderr, done.stderr[-3000:]


def test_a_draining_router_is_not_a_peer_to_hand_requests_to(redis_server: EmbeddedRedis) -> None:
    """A router that stops with requests running leaves them to a peer that is serving
    (Router.drain(hand_over=True)): not to one that drains too, as every router of a
    stopping `kvserve up --routers N` does; a mark left by a router that died draining
    ends on its own, and a restart under that id clears it."""

    async def scenario() -> list[list[str]]:
        store = RequestStore(StoreConfig(url=redis_server.url, prefix=f"drain-{os.getpid()}-{time.monotonic_ns()}"))
        try:
            a, b, c = (Ownership(store, name, 30.0) for name in ("router-a", "router-b", "router-c"))
            for ownership in (a, b, c):
                await ownership.renew()
            seen = [await a.serving_peers()]
            await b.mark_draining(30.0)
            seen.append(await a.serving_peers())
            await c.mark_draining(0.3)
            seen.append(await a.serving_peers())
            await asyncio.sleep(0.5)  # c's mark ended: as if it died draining and came back
            seen.append(await a.serving_peers())
            await b.clear_draining()  # b's next run
            await c.release()
            seen.append(await a.serving_peers())
            return seen
        finally:
            await store.close()

    assert asyncio.run(scenario()) == [
        ["router-b", "router-c"], ["router-c"], [], ["router-c"], ["router-b"],
    ]


def test_a_draining_router_adopts_nothing() -> None:
    """It takes no new work: what a dead peer left goes to one that serves. (Reaching Redis
    would fail here: the store is None.)"""
    from types import SimpleNamespace

    from router.moves import Mover

    router = SimpleNamespace(draining=True, limits=object(), ownership=None, store=None)
    assert asyncio.run(Mover(router).adopt()) == 0  # type: ignore[arg-type]
