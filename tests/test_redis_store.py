"""The request store against a real redis-server (no mocks).

Async code runs under asyncio.run inside plain test functions; each test uses one
event loop for its store, as the router does. The token log is a Redis Stream whose
entry ids come from output offsets (router/state.py's docstring): tests look at the
raw stream too, to pin the layout that readers seek by.
"""

from __future__ import annotations

import asyncio
import socket
import subprocess
import time
from collections.abc import Coroutine
from pathlib import Path
from typing import Any, TypeVar

import pytest
import redis

import router.state

from cluster.redis_server import EmbeddedRedis, RedisServerConfig, find_redis_server
from router.state import (
    FollowersExhausted,
    LogEnd,
    LogEntry,
    RequestRecord,
    RequestStatus,
    RequestStore,
    StepWrite,
    StoreConfig,
    StoreUnavailable,
)

_T = TypeVar("_T")


def run(coroutine: Coroutine[Any, Any, _T]) -> _T:
    return asyncio.run(coroutine)


def record(request_id: str, prompt_ids: list[int] | None = None) -> RequestRecord:
    return RequestRecord(
        request_id=request_id,
        status=RequestStatus.QUEUED,
        prompt_ids=[1, 2, 3] if prompt_ids is None else prompt_ids,
        sampling={"temperature": 0.7, "max_tokens": 16},
        seed=1234,
        created_at=1700000000.5,
    )


def raw_log(config: StoreConfig, request_id: str) -> list[tuple[str, dict[str, str]]]:
    """The log stream as Redis holds it: (entry id, fields)."""
    with redis.Redis.from_url(config.url, decode_responses=True) as client:
        return [(entry_id, dict(fields)) for entry_id, fields in client.xrange(f"{config.prefix}:log:{request_id}")]


def unused_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port: int = probe.getsockname()[1]
        return port


def test_find_redis_server_runs() -> None:
    binary = find_redis_server()
    version = subprocess.run([binary, "--version"], capture_output=True, text=True, timeout=10, check=True)
    assert "Redis server" in version.stdout


def test_create_if_absent_is_atomic(store_config: StoreConfig) -> None:
    async def scenario() -> None:
        store = RequestStore(store_config)
        try:
            # Each contender has its own prompt, so we can tell whose record won.
            results = await asyncio.gather(*(store.create(record("dup", [i])) for i in range(20)))
            winners = [i for i, result in enumerate(results) if result is None]
            assert len(winners) == 1
            stored = await store.get("dup")
            assert stored is not None and stored.prompt_ids == [winners[0]]
            assert all(result == stored for result in results if result is not None)
            assert await store.active_ids() == ["dup"]
        finally:
            await store.close()

    run(scenario())


def test_record_round_trips(store_config: StoreConfig) -> None:
    async def scenario() -> None:
        store = RequestStore(store_config)
        try:
            original = record("r1")
            assert await store.create(original) is None
            assert await store.get("r1") == original
            await store.update("r1", status=RequestStatus.RUNNING, worker_id="w-0", num_migrations=1)
            updated = await store.get("r1")
            assert updated is not None
            assert (updated.status, updated.worker_id, updated.num_migrations) == (RequestStatus.RUNNING, "w-0", 1)
            assert not updated.is_finished
        finally:
            await store.close()

    run(scenario())


def test_write_step_and_read_log(store_config: StoreConfig) -> None:
    lp = [{"token_id": t, "logprob": -0.1 * t} for t in range(10)]

    async def scenario() -> None:
        store = RequestStore(store_config)
        try:
            for request_id in ("a", "b", "c"):
                assert await store.create(record(request_id)) is None
            # Step 1: a gets one token, b gets three at once (its text belongs to the last).
            await store.write_step(
                [
                    StepWrite("a", LogEntry(0, (10,), "x"), {"status": "RUNNING", "first_token_at": 1.5}),
                    StepWrite("b", LogEntry(0, (20, 21, 22), "abc", tuple(lp[:3])), {"status": "RUNNING"}),
                    StepWrite("c", None, {"worker_id": "w-1"}),
                ]
            )
            # Step 2.
            await store.write_step(
                [
                    StepWrite("a", LogEntry(1, (11, 12), "yz"), {}),
                    StepWrite("b", LogEntry(3, (23,), "d", tuple(lp[3:4])), {}),
                ]
            )
            full_b = await store.read_log("b")
            assert full_b == [
                LogEntry(0, (20, 21, 22), "abc", tuple(lp[:3])),
                LogEntry(3, (23,), "d", tuple(lp[3:4])),
            ]
            # Mid-entry: tokens and logprobs are sliced, the text stays whole.
            assert await store.read_log("b", 1) == [
                LogEntry(1, (21, 22), "abc", tuple(lp[1:3])),
                LogEntry(3, (23,), "d", tuple(lp[3:4])),
            ]
            assert await store.read_log("b", 3) == [LogEntry(3, (23,), "d", tuple(lp[3:4]))]
            assert await store.read_log("b", 4) == []
            assert await store.read_log("b", 100) == []
            assert await store.read_log("a", 2) == [LogEntry(2, (12,), "yz")]
            assert await store.read_log("c") == []
            assert await store.read_log("never-created") == []

            a = await store.get("a")
            b = await store.get("b")
            c = await store.get("c")
            assert a is not None and b is not None and c is not None
            assert (a.status, a.first_token_at, a.num_output_tokens) == (RequestStatus.RUNNING, 1.5, 3)
            assert b.num_output_tokens == 4
            assert (c.status, c.worker_id) == (RequestStatus.QUEUED, "w-1")
        finally:
            await store.close()

    run(scenario())


def test_resent_step_is_not_logged_twice(store_config: StoreConfig) -> None:
    async def scenario() -> None:
        store = RequestStore(store_config)
        try:
            await store.create(record("r"))
            step = [StepWrite("r", LogEntry(0, (5, 6), "hi"), {"status": "RUNNING"})]
            await store.write_step(step)
            await store.write_step(step)
            # Text released after the last token: an entry with no tokens.
            flush = [StepWrite("r", LogEntry(2, (), "!"), {})]
            await store.write_step(flush)
            await store.write_step(flush)
            assert await store.read_log("r") == [LogEntry(0, (5, 6), "hi"), LogEntry(2, (), "!")]
            assert await store.read_log("r", 1) == [LogEntry(1, (6,), "hi"), LogEntry(2, (), "!")]
            assert await store.read_log("r", 2) == [LogEntry(2, (), "!")]
            assert await store.read_log("r", 3) == []
            stored = await store.get("r")
            assert stored is not None and stored.num_output_tokens == 2
        finally:
            await store.close()

    run(scenario())


def test_one_step_call_sorts_each_request_on_its_own(store_config: StoreConfig) -> None:
    """A step is one script call for all its requests: each request's write lands, is
    skipped or is fenced by its own state, and text and values outside ASCII are stored
    as sent."""

    async def scenario() -> None:
        owner, peer = RequestStore(store_config), RequestStore(store_config)
        owner.set_owner("router-a")
        try:
            for request_id in ("fresh", "ended", "repeat", "theirs"):
                assert await owner.create(record(request_id)) is None
            await owner.write_step([StepWrite("repeat", LogEntry(0, (1,), "a"), {})])
            await owner.finish("ended", RequestStatus.FINISHED, "length")
            await peer.update("theirs", router_id="router-b")
            fenced = await owner.write_step([
                StepWrite("fresh", LogEntry(0, (7, 8), 'é "ü"\\n 😀'), {"error": "naïve ✓"}),
                StepWrite("ended", LogEntry(0, (9,), "late"), {}),
                StepWrite("never-created", LogEntry(0, (9,), "x"), {}),
                StepWrite("repeat", LogEntry(0, (1,), "a"), {}),
                StepWrite("theirs", LogEntry(0, (3,), "no"), {}),
            ])
            assert fenced == ["theirs"]
            assert await owner.read_log("fresh") == [LogEntry(0, (7, 8), 'é "ü"\\n 😀')]
            fresh = await owner.get("fresh")
            assert fresh is not None and (fresh.error, fresh.num_output_tokens) == ("naïve ✓", 2)
            assert await owner.read_log("ended") == []
            assert await owner.get("never-created") is None
            assert await owner.read_log("repeat") == [LogEntry(0, (1,), "a")]
            assert await owner.read_log("theirs") == []
        finally:
            await owner.close()
            await peer.close()

    run(scenario())


def test_finish_expires_keys_and_leaves_active(store_config: StoreConfig) -> None:
    async def scenario() -> None:
        store = RequestStore(store_config)
        try:
            await store.create(record("done"))
            await store.create(record("still-running"))
            await store.write_step([StepWrite("done", LogEntry(0, (7,), "t"), {"status": "RUNNING"})])
            assert await store.ttl("done") == (-1, -1)
            assert await store.active_ids() == ["done", "still-running"]

            await store.finish("done", RequestStatus.FINISHED, finish_reason="length", finished_at=42.0)
            finished = await store.get("done")
            assert finished is not None and finished.is_finished
            assert (finished.status, finished.finish_reason, finished.finished_at) == (
                RequestStatus.FINISHED,
                "length",
                42.0,
            )
            hash_ttl, log_ttl = await store.ttl("done")
            assert 0 < hash_ttl <= store_config.ttl_seconds
            assert 0 < log_ttl <= store_config.ttl_seconds
            with redis.Redis.from_url(store_config.url, decode_responses=True) as client:
                assert client.type(f"{store_config.prefix}:log:done") == "stream"
            assert await store.active_ids() == ["still-running"]

            # The log is final and the first end wins: late writes and a late cancel do nothing.
            await store.write_step([StepWrite("done", LogEntry(1, (8,), "u"), {"status": "RUNNING"})])
            await store.finish("done", RequestStatus.CANCELLED)
            assert await store.get("done") == finished
            assert await store.read_log("done") == [LogEntry(0, (7,), "t")]
            assert [entry_id for entry_id, _ in raw_log(store_config, "done")] == ["1-0", "1-1"]

            # Ending through a status field is still an end: keys expire.
            await store.update("still-running", status=RequestStatus.FAILED, error="worker died")
            hash_ttl, _ = await store.ttl("still-running")
            assert 0 < hash_ttl <= store_config.ttl_seconds
            assert await store.active_ids() == []
        finally:
            await store.close()

    run(scenario())


def test_entry_ids_seek_by_offset_straddling_and_text_only(store_config: StoreConfig) -> None:
    """The stream ids of the docstring's picture: A = tokens 0-1, B = tokens 2-4, C = text
    only at 5, then the end marker; every read from an offset starts at its seek id."""

    async def scenario() -> None:
        store = RequestStore(store_config)
        try:
            await store.create(record("r"))
            await store.write_step([StepWrite("r", LogEntry(0, (10, 11), "ab"), {"status": "RUNNING"})])
            await store.write_step([StepWrite("r", LogEntry(2, (12, 13, 14), "cde"), {})])
            await store.write_step([StepWrite("r", LogEntry(5, (), "!"), {})])
            await store.finish("r", RequestStatus.FINISHED, finish_reason="length", finished_at=7.0)
            a, b, c = LogEntry(0, (10, 11), "ab"), LogEntry(2, (12, 13, 14), "cde"), LogEntry(5, (), "!")
            assert raw_log(store_config, "r") == [
                ("2-0", {"e": a.to_json()}),
                ("5-0", {"e": b.to_json()}),
                ("5-1", {"e": c.to_json()}),
                ("5-2", {"end": "FINISHED", "finish_reason": "length", "error": "", "n": "5"}),
            ]
            assert await store.read_log("r") == [a, b, c]
            assert await store.read_log("r", 1) == [LogEntry(1, (11,), "ab"), b, c]
            assert await store.read_log("r", 2) == [b, c]  # A ends at 2 (id 2-0): not read
            # B straddles 3 and 4: sliced, its text whole.
            assert await store.read_log("r", 3) == [LogEntry(3, (13, 14), "cde"), c]
            assert await store.read_log("r", 4) == [LogEntry(4, (14,), "cde"), c]
            assert await store.read_log("r", 5) == [c]  # the text-only entry sits at 5
            assert await store.read_log("r", 6) == []
            # follow() of an ended request: what is there, then its end, without blocking.
            items = [item async for item in store.follow("r", 3)]
            assert items == [LogEntry(3, (13, 14), "cde"), c, LogEnd(RequestStatus.FINISHED, "length", "", 5)]
            assert store.num_followers == 0
        finally:
            await store.close()

    run(scenario())


def test_an_end_without_output_and_a_resent_end_write_one_marker(store_config: StoreConfig) -> None:
    async def scenario() -> None:
        store = RequestStore(store_config)
        try:
            await store.create(record("c"))
            await store.finish("c", RequestStatus.CANCELLED, finish_reason="cancelled")
            await store.finish("c", RequestStatus.CANCELLED, finish_reason="cancelled")  # resent
            await store.update("c", status=RequestStatus.FAILED, error="late")  # first end wins
            assert raw_log(store_config, "c") == [
                ("0-1", {"end": "CANCELLED", "finish_reason": "cancelled", "error": "", "n": "0"}),
            ]
            assert await store.read_log("c") == []
            assert [item async for item in store.follow("c")] == [LogEnd(RequestStatus.CANCELLED, "cancelled", "", 0)]
            hash_ttl, log_ttl = await store.ttl("c")
            assert 0 < hash_ttl <= store_config.ttl_seconds and 0 < log_ttl <= store_config.ttl_seconds
        finally:
            await store.close()

    run(scenario())


def test_follow_waits_for_each_entry_and_the_end(store_config: StoreConfig) -> None:
    """A follower from offset 1 gets what is there, then each step as it lands (XREAD BLOCK),
    every token once, then the end; it blocks on a connection of its own."""

    async def scenario() -> None:
        writer, reader = RequestStore(store_config), RequestStore(store_config)
        try:
            await writer.create(record("f"))
            await writer.write_step([StepWrite("f", LogEntry(0, (1, 2), "ab"), {"status": "RUNNING"})])
            got: list[LogEntry | LogEnd] = []
            following = reader.follow("f", 1)

            async def read_all() -> None:
                async for item in following:
                    got.append(item)

            task = asyncio.create_task(read_all())
            for offset in range(2, 12):
                await asyncio.sleep(0.02)
                # The first step is sent twice (a resent pipeline): the follower sees it once.
                for _ in range(2 if offset == 2 else 1):
                    await writer.write_step([StepWrite("f", LogEntry(offset, (offset + 1,), str(offset)), {})])
            assert reader.num_followers == 1, "caught up, it waits in XREAD BLOCK"
            # The shared pool stays free for others while the follower blocks.
            assert await reader.get("f") is not None
            await writer.finish("f", RequestStatus.FINISHED, finish_reason="length")
            await asyncio.wait_for(task, 10)
            assert got[0] == LogEntry(1, (2,), "ab")
            assert got[1:-1] == [LogEntry(o, (o + 1,), str(o)) for o in range(2, 12)]
            assert got[-1] == LogEnd(RequestStatus.FINISHED, "length", "", 12)
            assert reader.num_followers == 0
        finally:
            await writer.close()
            await reader.close()

    run(scenario())


def test_a_follower_from_past_the_end_hears_the_end_at_once_not_after_a_block(
    store_config: StoreConfig, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An offset past the log's end: the end marker, and whatever comes, have ids below
    from_offset-0, where an XREAD from there never looks. The follower used to learn of
    the end only from the hash, after a whole BLOCK that saw nothing (5 s for each such
    Stream call, found by a Node.js client). The BLOCK is made 120 s here: every wait
    below is bounded by 60 s, so only a follower that never blocks passes."""
    monkeypatch.setattr(router.state, "_FOLLOW_BLOCK_S", 120.0)

    async def follow_all(store: RequestStore, request_id: str, from_offset: int) -> list[LogEntry | LogEnd]:
        return [item async for item in store.follow(request_id, from_offset)]

    async def scenario() -> None:
        writer, reader = RequestStore(store_config), RequestStore(store_config)
        try:
            # Ended with 3 tokens; from offsets 4 and 2**63 - 1.
            await writer.create(record("ended"))
            await writer.write_step([StepWrite("ended", LogEntry(0, (1, 2, 3), "abc"), {"status": "RUNNING"})])
            await writer.finish("ended", RequestStatus.FINISHED, finish_reason="length")
            end = LogEnd(RequestStatus.FINISHED, "length", "", 3)
            for offset in (3, 4, 2**63 - 1):
                assert await asyncio.wait_for(follow_all(reader, "ended", offset), 60) == [end]
            # Running: the follower from offset 6 waits; the tokens below 6 are not its; the end is.
            await writer.create(record("running"))
            await writer.write_step([StepWrite("running", LogEntry(0, (1,), "a"), {"status": "RUNNING"})])
            following = asyncio.ensure_future(follow_all(reader, "running", 6))
            while reader.num_followers == 0:
                await asyncio.sleep(0.01)
            for offset in range(1, 8):
                await writer.write_step([StepWrite("running", LogEntry(offset, (offset + 1,), str(offset)), {})])
            await writer.finish("running", RequestStatus.FINISHED, finish_reason="stop")
            assert await asyncio.wait_for(following, 60) == [
                LogEntry(6, (7,), "6"), LogEntry(7, (8,), "7"), LogEnd(RequestStatus.FINISHED, "stop", "", 8)
            ]
            # Queued, no entry yet: it ends (cancelled) before reaching offset 5.
            await writer.create(record("queued"))
            following = asyncio.ensure_future(follow_all(reader, "queued", 5))
            while reader.num_followers == 0:
                await asyncio.sleep(0.01)
            await writer.write_step([StepWrite("queued", LogEntry(0, (1, 2), "ab"), {"status": "RUNNING"})])
            await writer.finish("queued", RequestStatus.CANCELLED, finish_reason="cancelled")
            assert await asyncio.wait_for(following, 60) == [LogEnd(RequestStatus.CANCELLED, "cancelled", "", 2)]
            assert reader.num_followers == 0
        finally:
            await writer.close()
            await reader.close()

    run(scenario())


@pytest.mark.parametrize("ends_between", [True, False])
def test_a_step_landing_between_the_follower_s_two_reads_is_not_skipped(
    store_config: StoreConfig, ends_between: bool
) -> None:
    """From an offset past the log's end, follow() reads XRANGE (nothing there) and then the
    newest entry. A worker step that lands between the two, with tokens at and past the
    offset (and the end right behind it, or later), must still be sent: the newest entry
    used to be taken as the end, and tokens 5-7 were never sent (found by review). The
    writes are put exactly between the two reads."""

    async def scenario() -> list[LogEntry | LogEnd]:
        writer, reader = RequestStore(store_config), RequestStore(store_config)
        try:
            await writer.create(record("r"))
            await writer.write_step([StepWrite("r", LogEntry(0, (1, 2, 3), "abc"), {"status": "RUNNING"})])
            real_call = reader._call
            calls = 0

            async def call(operation: Any) -> Any:
                nonlocal calls
                calls += 1
                if calls == 2:  # the read of the newest entry: the step lands just before it
                    await writer.write_step([StepWrite("r", LogEntry(3, (4, 5, 6, 7, 8), "defgh"), {})])
                    if ends_between:
                        await writer.finish("r", RequestStatus.FINISHED, finish_reason="length")
                return await real_call(operation)

            reader._call = call  # type: ignore[method-assign]
            following = asyncio.ensure_future(_follow_all(reader, "r", 5))
            if not ends_between:
                while reader.num_followers == 0 and not following.done():
                    await asyncio.sleep(0.01)
                await writer.write_step([StepWrite("r", LogEntry(8, (9,), "i"), {})])
                await writer.finish("r", RequestStatus.FINISHED, finish_reason="length")
            return await asyncio.wait_for(following, 60)
        finally:
            await writer.close()
            await reader.close()

    items = run(scenario())
    assert [t for item in items if isinstance(item, LogEntry) for t in item.token_ids] == (
        [6, 7, 8] if ends_between else [6, 7, 8, 9])
    assert items[-1] == LogEnd(RequestStatus.FINISHED, "length", "", 8 if ends_between else 9)
    assert sum(isinstance(item, LogEnd) for item in items) == 1


async def _follow_all(store: RequestStore, request_id: str, from_offset: int) -> list[LogEntry | LogEnd]:
    return [item async for item in store.follow(request_id, from_offset)]


def test_followers_are_bounded_and_a_gone_request_ends_its_follower(store_config: StoreConfig) -> None:
    config = StoreConfig(url=store_config.url, prefix=store_config.prefix, max_followers=1)

    async def scenario() -> None:
        store = RequestStore(config)
        try:
            for request_id in ("x", "y"):
                await store.create(record(request_id))
            first = store.follow("x")
            waiting = asyncio.ensure_future(first.__anext__())
            await asyncio.sleep(0.2)
            assert store.num_followers == 1 and not waiting.done()
            with pytest.raises(FollowersExhausted, match="max_followers=1"):
                await store.follow("y").__anext__()
            waiting.cancel()
            with pytest.raises(asyncio.CancelledError):
                await waiting
            await first.aclose()
            assert store.num_followers == 0
            # Never created (or expired): after one BLOCK that saw nothing, a FAILED end.
            started = time.monotonic()
            assert [item async for item in store.follow("never")] == [
                LogEnd(RequestStatus.FAILED, "error", "record expired", 0)
            ]
            assert time.monotonic() - started < 30
        finally:
            await store.close()

    run(scenario())


def test_missing_request(store_config: StoreConfig) -> None:
    async def scenario() -> None:
        store = RequestStore(store_config)
        try:
            assert await store.get("nope") is None
            # Writes to an unknown id create nothing (nothing would ever expire it).
            await store.update("nope", worker_id="w")
            await store.write_step([StepWrite("nope", LogEntry(0, (1,), "a"), {})])
            await store.finish("nope", RequestStatus.CANCELLED)
            assert await store.ttl("nope") == (-2, -2)
            assert await store.active_ids() == []
        finally:
            await store.close()

    run(scenario())


def test_a_burst_of_commands_waits_for_connections_rather_than_failing(store_config: StoreConfig) -> None:
    """More commands at once than the store's pool has connections: they queue for one. redis-py
    8's default pool raised MaxConnectionsError past 100, and a burst of 320 requests to a router
    got UNAVAILABLE "Too many connections" (test_chaos_overload's burst)."""

    async def scenario() -> None:
        store = RequestStore(store_config)
        try:
            await store.create(record("burst"))
            found = await asyncio.gather(*(store.get("burst" if i % 2 else f"nope-{i}") for i in range(400)))
            assert [r is not None and r.request_id == "burst" for r in found] == [i % 2 == 1 for i in range(400)]
        finally:
            await store.close()

    run(scenario())


def test_replies_are_parsed_by_hiredis(store_config: StoreConfig) -> None:
    """The store's connections (the shared pool's, a follower's) parse replies with hiredis,
    which the install brings (redis[hiredis]): a 4,096-entry log read by Stream or GetRequest
    took 158 ms of the router's CPU with redis-py's Python parser, and 28 ms with hiredis."""

    async def scenario() -> list[str]:
        store = RequestStore(store_config)
        try:
            await store.create(record("parsed"))
            await store.write_step([StepWrite("parsed", LogEntry(0, (7, 8), "ab"), {"num_output_tokens": 2})])
            assert [e.token_ids for e in await store.read_log("parsed")] == [(7, 8)]
            pool = store._redis().connection_pool
            connections = [*pool._available_connections, *pool._in_use_connections]
            follower = store._follower_client()
            try:
                await follower.ping()
                connections.append(follower.connection)
            finally:
                await follower.aclose()
            return [type(connection._parser).__name__ for connection in connections]
        finally:
            await store.close()

    parsers = run(scenario())
    assert parsers and set(parsers) == {"_AsyncHiredisParser"}, parsers


def test_unavailable_is_quick_and_names_redis() -> None:
    config = StoreConfig(url=f"redis://:secret@127.0.0.1:{unused_port()}/0", socket_timeout=1.0)

    async def scenario() -> None:
        store = RequestStore(config)
        try:
            assert await store.ping() is False
            started = time.monotonic()
            with pytest.raises(StoreUnavailable) as raised:
                await store.get("r")
            assert time.monotonic() - started < 3.0
            message = str(raised.value)
            assert "Redis" in message and "secret" not in message and "***" in message
            with pytest.raises(StoreUnavailable):
                await store.write_step([StepWrite("r", LogEntry(0, (1,), "a"), {})])
        finally:
            await store.close()

    run(scenario())


def test_restart_keeps_records_and_the_same_store_recovers(tmp_path: Path) -> None:
    server = EmbeddedRedis(RedisServerConfig(state_dir=tmp_path / "redis"))
    server.start()
    try:
        config = StoreConfig(url=server.url, prefix="restart", socket_timeout=1.0)

        async def scenario() -> None:
            store = RequestStore(config)
            try:
                await store.create(record("r"))
                await store.write_step([StepWrite("r", LogEntry(0, (1, 2), "ab"), {"status": "RUNNING"})])

                await asyncio.to_thread(server.restart)
                assert server.port == int(config.url.rsplit(":", 1)[1].split("/")[0])
                # The pooled connection died with the old server; the store reconnects by itself.
                stored = await store.get("r")
                assert stored is not None and stored.status is RequestStatus.RUNNING
                # The restarted server forgot the Lua scripts; the store loads them again.
                await store.write_step([StepWrite("r", LogEntry(2, (3,), "c"), {})])
                assert await store.read_log("r") == [LogEntry(0, (1, 2), "ab"), LogEntry(2, (3,), "c")]
                assert await store.active_ids() == ["r"]

                # Down: a quick StoreUnavailable. Back: the same store works again.
                await asyncio.to_thread(server.stop)
                with pytest.raises(StoreUnavailable):
                    await store.get("r")
                assert await store.ping() is False
                await asyncio.to_thread(server.start)
                assert await store.ping() is True
                await store.finish("r", RequestStatus.FINISHED, finish_reason="stop")
                finished = await store.get("r")
                assert finished is not None and finished.num_output_tokens == 3
            finally:
                await store.close()

        run(scenario())
    finally:
        server.stop()
    assert not server.running


def test_password_protected_server(tmp_path: Path) -> None:
    config = RedisServerConfig(state_dir=tmp_path / "redis", password="p@ss word/:")
    with EmbeddedRedis(config) as server:
        assert server.url.startswith("redis://:")
        without_password = f"redis://127.0.0.1:{server.port}/0"

        async def scenario() -> None:
            store = RequestStore(StoreConfig(url=server.url))
            intruder = RequestStore(StoreConfig(url=without_password))
            try:
                assert await store.ping() is True
                assert await store.create(record("r")) is None
                assert await intruder.ping() is False
                with pytest.raises(StoreUnavailable, match="Redis"):
                    await intruder.get("r")
            finally:
                await store.close()
                await intruder.close()

        run(scenario())


def test_server_that_cannot_start_reports_its_log(tmp_path: Path, redis_server: EmbeddedRedis) -> None:
    # The session's server already holds this port.
    taken = EmbeddedRedis(RedisServerConfig(state_dir=tmp_path / "redis", port=redis_server.port))
    with pytest.raises(RuntimeError, match="Address already in use"):
        taken.start(timeout=5.0)
    assert not taken.running


@pytest.mark.parametrize(
    ("kwargs", "field_name"),
    [
        ({"port": 70000}, "port"),
        ({"appendfsync": "sometimes"}, "appendfsync"),
        ({"password": ""}, "password"),
        ({"bind": "127.0.0.1\nport 1"}, "bind"),
    ],
)
def test_server_config_is_validated(tmp_path: Path, kwargs: dict[str, Any], field_name: str) -> None:
    with pytest.raises(ValueError, match=field_name):
        RedisServerConfig(state_dir=tmp_path, **kwargs)


@pytest.mark.parametrize(
    ("kwargs", "field_name"),
    [
        ({"url": "http://x"}, "url"),
        ({"prefix": ""}, "prefix"),
        ({"ttl_seconds": 0}, "ttl_seconds"),
        ({"socket_timeout": 0.0}, "socket_timeout"),
    ],
)
def test_store_config_is_validated(kwargs: dict[str, Any], field_name: str) -> None:
    with pytest.raises(ValueError, match=field_name):
        StoreConfig(**kwargs)


def test_step_write_rejects_an_unknown_status() -> None:
    with pytest.raises(ValueError, match="status"):
        StepWrite("r", None, {"status": "DONE"})
    StepWrite("r", None, {"status": RequestStatus.CANCELLED})


def test_a_live_follower_waits_out_a_redis_restart_and_misses_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A `Stream` that a router serves from Redis (another router's request) was cut off
    with UNAVAILABLE when the embedded Redis was killed and restarted, 3 of 3 times, though
    Redis was back within a second (found by a walkthrough). The follower now waits for it
    from where it was, up to FOLLOW_OUTAGE_S; past that it still gives up."""
    server = EmbeddedRedis(RedisServerConfig(state_dir=tmp_path / "redis"))
    server.start()
    try:
        config = StoreConfig(url=server.url, prefix="outage", socket_timeout=1.0)

        async def scenario() -> None:
            writer, reader = RequestStore(config), RequestStore(config)
            try:
                await writer.create(record("r"))
                await writer.write_step([StepWrite("r", LogEntry(0, (1, 2), "ab"), {"status": "RUNNING"})])
                following = asyncio.ensure_future(_follow_all(reader, "r", 1))
                while reader.num_followers == 0:
                    await asyncio.sleep(0.01)
                await asyncio.to_thread(server.restart)  # under the follower's XREAD BLOCK
                await writer.write_step([StepWrite("r", LogEntry(2, (3,), "c"), {})])
                await writer.finish("r", RequestStatus.FINISHED, finish_reason="stop")
                assert await asyncio.wait_for(following, 60) == [
                    LogEntry(1, (2,), "ab"), LogEntry(2, (3,), "c"), LogEnd(RequestStatus.FINISHED, "stop", "", 3)
                ]
                # Down for longer than it waits: the follower gives up, as before.
                monkeypatch.setattr(router.state, "FOLLOW_OUTAGE_S", 0.5)
                await writer.create(record("s"))
                following = asyncio.ensure_future(_follow_all(reader, "s", 0))
                while reader.num_followers == 0:
                    await asyncio.sleep(0.01)
                await asyncio.to_thread(server.stop)
                with pytest.raises(StoreUnavailable):
                    await asyncio.wait_for(following, 60)
                assert reader.num_followers == 0
            finally:
                await writer.close()
                await reader.close()

        run(scenario())
    finally:
        server.stop()
