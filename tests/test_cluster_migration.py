"""No request is lost with its worker or its router: chaos tests on a real cluster.

Each test breaks a cluster of its own: it kills a worker actor, SIGKILLs a worker process,
hangs a worker's engine, or crashes the router, while clients are mid-stream. The client's
stream must go on with no missing and no duplicated token (parse_stream checks offsets),
and the output must equal an uninterrupted run, greedy and seeded alike.
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
import signal
import time
from pathlib import Path
from typing import Any

import grpc
import pytest
import ray
import redis

from cluster.local import ClusterConfig
from cluster.redis_server import EmbeddedRedis, RedisServerConfig
from protos.kvserve.v1 import serving_pb2 as pb
from protos.kvserve.v1 import serving_pb2_grpc as pb_grpc
from router.core import RouterConfig
from tests.cluster_harness import (
    metric_values,
    MiB,
    ClusterHarness,
    ReferenceEngine,
    cluster_config,
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
from workers.engine.sampling import SamplingParams
from workers.messages import AddRefused

# w0 has the room, so an idle cluster places the first requests there; w1 takes them over.
BUDGETS = (48 * MiB, 16 * MiB)
PROMPT_A = list(range(30, 50))
PROMPT_B = list(range(200, 213))
SEEDED = SamplingParams(max_tokens=240, temperature=0.9, top_p=0.95, seed=4242, ignore_eos=True)


def _seeded_request(prompt: list[int], params: SamplingParams, logprobs: int | None = None) -> pb.GenerateRequest:
    sampling = pb.SamplingParams(
        max_tokens=params.max_tokens, temperature=params.temperature, top_p=params.top_p, seed=params.seed,
        ignore_eos=True,
    )
    if logprobs is not None:
        sampling.logprobs = logprobs
    return pb.GenerateRequest(token_ids=pb.TokenIds(ids=prompt), sampling=sampling)



def _dead_within(stub: pb_grpc.KVServeStub, worker_id: str, since: float, timeout: float = 15.0) -> float:
    wait_until(lambda: not worker_status(stub, worker_id).alive, timeout=timeout, what=f"{worker_id} marked dead")
    return time.monotonic() - since


def test_killed_worker_actor_requests_move_and_finish_exactly(
    ray_session: None, redis_server: EmbeddedRedis, tmp_path: Path, reference_engine: ReferenceEngine
) -> None:
    greedy_expected = reference_engine.greedy([(PROMPT_A, 260)])[0].output_ids
    seeded_expected = reference_engine.run([(PROMPT_B, SEEDED)])[0].output_ids
    with running_cluster(cluster_config(redis_server.url, tmp_path, BUDGETS)) as cluster:
        stub = cluster.stub
        greedy_call = stub.Generate(greedy_request(PROMPT_A, 260), timeout=120)
        seeded_call = stub.Generate(_seeded_request(PROMPT_B, SEEDED), timeout=120)
        g_started, g_head = read_deltas(greedy_call, 4)
        s_started, s_head = read_deltas(seeded_call, 4)
        assert (g_started.worker_id, s_started.worker_id) == ("w0", "w0")

        hold_engines(cluster, ("w0",), 5.0)  # both still running when the kill lands
        killed_at = time.monotonic()
        ray.kill(cluster.cluster.handles[0], no_restart=True)
        noticed_s = _dead_within(stub, "w0", killed_at)
        greedy_out = read_rest(g_started, g_head, greedy_call)
        seeded_out = read_rest(s_started, s_head, seeded_call)

        print(f"killed actor: noticed after {noticed_s:.2f} s")
        assert noticed_s < 2.0, f"the router noticed the dead worker after {noticed_s:.2f} s"
        assert greedy_out.token_ids == greedy_expected
        assert seeded_out.token_ids == seeded_expected
        for result in (greedy_out, seeded_out):
            assert result.finished.finish_reason == pb.FINISH_REASON_LENGTH, result.finished
            info = request_info(stub, result.started.request_id)
            assert info.worker_id == "w1" and info.num_migrations == 1
            assert list(info.output_token_ids) == result.token_ids  # Redis has it all, once
        assert wait_idle(stub).alive_workers == 1


def test_sigkilled_worker_process_mid_stream_text_and_logprobs_go_on(
    ray_session: None, redis_server: EmbeddedRedis, tmp_path: Path, reference_engine: ReferenceEngine
) -> None:
    params = dataclasses.replace(SEEDED, max_tokens=200, logprobs=2)
    expected = reference_engine.run([(PROMPT_A, params)])[0]
    with running_cluster(cluster_config(redis_server.url, tmp_path, BUDGETS)) as cluster:
        stub = cluster.stub
        pid = worker_pid(cluster.cluster.handles[0])
        engine_pid = _engine_pid(cluster.cluster.handles[0])
        call = stub.Generate(_seeded_request(PROMPT_A, params, logprobs=2), timeout=120)
        started, head = read_deltas(call, 6)
        assert started.worker_id == "w0"

        killed_at = time.monotonic()
        os.kill(pid, signal.SIGKILL)
        noticed_s = _dead_within(stub, "w0", killed_at)
        result = read_rest(started, head, call)

        print(f"SIGKILLed process: noticed after {noticed_s:.2f} s")
        assert noticed_s < 2.0, f"the router noticed the dead worker after {noticed_s:.2f} s"
        assert result.token_ids == expected.output_ids
        assert result.text == expected.output_text
        logprobs = [lp for d in result.deltas for lp in d.logprobs]
        assert [lp.token_id for lp in logprobs] == expected.output_ids
        assert [lp.logprob for lp in logprobs] == pytest.approx([s.logprob for s in expected.logprobs], abs=1e-4)
        assert request_info(stub, started.request_id).num_migrations == 1
        # Its engine process died with it: nothing is left holding the model or the KV.
        wait_until(lambda: not _alive(engine_pid), timeout=10, what="the engine process to die with its actor")


def _engine_pid(handle: Any) -> int:
    """The process id of a worker's engine process (workers/engine_process.py)."""
    import ray

    pid: int = ray.get(handle.__ray_call__.remote(lambda actor: actor._engine.pid), timeout=30)
    return pid


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    state = Path(f"/proc/{pid}/stat").read_text().split(") ", 1)[-1][:1] if Path(f"/proc/{pid}/stat").exists() else "X"
    return state not in ("Z", "X")  # a zombie is dead, waiting for its parent to reap it


def test_a_killed_engine_process_takes_its_worker_down_and_requests_go_on(
    ray_session: None, redis_server: EmbeddedRedis, tmp_path: Path, reference_engine: ReferenceEngine
) -> None:
    params = dataclasses.replace(SEEDED, max_tokens=200)
    expected = reference_engine.run([(PROMPT_A, params)])[0]
    with running_cluster(cluster_config(redis_server.url, tmp_path, BUDGETS)) as cluster:
        stub = cluster.stub
        actor_pid = worker_pid(cluster.cluster.handles[0])
        engine_pid = _engine_pid(cluster.cluster.handles[0])
        assert engine_pid != actor_pid
        call = stub.Generate(_seeded_request(PROMPT_A, params), timeout=120)
        started, head = read_deltas(call, 6)
        assert started.worker_id == "w0"
        killed_at = time.monotonic()
        os.kill(engine_pid, signal.SIGKILL)  # a crash, the OOM killer
        noticed_s = _dead_within(stub, "w0", killed_at)
        result = read_rest(started, head, call)
        print(f"SIGKILLed engine process: noticed after {noticed_s:.2f} s")
        assert result.token_ids == expected.output_ids
        assert request_info(stub, started.request_id).num_migrations == 1
        wait_until(lambda: not _alive(actor_pid), timeout=10, what="the actor to exit with its engine process")
        assert wait_idle(stub).alive_workers == 1


def test_past_max_migrations_a_request_fails_clearly(
    ray_session: None, redis_server: EmbeddedRedis, tmp_path: Path
) -> None:
    config = cluster_config(redis_server.url, tmp_path, BUDGETS, router=RouterConfig(max_migrations=0))
    with running_cluster(config) as cluster:
        stub = cluster.stub
        call = stub.Generate(greedy_request(PROMPT_A, 260), timeout=120)
        started, head = read_deltas(call, 2)
        hold_engines(cluster, ("w0",), 5.0)  # still running when the kill lands
        ray.kill(cluster.cluster.handles[0], no_restart=True)
        result = read_rest(started, head, call)
        assert result.finished.finish_reason == pb.FINISH_REASON_ERROR
        assert "w0" in result.finished.error and "max_migrations=0" in result.finished.error
        info = wait_for(
            lambda: request_info(stub, started.request_id),
            lambda i: i.status == pb.REQUEST_STATUS_FAILED,
            what="the request recorded as FAILED",
        )
        assert "max_migrations=0" in info.error and info.num_migrations == 0
        assert list(info.output_token_ids) == result.token_ids  # what it had is kept
        wait_idle(stub)


def test_a_restarted_worker_rejoins_placement(
    ray_session: None, redis_server: EmbeddedRedis, tmp_path: Path, reference_engine: ReferenceEngine
) -> None:
    expected = reference_engine.greedy([(PROMPT_A, 200)])[0].output_ids
    config = dataclasses.replace(cluster_config(redis_server.url, tmp_path, BUDGETS), worker_max_restarts=1)
    with running_cluster(config) as cluster:
        stub = cluster.stub
        w0 = cluster.cluster.handles[0]
        pid = worker_pid(w0)
        call = stub.Generate(greedy_request(PROMPT_A, 200), timeout=120)
        started, head = read_deltas(call, 3)
        assert started.worker_id == "w0"
        os.kill(pid, signal.SIGKILL)
        assert read_rest(started, head, call).token_ids == expected  # moved to w1

        # Ray restarts the actor (it loads the model again); the router follows it once more.
        wait_until(lambda: worker_status(stub, "w0").alive, timeout=90, what="w0 back after its restart")
        assert worker_pid(w0) != pid
        ray.kill(cluster.cluster.handles[1], no_restart=True)
        wait_until(lambda: not worker_status(stub, "w1").alive, timeout=10, what="w1 dead")
        after = parse_stream(stub.Generate(greedy_request(PROMPT_A, 200), timeout=120))
        assert after.started.worker_id == "w0" and after.token_ids == expected
        status = wait_idle(stub)
        w0_status = worker_status(stub, "w0")
        assert status.alive_workers == 1 and w0_status.free_blocks == w0_status.total_blocks


def test_a_hung_engine_is_dead_by_progress_and_its_requests_move(
    ray_session: None, redis_server: EmbeddedRedis, tmp_path: Path, reference_engine: ReferenceEngine
) -> None:
    expected = reference_engine.greedy([(PROMPT_A, 260)])[0].output_ids
    router = RouterConfig(progress_timeout_s=1.5)
    with running_cluster(cluster_config(redis_server.url, tmp_path, BUDGETS, router=router)) as cluster:
        stub = cluster.stub
        call = stub.Generate(greedy_request(PROMPT_A, 260), timeout=120)
        started, head = read_deltas(call, 3)
        assert started.worker_id == "w0"
        stalled_at = time.monotonic()
        ray.get(cluster.cluster.handles[0].inject_stall.remote(6.0), timeout=10)
        noticed_s = _dead_within(stub, "w0", stalled_at)
        # It still answers: its heartbeats kept coming, only its steps stopped.
        assert worker_status(stub, "w0").report_age_seconds < 1.0
        print(f"hung engine (progress_timeout_s=1.5): dead after {noticed_s:.2f} s")
        assert 1.5 <= noticed_s < 4.0, noticed_s
        result = read_rest(started, head, call)
        assert result.token_ids == expected
        assert request_info(stub, started.request_id).worker_id == "w1"

        # When its step loop runs again it drops the moved request and rejoins, its KV all free.
        wait_until(lambda: worker_status(stub, "w0").alive, timeout=15, what="w0 alive again")
        w0 = wait_for(lambda: worker_status(stub, "w0"), lambda w: w.free_blocks == w.total_blocks, what="w0 idle")
        assert w0.uncommitted_blocks == w0.total_blocks


def test_a_restarted_router_adopts_in_flight_requests(
    ray_session: None, redis_server: EmbeddedRedis, tmp_path: Path, reference_engine: ReferenceEngine,
    caplog: pytest.LogCaptureFixture,
) -> None:
    # Long enough that the submitted ones are still running when the router dies.
    expected_a, expected_b = (
        r.output_ids for r in reference_engine.greedy([(PROMPT_A, 300), (PROMPT_B, 500)])
    )
    seeded = dataclasses.replace(SEEDED, max_tokens=500)
    seeded_expected = reference_engine.run([(PROMPT_B, seeded)])[0].output_ids
    config = dataclasses.replace(cluster_config(redis_server.url, tmp_path, BUDGETS), metrics_port=0)
    first = ClusterHarness(config)
    try:
        stub = first.stub
        call = stub.Generate(greedy_request(PROMPT_A, 300), timeout=120)
        started, head = read_deltas(call, 3)
        submitted = stub.Submit(greedy_request(PROMPT_B, 500), timeout=10).request_id
        seeded_id = stub.Submit(_seeded_request(PROMPT_B, seeded), timeout=10).request_id
        cancelled_id = stub.Submit(greedy_request(PROMPT_A, 500), timeout=10).request_id
        wait_until(lambda: len(request_info(stub, seeded_id).output_token_ids) > 0, what="the seeded one running")
        hold_engines(first, ("w0", "w1"), 2.0)  # all four still running when the router dies
        running = _crash_router(first)
        assert {started.request_id, submitted, seeded_id, cancelled_id} <= set(running), running
    except BaseException:
        first.stop()
        raise
    received = [t for d in head for t in d.token_ids]
    with pytest.raises(grpc.RpcError):
        read_rest(started, head, call)  # the client's stream broke with its router
    # One as if its RUNNING write had not landed when the router died: Redis says QUEUED, on
    # no worker, while it runs on. The new router must stop that placement wherever it is,
    # and not take what it still sends for the new one's.
    client = redis.Redis.from_url(redis_server.url)
    client.hset(f"{config.store_prefix}:req:{submitted}", mapping={"status": "QUEUED", "worker_id": ""})
    # One a client cancelled through another router while its owner was gone (Cancel marks
    # it; router/ownership.py): whoever adopts it ends it instead of running it.
    client.hset(f"{config.store_prefix}:req:{cancelled_id}", "cancel_requested", "1")
    client.close()

    # A new router process: same Redis, same named workers. Its requests are adopted (at
    # its start: it starts with them running, not idle; on a loaded machine four of them
    # outlast any wait for idle workers).
    with running_cluster(config, idle=False) as second:
        stub = second.stub
        resumed = parse_stream(
            stub.Stream(pb.StreamRequest(request_id=started.request_id, from_offset=len(received)), timeout=120),
            from_offset=len(received),
        )
        assert received + resumed.token_ids == expected_a
        assert resumed.finished.finish_reason == pb.FINISH_REASON_LENGTH
        for request_id, expected in ((submitted, expected_b), (seeded_id, seeded_expected)):
            info = wait_for(
                lambda: request_info(stub, request_id),
                lambda i: i.status == pb.REQUEST_STATUS_FINISHED,
                timeout=60,
                what="the submitted request to finish under the new router",
            )
            assert list(info.output_token_ids) == expected and info.num_migrations == 1
        whole = parse_stream(stub.Stream(pb.StreamRequest(request_id=started.request_id), timeout=30))
        assert whole.token_ids == expected_a
        cancelled = request_info(stub, cancelled_id)
        assert cancelled.status == pb.REQUEST_STATUS_CANCELLED
        assert cancelled.finish_reason == pb.FINISH_REASON_CANCELLED and cancelled.num_migrations == 0
        wait_idle(stub)
        # Each had its first token under the first router, which observed its TTFT: not again
        # here (a metrics audit found two samples for one request).
        values = metric_values(second)
        assert values["kvserve_time_to_first_token_seconds_count"] == 0
        assert sum(v for name, v in values.items() if name.startswith("kvserve_adoptions_total")) == 4
    # Exact without the last resort either: no placement's events were lost or mixed in.
    assert [r.getMessage() for r in caplog.records if "were lost" in r.getMessage()] == []


def _crash_router(harness: ClusterHarness) -> dict[str, int]:
    """The router goes away as if its process died: no drain, no finishing of requests, and
    the workers (named Ray actors) are left running. Returns the requests it was running at
    that moment, with the tokens each had, for a test to check its premise."""
    cluster = harness.cluster

    async def crash() -> dict[str, int]:
        running = {r: t.num_output_tokens for r, t in cluster.router.trackers.items() if not t.finished}
        # The router first, so nothing it does from here on reaches Redis (a server that
        # stops would otherwise cancel its clients' requests, which a crash never does).
        await cluster.router.close()
        await cluster.store.close()
        await cluster.server.stop(0)
        return running

    running = harness.call(crash())
    if harness.channel is not None:
        harness.channel.close()
    harness.loop.call_soon_threadsafe(harness.loop.stop)
    harness.thread.join(timeout=10)
    return running


def test_a_router_that_starts_while_redis_is_down_adopts_once_redis_returns(
    ray_session: None, tmp_path: Path, reference_engine: ReferenceEngine
) -> None:
    # Crashed as soon as it runs: Redis is then stopped with SHUTDOWN, which writes the whole
    # AOF, so nothing waits for an fsync. (A second's wait for it, here before, let the tiny
    # model finish all 1,000 tokens on a fast CI machine: the router crashed with nothing to
    # adopt, and the request was FINISHED with no move.)
    expected = reference_engine.greedy([(PROMPT_B, 1000)])[0].output_ids
    redis = EmbeddedRedis(RedisServerConfig(state_dir=tmp_path / "redis"))
    redis.start()
    try:
        config = cluster_config(redis.url, tmp_path, BUDGETS)
        first = ClusterHarness(config)
        try:
            request_id = first.stub.Submit(greedy_request(PROMPT_B, 1000), timeout=10).request_id
            wait_until(lambda: len(request_info(first.stub, request_id).output_token_ids) > 0, what="it running")
            running = _crash_router(first)
            assert request_id in running, f"it ended before the router crashed: {running}"
        except BaseException:
            first.stop()
            raise
        redis.stop()
        # Starts, and serves ClusterStatus, without Redis. Not idle: the crashed router's
        # placement runs on until this one adopts the request (on a loaded machine its 1,000
        # tokens outlast any wait for idle workers).
        with running_cluster(config, idle=False) as second:
            assert second.router.trackers == {}
            down = second.stub.ClusterStatus(pb.ClusterStatusRequest(), timeout=10)
            assert down.alive_workers == 2 and not down.routers_known and list(down.routers) == []
            redis.restart()
            info = wait_for(
                lambda: request_info(second.stub, request_id),
                lambda i: i.status == pb.REQUEST_STATUS_FINISHED,
                timeout=60,
                what="the request adopted once Redis was back to finish",
            )
            assert list(info.output_token_ids) == expected and info.num_migrations == 1
            up = wait_idle(second.stub)
            assert up.routers_known
            assert [(r.router_id, r.answering) for r in up.routers] == [(second.router.router_id, True)]
    finally:
        redis.stop()


SHARED_PREFIX = list(range(10, 74))  # four full 16-token blocks


def test_a_moved_request_s_cached_prompt_tokens_are_those_of_the_placement_that_finished_it(
    ray_session: None, redis_server: EmbeddedRedis, tmp_path: Path
) -> None:
    """serving.proto, Usage.cached_prompt_tokens: 'of the placement that finished it'. A
    request that hit 64 cached tokens on w0 and moved to w1 (nothing cached there: it
    computed its whole prompt again) reports w1's 0, in its `finished` and in GetRequest,
    not w0's 64. (An outside check's find: the router kept the first placement's count.)"""
    config = dataclasses.replace(cluster_config(redis_server.url, tmp_path, BUDGETS), metrics_port=0)
    with running_cluster(config) as cluster:
        stub = cluster.stub
        warm = parse_stream(stub.Generate(greedy_request(SHARED_PREFIX + [200, 201], 2), timeout=60))
        assert warm.started.worker_id == "w0"
        call = stub.Generate(greedy_request(SHARED_PREFIX + [202, 203], 300), timeout=120)
        started, head = read_deltas(call, 3)
        assert started.worker_id == "w0"
        wait_for(lambda: request_info(stub, started.request_id).cached_prompt_tokens, lambda n: n == 64,
                 timeout=10, what="w0's hit of the shared prefix to be recorded")
        hold_engines(cluster, ("w0",), 5.0)  # still running when the kill lands
        ray.kill(cluster.cluster.handles[0], no_restart=True)
        result = read_rest(started, head, call)
        info = request_info(stub, started.request_id)
        assert (info.worker_id, info.num_migrations) == ("w1", 1)
        assert worker_status(stub, "w1").prefix_cache_hit_tokens == 0  # w1 computed the whole prompt
        assert (result.finished.usage.cached_prompt_tokens, info.cached_prompt_tokens) == (0, 0), result.finished


def test_a_queued_request_adopted_by_a_restarted_router_gets_its_queue_time(
    ray_session: None, redis_server: EmbeddedRedis, tmp_path: Path
) -> None:
    """README, Metrics: kvserve_request_queue_time_seconds runs from creation to the placement
    the first worker to take it accepted. A request still in its router's queue when that
    router died is first taken under the router that adopts it: that router observes its
    queue time (and its TTFT), and not again those of the adopted requests a worker had
    taken before. (An outside check's find: adoption counts as a move, and moves were skipped.)"""
    # At ratio 1 each long request commits its longest, 76 of a worker's 128 blocks: one per worker.
    config = dataclasses.replace(
        cluster_config(redis_server.url, tmp_path, (16 * MiB, 16 * MiB), RouterConfig(kv_reserve_ratio=1.0)),
        metrics_port=0,
    )
    prompt = [1, 2, 3, 4, 5, 6, 7, 8]
    first = ClusterHarness(config)
    try:
        stub = first.stub
        running = [stub.Submit(greedy_request(prompt, 1200), timeout=10).request_id for _ in range(2)]
        queued = stub.Submit(greedy_request(prompt, 1200), timeout=10).request_id
        wait_until(lambda: all(request_info(stub, r).output_token_ids for r in running), 20, "both to run")
        assert request_info(stub, queued).status == pb.REQUEST_STATUS_QUEUED
        hold_engines(first, ("w0", "w1"), 2.0)
        _crash_router(first)
    except BaseException:
        first.stop()
        raise
    values = _finished_under_a_new_router(config, [*running, queued])
    assert sum(v for k, v in values.items() if k.startswith("kvserve_adoptions_total")) == 3
    # Only the queued one had its first token here (the others resumed past offset 0).
    assert values["kvserve_time_to_first_token_seconds_count"] == 1
    assert values["kvserve_request_queue_time_seconds_count"] == 1, "the adopted queued request's queue time"


def test_an_adopted_request_no_worker_ever_took_gets_its_queue_time(
    ray_session: None, redis_server: EmbeddedRedis, tmp_path: Path
) -> None:
    """A request whose placements workers refused (AddRefused: another router's requests
    took the room) shows RUNNING in Redis (the RUNNING write overlaps the add), though no
    worker took it. Its router dies: the adopter, whose placement is the first accepted,
    observes its queue time. (A review's find: inferring 'accepted before' from the status
    lost this sample; Redis now keeps accepted_at.) The refusals are the registry's
    send_add replaced: this is about the router's bookkeeping."""
    config = dataclasses.replace(cluster_config(redis_server.url, tmp_path), metrics_port=0)
    first = ClusterHarness(config)
    refusals: list[str] = []
    try:
        registry = first.router.registry

        def refusing(worker_id: str, add: Any) -> Any:
            async def refuse() -> AddRefused:
                await asyncio.sleep(0.05)
                refusals.append(add.request_id)
                return AddRefused(add.request_id, 10**6, 10**6, 1)
            return refuse()

        registry.send_add = refusing  # every worker refuses, as if other routers filled them
        stub = first.stub
        request_id = stub.Submit(greedy_request([1, 2, 3, 4, 5, 6, 7, 8], 16), timeout=10).request_id
        wait_until(lambda: len(refusals) >= 2, 20, "two refusals")
        info = request_info(stub, request_id)
        assert not info.output_token_ids
        assert info.status == pb.REQUEST_STATUS_RUNNING  # what the status said, though no worker took it
        _crash_router(first)
    except BaseException:
        first.stop()
        raise
    values = _finished_under_a_new_router(config, [request_id])
    assert sum(v for k, v in values.items() if k.startswith("kvserve_adoptions_total")) == 1
    assert values["kvserve_time_to_first_token_seconds_count"] == 1
    # No worker took it before the adopter placed it: its one queue-time sample is here.
    assert values["kvserve_request_queue_time_seconds_count"] == 1, "the never-taken request's queue time"


def _finished_under_a_new_router(config: ClusterConfig, request_ids: list[str]) -> dict[str, float]:
    """A router started over the same workers and Redis (it adopts what its crashed
    predecessor left): once each request has finished under it, its metrics."""
    with running_cluster(config, idle=False) as second:
        stub = second.stub
        for request_id in request_ids:
            wait_for(lambda: request_info(stub, request_id), lambda i: i.status == pb.REQUEST_STATUS_FINISHED,
                     timeout=90, what=f"{request_id} to finish under the new router")
        return metric_values(second)
