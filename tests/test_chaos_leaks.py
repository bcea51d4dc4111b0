"""Chaos: 1,000 random cancels, disconnects and deadlines under load leave nothing behind.

A seeded plan of operations runs on a small cluster (two workers of 32 KV blocks, a short
admission queue, so requests also wait and get refused): clients that cancel their stream,
clients whose channel closes mid-stream, Cancel RPCs, deadlines from 10 ms to 0.4 s, Submit
then Cancel, Submit left to run, a Stream re-attached then dropped, and plain completions.
Afterwards every worker's KV is free and uncommitted, the router tracks nothing, and in
Redis no request is left active and every key has an expiry.
"""

from __future__ import annotations

import asyncio
import collections
import random
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import grpc.aio
import pytest
import redis

from cluster.redis_server import EmbeddedRedis
from protos.kvserve.v1 import serving_pb2 as pb
from protos.kvserve.v1 import serving_pb2_grpc as pb_grpc
from router.core import RouterConfig
from tests.cluster_harness import (
    MiB,
    ClusterHarness,
    cluster_config,
    greedy_request,
    hold_engines,
    running_cluster,
    wait_idle,
    wait_until,
)

SEED = 20261130
NUM_OPS = 1000
NUM_CLIENTS = 24  # operations in flight at once (Submit-ed requests run on beyond their op)
WORKER_KV = 4 * MiB  # 32 blocks of 16 tokens with the tiny preset
RPC_TIMEOUT_S = 60.0
AFTER_CANCEL_S = 5.0  # a stream must end this soon after its request is cancelled
# kind: weight. Each kind ends a request a different way (see _run_op).
KINDS = {
    "complete": 3,
    "client_cancel": 3,
    "disconnect": 2,
    "cancel_rpc": 2,
    "deadline": 3,
    "submit_cancel": 2,
    "submit": 1,
    "stream_drop": 1,
}
EXPECTED = {"OK", "DEADLINE_EXCEEDED", "RESOURCE_EXHAUSTED"}  # refused: queue full, or no room in time
# A Generate whose request a Cancel call ended must end too (finished CANCELLED, or LENGTH
# if it won the race); one still open AFTER_CANCEL_S later is reported as this.
NO_END_AFTER_CANCEL = "no_end_after_cancel"
ENDED = {"FINISHED", "CANCELLED", "FAILED"}


@dataclass(frozen=True)
class Op:
    index: int
    kind: str
    prompt_ids: tuple[int, ...]
    max_tokens: int
    num_deltas: int  # deltas read before the fault; -1: the fault comes before any message
    delay_s: float  # the wait before a fault, or the deadline

    @property
    def request_id(self) -> str:
        return f"leak-{self.index}"

    def request(self) -> pb.GenerateRequest:
        return greedy_request(list(self.prompt_ids), self.max_tokens, self.request_id)


def plan_ops(seed: int, count: int) -> list[Op]:
    rng = random.Random(seed)
    kinds = rng.choices(list(KINDS), weights=list(KINDS.values()), k=count)
    return [
        Op(
            index=index,
            kind=kind,
            prompt_ids=tuple(rng.randrange(1, 250) for _ in range(rng.randint(2, 24))),
            max_tokens=rng.randint(2, 32),
            num_deltas=rng.randint(-1, 4),
            delay_s=rng.uniform(0.01, 0.4),
        )
        for index, kind in enumerate(kinds)
    ]


async def _read(call: Any, op: Op) -> None:
    """Wait op.delay_s (op.num_deltas == -1), or read `started` and op.num_deltas deltas."""
    if op.num_deltas < 0:
        await asyncio.sleep(op.delay_s)
        return
    seen = 0
    async for message in call:
        kind = message.WhichOneof("event")
        if kind == "finished":
            return
        if kind == "delta":
            seen += 1
        if seen >= op.num_deltas:
            return


async def _run_op(address: str, stub: pb_grpc.KVServeStub, op: Op) -> str:
    """Run one operation; returns the status the client ended with (OK when it ended it)."""
    try:
        if op.kind == "complete":
            messages = [m async for m in stub.Generate(op.request(), timeout=RPC_TIMEOUT_S)]
            assert messages[-1].finished.finish_reason == pb.FINISH_REASON_LENGTH, messages[-1]
        elif op.kind == "client_cancel":
            call = stub.Generate(op.request(), timeout=RPC_TIMEOUT_S)
            await _read(call, op)
            call.cancel()
        elif op.kind == "disconnect":
            async with grpc.aio.insecure_channel(address) as own:
                call = pb_grpc.KVServeStub(own).Generate(op.request(), timeout=RPC_TIMEOUT_S)
                await _read(call, op)
            # Leaving the block closed the channel under the open stream.
        elif op.kind == "cancel_rpc":
            call = stub.Generate(op.request(), timeout=RPC_TIMEOUT_S)
            await _read(call, op)
            try:
                await stub.Cancel(pb.CancelRequest(request_id=op.request_id), timeout=RPC_TIMEOUT_S)
            except grpc.aio.AioRpcError as error:
                # A Cancel sent before any answer can overtake its Generate: nothing to cancel yet.
                if not (op.num_deltas < 0 and error.code() == grpc.StatusCode.NOT_FOUND):
                    raise
            try:
                messages = await asyncio.wait_for(_rest(call), AFTER_CANCEL_S)
            except TimeoutError:
                call.cancel()
                return NO_END_AFTER_CANCEL
            if messages:
                assert messages[-1].finished.finish_reason in (pb.FINISH_REASON_CANCELLED, pb.FINISH_REASON_LENGTH)
        elif op.kind == "deadline":
            [m async for m in stub.Generate(op.request(), timeout=op.delay_s)]
        elif op.kind == "submit_cancel":
            await stub.Submit(op.request(), timeout=RPC_TIMEOUT_S)
            await asyncio.sleep(op.delay_s / 4)
            await stub.Cancel(pb.CancelRequest(request_id=op.request_id), timeout=RPC_TIMEOUT_S)
        elif op.kind == "submit":
            await stub.Submit(op.request(), timeout=RPC_TIMEOUT_S)
        elif op.kind == "stream_drop":
            await stub.Submit(op.request(), timeout=RPC_TIMEOUT_S)
            call = stub.Stream(pb.StreamRequest(request_id=op.request_id), timeout=RPC_TIMEOUT_S)
            await _read(call, op)
            call.cancel()  # the request was submitted: it runs on without this client
        else:
            raise AssertionError(f"unknown kind {op.kind}")
    except grpc.aio.AioRpcError as error:
        return str(error.code().name)
    return "OK"


async def _rest(call: Any) -> list[pb.GenerateResponse]:
    return [m async for m in call]


async def _run_plan(address: str, ops: list[Op]) -> dict[tuple[str, str], int]:
    todo: asyncio.Queue[Op] = asyncio.Queue()
    for op in ops:
        todo.put_nowait(op)
    outcomes: collections.Counter[tuple[str, str]] = collections.Counter()

    async def client(stub: pb_grpc.KVServeStub) -> None:
        while not todo.empty():
            op = todo.get_nowait()
            outcomes[op.kind, await _run_op(address, stub, op)] += 1

    async with grpc.aio.insecure_channel(address) as channel:
        stub = pb_grpc.KVServeStub(channel)
        await asyncio.wait_for(asyncio.gather(*(client(stub) for _ in range(NUM_CLIENTS))), 300)
    return dict(outcomes)


async def _router_leftovers(router: Any) -> dict[str, Any]:
    return {
        "trackers": sorted(router.trackers),
        "queue_length": router.queue_length,
        "reservations": {w: dict(view.reservations) for w, view in router.workers.items() if view.reservations},
        "outstanding": {w: sorted(view.outstanding) for w, view in router.workers.items() if view.outstanding},
    }


def _redis_leftovers(url: str, prefix: str) -> tuple[dict[str, int], list[str], dict[str, str]]:
    """(TTL of every key under the prefix, the active set, status of every request hash)."""
    with redis.Redis.from_url(url, decode_responses=True) as client:
        ttls = {key: int(client.ttl(key)) for key in client.scan_iter(match=f"{prefix}:*", count=1000)}
        active = sorted(client.smembers(f"{prefix}:active"))
        statuses = {key: str(client.hget(key, "status")) for key in ttls if key.startswith(f"{prefix}:req:")}
    return ttls, active, statuses


def test_a_thousand_random_cancels_disconnects_and_deadlines_leak_nothing(
    ray_session: None, redis_server: EmbeddedRedis, tmp_path: Path
) -> None:
    ops = plan_ops(SEED, NUM_OPS)
    assert ops == plan_ops(SEED, NUM_OPS), "the plan is reproducible"
    router = RouterConfig(max_queue=8, max_queue_wait_s=1.5)
    config = cluster_config(redis_server.url, tmp_path, (WORKER_KV, WORKER_KV), router)
    with running_cluster(config) as cluster:
        began = time.monotonic()
        outcomes = asyncio.run(_run_plan(cluster.cluster.address, ops))
        ran_for = time.monotonic() - began

        unexpected = {key: n for key, n in outcomes.items() if key[1] not in EXPECTED}
        assert not unexpected, unexpected
        assert sum(outcomes.values()) == NUM_OPS

        status = wait_idle(cluster.stub, timeout=60)
        for worker in status.workers:
            assert worker.alive
            assert worker.free_blocks == worker.total_blocks == worker.uncommitted_blocks, worker
        _check_router_forgot_everything(cluster)

        prefix = config.store_prefix
        wait_until(
            lambda: not _redis_leftovers(redis_server.url, prefix)[1], timeout=20, what="Redis's active set to empty"
        )
        ttls, active, statuses = _redis_leftovers(redis_server.url, prefix)
        assert active == []
        no_expiry = sorted(key for key, ttl in ttls.items() if ttl == -1)
        assert not no_expiry, f"{len(no_expiry)} keys without an expiry, e.g. {no_expiry[:5]}"
        not_ended = {key: s for key, s in statuses.items() if s not in ENDED}
        assert not not_ended, not_ended
        counts = collections.Counter(statuses.values())
        summary = ", ".join(f"{kind}/{code}: {n}" for (kind, code), n in sorted(outcomes.items()))
        print(f"{NUM_OPS} operations in {ran_for:.1f} s; Redis: {dict(counts)}; {summary}")


def _check_router_forgot_everything(cluster: ClusterHarness) -> None:
    empty = {"trackers": [], "queue_length": 0, "reservations": {}, "outstanding": {}}
    seen: list[dict[str, Any]] = []

    def forgotten() -> bool:
        seen[:] = [cluster.call(_router_leftovers(cluster.router))]
        return seen[0] == empty

    try:
        wait_until(forgotten, timeout=10, what="the router to forget every request")
    except AssertionError as error:
        raise AssertionError(f"{error}: {seen[0]}") from None


OCCUPIER_PROMPT = list(range(24))
OCCUPIER_MAX_TOKENS = 32 * 16 - len(OCCUPIER_PROMPT) + 1  # prompt + output - 1 = 511 tokens: all 32 blocks


def test_a_generate_cancelled_while_queued_gets_an_answer(
    ray_session: None, redis_server: EmbeddedRedis, tmp_path: Path
) -> None:
    router = RouterConfig(max_queue=4, max_queue_wait_s=30.0, kv_reserve_ratio=1.0)  # commits all of max_tokens
    config = cluster_config(redis_server.url, tmp_path, (WORKER_KV, WORKER_KV), router)
    with running_cluster(config) as cluster, ThreadPoolExecutor(1) as pool:
        stub = cluster.stub
        occupiers = [f"occupier-{i}" for i in range(2)]
        for request_id in occupiers:
            stub.Submit(greedy_request(OCCUPIER_PROMPT, OCCUPIER_MAX_TOKENS, request_id), timeout=10)
        wait_until(
            lambda: [w.uncommitted_blocks for w in stub.ClusterStatus(pb.ClusterStatusRequest(), timeout=5).workers]
            == [0, 0],
            what="both workers to be fully committed",
        )
        hold_engines(cluster, ("w0", "w1"), 3.0)  # the occupiers hold every block until cancelled

        def generate() -> tuple[str, float]:
            began = time.monotonic()
            try:
                messages = list(stub.Generate(greedy_request([5, 6, 7], 8, "queued"), timeout=AFTER_CANCEL_S + 10))
                return pb.FinishReason.Name(messages[-1].finished.finish_reason), time.monotonic() - began
            except grpc.RpcError as error:
                return error.code().name, time.monotonic() - began

        waiting = pool.submit(generate)
        wait_until(lambda: stub.ClusterStatus(pb.ClusterStatusRequest(), timeout=5).queued == 1, what="it to queue")
        cancelled_at = time.monotonic()
        assert stub.Cancel(pb.CancelRequest(request_id="queued"), timeout=10).status == pb.REQUEST_STATUS_CANCELLED
        outcome, _ = waiting.result(timeout=AFTER_CANCEL_S + 20)
        answered_after = time.monotonic() - cancelled_at
        for request_id in occupiers:
            stub.Cancel(pb.CancelRequest(request_id=request_id), timeout=10)
        wait_idle(stub)
    assert outcome == "FINISH_REASON_CANCELLED" and answered_after < AFTER_CANCEL_S, (outcome, answered_after)
