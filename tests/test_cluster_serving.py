"""Serving through a real cluster: two Ray workers, the session's redis-server, gRPC on loopback.

Every greedy output is checked against the in-process engine built from the workers'
EngineArgs, and every test ends with the KV of every worker free again.
"""

from __future__ import annotations

import random
import threading
import time
import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from cluster.cli import main
from cluster.redis_server import EmbeddedRedis
from protos.kvserve.v1 import serving_pb2 as pb
from router.core import RouterConfig
from router.placement import reservation
from tests.cluster_harness import (
    MiB,
    ClusterHarness,
    ReferenceEngine,
    cluster_config,
    greedy_request,
    hold_engines,
    observing,
    parse_stream,
    read_deltas,
    read_rest,
    request_info,
    running_cluster,
    wait_for,
    wait_idle,
    wait_until,
    worker_status,
)


@pytest.fixture(scope="module")
def cluster(
    ray_session: None, redis_server: EmbeddedRedis, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[ClusterHarness]:
    """Two workers of 128 KV blocks (16 MiB) each."""
    with running_cluster(cluster_config(redis_server.url, tmp_path_factory.mktemp("serving"))) as harness:
        yield harness


def _id(name: str) -> str:
    return f"{name}-{uuid.uuid4().hex[:8]}"



def _wait_status(cluster: ClusterHarness, request_id: str, status: int) -> pb.RequestInfo:
    return wait_for(
        lambda: request_info(cluster.stub, request_id),
        lambda info: info.status == status,
        what=f"{request_id} to reach {pb.RequestStatus.Name(status)}",
    )


def test_concurrent_streams_equal_the_in_process_engine(
    cluster: ClusterHarness, reference_engine: ReferenceEngine
) -> None:
    rng = random.Random(7)
    requests = [([rng.randrange(258) for _ in range(rng.randint(1, 40))], rng.randint(8, 40)) for _ in range(20)]
    expected = reference_engine.greedy(requests)
    start = threading.Barrier(len(requests))

    def run(index: int) -> Any:
        prompt, max_tokens = requests[index]
        start.wait()
        return parse_stream(cluster.stub.Generate(greedy_request(prompt, max_tokens), timeout=120))

    with ThreadPoolExecutor(len(requests)) as pool:
        results = list(pool.map(run, range(len(requests))))

    for index, ((prompt, max_tokens), result, want) in enumerate(zip(requests, results, expected)):
        assert result.token_ids == want.output_ids, f"request {index} differs from the in-process engine"
        assert result.text == want.output_text
        assert result.started.prompt_tokens == len(prompt)
        assert result.started.request_id.startswith("req-")
        assert result.finished.finish_reason == pb.FINISH_REASON_LENGTH
        assert result.finished.usage == pb.Usage(prompt_tokens=len(prompt), completion_tokens=max_tokens)
    assert len({r.started.request_id for r in results}) == len(requests)
    assert {r.started.worker_id for r in results} == {"w0", "w1"}
    status = wait_idle(cluster.stub)
    assert [(w.worker_id, w.alive, w.total_blocks) for w in status.workers] == [("w0", True, 128), ("w1", True, 128)]


def test_a_client_that_drops_resumes_from_its_offset(
    cluster: ClusterHarness, reference_engine: ReferenceEngine
) -> None:
    prompt, max_tokens = list(range(40, 60)), 96
    expected = reference_engine.greedy([(prompt, max_tokens)])[0].output_ids
    request_id = _id("resume")
    submitted = cluster.stub.Submit(greedy_request(prompt, max_tokens, request_id), timeout=10)
    assert (submitted.request_id, submitted.created) == (request_id, True)

    call = cluster.stub.Stream(pb.StreamRequest(request_id=request_id), timeout=60)
    _, first = read_deltas(call, 5)
    call.cancel()  # the client drops; a submitted request runs on without it
    # From offset 0, no gap, no overlap (tokens the client had not taken yet come merged).
    ends = [d.offset + len(d.token_ids) for d in first]
    assert [d.offset for d in first] == [0, *ends[:-1]], [(d.offset, len(d.token_ids)) for d in first]
    resume_at = first[-1].offset + len(first[-1].token_ids)
    time.sleep(0.1)  # tokens made while nobody is attached come back from Redis

    again = cluster.stub.Stream(pb.StreamRequest(request_id=request_id, from_offset=resume_at), timeout=60)
    rest = parse_stream(again, resume_at)
    assert [t for d in first for t in d.token_ids] + rest.token_ids == expected
    assert rest.finished.finish_reason == pb.FINISH_REASON_LENGTH
    assert rest.finished.usage.completion_tokens == max_tokens

    info = _wait_status(cluster, request_id, pb.REQUEST_STATUS_FINISHED)
    assert list(info.output_token_ids) == expected
    assert list(info.prompt_token_ids) == prompt
    assert info.finish_reason == pb.FINISH_REASON_LENGTH
    assert info.worker_id in ("w0", "w1") and info.worker_id == rest.started.worker_id
    assert info.sampling.max_tokens == max_tokens and info.sampling.temperature == 0.0
    assert 0 < info.timings.created_at <= info.timings.first_token_at <= info.timings.finished_at
    # A reader arriving after the end gets everything from Redis, or nothing past the end.
    assert parse_stream(cluster.stub.Stream(pb.StreamRequest(request_id=request_id), timeout=10)).token_ids == expected
    late = cluster.stub.Stream(pb.StreamRequest(request_id=request_id, from_offset=max_tokens), timeout=10)
    tail = parse_stream(late, max_tokens)
    assert tail.token_ids == [] and tail.finished.finish_reason == pb.FINISH_REASON_LENGTH
    wait_idle(cluster.stub)


LONG_PROMPT = list(range(100, 124))
LONG_MAX_TOKENS = 1500  # about ten seconds of decoding: it is always cancelled long before the end
# What it commits: its prompt and ceil(0.5 x 1500) = 750 output tokens at RouterConfig's
# default kv_reserve_ratio, 49 blocks; 95 at its longest.
LONG_RESERVED_BLOCKS = reservation(len(LONG_PROMPT), LONG_MAX_TOKENS, 0, 95, RouterConfig.kv_reserve_ratio, 16)[0]


def test_cancel_frees_the_requests_kv(cluster: ClusterHarness) -> None:
    request_id = _id("cancel")
    cluster.stub.Submit(greedy_request(LONG_PROMPT, LONG_MAX_TOKENS, request_id), timeout=10)
    info = wait_for(
        lambda: request_info(cluster.stub, request_id), lambda i: len(i.output_token_ids) > 0, what="the first tokens"
    )
    busy = worker_status(cluster.stub, info.worker_id)
    assert busy.running == 1 and busy.free_blocks < busy.total_blocks
    assert busy.uncommitted_blocks == busy.total_blocks - LONG_RESERVED_BLOCKS

    reply = cluster.stub.Cancel(pb.CancelRequest(request_id=request_id), timeout=10)
    assert (reply.request_id, reply.status) == (request_id, pb.REQUEST_STATUS_CANCELLED)
    wait_idle(cluster.stub)
    info = _wait_status(cluster, request_id, pb.REQUEST_STATUS_CANCELLED)
    assert info.finish_reason == pb.FINISH_REASON_CANCELLED
    assert 0 < len(info.output_token_ids) < LONG_MAX_TOKENS
    assert info.timings.finished_at >= info.timings.first_token_at > 0
    # Cancelling again changes nothing and says how it ended.
    again = cluster.stub.Cancel(pb.CancelRequest(request_id=request_id), timeout=10)
    assert again.status == pb.REQUEST_STATUS_CANCELLED


def test_a_cancel_right_after_submit_stops_the_request(cluster: ClusterHarness) -> None:
    # The Cancel arrives while the router is still handing the request to its worker; it
    # must not reach the worker before the request does (and be lost there).
    ids = [_id("quick") for _ in range(40)]

    def submit_and_cancel(request_id: str) -> int:
        cluster.stub.Submit(greedy_request(LONG_PROMPT, LONG_MAX_TOKENS, request_id), timeout=10)
        return cluster.stub.Cancel(pb.CancelRequest(request_id=request_id), timeout=10).status

    with ThreadPoolExecutor(4) as pool:
        assert set(pool.map(submit_and_cancel, ids)) == {pb.REQUEST_STATUS_CANCELLED}
    wait_idle(cluster.stub, timeout=5)  # a request that escaped would decode for seconds
    assert {_wait_status(cluster, request_id, pb.REQUEST_STATUS_CANCELLED).status for request_id in ids} == {
        pb.REQUEST_STATUS_CANCELLED
    }
    assert cluster.call(_outstanding(cluster)) == {"w0": set(), "w1": set()}


def test_a_client_disconnect_cancels_its_generate(cluster: ClusterHarness) -> None:
    request_id = _id("disconnect")
    call = cluster.stub.Generate(greedy_request(LONG_PROMPT, LONG_MAX_TOKENS, request_id), timeout=60)
    started, _ = read_deltas(call, 3)
    busy = worker_status(cluster.stub, started.worker_id)
    assert busy.running == 1 and busy.free_blocks < busy.total_blocks

    call.cancel()
    wait_idle(cluster.stub)
    info = _wait_status(cluster, request_id, pb.REQUEST_STATUS_CANCELLED)
    assert info.finish_reason == pb.FINISH_REASON_CANCELLED
    assert 3 <= len(info.output_token_ids) < LONG_MAX_TOKENS
    assert worker_status(cluster.stub, started.worker_id).running == 0


def test_a_client_that_leaves_at_any_moment_leaves_nothing_running(cluster: ClusterHarness) -> None:
    # Disconnects land wherever the router is: creating the record, placing, sending it to
    # the worker, or sending a message. None may leave a request decoding, or a record open.
    delays = random.Random(11)
    plan = [(_id("leave"), delays.random() * 0.004) for _ in range(60)]

    def leave(request_id: str, delay: float) -> None:
        call = cluster.stub.Generate(greedy_request(LONG_PROMPT, LONG_MAX_TOKENS, request_id), timeout=30)
        time.sleep(delay)
        call.cancel()

    with ThreadPoolExecutor(4) as pool:
        list(pool.map(lambda item: leave(*item), plan))
    wait_idle(cluster.stub, timeout=5)  # a request left behind would decode for seconds

    def ended(request_id: str) -> bool:
        try:
            return request_info(cluster.stub, request_id).status == pb.REQUEST_STATUS_CANCELLED
        except grpc.RpcError as error:  # it left before the router made a record
            return error.code() == grpc.StatusCode.NOT_FOUND

    for request_id, _ in plan:
        wait_until(lambda: ended(request_id), timeout=5, what=f"{request_id} to be cancelled")
    assert cluster.call(_outstanding(cluster)) == {"w0": set(), "w1": set()}


async def _outstanding(cluster: ClusterHarness) -> dict[str, set[str]]:
    return {worker_id: set(view.outstanding) for worker_id, view in cluster.router.workers.items()}


def test_submitting_one_id_many_times_runs_it_once(cluster: ClusterHarness, reference_engine: ReferenceEngine) -> None:
    prompt, max_tokens = [7, 8, 9, 10], 24
    expected = reference_engine.greedy([(prompt, max_tokens)])[0].output_ids
    request_id = _id("twice")
    placed: list[str] = []

    def on_event(name: str, payload: Any) -> None:
        if name == "placed":
            placed.append(payload[0].request_id)

    senders = 8
    start = threading.Barrier(senders)

    def submit(index: int) -> pb.SubmitResponse:
        # Later senders even ask for something else under the same id: the first one wins.
        request = greedy_request(prompt if index % 2 == 0 else [1, 2], max_tokens if index % 2 == 0 else 5, request_id)
        start.wait()
        return cluster.stub.Submit(request, timeout=10)

    with observing(cluster, on_event):
        with ThreadPoolExecutor(senders) as pool:
            replies = list(pool.map(submit, range(senders)))
        again = cluster.stub.Submit(greedy_request(prompt, max_tokens, request_id), timeout=10)
        info = _wait_status(cluster, request_id, pb.REQUEST_STATUS_FINISHED)
        wait_idle(cluster.stub)

    assert sorted(r.created for r in replies) == [False] * (senders - 1) + [True]
    assert all(r.request_id == request_id for r in [*replies, again])
    assert not again.created and again.status != pb.REQUEST_STATUS_UNSPECIFIED
    assert placed.count(request_id) == 1
    # Whichever sender won, one request ran: its tokens once, and no duplicate reached a worker
    # (an engine refuses a second request with a running id, which would fail this one).
    assert info.finish_reason == pb.FINISH_REASON_LENGTH
    if list(info.prompt_token_ids) == prompt:
        assert list(info.output_token_ids) == expected
    else:
        assert list(info.prompt_token_ids) == [1, 2] and len(info.output_token_ids) == 5


def test_health_is_serving_and_reflection_lists_the_service(cluster: ClusterHarness) -> None:
    assert cluster.channel is not None
    health = health_pb2_grpc.HealthStub(cluster.channel)
    for service in ("", "kvserve.v1.KVServe"):
        reply = health.Check(health_pb2.HealthCheckRequest(service=service), timeout=5)
        assert reply.status == health_pb2.HealthCheckResponse.SERVING

    reflection = reflection_pb2_grpc.ServerReflectionStub(cluster.channel)
    ask = reflection_pb2.ServerReflectionRequest(list_services="")
    replies = list(reflection.ServerReflectionInfo(iter([ask]), timeout=5))
    names = {s.name for s in replies[0].list_services_response.service}
    assert {"kvserve.v1.KVServe", "grpc.health.v1.Health"} <= names


def test_the_cli_submits_attaches_reads_and_cancels_a_request(
    cluster: ClusterHarness, capsys: pytest.CaptureFixture[str]
) -> None:
    """`kvserve submit`, `stream`, `get` and `cancel`: the README's resume flow from a
    terminal (a first-time user found only `generate` and `status`, and `generate
    --request-id` with a taken id told them to attach with Stream)."""
    address = cluster.cluster.address
    request_id = _id("cli")
    submit = ["submit", "Hello there", "--address", address, "--max-tokens", "12", "--request-id", request_id]
    assert main(submit) == 0
    out, err = capsys.readouterr()
    assert out == f"{request_id}\n" and f"[submitted: QUEUED; kvserve stream {request_id}]" in err, (out, err)
    assert main(submit) == 0  # the same id again: nothing new starts
    assert "[exists already, nothing new started" in capsys.readouterr().err
    info = _wait_status(cluster, request_id, pb.REQUEST_STATUS_FINISHED)
    assert main(["get", request_id, "--address", address]) == 0
    out, err = capsys.readouterr()
    assert out == info.output_text + "\n"
    assert f"[{request_id}: FINISHED, finish_reason=length; worker {info.worker_id}; " in err
    assert f", {len(info.output_token_ids)} output tokens]" in err and len(info.output_token_ids) == 12
    assert main(["stream", request_id, "--address", address]) == 0
    out, err = capsys.readouterr()
    assert out == info.output_text + "\n" and err.endswith("[finish_reason=length, 12 tokens]\n"), (out, err)
    assert main(["stream", request_id, "--address", address, "--from-offset", "12"]) == 0
    assert capsys.readouterr().out == "\n"  # from its end: nothing more, and the end at once
    assert main(["cancel", request_id, "--address", address]) == 0
    assert capsys.readouterr().out == "FINISHED\n"  # the first end wins
    for command in ("get", "stream", "cancel"):
        assert main([command, "no-such-request", "--address", address]) == 1
        assert capsys.readouterr().err.startswith(f"kvserve {command}: NOT_FOUND: "), command
    wait_idle(cluster.stub)


def test_a_request_a_stopping_router_cancels_says_why(
    ray_session: None, redis_server: EmbeddedRedis, tmp_path_factory: pytest.TempPathFactory
) -> None:
    """Past the drain grace the router cancels what still runs: the client (and GetRequest)
    learns it was the router, not a client, that cancelled it."""
    config = cluster_config(redis_server.url, tmp_path_factory.mktemp("drained"), (16 * MiB,))
    with running_cluster(config) as cluster:
        call = cluster.stub.Generate(greedy_request(LONG_PROMPT, LONG_MAX_TOKENS), timeout=60)
        started, head = read_deltas(call, 3)
        cluster.call(cluster.router.drain(0.2))
        result = read_rest(started, head, call)
        assert result.finished.finish_reason == pb.FINISH_REASON_CANCELLED
        assert result.finished.error == "the router stopped: it ran past the drain grace (0.2 s)"
        info = request_info(cluster.stub, started.request_id)
        assert (info.status, info.error) == (pb.REQUEST_STATUS_CANCELLED, result.finished.error)


def test_a_client_s_own_cancel_is_not_told_as_the_router_stopping(cluster: ClusterHarness) -> None:
    """A client cancels; the router's drain runs out while the abort is on its way to the
    worker and cancels it too (drain() calls cancel(request_id, why) for what is left). The
    client's cancel came first: no error, not "the router stopped" (found by a review)."""
    call = cluster.stub.Generate(greedy_request(LONG_PROMPT, LONG_MAX_TOKENS), timeout=60)
    started, _ = read_deltas(call, 2)
    request_id = started.request_id
    hold_engines(cluster, ("w0", "w1"), 2.0)  # the abort waits for the worker's next step
    with ThreadPoolExecutor(1) as pool:
        client_cancel = pool.submit(lambda: cluster.stub.Cancel(pb.CancelRequest(request_id=request_id), timeout=30))
        wait_until(lambda: cluster.call(_cancel_requested(cluster, request_id)), what="the client's cancel in")
        cluster.call(cluster.router.cancel(request_id, "the router stopped: it ran past the drain grace (30 s)"))
        assert client_cancel.result(timeout=30).status == pb.REQUEST_STATUS_CANCELLED
    finished = [m.finished for m in call if m.WhichOneof("event") == "finished"]
    assert finished and finished[0].finish_reason == pb.FINISH_REASON_CANCELLED
    assert (finished[0].error, request_info(cluster.stub, request_id).error) == ("", "")
    wait_idle(cluster.stub)


async def _cancel_requested(cluster: ClusterHarness, request_id: str) -> bool:
    tracker = cluster.router.trackers.get(request_id)
    return tracker is None or tracker.cancel_requested
