"""Redis faults land on the Redis path, never on worker liveness.

Under a running cluster, Redis is made to refuse writes (out of memory under a tiny
maxmemory; read-only, as a replica is after a failover) or to stall (DEBUG SLEEP past the
socket timeout and the worker timeout) while a request streams. The streaming client gets
every token, no worker is marked dead, no request moves, a new request is refused with
UNAVAILABLE naming Redis while writes are refused, and once Redis takes writes again the
kept writes land: the request's record says FINISHED with all its tokens.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
import redis

from cluster.redis_server import EmbeddedRedis, RedisServerConfig
from protos.kvserve.v1 import serving_pb2 as pb
from router.state import StoreConfig
from tests.cluster_harness import (
    ClusterHarness,
    cluster_config,
    greedy_request,
    observing,
    read_deltas,
    read_rest,
    request_info,
    running_cluster,
    wait_for,
)

# Long enough to stream well into the fault: ~1.5 s of decoding here, ~0.7 s on a machine
# twice as fast. Each test asserts that the router took tokens while Redis was failing.
MAX_TOKENS = 1500


@pytest.fixture(scope="module")
def faulty(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[ClusterHarness, redis.Redis]]:
    """A cluster on a Redis of its own (the faults below would hit every test sharing one)."""
    state = tmp_path_factory.mktemp("faults")
    with EmbeddedRedis(RedisServerConfig(state_dir=state / "redis")) as server:
        admin = redis.Redis.from_url(server.url)
        # The routers' own 2 s timeout (not the harness's): the stalls below outlast it.
        with running_cluster(cluster_config(server.url, state, redis_timeout_s=2.0)) as harness:
            yield harness, admin
        admin.close()


def _refuse_oom(admin: redis.Redis) -> Callable[[], None]:
    admin.config_set("maxmemory", "1")  # the default policy, noeviction, refuses every write
    return lambda: admin.config_set("maxmemory", "0")


def _refuse_readonly(admin: redis.Redis) -> Callable[[], None]:
    # A replica of a master that does not answer keeps its data and refuses writes.
    admin.execute_command("REPLICAOF", "127.0.0.1", "1")
    return lambda: admin.execute_command("REPLICAOF", "NO", "ONE")


@pytest.mark.parametrize("refuse", [_refuse_oom, _refuse_readonly], ids=["oom", "readonly"])
def test_refused_writes_never_cost_a_worker(faulty: tuple[ClusterHarness, redis.Redis], refuse: Any, tmp_path: Path) -> None:
    harness, admin = faulty
    seen: list[str] = []
    request_id = f"refused-{refuse.__name__}"
    produced: list[float] = []  # when the router took each token event of the request
    with observing(harness, _watch(seen, request_id, produced)):
        call = harness.stub.Generate(greedy_request(list(range(5, 17)), MAX_TOKENS, request_id), timeout=120)
        started, deltas = read_deltas(call, 5)
        restore = refuse(admin)
        refused_at = time.monotonic()
        try:
            try:
                list(harness.stub.Generate(greedy_request([1, 2, 3], 4), timeout=30))
            except grpc.RpcError as error:
                # Refused (a replica takes no write); under maxmemory Redis 6.2 lets the
                # creating script through (its first write is a DEL, after which a script is
                # never stopped), so a new request may also just run.
                assert error.code() == grpc.StatusCode.UNAVAILABLE, error.details()
                assert "Redis" in (error.details() or "")
            else:
                assert refuse is _refuse_oom, "a read-only Redis took a new request"
            result = _read_rest(started, deltas, call, produced)
        finally:
            restore()
        assert produced[-1] > refused_at, "the request ended before Redis refused anything: the test tested nothing"
        assert result.finished.finish_reason == pb.FINISH_REASON_LENGTH
        assert len(result.token_ids) == MAX_TOKENS
        # The writes kept while Redis refused them land once it takes writes again.
        info = wait_for(lambda: request_info(harness.stub, request_id),
                        lambda i: i.status == pb.REQUEST_STATUS_FINISHED, timeout=30, what="the kept writes")
        assert list(info.output_token_ids) == result.token_ids
        assert info.num_migrations == 0
    assert seen == [], f"a Redis refusal was taken for a worker's failure: {seen}"
    status = harness.stub.ClusterStatus(pb.ClusterStatusRequest())
    assert status.alive_workers == 2


def test_a_stalled_redis_never_costs_a_worker(faulty: tuple[ClusterHarness, redis.Redis]) -> None:
    """DEBUG SLEEP holds Redis for longer than its socket timeout (2 s) and the worker
    timeout (2 s): the router's writes time out and wait, its workers stay alive."""
    harness, admin = faulty
    seen: list[str] = []
    request_id = "stalled"
    produced: list[float] = []
    with observing(harness, _watch(seen, request_id, produced)):
        call = harness.stub.Generate(greedy_request(list(range(20, 32)), MAX_TOKENS, request_id), timeout=120)
        started, deltas = read_deltas(call, 5)
        asleep: list[float] = []  # when DEBUG SLEEP was sent, and when Redis answered it
        sleeper = threading.Thread(target=lambda: _stall(admin, 5, asleep))
        sleeper.start()
        result = _read_rest(started, deltas, call, produced)
        sleeper.join()
        assert len(result.token_ids) == MAX_TOKENS
        during = [t for t in produced if asleep[0] < t < asleep[1]]
        assert during, f"the router took no token while Redis slept (its last {produced[-1] - asleep[0]:+.2f} s from the sleep)"
        info = wait_for(lambda: request_info(harness.stub, request_id),
                        lambda i: i.status == pb.REQUEST_STATUS_FINISHED, timeout=30, what="the kept writes")
        assert list(info.output_token_ids) == result.token_ids
    assert seen == [], f"a stalled Redis was taken for a worker's failure: {seen}"


def _read_rest(started: pb.Started, deltas: list[pb.TokenDelta], call: Any, produced: list[float]) -> Any:
    """read_rest, and if the call fails, how far the request got: a deadline after every
    token event (a slow machine) reads differently from one after the events stopped."""
    try:
        return read_rest(started, deltas, call)
    except grpc.RpcError as error:
        now = time.monotonic()
        progress = (f", the first {now - produced[0]:.1f} s and the last {now - produced[-1]:.1f} s before it"
                    if produced else "")
        raise AssertionError(f"the stream ended {error.code().name} when the router had taken "
                             f"{len(produced)} of {MAX_TOKENS} token events{progress}") from error


def _stall(admin: redis.Redis, seconds: int, asleep: list[float]) -> None:
    """DEBUG SLEEP on a connection of its own: the server answers nobody meanwhile.
    asleep gets the time it was sent (once connected) and the time Redis answered.

    The connection waits well past the sleep for the answer: with the admin client's
    socket timeout (5 s) a 5 s sleep answered late on a loaded machine timed out here."""
    kwargs = {**admin.connection_pool.connection_kwargs, "socket_timeout": seconds + 60}
    with redis.Redis(connection_pool=redis.ConnectionPool(**kwargs)) as client:
        client.ping()
        asleep.append(time.monotonic())
        client.execute_command("DEBUG", "SLEEP", str(seconds))
        asleep.append(time.monotonic())


def _watch(seen: list[str], request_id: str, produced: list[float]) -> Callable[[str, Any], None]:
    """A router observer: worker deaths and moves into seen, and the time.monotonic() at
    which the router took each token event of request_id into produced."""

    def observe(name: str, payload: Any) -> None:
        if name in ("worker_dead", "migrated"):
            seen.append(name)
        elif name == "tokens" and any(tracker.request_id == request_id for tracker, _ in payload):
            produced.append(time.monotonic())

    return observe


def test_a_running_request_whose_record_is_evicted_is_said_and_leaves_no_key_without_expiry(
    faulty: tuple[ClusterHarness, redis.Redis], caplog: pytest.LogCaptureFixture
) -> None:
    """An allkeys-* maxmemory-policy evicts what it likes: an outside check under allkeys-lru
    saw the hashes of 12 of 30 running requests go. Their later writes were dropped without
    a word, their logs kept no expiry, and their ids stayed in the active set for good
    (every adoption sweep read them again). The hash is deleted here as the evictor does.
    The stream itself goes on from the router's memory."""
    import logging

    caplog.set_level(logging.WARNING, logger="kvserve.router")
    harness, admin = faulty
    prefix = harness.cluster.config.store_prefix
    request_id = "evicted-record"
    call = harness.stub.Generate(greedy_request(list(range(5, 17)), MAX_TOKENS, request_id), timeout=120)
    started, deltas = read_deltas(call, 3)
    assert admin.exists(f"{prefix}:log:{request_id}")
    admin.delete(f"{prefix}:req:{request_id}")
    result = read_rest(started, deltas, call)
    assert len(result.token_ids) == MAX_TOKENS
    wait_for(lambda: admin.ttl(f"{prefix}:log:{request_id}"), lambda ttl: ttl > 0, timeout=10,
             what="the log's expiry")
    assert not admin.sismember(f"{prefix}:active", request_id)
    said = [r.getMessage() for r in caplog.records if request_id in r.getMessage()]
    assert len(said) == 1 and "its record is gone from Redis" in said[0] and "maxmemory-policy" in said[0], said


def test_the_writes_of_a_request_whose_create_failed_are_not_told_as_an_eviction(
    store_config: StoreConfig, caplog: pytest.LogCaptureFixture
) -> None:
    """recorder.Barrier: a create that failed leaves the writes after it no record, and the
    store drops them. Router.create(wait=False) whose create Redis refused: recorded()
    cancels it and its end goes through the recorder. The record-gone warning (above) fired
    for it, sending an operator after an eviction policy for every request an outage kept
    from being created (a review's find). Only a request that left a trace (its id active,
    or a log) was made and then lost."""
    import asyncio
    import logging

    from router.state import RequestStore, StoreUnavailable
    from router.validation import ValidRequest
    from tests.test_queue_deadline import _full_router
    from workers.engine.sampling import SamplingParams

    caplog.set_level(logging.WARNING, logger="kvserve.router")

    async def scenario() -> None:
        store = RequestStore(store_config)
        router = _full_router(store)

        async def refused(records: object) -> object:
            raise StoreUnavailable("Redis is unavailable (the test's)")

        router.creates._send = refused  # type: ignore[method-assign]
        try:
            await router.ownership.renew()
            request = ValidRequest("create-failed", (1, 2, 3), SamplingParams(max_tokens=8), 1)
            tracker = await router.create(request, wait=False)
            admitting = asyncio.ensure_future(router.admit(tracker, None))
            with pytest.raises(StoreUnavailable):
                await router.recorded(tracker)  # what Generate awaits: it cancels the request
            with pytest.raises(Exception):  # noqa: B017 - Cancelled, once its end is recorded
                await asyncio.wait_for(admitting, 10)
        finally:
            await store.close()

    asyncio.run(scenario())
    said = [r.getMessage() for r in caplog.records if "create-failed" in r.getMessage()]
    assert not any("its record is gone from Redis" in s for s in said), said
