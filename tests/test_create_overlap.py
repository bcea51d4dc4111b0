"""A Generate whose id the router makes is placed while Redis creates its record
(Router.create(wait=False)): its time to first token does not wait for that round trip.
What must hold anyway, through a real cluster with the create held back on purpose:

- the record lands before any other write of the request (RUNNING, tokens, the finish),
  or those would find no record and be dropped, and the late create would leave it QUEUED;
- `started` names the request only once Redis holds it (GetRequest finds it at once);
- a create Redis refuses ends the request where it runs (its KV freed) and the call is
  UNAVAILABLE, as when the create came first;
- a client-chosen id is created first, so that a taken one is refused before it runs;
- so is any id while a create is in flight (under load), or the create's Barrier would hold
  the recorder's writes behind the create pipeline's calls in turn.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from collections.abc import Awaitable, Callable, Iterator, Sequence
from typing import Any

import grpc
import pytest
import redis

from cluster.redis_server import EmbeddedRedis
from protos.kvserve.v1 import serving_pb2 as pb
from router.state import RequestRecord, StoreUnavailable
from tests.cluster_harness import (
    ClusterHarness,
    ReferenceEngine,
    cluster_config,
    expect_error,
    greedy_request,
    observing,
    parse_stream,
    request_info,
    running_cluster,
    wait_idle,
)

PROMPT, MAX_TOKENS = [11, 12, 13, 14, 15], 8
HOLD_S = 0.6  # each create call is held this long: far past a request of MAX_TOKENS on `tiny`


@pytest.fixture(scope="module")
def cluster(
    ray_session: None, redis_server: EmbeddedRedis, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[ClusterHarness]:
    with running_cluster(cluster_config(redis_server.url, tmp_path_factory.mktemp("overlap"))) as harness:
        yield harness


Send = Callable[[Sequence[RequestRecord]], Awaitable[Sequence[Any]]]


@pytest.fixture
def creates(cluster: ClusterHarness) -> Iterator[dict[str, Any]]:
    """The router's create calls, held HOLD_S and timed; `fail` makes the next one fail."""
    group = cluster.router.creates
    send: Send = group._send
    state: dict[str, Any] = {"landed": {}, "fail": False}

    async def held(records: Sequence[RequestRecord]) -> Sequence[Any]:
        await asyncio.sleep(HOLD_S)
        if state["fail"]:
            state["fail"] = False
            raise StoreUnavailable("Redis is unavailable (held back by the test)")
        answer = await send(records)
        for record in records:
            state["landed"].setdefault(record.request_id, time.monotonic())  # its first create
        return answer

    group._send = held
    try:
        yield state
    finally:
        group._send = send


def _placed_at(cluster: ClusterHarness) -> tuple[dict[str, float], Callable[[str, Any], None]]:
    placed: dict[str, float] = {}

    def observe(name: str, payload: Any) -> None:
        if name == "placed":
            placed.setdefault(payload[0].request_id, time.monotonic())

    return placed, observe


def test_a_request_is_placed_while_its_record_is_created_and_every_write_lands_after_it(
    cluster: ClusterHarness, creates: dict[str, Any], reference_engine: ReferenceEngine, redis_server: EmbeddedRedis
) -> None:
    expected = reference_engine.greedy([(PROMPT, MAX_TOKENS)])[0].output_ids
    placed, observe = _placed_at(cluster)
    with observing(cluster, observe):
        call = cluster.stub.Generate(greedy_request(PROMPT, MAX_TOKENS), timeout=60)
        started = next(call)
        assert started.WhichOneof("event") == "started"
        request_id = started.started.request_id
        assert request_info(cluster.stub, request_id).status in (pb.REQUEST_STATUS_RUNNING, pb.REQUEST_STATUS_FINISHED)
        result = parse_stream([started, *call])
    assert result.token_ids == expected
    # It went to its worker before its record was there: the create's round trip was off its TTFT.
    assert placed[request_id] < creates["landed"][request_id] - HOLD_S / 2, (placed, creates["landed"])
    # Every write after the create: the log and the end as they are, nothing left active.
    client = redis.Redis.from_url(redis_server.url, decode_responses=True)
    try:
        prefix = cluster.cluster.config.store_prefix
        assert not client.sismember(f"{prefix}:active", request_id)
        assert client.ttl(f"{prefix}:req:{request_id}") > 0
    finally:
        client.close()
    info = request_info(cluster.stub, request_id)
    assert info.status == pb.REQUEST_STATUS_FINISHED and list(info.output_token_ids) == expected
    whole = parse_stream(cluster.stub.Stream(pb.StreamRequest(request_id=request_id), timeout=30))
    assert whole.token_ids == expected and whole.finished.finish_reason == pb.FINISH_REASON_LENGTH


def test_a_create_redis_refuses_ends_the_placed_request_and_the_call_is_unavailable(
    cluster: ClusterHarness, creates: dict[str, Any]
) -> None:
    creates["fail"] = True
    placed, observe = _placed_at(cluster)
    with observing(cluster, observe):
        expect_error(lambda: list(cluster.stub.Generate(greedy_request(PROMPT, 400), timeout=60)),
                     grpc.StatusCode.UNAVAILABLE, "Redis")
    assert len(placed) == 1  # it was on a worker when the create failed: its KV must come back
    wait_idle(cluster.stub)
    assert not cluster.call(_live_trackers(cluster))


def test_a_client_chosen_id_is_created_before_it_is_placed(cluster: ClusterHarness, creates: dict[str, Any]) -> None:
    request_id = f"chosen-{uuid.uuid4().hex[:8]}"
    placed, observe = _placed_at(cluster)
    with observing(cluster, observe):
        parse_stream(cluster.stub.Generate(greedy_request(PROMPT, MAX_TOKENS, request_id), timeout=60))
        expect_error(lambda: list(cluster.stub.Generate(greedy_request(PROMPT, MAX_TOKENS, request_id), timeout=60)),
                     grpc.StatusCode.ALREADY_EXISTS, request_id)
    assert list(placed) == [request_id] and placed[request_id] >= creates["landed"][request_id]


def test_under_load_a_request_is_created_before_it_is_placed(cluster: ClusterHarness, creates: dict[str, Any]) -> None:
    placed, observe = _placed_at(cluster)
    with observing(cluster, observe), ThreadPoolExecutor(2) as pool:
        first = pool.submit(lambda: parse_stream(cluster.stub.Generate(greedy_request(PROMPT, MAX_TOKENS), timeout=60)))
        time.sleep(HOLD_S / 3)  # the first's create is in flight
        second = pool.submit(lambda: parse_stream(cluster.stub.Generate(greedy_request(PROMPT, MAX_TOKENS), timeout=60)))
        overlapped, waited = first.result().started.request_id, second.result().started.request_id
    assert placed[overlapped] < creates["landed"][overlapped]
    assert placed[waited] >= creates["landed"][waited]


async def _live_trackers(cluster: ClusterHarness) -> list[str]:
    return [request_id for request_id, tracker in cluster.router.trackers.items() if not tracker.finished]


def test_finished_is_sent_once_redis_holds_the_end_so_get_request_reads_it(cluster: ClusterHarness) -> None:
    """`finished` came from the router's memory, and the end's write reached Redis after it:
    a client that called GetRequest on `finished` read RUNNING and part of the output (a
    Node.js client, up to 17 of 80 calls at 8 streams). Here every Redis write of the
    router is held 0.2 s, so each GetRequest would land before the end's write."""
    store = cluster.router.store
    write_step = store.write_step

    async def held(writes: Any) -> list[str]:
        await asyncio.sleep(0.2)  # well inside END_RECORD_WAIT_S (1 s), which bounds the wait
        return await write_step(writes)

    store.write_step = held  # type: ignore[method-assign]
    try:
        for _ in range(3):
            result = parse_stream(cluster.stub.Generate(greedy_request(PROMPT, MAX_TOKENS), timeout=60))
            info = request_info(cluster.stub, result.started.request_id)
            assert (info.status, len(info.output_token_ids)) == (pb.REQUEST_STATUS_FINISHED, MAX_TOKENS), info
    finally:
        store.write_step = write_step  # type: ignore[method-assign]
