"""Two routers over one set of workers and one Redis: this test's in-process router, and a
`kvserve router` process started the way `kvserve up --routers 2` starts its second one
(cluster/routers.py), joined to the same Ray and Redis.

- Requests go through both and finish exactly; either router streams any request.
- The process router is SIGKILLed mid-stream: its lease lapses, the other router claims
  and adopts its requests, and they finish exactly there; a client re-attaches there.
- Both routers place a burst at once, each blind to the other's reservations: the
  workers refuse what they cannot commit, so no worker is ever over-committed (no
  preemption), and every request finishes exactly.
- While both hold their leases, neither looks for orphaned requests (an O(in flight) read).
"""

from __future__ import annotations

import concurrent.futures
import os
import re
import signal
import socket
import threading
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import pytest

from cluster.local import ClusterConfig
from cluster.redis_server import EmbeddedRedis
from cluster.routers import RouterProcesses
from protos.kvserve.v1 import serving_pb2 as pb
from protos.kvserve.v1 import serving_pb2_grpc as pb_grpc
from router.core import CANCEL_ANSWER_WAIT_S, RouterConfig
from router.validation import prompt_block_hashes
from tests.cluster_harness import (
    MiB,
    ClusterHarness,
    ReferenceEngine,
    cluster_config,
    greedy_request,
    hold_engines,
    is_idle,
    metric_values,
    observing,
    redis_command_calls,
    parse_stream,
    read_deltas,
    request_info,
    wait_for,
    wait_idle,
)
from workers.messages import StepBatch

LEASE_TTL_S = 2.0
DRAIN_GRACE_S = 1.0  # the process router's: what still runs after it goes to the other
HOLD_S = 5.0  # below the routers' progress_timeout_s (10 s), or the held workers are taken for dead
BUDGETS = (16 * MiB, 16 * MiB)
SMALL_BUDGETS = (4 * MiB, 4 * MiB)  # 32 blocks a worker: a burst fills them


@dataclass
class TwoRouters:
    first: ClusterHarness  # in this process
    second: RouterProcesses  # a `kvserve router` process
    second_stub: pb_grpc.KVServeStub
    second_channel: grpc.Channel
    second_metrics_port: int
    config: ClusterConfig
    started_at: float  # monotonic, once both routers held their leases

    @property
    def stubs(self) -> tuple[pb_grpc.KVServeStub, pb_grpc.KVServeStub]:
        return self.first.stub, self.second_stub

    def refusals(self) -> int:
        """Worker refusals both routers counted (kvserve_worker_refusals)."""
        return int(self.first.call(_refusals_here(self.first))) + _refusals_scraped(self.second_metrics_port)


async def _refusals_here(harness: ClusterHarness) -> float:
    metrics = harness.cluster.metrics
    assert metrics is not None
    return sum(sample.value for family in metrics.refusals.collect() for sample in family.samples
               if sample.name.endswith("_total"))


def _refusals_scraped(port: int) -> int:
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    return int(sum(float(v) for v in re.findall(r'^kvserve_worker_refusals_total\{[^}]*\} (\S+)$', text, re.M)))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture
def two_routers(
    request: pytest.FixtureRequest, ray_session: None, redis_server: EmbeddedRedis, tmp_path: Path
) -> Iterator[TwoRouters]:
    import dataclasses

    import ray

    budgets = getattr(request, "param", BUDGETS)
    config = dataclasses.replace(
        cluster_config(redis_server.url, tmp_path, budgets, RouterConfig(lease_ttl_s=LEASE_TTL_S, kv_reserve_ratio=1.0)),
        metrics_port=0,
    )
    first = ClusterHarness(config)
    second = RouterProcesses()
    channel: grpc.Channel | None = None
    try:
        metrics_port = _free_port()
        # Both routers commit all of max_tokens: a worker is never promised more KV than it has.
        flags = ["--store-prefix", config.store_prefix, "--lease-ttl", str(LEASE_TTL_S), "--worker-timeout", "5",
                 "--redis-timeout", str(config.redis_timeout_s), "--kv-reserve-ratio", "1",
                 "--drain-grace", str(DRAIN_GRACE_S)]
        # RouterProcesses numbers ports from the first router's: the second's are these.
        first.call(second.start(1, ray.get_runtime_context().gcs_address, redis_server.url, flags,
                                port=0, metrics_port=metrics_port - 1), timeout=240)
        channel = grpc.insecure_channel(second.addresses[0])
        stub = pb_grpc.KVServeStub(channel)
        wait_idle(stub, timeout=60)
        yield TwoRouters(first, second, stub, channel, metrics_port, config, time.monotonic())
    finally:
        if channel is not None:
            channel.close()
        second.signal_stop()
        first.call(second.wait(30), timeout=60)
        first.stop()


def _router_pid(routers: TwoRouters) -> int:
    return routers.second.pids[0]


PROMPTS = [[3 + i, 17, 29 + i, 5, 11 + 2 * i, 42, 7 + i] for i in range(8)]


def test_requests_through_both_routers_finish_exactly_and_either_streams_any(
    two_routers: TwoRouters, reference_engine: ReferenceEngine, redis_server: EmbeddedRedis
) -> None:
    expected = [r.output_ids for r in reference_engine.greedy([(p, 24) for p in PROMPTS])]
    stubs = two_routers.stubs
    with concurrent.futures.ThreadPoolExecutor(len(PROMPTS)) as pool:
        results = list(pool.map(
            lambda i: parse_stream(stubs[i % 2].Generate(greedy_request(PROMPTS[i], 24), timeout=120)),
            range(len(PROMPTS)),
        ))
    assert [r.token_ids for r in results] == expected
    # Each router placed on both workers: every router knows every worker.
    for parity in (0, 1):
        assert {r.started.worker_id for r in results[parity::2]} == {"w0", "w1"}
    # Any router streams any request, from any offset, and answers its record.
    for index, result in enumerate(results):
        other = stubs[(index + 1) % 2]
        again = parse_stream(other.Stream(pb.StreamRequest(request_id=result.started.request_id, from_offset=5),
                                          timeout=30), from_offset=5)
        assert again.token_ids == expected[index][5:]
        assert list(request_info(other, result.started.request_id).output_token_ids) == expected[index]
    # Every router hears every worker's cache events: a prompt placed through the second is
    # in the first's prefix index, on the worker that ran it (the first predicted nothing).
    long_prompt = list(range(60, 100))  # 40 tokens: two full blocks cached
    placed = parse_stream(stubs[1].Generate(greedy_request(long_prompt, 4), timeout=60))
    hashes = prompt_block_hashes(tuple(long_prompt), 16)
    assert len(hashes) == 2
    wait_for(lambda: two_routers.first.call(_hits(two_routers.first, hashes)),
             lambda hits: hits.get(placed.started.worker_id) == len(hashes), timeout=10,
             what="the first router's index to hold what the second placed")
    ids = []
    for stub in stubs:
        status = wait_idle(stub)
        assert status.alive_workers == 2
        # Every router lists both, from their leases, and marks itself.
        assert status.routers_known and len(status.routers) == 2
        ids.append([r.router_id for r in status.routers if r.answering])
        assert all(r.address for r in status.routers)
    assert ids[0] == [two_routers.first.router.router_id] and len(ids[1]) == 1 and ids[1] != ids[0]
    _no_sweeps_while_both_hold_their_leases(two_routers, redis_server)


SWEEP_WINDOW_S = 4 * LEASE_TTL_S / 4  # four renewals of each router


def _no_sweeps_while_both_hold_their_leases(two_routers: TwoRouters, redis_server: EmbeddedRedis) -> None:
    """While both routers hold their leases, their renewals do not read Redis's active set
    (SMEMBERS, the start of a sweep for orphans: router/ownership.py PeerWatch): it used to
    be read, with the owner of every request the router does not track, at every renewal,
    so every window had 2 SMEMBERS per renewal. A window with a sweep is tried again, up to
    three times: a starved machine can stall a router or Redis past a TTL, and a router
    that then sees a lease end sweeps rightly."""
    import redis

    # Both steady: each has held its lease for a whole TTL, so each has made its first sweep.
    time.sleep(max(0.0, two_routers.started_at + LEASE_TTL_S * 1.5 - time.monotonic()))
    with redis.Redis.from_url(redis_server.url, decode_responses=True) as client:
        for attempt in range(3):
            client.config_resetstat()
            time.sleep(SWEEP_WINDOW_S)
            calls = redis_command_calls(client)
            # The routers did renew in the window (each renewal runs TIME in its script).
            assert calls.get("time", 0) >= 2, calls
            if calls.get("smembers", 0) == 0:
                return
            print(f"window {attempt + 1}: {calls['smembers']} SMEMBERS (first router steady: "
                  f"{two_routers.first.router.ownership.steady}); again")
    pytest.fail(f"a sweep in each of three windows of {SWEEP_WINDOW_S:g} s: {calls}")


async def _hits(harness: ClusterHarness, hashes: tuple[Any, ...]) -> dict[str, int]:
    return dict(harness.router.prefix_index.hits(hashes))


def test_a_sigkilled_router_s_requests_finish_exactly_on_the_other(
    two_routers: TwoRouters, reference_engine: ReferenceEngine
) -> None:
    lengths = (1000, 900, 950)
    expected = [r.output_ids for r in reference_engine.greedy([(PROMPTS[i], n) for i, n in enumerate(lengths)])]
    first, second = two_routers.stubs
    call = second.Generate(greedy_request(PROMPTS[0], lengths[0]), timeout=120)
    started, head = read_deltas(call, 3)
    # From here to the SIGKILL the engines are held, so all three are still running when
    # their router dies however long the steps below take: a Redis stall once kept the wait
    # for the others' first tokens long enough for the first request to end before the kill.
    hold_engines(two_routers.first, ("w0", "w1"), HOLD_S)
    held_at = time.monotonic()
    submitted = [second.Submit(greedy_request(PROMPTS[i], lengths[i]), timeout=10).request_id for i in (1, 2)]
    wait_for(lambda: [request_info(first, r).status for r in submitted],
             lambda statuses: all(s == pb.REQUEST_STATUS_RUNNING for s in statuses),
             timeout=HOLD_S, what="the submitted requests placed")
    running = [request_info(first, r) for r in (started.request_id, *submitted)]
    assert all(i.status == pb.REQUEST_STATUS_RUNNING for i in running), [i.status for i in running]
    owners = two_routers.first.call(_owners(two_routers.first, [started.request_id, *submitted]))
    second_id = owners[0]
    assert set(owners) == {second_id} and second_id != two_routers.first.router.router_id
    assert time.monotonic() - held_at < HOLD_S, "the kill must land while the engines are held"
    os.kill(_router_pid(two_routers), signal.SIGKILL)
    killed_at = time.monotonic()
    received = [t for d in head for t in d.token_ids]
    with pytest.raises(grpc.RpcError):
        for message in call:  # the stream breaks with its router
            if message.WhichOneof("event") == "delta":
                received.extend(message.delta.token_ids)
    # The client re-attaches on the other router, from what it has.
    resumed = parse_stream(
        first.Stream(pb.StreamRequest(request_id=started.request_id, from_offset=len(received)), timeout=120),
        from_offset=len(received),
    )
    assert received + resumed.token_ids == expected[0]
    for request_id, want in zip(submitted, expected[1:]):
        info = wait_for(lambda: request_info(first, request_id), lambda i: i.status == pb.REQUEST_STATUS_FINISHED,
                        timeout=90, what="the dead router's submitted request to finish")
        assert list(info.output_token_ids) == want
        assert info.num_migrations == 1  # adopted once, under its next engine key
    adopted = two_routers.first.call(_owners(two_routers.first, [started.request_id, *submitted]))
    assert set(adopted) == {two_routers.first.router.router_id}
    # kvserve_adoptions_total counts the three, by the router that owned them.
    assert two_routers.first.call(_adoptions_here(two_routers.first)) == {second_id: 3.0}
    print(f"adopted and finished {time.monotonic() - killed_at:.1f} s after the SIGKILL (lease TTL {LEASE_TTL_S} s)")
    wait_idle(first)


def test_a_stopped_router_leaves_what_still_runs_to_the_other_where_its_clients_re_attach(
    two_routers: TwoRouters, reference_engine: ReferenceEngine
) -> None:
    """A router that joined the workers (kvserve router) is stopped (Ctrl-C, or Kubernetes'
    SIGTERM in a rolling update): after its drain grace it does not cancel what still runs,
    since a peer is serving: the peer adopts it, and the client is told where to re-attach."""
    lengths = (1000, 900)
    expected = [r.output_ids for r in reference_engine.greedy([(PROMPTS[3 + i], n) for i, n in enumerate(lengths)])]
    first, second = two_routers.stubs
    call = second.Generate(greedy_request(PROMPTS[3], lengths[0]), timeout=120)
    started, head = read_deltas(call, 3)
    hold_engines(two_routers.first, ("w0", "w1"), HOLD_S)  # both still run when the grace ends
    submitted = second.Submit(greedy_request(PROMPTS[4], lengths[1]), timeout=10).request_id
    second_id = two_routers.first.call(_owners(two_routers.first, [started.request_id]))[0]
    two_routers.second.signal_stop()
    received = [t for d in head for t in d.token_ids]
    with pytest.raises(grpc.RpcError) as stopped:
        for message in call:
            if message.WhichOneof("event") == "delta":
                received.extend(message.delta.token_ids)
    assert stopped.value.code() == grpc.StatusCode.UNAVAILABLE, stopped.value
    hint = re.search(r"re-attach with Stream\(request_id='([^']+)', from_offset=(\d+)\)", stopped.value.details() or "")
    assert hint and hint.group(1) == started.request_id, stopped.value.details()
    assert int(hint.group(2)) == len(received) > 0
    two_routers.first.call(two_routers.second.wait(30), timeout=60)
    assert two_routers.second._processes[0].returncode == 0  # drained and stopped, not killed
    resumed = parse_stream(
        first.Stream(pb.StreamRequest(request_id=started.request_id, from_offset=len(received)), timeout=120),
        from_offset=len(received),
    )
    assert received + resumed.token_ids == expected[0]
    assert resumed.finished.finish_reason == pb.FINISH_REASON_LENGTH
    info = wait_for(lambda: request_info(first, submitted), lambda i: i.status == pb.REQUEST_STATUS_FINISHED,
                    timeout=90, what="the stopped router's submitted request to finish on the other")
    assert list(info.output_token_ids) == expected[1] and info.num_migrations == 1
    assert two_routers.first.call(_adoptions_here(two_routers.first)) == {second_id: 2.0}
    wait_idle(first)


async def _adoptions_here(harness: ClusterHarness) -> dict[str, float]:
    metrics = harness.cluster.metrics
    assert metrics is not None
    return {sample.labels["from_router"]: sample.value for family in metrics.adoptions.collect()
            for sample in family.samples if sample.name.endswith("_total")}


async def _owners(harness: ClusterHarness, request_ids: list[str]) -> list[str]:
    return list((await harness.router.ownership.owners(request_ids)).values())


ROUNDS = 3


@pytest.mark.parametrize("two_routers", [SMALL_BUDGETS], indirect=True)
def test_two_routers_placing_a_burst_at_once_never_over_commit_a_worker(
    two_routers: TwoRouters, reference_engine: ReferenceEngine
) -> None:
    status = wait_idle(two_routers.first.stub)
    total = min(w.total_blocks for w in status.workers)
    block_size = status.workers[0].block_size
    # Each request needs about a third of a worker at its longest: two workers hold six at
    # once, and each router, seeing only its own reservations, would place six.
    max_tokens = (total // 3) * block_size - len(PROMPTS[0]) - block_size
    per_router = 8
    expected = {tuple(p): r.output_ids for p, r in zip(PROMPTS, reference_engine.greedy([(p, max_tokens) for p in PROMPTS]))}
    reports: list[tuple[str, int, int, int]] = []
    placed: dict[str, list[float]] = {}  # this router's placements of each request (unix times)
    created: dict[str, float] = {}
    refused: set[str] = set()

    def observe(name: str, payload: Any) -> None:
        if name == "report":
            view, batch = payload
            assert isinstance(batch, StepBatch)
            r = batch.report
            reports.append((view.worker_id, r.num_committed_blocks, r.num_total_blocks, r.num_preemptions))
        elif name == "placed":
            created[payload[0].request_id] = payload[0].created_at
            placed.setdefault(payload[0].request_id, []).append(time.time())
        elif name == "refused":
            refused.add(payload[0].request_id)

    queue_time_before = metric_values(two_routers.first)["kvserve_request_queue_time_seconds_sum"]
    with observing(two_routers.first, observe):
        preempted_before = _preemptions(two_routers.first.stub)
        for round_index in range(ROUNDS):
            requests = [(stub, PROMPTS[(i + round_index) % len(PROMPTS)]) for stub in two_routers.stubs
                        for i in range(per_router)]
            barrier = threading.Barrier(len(requests))

            def run(item: tuple[pb_grpc.KVServeStub, list[int]]) -> list[int]:
                stub, prompt = item
                barrier.wait()
                return parse_stream(stub.Generate(greedy_request(prompt, max_tokens), timeout=300)).token_ids

            with concurrent.futures.ThreadPoolExecutor(len(requests)) as pool:
                outputs = list(pool.map(run, requests))
            assert outputs == [expected[tuple(prompt)] for _, prompt in requests], f"round {round_index}"
        wait_idle(two_routers.first.stub)
    over = [r for r in reports if r[1] > r[2]]
    assert reports and over == [], f"committed past the pool: {over[:5]}"
    assert _preemptions(two_routers.first.stub) == preempted_before, "a worker preempted: it was over-committed"
    refusals = two_routers.refusals()
    print(f"{ROUNDS} bursts of {2 * per_router} through two routers: {refusals} refusals, "
          f"max committed {max(r[1] for r in reports)}/{total} blocks")
    assert refusals > 0, "the bursts never met a full worker: the test did not reach its racy moment"
    # Queue time runs to the placement a worker accepted (the last, here): a request's wait
    # after a refusal is a wait for room too (a metrics audit found it counted as TTFT).
    waited = sum(times[-1] - created[request_id] for request_id, times in placed.items())
    after_refusals = sum(placed[r][-1] - placed[r][0] for r in refused)
    measured = metric_values(two_routers.first)["kvserve_request_queue_time_seconds_sum"] - queue_time_before
    print(f"queue time {measured:.2f} s; {len(placed)} requests waited {waited:.2f} s, {after_refusals:.2f} s of it "
          f"after {len(refused)} refusals")
    assert abs(measured - waited) < 0.01 * len(placed), (measured, waited, after_refusals)


def _preemptions(stub: pb_grpc.KVServeStub) -> int:
    status = stub.ClusterStatus(pb.ClusterStatusRequest(), timeout=5)
    return sum(w.preemptions for w in status.workers)


_UNENDED = (pb.REQUEST_STATUS_QUEUED, pb.REQUEST_STATUS_RUNNING)


def _cancel(stub: pb_grpc.KVServeStub, request_id: str) -> int:
    """Cancel's answer: the status after the call, which may still be QUEUED or RUNNING
    only when the request's end was not known within CANCEL_ANSWER_WAIT_S (router/core.py:
    on a starved machine Redis may not show the owner's end that soon)."""
    began = time.monotonic()
    status = stub.Cancel(pb.CancelRequest(request_id=request_id), timeout=60).status
    if time.monotonic() - began < CANCEL_ANSWER_WAIT_S:
        assert status not in _UNENDED, f"Cancel answered {pb.RequestStatus.Name(status)} before its wait ran out"
    return status


def _ended(stub: pb_grpc.KVServeStub, request_id: str) -> pb.RequestInfo:
    return wait_for(lambda: request_info(stub, request_id), lambda i: i.status not in _UNENDED, timeout=60,
                    what=f"the end of {request_id} in Redis")  # fmt: skip


def test_a_request_waiting_in_its_owners_queue_is_cancelled_through_the_other_router(
    two_routers: TwoRouters,
) -> None:
    """Only its owner can reach a request in its admission queue: the other router marks it
    in Redis and tells the owner (router/ownership.py), which cancels it there; it never
    reaches a worker. A running one is cancelled through the other router too.

    Each filler holds all but two blocks of a worker at its longest, for ~2,000 steps (~6 s).
    On a starved machine the calls took longer than that (a redis-server waited up to ~1 s
    at a time for a CPU): a filler that ends first lets the waiting request onto a worker,
    or answers FINISHED, and proves nothing. Such an attempt runs again, up to 3 times."""
    first, second = two_routers.stubs
    status = wait_idle(first)
    block_size = status.workers[0].block_size
    total = min(w.total_blocks for w in status.workers)
    filler_tokens = (total - 2) * block_size - len(PROMPTS[0])

    def running_fillers(prompts: list[list[int]]) -> list[str]:
        fillers = [first.Submit(greedy_request(p, filler_tokens), timeout=10).request_id for p in prompts]
        wait_for(lambda: [request_info(first, r) for r in fillers],
                 lambda infos: all(i.status == pb.REQUEST_STATUS_RUNNING for i in infos), timeout=30,
                 what="the fillers running")  # fmt: skip
        return fillers

    for _ in range(3):
        fillers = running_fillers(PROMPTS[:2])
        waiting = first.Submit(greedy_request(PROMPTS[2], 4 * block_size), timeout=10).request_id
        answer = _cancel(second, waiting)
        ended = [_ended(stub, waiting) for stub in (first, second)]
        # The owner writes Redis in order: a filler's end would be there before the
        # waiting request's. Both still running: it waited in the queue until cancelled.
        if [request_info(first, r).status for r in fillers] == [pb.REQUEST_STATUS_RUNNING] * 2:
            break
        for request_id in fillers:
            _cancel(first, request_id)
        wait_idle(first, timeout=60)
    else:
        raise AssertionError("in 3 attempts a filler always ended before the cancel: the test never reached its moment")
    assert answer in (pb.REQUEST_STATUS_CANCELLED, pb.REQUEST_STATUS_QUEUED)
    for info in ended:
        assert info.status == pb.REQUEST_STATUS_CANCELLED
        assert (info.worker_id, list(info.output_token_ids)) == ("", [])

    # A running one, through the other router: one of the fillers, else a fresh one.
    cancelled = []
    for attempt in range(4):
        candidates = fillers if attempt == 0 else running_fillers([PROMPTS[2 + attempt]])
        for request_id in candidates:
            answer = _cancel(second, request_id)
            info = _ended(second, request_id)
            assert answer in (info.status, pb.REQUEST_STATUS_RUNNING), (answer, info.status)
            if info.status == pb.REQUEST_STATUS_CANCELLED:
                assert len(info.output_token_ids) < filler_tokens
                cancelled.append(request_id)
            else:
                assert info.status == pb.REQUEST_STATUS_FINISHED  # it ended before the cancel
        if cancelled:
            break
    assert cancelled, "no running filler outlasted a Cancel through the other router"
    for stub in (first, second):
        assert all(_ended(stub, r).status == pb.REQUEST_STATUS_CANCELLED for r in cancelled)
        assert is_idle(wait_idle(stub, timeout=60))
