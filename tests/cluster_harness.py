"""A real cluster (Ray actors, redis-server, gRPC on loopback) driven from synchronous tests.

The cluster's asyncio loop runs in a background thread; tests talk to it over gRPC like
any client, and may run coroutines on its loop (call) to look at router state.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
import uuid
from collections.abc import Callable, Coroutine, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import grpc

from cluster.local import Cluster, ClusterConfig
from protos.kvserve.v1 import serving_pb2 as pb
from protos.kvserve.v1 import serving_pb2_grpc as pb_grpc
from router.core import RouterConfig
from router.server import ServerConfig
from workers.config import EngineArgs

T = TypeVar("T")
MiB = 2**20


class ClusterHarness:
    def __init__(
        self,
        config: ClusterConfig,
        start_timeout: float = 180.0,
        open_channel: Callable[[str], grpc.Channel] = grpc.insecure_channel,
        idle: bool = True,
    ) -> None:
        """idle=False: start once every worker has reported, busy or not (workers a crashed
        router left running requests on, which only this router can stop)."""
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="cluster-loop", daemon=True)
        self.thread.start()
        self.cluster = Cluster(config)
        self.channel: grpc.Channel | None = None
        try:
            self.call(self.cluster.start(), timeout=start_timeout)
        except BaseException:
            self.stop()
            raise
        self.channel = open_channel(self.cluster.address)
        self.stub = pb_grpc.KVServeStub(self.channel)
        # Workers are registered once they answer info(); their first KV report follows a
        # moment later. Tests start from reported, idle workers.
        if idle:
            wait_idle(self.stub)
        else:
            wait_until(lambda: _all_reported(self.stub), 20.0, "every worker's first report")

    @property
    def router(self) -> Any:
        return self.cluster.router

    def call(self, coroutine: Coroutine[Any, Any, T], timeout: float = 60.0) -> T:
        """Run a coroutine on the cluster's loop and wait for its result."""
        return asyncio.run_coroutine_threadsafe(coroutine, self.loop).result(timeout)

    def stop(self) -> None:
        if self.channel is not None:
            self.channel.close()
        try:
            self.call(self.cluster.stop(), timeout=60)
        finally:
            self.loop.call_soon_threadsafe(self.loop.stop)
            self.thread.join(timeout=10)


def generate(stub: pb_grpc.KVServeStub, request: pb.GenerateRequest, timeout: float = 120.0) -> list[pb.GenerateResponse]:
    return list(stub.Generate(request, timeout=timeout))


def output_ids(messages: Iterator[pb.GenerateResponse] | list[pb.GenerateResponse]) -> list[int]:
    return [t for m in messages if m.WhichOneof("event") == "delta" for t in m.delta.token_ids]


def greedy_request(prompt_ids: list[int], max_tokens: int, request_id: str = "") -> pb.GenerateRequest:
    return pb.GenerateRequest(
        request_id=request_id,
        token_ids=pb.TokenIds(ids=prompt_ids),
        sampling=pb.SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True),
    )


def redis_command_calls(client: Any) -> dict[str, int]:
    """Calls of each command a redis-server has run since CONFIG RESETSTAT (INFO commandstats;
    a script's commands count too)."""
    stats = client.info("commandstats")
    return {name.removeprefix("cmdstat_"): int(value["calls"]) for name, value in stats.items()}


# -- building small clusters --------------------------------------------------------------


def tiny_engine(kv_cache_memory: int = 16 * MiB) -> EngineArgs:
    """The engine of every cluster test worker: the tiny preset on one torch thread (CI has two cores)."""
    return EngineArgs(model="tiny", kv_cache_memory=kv_cache_memory, num_threads=1)


# How long a Redis command may take in a test cluster before its router takes Redis for
# unavailable. The routers' default, 2 s, is no bound on a loaded 2-core machine: with two
# test processes, a redis-server waited up to 0.8 s at a time for a CPU (its schedstat), a
# PING took 1.8 s, and test_two_routers twice got UNAVAILABLE "Timeout reading" from a Redis
# that was only starved. Tests of a stalled Redis set 2 s themselves.
TEST_REDIS_TIMEOUT_S = 10.0


def cluster_config(
    redis_url: str,
    state_dir: Path,
    worker_kv_cache_memory: tuple[int, ...] = (16 * MiB, 16 * MiB),
    router: RouterConfig | None = None,
    redis_timeout_s: float = TEST_REDIS_TIMEOUT_S,
) -> ClusterConfig:
    """CPU workers with these KV budgets, on an existing Redis under a key prefix of their own,
    serving on a free loopback port, reporting every 50 ms."""
    return ClusterConfig(
        engine=tiny_engine(),
        num_workers=len(worker_kv_cache_memory),
        worker_cpus=1,
        worker_kv_cache_memory=worker_kv_cache_memory,
        redis_url=redis_url,
        state_dir=state_dir,
        router=router or RouterConfig(),
        server=ServerConfig(port=0),
        store_prefix=f"test-{uuid.uuid4().hex[:12]}",
        report_interval_s=0.05,
        metrics_port=None,
        redis_timeout_s=redis_timeout_s,
    )


def _all_reported(stub: pb_grpc.KVServeStub) -> bool:
    status = stub.ClusterStatus(pb.ClusterStatusRequest(), timeout=5)
    return bool(status.workers) and all(w.alive and w.total_blocks > 0 for w in status.workers)


@contextlib.contextmanager
def running_cluster(config: ClusterConfig, idle: bool = True) -> Iterator[ClusterHarness]:
    harness = ClusterHarness(config, idle=idle)
    try:
        yield harness
    finally:
        harness.stop()


def metric_values(harness: ClusterHarness) -> dict[str, float]:
    """The router's metrics now, named as /metrics names them: `name{label="value",...}`
    (labels sorted), or `name`. The cluster needs metrics_port=0 (a free port)."""
    metrics = harness.cluster.metrics
    assert metrics is not None, "this cluster serves no metrics: start it with metrics_port=0"
    values: dict[str, float] = {}
    for family in metrics.registry.collect():
        for sample in family.samples:
            labels = ",".join(f'{k}="{v}"' for k, v in sorted(sample.labels.items()))
            values[f"{sample.name}{{{labels}}}" if labels else sample.name] = sample.value
    return values


@contextlib.contextmanager
def observing(harness: ClusterHarness, observer: Callable[[str, Any], None]) -> Iterator[None]:
    """Hook `observer(event name, payload)` into the router while the block runs; it is
    called on the cluster's loop, so it should only record."""

    async def attach() -> None:
        harness.router.observers.append(observer)

    async def detach() -> None:
        harness.router.observers.remove(observer)

    harness.call(attach())
    try:
        yield
    finally:
        harness.call(detach())


# -- reading streams ----------------------------------------------------------------------


@dataclass
class StreamResult:
    started: pb.Started
    deltas: list[pb.TokenDelta]
    finished: pb.Finished

    @property
    def token_ids(self) -> list[int]:
        return [t for d in self.deltas for t in d.token_ids]

    @property
    def text(self) -> str:
        return "".join(d.text for d in self.deltas)


def parse_stream(messages: Iterable[pb.GenerateResponse], from_offset: int = 0) -> StreamResult:
    """Check the shape of a Generate or Stream response and split it: `started` first, then
    deltas whose offsets run on from `from_offset` with no gap and no overlap, `finished` last."""
    messages = list(messages)
    kinds = [m.WhichOneof("event") for m in messages]
    assert len(kinds) >= 2 and kinds[0] == "started" and kinds[-1] == "finished", kinds
    assert all(kind == "delta" for kind in kinds[1:-1]), kinds
    next_offset = from_offset
    for message in messages[1:-1]:
        assert message.delta.offset == next_offset, f"delta at offset {message.delta.offset}, expected {next_offset}"
        next_offset += len(message.delta.token_ids)
    return StreamResult(messages[0].started, [m.delta for m in messages[1:-1]], messages[-1].finished)


def read_deltas(call: Iterator[pb.GenerateResponse], num_deltas: int) -> tuple[pb.Started, list[pb.TokenDelta]]:
    """The `started` message and the next `num_deltas` deltas of a live stream (left open)."""
    first = next(call)
    assert first.WhichOneof("event") == "started", first
    deltas: list[pb.TokenDelta] = []
    while len(deltas) < num_deltas:
        message = next(call)
        assert message.WhichOneof("event") == "delta", message
        deltas.append(message.delta)
    return first.started, deltas


def read_rest(started: pb.Started, deltas: list[pb.TokenDelta], call: Iterator[pb.GenerateResponse]) -> StreamResult:
    """Read a stream begun with read_deltas to its end, and parse all of it."""
    head = [pb.GenerateResponse(started=started), *(pb.GenerateResponse(delta=d) for d in deltas)]
    return parse_stream([*head, *call])


def expect_error(rpc: Callable[[], Any], code: grpc.StatusCode, *words: str) -> str:
    """Run `rpc` (for a stream, something that reads it); it must fail with `code` and a
    message containing every one of `words`. Returns the message."""
    try:
        rpc()
    except grpc.RpcError as error:
        assert error.code() == code, f"expected {code}, got {error.code()}: {error.details()}"
        message = error.details() or ""
        for word in words:
            assert word in message, f"{word!r} not in {message!r}"
        return message
    raise AssertionError(f"expected {code}, the call succeeded")


# -- waiting for the cluster ---------------------------------------------------------------


def wait_until(condition: Callable[[], T], timeout: float = 10.0, what: str = "a condition") -> T:
    """Poll `condition` until it returns something true; that value is returned."""
    deadline = time.monotonic() + timeout
    while True:
        value = condition()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"waited {timeout:g} s for {what}")
        time.sleep(0.02)


def wait_for(fetch: Callable[[], T], accept: Callable[[T], bool], timeout: float = 10.0, what: str = "a value") -> T:
    """Call `fetch` until `accept` holds for what it returns; that value is returned."""
    latest: list[T] = []

    def accepted() -> bool:
        latest[:] = [fetch()]
        return accept(latest[0])

    try:
        wait_until(accepted, timeout, what)
    except AssertionError as exc:
        raise AssertionError(f"{exc}; the last value: {latest[0] if latest else 'none'}") from None
    return latest[0]


def request_info(stub: pb_grpc.KVServeStub, request_id: str) -> pb.RequestInfo:
    return stub.GetRequest(pb.GetRequestRequest(request_id=request_id), timeout=5)


def is_idle(status: pb.ClusterStatusResponse) -> bool:
    """Nothing queued, and every live worker's KV free and uncommitted, with nothing running."""
    return status.queued == 0 and status.alive_workers > 0 and all(
        w.free_blocks == w.total_blocks and w.uncommitted_blocks == w.total_blocks and w.running == 0 and w.waiting == 0
        for w in status.workers
        if w.alive
    )


def wait_idle(stub: pb_grpc.KVServeStub, timeout: float = 20.0) -> pb.ClusterStatusResponse:
    """Poll ClusterStatus until the cluster is idle (is_idle); returns that status."""
    seen: list[pb.ClusterStatusResponse] = []

    def idle() -> bool:
        seen.append(stub.ClusterStatus(pb.ClusterStatusRequest(), timeout=5))
        return is_idle(seen[-1])

    try:
        wait_until(idle, timeout, "every worker's KV to be free again")
    except AssertionError as error:
        raise AssertionError(f"{error}; the last ClusterStatus:\n{seen[-1]}") from None
    return seen[-1]


def worker_pid(handle: Any) -> int:
    """The process id of a worker actor (to SIGKILL or SIGSTOP it)."""
    import os

    import ray

    pid: int = ray.get(handle.__ray_call__.remote(lambda actor: os.getpid()), timeout=30)
    return pid


def hold_engines(harness: ClusterHarness, worker_ids: Iterable[str], seconds: float) -> None:
    """Stall these workers' engines for `seconds` (fault injection: each worker stays alive
    and reporting, its steps wait), so that what runs on them is still running at a test's
    racy moment however fast the machine decodes: the tiny model makes ~750 tokens/s on one
    thread here, and a request of a few hundred tokens can end before a kill lands. Keep it
    below the router's progress_timeout_s (10 s by default), or the worker is taken for dead."""
    import ray

    ray.get([harness.router.registry.handle(w).inject_stall.remote(seconds) for w in worker_ids], timeout=10)


def worker_status(stub: pb_grpc.KVServeStub, worker_id: str) -> pb.WorkerStatus:
    status = stub.ClusterStatus(pb.ClusterStatusRequest(), timeout=5)
    return next(w for w in status.workers if w.worker_id == worker_id)


# -- what the cluster must return -----------------------------------------------------------


class ReferenceEngine:
    """The in-process engine built from the workers' EngineArgs: its greedy tokens are what
    the cluster must stream. Torch's thread count is the workers' only while it runs."""

    def __init__(self, args: EngineArgs) -> None:
        from workers.model.build import load

        self.args = args
        with self._threads():
            self.loaded = load(args)

    def greedy(self, requests: list[tuple[list[int], int]]) -> list[Any]:
        """RequestOutputs (output_ids, output_text) of (prompt_ids, max_tokens) pairs, run together."""
        from workers.engine.sampling import SamplingParams

        return self.run(
            [(prompt, SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)) for prompt, max_tokens in requests]
        )

    def run(self, requests: list[tuple[list[int], Any]]) -> list[Any]:
        """RequestOutputs of (prompt_ids, SamplingParams) pairs, run together."""
        from workers.engine.collect import PromptSpec, run_to_completion
        from workers.model.build import create_engine

        specs = [PromptSpec(tuple(prompt), params) for prompt, params in requests]
        with self._threads():
            return run_to_completion(create_engine(self.args, self.loaded, quiet=True), specs)

    @contextlib.contextmanager
    def _threads(self) -> Iterator[None]:
        import torch

        before = torch.get_num_threads()
        try:
            if self.args.num_threads is not None:
                torch.set_num_threads(self.args.num_threads)
            yield
        finally:
            torch.set_num_threads(before)
