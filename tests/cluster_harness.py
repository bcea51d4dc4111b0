"""A real cluster (Ray actors, redis-server, gRPC on loopback) driven from synchronous tests.

The cluster's asyncio loop runs in a background thread; tests talk to it over gRPC like
any client, and may run coroutines on its loop (call) to look at router state.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Coroutine, Iterator
from typing import Any, TypeVar

import grpc

from cluster.local import Cluster, ClusterConfig
from protos.kvserve.v1 import serving_pb2 as pb
from protos.kvserve.v1 import serving_pb2_grpc as pb_grpc

T = TypeVar("T")


class ClusterHarness:
    def __init__(self, config: ClusterConfig, start_timeout: float = 180.0) -> None:
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
        self.channel = grpc.insecure_channel(self.cluster.address)
        self.stub = pb_grpc.KVServeStub(self.channel)

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
