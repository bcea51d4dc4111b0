"""Failures around a real cluster: Redis going away and coming back, a worker that falls
silent, workers that crash. Each test starts a cluster of its own, since it breaks it."""

from __future__ import annotations

import dataclasses
import os
import signal
import time
from pathlib import Path

import grpc
import ray
from grpc_health.v1 import health_pb2, health_pb2_grpc

from cluster.redis_server import EmbeddedRedis, RedisServerConfig
from protos.kvserve.v1 import serving_pb2 as pb
from router.core import RouterConfig
from tests.cluster_harness import (
    metric_values,
    MiB,
    ClusterHarness,
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
    worker_pid,
    worker_status,
)

WORKER_TIMEOUT_S = 1.0


def _health(cluster: ClusterHarness) -> int:
    assert cluster.channel is not None
    stub = health_pb2_grpc.HealthStub(cluster.channel)
    return stub.Check(health_pb2.HealthCheckRequest(service="kvserve.v1.KVServe"), timeout=5).status



def test_redis_down_is_unavailable_and_serving_resumes_when_it_returns(
    ray_session: None, tmp_path: Path, reference_engine: ReferenceEngine
) -> None:
    # Long enough, and held, to be still decoding when Redis stops: a CI run read its first
    # delta only once all 160 tokens of the request had been made, merged into one.
    prompt, max_tokens = list(range(60, 72)), 800
    expected = reference_engine.greedy([(prompt, max_tokens)])[0].output_ids
    redis = EmbeddedRedis(RedisServerConfig(state_dir=tmp_path / "redis"))
    redis.start()
    try:
        with running_cluster(cluster_config(redis.url, tmp_path, (16 * MiB,))) as cluster:
            assert _health(cluster) == health_pb2.HealthCheckResponse.SERVING
            call = cluster.stub.Generate(greedy_request(prompt, max_tokens), timeout=60)
            started, first = read_deltas(call, 1)
            hold_engines(cluster, ("w0",), 1.0)
            assert sum(len(d.token_ids) for d in first) < max_tokens, "the request ended before Redis stopped"
            redis.stop()
            # A stream already running keeps getting its tokens: they reach it before Redis.
            during = read_rest(started, first, call)
            assert during.token_ids == expected
            assert during.finished.finish_reason == pb.FINISH_REASON_LENGTH

            stub = cluster.stub
            for rpc in (
                lambda: list(stub.Generate(greedy_request(prompt, 8), timeout=10)),
                lambda: stub.Submit(greedy_request(prompt, 8), timeout=10),
                lambda: stub.GetRequest(pb.GetRequestRequest(request_id=started.request_id), timeout=10),
            ):
                expect_error(rpc, grpc.StatusCode.UNAVAILABLE, "Redis")
            # The router is up, its worker alive, and the finished request's KV is free;
            # health says Redis is not answering.
            assert wait_idle(stub).alive_workers == 1
            wait_until(lambda: _health(cluster) == health_pb2.HealthCheckResponse.NOT_SERVING, timeout=5,
                       what="health NOT_SERVING while Redis is down")

            redis.restart()  # same port and data directory
            # What happened while Redis was down is recorded once it is back: the request
            # that finished during the outage is FINISHED with its whole output.
            during_info = wait_for(
                lambda: request_info(stub, started.request_id),
                lambda i: i.status == pb.REQUEST_STATUS_FINISHED,
                what="the request that ended during the outage to be recorded",
            )
            assert list(during_info.output_token_ids) == expected
            assert during_info.finish_reason == pb.FINISH_REASON_LENGTH
            after = parse_stream(stub.Generate(greedy_request(prompt, max_tokens), timeout=60))
            assert after.token_ids == expected
            wait_until(lambda: _health(cluster) == health_pb2.HealthCheckResponse.SERVING, timeout=5,
                       what="health SERVING once Redis is back")
            after_id = after.started.request_id
            info = wait_for(
                lambda: request_info(stub, after_id),
                lambda i: i.status == pb.REQUEST_STATUS_FINISHED,
                what="the request to be recorded as finished",
            )
            assert list(info.output_token_ids) == expected
            wait_idle(stub)
    finally:
        redis.stop()


def test_a_silent_worker_is_marked_dead_and_its_request_moves(
    ray_session: None, redis_server: EmbeddedRedis, tmp_path: Path, reference_engine: ReferenceEngine
) -> None:
    expected = reference_engine.greedy([(list(range(10)), 200)])[0].output_ids
    config = cluster_config(redis_server.url, tmp_path, router=RouterConfig(worker_timeout_s=WORKER_TIMEOUT_S))
    with running_cluster(config) as cluster:
        stub = cluster.stub
        pid = worker_pid(cluster.cluster.handles[0])
        call = stub.Generate(greedy_request(list(range(10)), 200), timeout=60)
        started, first = read_deltas(call, 1)
        assert started.worker_id == "w0", "an idle cluster places on its first worker"

        os.kill(pid, signal.SIGSTOP)  # alive to Ray, silent to the router
        silent_since = time.monotonic()
        try:
            dead = wait_for(lambda: worker_status(stub, "w0"), lambda w: not w.alive, timeout=5, what="w0 dead")
            # Dead for its silence, not sooner (its last message came a few ms before the stop).
            assert time.monotonic() - silent_since >= WORKER_TIMEOUT_S - 0.1
            assert dead.report_age_seconds > WORKER_TIMEOUT_S
            # Its request went on on w1, from where it was, to the same end.
            moved = read_rest(started, first, call)
            assert moved.token_ids == expected and moved.finished.finish_reason == pb.FINISH_REASON_LENGTH
            assert request_info(stub, started.request_id).worker_id == "w1"
            assert stub.ClusterStatus(pb.ClusterStatusRequest(), timeout=5).alive_workers == 1
            assert _health(cluster) == health_pb2.HealthCheckResponse.SERVING

            for _ in range(3):
                result = parse_stream(stub.Generate(greedy_request([1, 2, 3], 8), timeout=30))
                assert result.started.worker_id == "w1" and len(result.token_ids) == 8
        finally:
            os.kill(pid, signal.SIGCONT)

        # Reporting again, it is alive again, and drops the request that moved away.
        wait_until(lambda: worker_status(stub, "w0").alive, timeout=10, what="w0 alive again")
        wait_idle(stub)
        assert _health(cluster) == health_pb2.HealthCheckResponse.SERVING


def test_crashed_workers_hand_their_requests_over_until_none_is_left(
    ray_session: None, redis_server: EmbeddedRedis, tmp_path: Path, reference_engine: ReferenceEngine
) -> None:
    expected_w0, expected_w1 = (
        r.output_ids for r in reference_engine.greedy([(list(range(10)), 120), (list(range(20)), 400)])
    )
    config = cluster_config(
        redis_server.url, tmp_path, router=RouterConfig(worker_timeout_s=WORKER_TIMEOUT_S, max_queue_wait_s=4.0)
    )
    with running_cluster(dataclasses.replace(config, metrics_port=0)) as cluster:
        stub = cluster.stub
        on_w0 = stub.Generate(greedy_request(list(range(10)), 120), timeout=60)
        started_w0, first_w0 = read_deltas(on_w0, 1)
        on_w1 = stub.Generate(greedy_request(list(range(20)), 400), timeout=60)
        started_w1, first_w1 = read_deltas(on_w1, 1)
        assert (started_w0.worker_id, started_w1.worker_id) == ("w0", "w1")
        w1_load = [f'kvserve_worker_{name}{{worker="w1"}}' for name in ("running_requests", "kv_usage_ratio",
                                                                          "uncommitted_blocks")]
        wait_until(lambda: metric_values(cluster)[w1_load[0]] == 1, what="w1's report of its request")

        hold_engines(cluster, ("w1",), 5.0)  # still running when the kill lands
        ray.kill(cluster.cluster.handles[1])
        moved = read_rest(started_w1, first_w1, on_w1)
        assert moved.finished.finish_reason == pb.FINISH_REASON_LENGTH and moved.token_ids == expected_w1
        wait_until(lambda: worker_status(stub, "w1").alive is False, timeout=5, what="w1 dead")
        info = wait_for(
            lambda: request_info(stub, started_w1.request_id),
            lambda i: i.status == pb.REQUEST_STATUS_FINISHED,
            what="the moved request to be recorded as finished",
        )
        assert info.worker_id == "w0" and info.num_migrations == 1 and list(info.output_token_ids) == expected_w1
        # A dead worker's gauges are not its last report's load (a metrics audit found a sum of
        # running requests over workers that never came back to 0).
        values = metric_values(cluster)
        assert [values[name] for name in w1_load] == [0, 0, 0]
        assert values['kvserve_worker_alive{worker="w1"}'] == 0
        # So does ClusterStatus (an outside check read running 1 and 2 on dead workers).
        dead = worker_status(stub, "w1")
        assert (dead.running, dead.waiting, dead.uncommitted_blocks) == (0, 0, 0), dead
        # The other worker's request is untouched, and new ones go there.
        kept = read_rest(started_w0, first_w0, on_w0)
        assert kept.finished.finish_reason == pb.FINISH_REASON_LENGTH and kept.token_ids == expected_w0
        result = parse_stream(stub.Generate(greedy_request([1, 2, 3], 8), timeout=30))
        assert result.started.worker_id == "w0"
        assert _health(cluster) == health_pb2.HealthCheckResponse.SERVING

        # Both are placed on w0 while its engine is held, so that both are surely running when
        # the kill lands. Held after a token each (as for w1 above), they ran on until the hold
        # did; a suite run then waited 10 s for the cancelled one to be moved (cause not found).
        cancelled_before = metric_values(cluster).get('kvserve_requests_finished_total{reason="cancelled"}', 0)
        hold_engines(cluster, ("w0",), 5.0)
        last = stub.Generate(greedy_request(list(range(10)), 400), timeout=60)
        last_started, last_first = read_deltas(last, 0)
        cancelled = stub.Generate(greedy_request(list(range(30, 40)), 400), timeout=60)
        cancelled_started, cancelled_first = read_deltas(cancelled, 0)
        assert (last_started.worker_id, cancelled_started.worker_id) == ("w0", "w0")
        ray.kill(cluster.cluster.handles[0])
        # A moved request that waits for a worker, cancelled by its client, ends CANCELLED, as
        # it would have anywhere else (it ended FAILED, "could not resume after a move").
        wait_for(lambda: request_info(stub, cancelled_started.request_id),
                 lambda i: i.status == pb.REQUEST_STATUS_QUEUED and i.num_migrations == 1,
                 what="the request to be moved and waiting for a worker")
        answer = stub.Cancel(pb.CancelRequest(request_id=cancelled_started.request_id), timeout=30)
        assert answer.status == pb.REQUEST_STATUS_CANCELLED
        ended = read_rest(cancelled_started, cancelled_first, cancelled)
        assert (ended.finished.finish_reason, ended.finished.error) == (pb.FINISH_REASON_CANCELLED, "")
        info = wait_for(lambda: request_info(stub, cancelled_started.request_id),
                        lambda i: i.status != pb.REQUEST_STATUS_QUEUED, what="the cancel recorded")
        assert info.status == pb.REQUEST_STATUS_CANCELLED
        # With no worker left to move to, it waits max_queue_wait_s for one, then fails clearly.
        stranded = read_rest(last_started, last_first, last)
        assert stranded.finished.finish_reason == pb.FINISH_REASON_ERROR
        assert "no live worker took it over" in stranded.finished.error
        # It was admitted once: it ended in error, but was not refused at admission.
        values = metric_values(cluster)
        assert values['kvserve_requests_finished_total{reason="error"}'] == 1
        assert values['kvserve_requests_finished_total{reason="cancelled"}'] == cancelled_before + 1
        assert not {name: v for name, v in values.items() if name.startswith("kvserve_requests_rejected_total")}
        wait_until(
            lambda: stub.ClusterStatus(pb.ClusterStatusRequest(), timeout=5).alive_workers == 0,
            timeout=5,
            what="no live worker",
        )
        expect_error(
            lambda: list(stub.Generate(greedy_request([1, 2, 3], 8), timeout=10)),
            grpc.StatusCode.UNAVAILABLE,
            "no live worker",
        )
        wait_until(
            lambda: _health(cluster) == health_pb2.HealthCheckResponse.NOT_SERVING, timeout=5, what="health NOT_SERVING"
        )
