"""Chaos: redis-server crashes (SIGKILL, not SHUTDOWN) under the request store and under a
running cluster, and comes back on the same port and directory.

What is promised (README, "What survives what"): with `appendonly yes` and `appendfsync
everysec` a crash loses at most the writes of about the last second; the store reconnects
by itself; while Redis is down new requests get UNAVAILABLE naming Redis, running requests
keep going (streams to their clients), and their Redis writes are replayed once it is back.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

import grpc
import pytest
import redis

from cluster.redis_server import EmbeddedRedis, RedisServerConfig
from protos.kvserve.v1 import serving_pb2 as pb
from router.core import RouterConfig
from router.state import LogEntry, RequestRecord, RequestStatus, RequestStore, StepWrite, StoreConfig, StoreUnavailable
from tests.cluster_harness import (
    MiB,
    ReferenceEngine,
    cluster_config,
    expect_error,
    greedy_request,
    hold_engines,
    parse_stream,
    read_deltas,
    read_rest,
    request_info,
    running_cluster,
    wait_for,
    wait_idle,
    wait_until,
)

FSYNC_WINDOW_S = 1.0  # appendfsync everysec: what a crash may take
WRITE_FOR_S = 2.5  # how long the loss-bound test writes before the crash
STREAM_PROMPT = list(range(60, 72))
SUBMIT_PROMPTS = [list(range(30, 40)), list(range(90, 97))]
# Long enough to be mid-stream when Redis crashes: a few dozen tokens in on an idle machine;
# with the other test process loading both cores, two sharing a worker were 200 in and the
# third had finished 600.
MAX_TOKENS = 1500
# Room on each worker for two of them whole (2 x 95 blocks of 16 tokens), as on 16 MiB for 600.
KV_PER_WORKER = 32 * MiB


def _record(request_id: str) -> RequestRecord:
    return RequestRecord(
        request_id=request_id,
        status=RequestStatus.QUEUED,
        prompt_ids=[1, 2, 3],
        sampling={"max_tokens": 4},
        seed=7,
        created_at=time.time(),
    )


def _prefix_keys(url: str, prefix: str) -> dict[str, int]:
    """Every key under `prefix` with its TTL (-1: no expiry)."""
    with redis.Redis.from_url(url, decode_responses=True) as client:
        return {key: int(client.ttl(key)) for key in client.scan_iter(match=f"{prefix}:*", count=1000)}


def test_embedded_redis_runs_aof_everysec_by_default(tmp_path: Path) -> None:
    config = RedisServerConfig(state_dir=tmp_path / "redis")
    assert (config.appendonly, config.appendfsync) == (True, "everysec")
    with EmbeddedRedis(config) as server, redis.Redis.from_url(server.url, decode_responses=True) as client:
        assert client.config_get("appendonly") == {"appendonly": "yes"}
        assert client.config_get("appendfsync") == {"appendfsync": "everysec"}
        assert client.config_get("aof-load-truncated") == {"aof-load-truncated": "yes"}


def test_a_crash_loses_at_most_the_last_second_of_writes(tmp_path: Path) -> None:
    """Write requests for 2.5 s, SIGKILL redis-server, start it on the same directory: every
    request acknowledged more than a second before the kill is there, record and log."""
    server = EmbeddedRedis(RedisServerConfig(state_dir=tmp_path / "redis"))
    server.start()
    config = StoreConfig(url=server.url, prefix="crash", socket_timeout=1.0)
    acked_at: dict[str, float] = {}

    async def write_then_crash() -> None:
        store = RequestStore(config)
        try:
            began = time.monotonic()
            index = 0
            while time.monotonic() - began < WRITE_FOR_S:
                request_id = f"r{index}"
                await store.create(_record(request_id))
                await store.write_step([StepWrite(request_id, LogEntry(0, (index % 100, 1), "ab"), {"status": "RUNNING"})])
                acked_at[request_id] = time.monotonic()
                index += 1
                await asyncio.sleep(0.005)
        finally:
            await store.close()

    try:
        asyncio.run(write_then_crash())
        server.kill()
        killed_at = time.monotonic()
        assert not server.running
        server.start()

        async def read_back() -> dict[str, bool]:
            store = RequestStore(config)
            try:
                present = {}
                for request_id in acked_at:
                    stored = await store.get(request_id)
                    log = await store.read_log(request_id)
                    index = int(request_id[1:])
                    whole = (
                        stored is not None
                        and stored.status is RequestStatus.RUNNING
                        and log == [LogEntry(0, (index % 100, 1), "ab")]
                    )
                    present[request_id] = whole
                return present
            finally:
                await store.close()

        present = asyncio.run(read_back())
    finally:
        server.stop()
    old = [r for r, t in acked_at.items() if killed_at - t > FSYNC_WINDOW_S]
    recent = [r for r, t in acked_at.items() if killed_at - t <= FSYNC_WINDOW_S]
    assert len(old) > 100 and recent, (len(old), len(recent))
    lost_old = [r for r in old if not present[r]]
    assert not lost_old, f"{len(lost_old)} requests acknowledged over {FSYNC_WINDOW_S} s before the crash were lost"
    # A process crash keeps what Redis had handed to the kernel, so normally the last second
    # survives too; only a machine crash (or a deferred write on a slow disk) would lose it.
    print(f"crash after {len(acked_at)} acknowledged requests: {sum(present[r] for r in recent)}/{len(recent)} "
          f"of the last {FSYNC_WINDOW_S:g} s survived")


def test_the_same_store_reconnects_after_a_crash(tmp_path: Path) -> None:
    server = EmbeddedRedis(RedisServerConfig(state_dir=tmp_path / "redis", password="pw"))
    server.start()
    config = StoreConfig(url=server.url, prefix="reconnect", socket_timeout=1.0)

    async def scenario() -> None:
        store = RequestStore(config)
        try:
            await store.create(_record("r"))
            await store.write_step([StepWrite("r", LogEntry(0, (5, 6), "xy"), {"status": "RUNNING"})])
            await asyncio.sleep(FSYNC_WINDOW_S + 0.2)  # past the fsync window

            await asyncio.to_thread(server.kill)
            began = time.monotonic()
            with pytest.raises(StoreUnavailable, match="Redis"):
                await store.write_step([StepWrite("r", LogEntry(2, (7,), "z"), {})])
            with pytest.raises(StoreUnavailable, match="Redis"):
                await store.get("r")
            assert await store.ping() is False
            assert time.monotonic() - began < 3 * config.socket_timeout, "down is said quickly"

            await asyncio.to_thread(server.start)
            # The pool's connections died with the old process; the first call after the
            # restart already works (a fresh connection, the Lua scripts loaded again).
            await store.write_step([StepWrite("r", LogEntry(2, (7,), "z"), {})])
            await store.finish("r", RequestStatus.FINISHED, finish_reason="length")
            finished = await store.get("r")
            assert finished is not None and finished.status is RequestStatus.FINISHED
            assert finished.num_output_tokens == 3
            assert await store.read_log("r") == [LogEntry(0, (5, 6), "xy"), LogEntry(2, (7,), "z")]
            assert await store.active_ids() == []
            hash_ttl, log_ttl = await store.ttl("r")
            assert hash_ttl > 0 and log_ttl > 0
        finally:
            await store.close()

    try:
        asyncio.run(scenario())
    finally:
        server.stop()


def _wait_written_to_aof(url: str, timeout: float = 10.0) -> None:
    """Until every command Redis had processed is written to its AOF file (in the kernel:
    what SIGKILL cannot lose). Redis writes its AOF buffer before each event-loop sleep, and
    holds it back only while a slow everysec fsync runs; an empty buffer at an INFO means
    every command processed before it was written."""
    with redis.Redis.from_url(url) as client:
        wait_until(lambda: client.info("persistence")["aof_buffer_length"] == 0, timeout, "Redis to write its AOF")


async def _progress(router: Any, request_ids: list[str]) -> dict[str, int]:
    """Tokens so far of each of these requests the router still tracks (run on its loop)."""
    return {r: router.trackers[r].num_output_tokens for r in request_ids if r in router.trackers}


def test_redis_crash_mid_stream_keeps_requests_running_and_records_them_when_it_returns(
    ray_session: None, tmp_path: Path, reference_engine: ReferenceEngine
) -> None:
    """The crash variant of test_cluster_failures' clean stop: SIGKILL redis-server while a
    Generate stream and two Submit-ed (client-less) requests decode. New requests are
    refused naming Redis; all three run to the end during the outage; once Redis is back
    on the same directory, each is FINISHED in Redis with its whole, exact log."""
    prompts = [STREAM_PROMPT, *SUBMIT_PROMPTS]
    expected = [out.output_ids for out in reference_engine.greedy([(p, MAX_TOKENS) for p in prompts])]
    server = EmbeddedRedis(RedisServerConfig(state_dir=tmp_path / "redis"))
    server.start()
    try:
        config = cluster_config(server.url, tmp_path, worker_kv_cache_memory=(KV_PER_WORKER, KV_PER_WORKER))
        with running_cluster(config) as cluster:
            stub = cluster.stub
            submitted = [stub.Submit(greedy_request(p, MAX_TOKENS), timeout=10).request_id for p in SUBMIT_PROMPTS]
            call = stub.Generate(greedy_request(STREAM_PROMPT, MAX_TOKENS), timeout=120)
            started, first = read_deltas(call, 2)
            ids = [started.request_id, *submitted]
            wait_for(
                lambda: [request_info(stub, r) for r in submitted],
                lambda infos: all(i.status == pb.REQUEST_STATUS_RUNNING and i.output_token_ids for i in infos),
                what="the submitted requests to decode",
            )
            # Their records are in the AOF file, which a SIGKILL does not take. (Sleeping out
            # the fsync window instead, here before, let a fast CI machine's tiny model finish
            # one of the 600-token requests before the crash.)
            _wait_written_to_aof(server.url)
            server.kill()
            at_kill = cluster.call(_progress(cluster.router, ids))
            assert sorted(at_kill) == sorted(ids), "all three were running when Redis crashed"
            assert all(0 < n < MAX_TOKENS for n in at_kill.values()), at_kill

            for rpc in (
                lambda: list(stub.Generate(greedy_request(STREAM_PROMPT, 8), timeout=10)),
                lambda: stub.Submit(greedy_request(STREAM_PROMPT, 8), timeout=10),
                lambda: list(stub.Stream(pb.StreamRequest(request_id=submitted[0]), timeout=10)),
                lambda: stub.GetRequest(pb.GetRequestRequest(request_id=started.request_id), timeout=10),
            ):
                expect_error(rpc, grpc.StatusCode.UNAVAILABLE, "Redis")

            # The connected client gets every token, exactly the reference's, with Redis down.
            streamed = read_rest(started, first, call)
            assert streamed.token_ids == expected[0]
            assert streamed.finished.finish_reason == pb.FINISH_REASON_LENGTH
            # The client-less ones run to their end too, and free their KV, while Redis is down.
            wait_idle(stub, timeout=60)
            assert not server.running
            assert cluster.call(_progress(cluster.router, ids)) == {}, "nothing is left tracked"
            expect_error(
                lambda: stub.GetRequest(pb.GetRequestRequest(request_id=submitted[0]), timeout=10),
                grpc.StatusCode.UNAVAILABLE,
                "Redis",
            )

            server.start()  # same port and directory: the AOF is replayed
            back_at = time.monotonic()
            infos = wait_for(
                lambda: [request_info(stub, r) for r in ids],
                lambda infos: all(i.status == pb.REQUEST_STATUS_FINISHED for i in infos),
                timeout=15,
                what="the requests that ended during the outage to be recorded",
            )
            recorded_after = time.monotonic() - back_at
            for info, want in zip(infos, expected):
                assert list(info.output_token_ids) == want
                assert info.finish_reason == pb.FINISH_REASON_LENGTH and info.worker_id in ("w0", "w1")
            # A client that was never attached reads a submitted request's whole log back.
            for request_id, want in zip(submitted, expected[1:]):
                replay = parse_stream(stub.Stream(pb.StreamRequest(request_id=request_id), timeout=30))
                assert replay.token_ids == want
                assert replay.finished.usage.completion_tokens == MAX_TOKENS
            keys = _prefix_keys(server.url, config.store_prefix)
            assert f"{config.store_prefix}:active" not in keys, "no request is left active"
            # Beside the requests' hashes and logs, only the routers' leases and whether each
            # requires a token (router/ownership.py), which expire too.
            leases = {f"{config.store_prefix}:routers", f"{config.store_prefix}:routers:address",
                      f"{config.store_prefix}:routers:guard"}
            assert leases <= set(keys)
            assert set(keys) - leases == {f"{config.store_prefix}:{kind}:{i}" for i in ids for kind in ("req", "log")}
            # Every key expires (TTL >= 0; -1 is none). The leases' key may be within a second of
            # it: its last renewal was before the crash, and the next one may not have come yet.
            assert all(ttl >= 0 for ttl in keys.values()), keys

            after = parse_stream(stub.Generate(greedy_request(STREAM_PROMPT, MAX_TOKENS), timeout=120))
            assert after.token_ids == expected[0]
            wait_idle(stub)
            print(f"outage: progress at the crash {at_kill}; recorded {recorded_after:.2f} s after Redis was back")
    finally:
        server.stop()


def test_requests_queued_when_redis_crashes_are_ended_in_redis_when_it_returns(
    ray_session: None, tmp_path: Path
) -> None:
    occupier_prompt = list(range(24))
    occupier_max_tokens = 64 * 16 - len(occupier_prompt) + 1  # every block of an 8 MiB worker
    server = EmbeddedRedis(RedisServerConfig(state_dir=tmp_path / "redis"))
    server.start()
    try:
        router = RouterConfig(max_queue=4, max_queue_wait_s=60.0, kv_reserve_ratio=1.0)  # the occupier fills a worker
        config = cluster_config(server.url, tmp_path, (8 * MiB, 8 * MiB), router)
        with running_cluster(config) as cluster:
            stub = cluster.stub
            occupiers = [
                stub.Submit(greedy_request(occupier_prompt, occupier_max_tokens), timeout=10).request_id
                for _ in range(2)
            ]
            cancelled = stub.Submit(greedy_request([5, 6, 7], 16), timeout=10).request_id
            placed_later = stub.Submit(greedy_request([5, 6, 8], 16), timeout=10).request_id
            wait_until(lambda: stub.ClusterStatus(pb.ClusterStatusRequest(), timeout=5).queued == 2, what="two queued")
            hold_engines(cluster, ("w0", "w1"), 3.0)  # the occupiers hold their blocks until cancelled
            _wait_written_to_aof(server.url)

            server.kill()
            # Both act on the router's live state, so they need no Redis.
            stub.Cancel(pb.CancelRequest(request_id=cancelled), timeout=10)
            for request_id in occupiers:
                stub.Cancel(pb.CancelRequest(request_id=request_id), timeout=10)  # room for placed_later
            wait_idle(stub, timeout=30)

            server.start()
            wait_until(
                lambda: f"{config.store_prefix}:active" not in _prefix_keys(server.url, config.store_prefix),
                timeout=10,
                what="no request left active in Redis",
            )
            keys = _prefix_keys(server.url, config.store_prefix)
            # Every key expires (TTL >= 0; -1 is none). The leases' key may be within a second of
            # it: its last renewal was before the crash, and the next one may not have come yet.
            assert all(ttl >= 0 for ttl in keys.values()), keys
            assert request_info(stub, cancelled).status == pb.REQUEST_STATUS_CANCELLED
            assert request_info(stub, placed_later).status != pb.REQUEST_STATUS_QUEUED
    finally:
        server.stop()
