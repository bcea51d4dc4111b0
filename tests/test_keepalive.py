"""A client that sends HTTP/2 keepalive pings keeps its connection and its calls.

gRPC's server default closed a connection whose client pinged more often than every
5 minutes while nothing was sent back (GOAWAY too_many_pings, after two such pings),
and every call on it ended; a Node.js client with a 5 s keepalive lost a Generate
waiting in the queue that way (recorded CANCELLED) 20 s in. Here a real router's gRPC
server and a real client that pings every 1.5 s, with a call open that sends nothing
(a health Watch after its first answer), then with none: under the old policy the
quiet call ended UNAVAILABLE within a few pings.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Iterator

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from router.core import Router, RouterConfig
from router.server import KEEPALIVE_OPTIONS, RouterServer, ServerConfig
from router.state import RequestStore, StoreConfig

PING_EVERY_MS = 1_500
QUIET_S = 8.0  # past four pings


@pytest.fixture
def address(store_config: StoreConfig) -> Iterator[str]:
    """A router's gRPC server (no worker: health says NOT_SERVING, which Watch sends once)."""
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, name="server-loop", daemon=True)
    thread.start()

    async def start() -> tuple[RouterServer, int]:  # grpc.aio's server belongs to the loop it is made on
        server = RouterServer(Router(RouterConfig(), RequestStore(store_config)), ServerConfig(port=0))
        return server, await server.start()

    server, port = asyncio.run_coroutine_threadsafe(start(), loop).result(30)
    try:
        yield f"127.0.0.1:{port}"
    finally:
        asyncio.run_coroutine_threadsafe(server.stop(grace_s=0.1), loop).result(30)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)
        loop.close()


def test_the_server_allows_a_ping_a_second_with_or_without_calls() -> None:
    options = dict(KEEPALIVE_OPTIONS)
    assert options["grpc.http2.min_ping_interval_without_data_ms"] <= 1_000 < PING_EVERY_MS
    assert options["grpc.keepalive_permit_without_calls"] == 1


def test_a_client_pinging_every_1_5_s_keeps_its_quiet_call_and_its_connection(address: str) -> None:
    channel = grpc.insecure_channel(address, options=[
        ("grpc.keepalive_time_ms", PING_EVERY_MS),
        ("grpc.keepalive_timeout_ms", 5_000),
        ("grpc.keepalive_permit_without_calls", 1),
        ("grpc.http2.max_pings_without_data", 0),  # keep pinging while nothing comes back
    ])
    states: list[grpc.ChannelConnectivity] = []
    channel.subscribe(states.append, try_to_connect=True)
    try:
        health = health_pb2_grpc.HealthStub(channel)
        # A call open that sends nothing after its first answer.
        watch = health.Watch(health_pb2.HealthCheckRequest())
        assert next(watch).status == health_pb2.HealthCheckResponse.NOT_SERVING
        ended: list[grpc.StatusCode] = []

        def drain() -> None:
            try:
                for _ in watch:
                    pass
            except grpc.RpcError as exc:
                ended.append(exc.code())

        reader = threading.Thread(target=drain, daemon=True)
        reader.start()
        time.sleep(QUIET_S)
        assert not ended, f"the quiet call ended: {ended}"
        watch.cancel()
        reader.join(10)
        assert ended == [grpc.StatusCode.CANCELLED]  # by us
        # No call open: the client pings all the same (the old policy struck each such ping).
        time.sleep(QUIET_S / 2)
        assert health.Check(health_pb2.HealthCheckRequest(), timeout=10).status == health_pb2.HealthCheckResponse.NOT_SERVING
        # One connection all along: a GOAWAY would have sent the channel back to IDLE.
        ready = states.index(grpc.ChannelConnectivity.READY)
        assert states[ready:] == [grpc.ChannelConnectivity.READY], states
    finally:
        channel.close()
