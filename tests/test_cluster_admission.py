"""Admission through a real cluster: a request no worker has room for waits in the router's
FIFO queue, and is refused when the queue is full, when it waited too long, or when the
client's deadline passes first.

Two workers of 64 KV blocks each; one "occupier" (24 + 1000 tokens) claims a whole pool,
and is cancelled as soon as a test is done with it. The tiny model decodes its 1,000 tokens
in about a second on one thread here, less on a faster machine, so a test whose premise is
"no room frees for a while" also holds the occupiers' engines still (a fault-injected
stall: the worker stays alive and reporting, its steps wait) for longer than it needs.
"""

from __future__ import annotations

import contextlib
import time
import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest

from cluster.redis_server import EmbeddedRedis
from protos.kvserve.v1 import serving_pb2 as pb
from router.core import RouterConfig
from router.metrics import RouterMetrics
from tests.cluster_harness import (
    MiB,
    ClusterHarness,
    StreamResult,
    cluster_config,
    expect_error,
    greedy_request,
    hold_engines,
    parse_stream,
    request_info,
    running_cluster,
    wait_for,
    wait_idle,
    wait_until,
)

MAX_QUEUE_WAIT_S = 1.5
OCCUPIER_PROMPT, OCCUPIER_MAX_TOKENS = list(range(24)), 1000  # 1023 tokens: all 64 blocks of a worker
SMALL_PROMPT, SMALL_MAX_TOKENS = [5, 6, 7], 16


@pytest.fixture(scope="module")
def cluster(
    ray_session: None, redis_server: EmbeddedRedis, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[ClusterHarness]:
    config = cluster_config(
        redis_server.url,
        tmp_path_factory.mktemp("admission"),
        worker_kv_cache_memory=(8 * MiB, 8 * MiB),
        # A request commits all of max_tokens: one of 64 blocks at its longest fills a worker.
        router=RouterConfig(max_queue=1, max_queue_wait_s=MAX_QUEUE_WAIT_S, kv_reserve_ratio=1.0),
    )
    with running_cluster(config) as harness:
        yield harness


def _id(name: str) -> str:
    return f"{name}-{uuid.uuid4().hex[:8]}"



def _queued(cluster: ClusterHarness) -> int:
    return cluster.stub.ClusterStatus(pb.ClusterStatusRequest(), timeout=5).queued


def _small(request_id: str = "") -> pb.GenerateRequest:
    return greedy_request(SMALL_PROMPT, SMALL_MAX_TOKENS, request_id)


@contextlib.contextmanager
def both_workers_full(cluster: ClusterHarness) -> Iterator[dict[str, str]]:
    """Occupy every block of both workers; yields {worker_id: occupier request_id}."""
    ids = [_id("occupier"), _id("occupier")]
    try:
        for request_id in ids:
            cluster.stub.Submit(greedy_request(OCCUPIER_PROMPT, OCCUPIER_MAX_TOKENS, request_id), timeout=10)
        infos = wait_for(
            lambda: [request_info(cluster.stub, r) for r in ids],
            lambda infos: all(i.output_token_ids for i in infos),
            what="both occupiers to decode",
        )
        occupied = {info.worker_id: info.request_id for info in infos}
        assert sorted(occupied) == ["w0", "w1"], "one occupier per worker"
        status = cluster.stub.ClusterStatus(pb.ClusterStatusRequest(), timeout=5)
        assert [w.uncommitted_blocks for w in status.workers] == [0, 0]
        yield occupied
    finally:
        for request_id in ids:
            cluster.stub.Cancel(pb.CancelRequest(request_id=request_id), timeout=10)
        wait_idle(cluster.stub)


def test_a_request_without_room_waits_then_runs_when_room_frees(cluster: ClusterHarness) -> None:
    waiter_id = _id("waiter")
    with both_workers_full(cluster) as occupied, ThreadPoolExecutor(1) as pool:
        hold_engines(cluster, ("w0",), 4.0)  # w0's occupier is still running at the end
        metrics = cluster.call(_attach_metrics(cluster))  # from here on: only the waiter is placed
        waiting = pool.submit(lambda: parse_stream(cluster.stub.Generate(_small(waiter_id), timeout=60)))
        wait_until(lambda: _queued(cluster) == 1, what="the request to queue")
        seen_queued_at = time.monotonic()
        info = request_info(cluster.stub, waiter_id)
        assert (info.status, info.worker_id, len(info.output_token_ids)) == (pb.REQUEST_STATUS_QUEUED, "", 0)
        assert cluster.call(_queue_length(cluster)) == 1
        assert not waiting.done()

        time.sleep(0.3)
        waited_at_least = time.monotonic() - seen_queued_at
        cluster.stub.Cancel(pb.CancelRequest(request_id=occupied["w1"]), timeout=10)  # room frees on w1
        result: StreamResult = waiting.result(timeout=30)
        freed = request_info(cluster.stub, occupied["w1"])
        still_running = request_info(cluster.stub, occupied["w0"])

    assert result.started.worker_id == "w1"
    assert len(result.token_ids) == SMALL_MAX_TOKENS and result.finished.finish_reason == pb.FINISH_REASON_LENGTH
    info = request_info(cluster.stub, waiter_id)
    assert info.status == pb.REQUEST_STATUS_FINISHED and info.worker_id == "w1"
    assert freed.status == pb.REQUEST_STATUS_CANCELLED
    assert info.timings.first_token_at >= freed.timings.finished_at > 0, "it ran only once room was free"
    assert still_running.status == pb.REQUEST_STATUS_RUNNING
    # The queue-time histogram has the waiter's wait: created before it was seen queued,
    # placed after the cancel, and before its first token.
    queue_time = metrics.registry.get_sample_value("kvserve_request_queue_time_seconds_sum")
    assert metrics.registry.get_sample_value("kvserve_request_queue_time_seconds_count") == 1
    assert waited_at_least < queue_time <= info.timings.first_token_at - info.timings.created_at


async def _attach_metrics(cluster: ClusterHarness) -> RouterMetrics:
    return RouterMetrics(cluster.router)


async def _queue_length(cluster: ClusterHarness) -> int:
    return cluster.router.queue_length


def test_past_the_queue_bound_a_request_is_refused(cluster: ClusterHarness) -> None:
    with both_workers_full(cluster):
        hold_engines(cluster, ("w0", "w1"), 3.0)
        queued_id = _id("queued")
        assert cluster.stub.Submit(_small(queued_id), timeout=10).created
        wait_until(lambda: _queued(cluster) == 1, what="the queue (max_queue=1) to fill")

        refused_id = _id("refused")
        message = expect_error(
            lambda: list(cluster.stub.Generate(_small(refused_id), timeout=30)),
            grpc.StatusCode.RESOURCE_EXHAUSTED,
            "queue is full",
            "max_queue=1",
        )
        expect_error(
            lambda: cluster.stub.Submit(_small(), timeout=10), grpc.StatusCode.RESOURCE_EXHAUSTED, "queue is full"
        )
        assert _queued(cluster) == 1, "refused requests never joined the queue"
        refused = request_info(cluster.stub, refused_id)
        assert refused.status == pb.REQUEST_STATUS_FAILED and refused.error == message

        # A queued request can be cancelled, and leaves the queue.
        reply = cluster.stub.Cancel(pb.CancelRequest(request_id=queued_id), timeout=10)
        assert reply.status == pb.REQUEST_STATUS_CANCELLED
        assert _queued(cluster) == 0
        wait_until(
            lambda: request_info(cluster.stub, queued_id).status == pb.REQUEST_STATUS_CANCELLED,
            what="the cancel recorded",
        )


def test_a_waiter_gets_resource_exhausted_after_max_queue_wait(cluster: ClusterHarness) -> None:
    request_id = _id("patient")
    with both_workers_full(cluster):
        hold_engines(cluster, ("w0", "w1"), MAX_QUEUE_WAIT_S + 2.0)
        began = time.monotonic()
        expect_error(
            lambda: list(cluster.stub.Generate(_small(request_id), timeout=30)),
            grpc.StatusCode.RESOURCE_EXHAUSTED,
            "max_queue_wait_s",
        )
        waited = time.monotonic() - began
        assert _queued(cluster) == 0
    assert MAX_QUEUE_WAIT_S - 0.1 <= waited < MAX_QUEUE_WAIT_S + 3
    assert request_info(cluster.stub, request_id).status == pb.REQUEST_STATUS_FAILED


def test_a_client_deadline_shorter_than_the_wait_is_exceeded(cluster: ClusterHarness) -> None:
    request_id = _id("hurried")
    with both_workers_full(cluster):
        hold_engines(cluster, ("w0", "w1"), 2.5)
        began = time.monotonic()
        expect_error(
            lambda: list(cluster.stub.Generate(_small(request_id), timeout=0.5)), grpc.StatusCode.DEADLINE_EXCEEDED
        )
        assert time.monotonic() - began < MAX_QUEUE_WAIT_S
        wait_until(lambda: _queued(cluster) == 0, what="the expired request to leave the queue")
        info = wait_for(
            lambda: request_info(cluster.stub, request_id),
            lambda i: i.status != pb.REQUEST_STATUS_QUEUED,
            what="its end",
        )
    # The router's own deadline (FAILED) and the client's cancellation (CANCELLED) race; either ends it.
    assert info.status in (pb.REQUEST_STATUS_FAILED, pb.REQUEST_STATUS_CANCELLED)
    assert info.worker_id == "" and len(info.output_token_ids) == 0


def test_a_client_that_leaves_the_queue_takes_no_room(cluster: ClusterHarness) -> None:
    request_id = _id("leaver")
    with both_workers_full(cluster):
        hold_engines(cluster, ("w0", "w1"), 3.0)
        call = cluster.stub.Generate(_small(request_id), timeout=30)
        wait_until(lambda: _queued(cluster) == 1, what="the request to queue")
        call.cancel()
        wait_until(lambda: _queued(cluster) == 0, what="the queue to empty")
        wait_until(
            lambda: request_info(cluster.stub, request_id).status == pb.REQUEST_STATUS_CANCELLED,
            what="the cancel recorded",
        )
    # And the cluster serves as before.
    assert len(parse_stream(cluster.stub.Generate(_small(), timeout=30)).token_ids) == SMALL_MAX_TOKENS
    wait_idle(cluster.stub)
