"""A port the router is to serve on that something else holds fails the start, in one line.

gRPC's server sets SO_REUSEPORT by default: a second `kvserve up` (another state dir) on
the first one's 50051 started without a word and took a share of its connections, so
requests went to a cluster nobody meant. And a taken metrics port (`kvserve router`
beside `kvserve up` on one host, both on 9400 by default) ended the start with a raw
traceback. Both were found by a first-time user following the README.
"""

from __future__ import annotations

import asyncio
import os
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from cluster.local import _start_metrics
from cluster.redis_server import EmbeddedRedis
from router.core import Router, RouterConfig
from router.server import PortUnavailable, RouterServer, ServerConfig
from router.state import RequestStore, StoreConfig


@pytest.fixture
def held_port() -> Iterator[int]:
    """A loopback port another process could hold: a plain listening socket."""
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        yield held.getsockname()[1]


def test_a_second_router_on_a_serving_routers_port_is_refused(store_config: StoreConfig) -> None:
    async def scenario() -> str:
        store = RequestStore(store_config)
        first = RouterServer(Router(RouterConfig(), store), ServerConfig(port=0))
        port = await first.start()
        second = RouterServer(Router(RouterConfig(), store), ServerConfig(port=port))
        try:
            with pytest.raises(PortUnavailable) as refused:
                await second.start()
            return str(refused.value)
        finally:
            await first.stop(grace_s=0.1)
            await store.close()

    message = asyncio.run(scenario())
    assert "could not serve gRPC on 127.0.0.1:" in message and "(--port)" in message
    assert "another kvserve up or kvserve router" in message


def test_a_taken_metrics_port_names_the_flag(store_config: StoreConfig, held_port: int) -> None:
    async def scenario() -> None:
        store = RequestStore(store_config)
        try:
            with pytest.raises(PortUnavailable, match=rf"could not serve metrics on 127.0.0.1:{held_port} "
                                                      r"\(--metrics-port; .*give each its own, or off\): "
                                                      r"Address already in use"):
                _start_metrics(Router(RouterConfig(), store), "127.0.0.1", held_port)
        finally:
            await store.close()

    asyncio.run(scenario())


def test_kvserve_up_on_a_taken_port_says_so_in_one_line_and_exits_1(
    redis_server: EmbeddedRedis, tmp_path: Path, held_port: int
) -> None:
    """The user's path: `kvserve up` whose --port is held exits 1 with the reason, before
    Ray and Redis start (an outside check waited ~10 s for it, after a line of gRPC's own),
    and without a traceback."""
    done = subprocess.run(
        [sys.executable, "-m", "cluster.cli", "up", "--redis-url", redis_server.url, "--model", "tiny",
         "--port", str(held_port), "--metrics-port", "off", "--state-dir", str(tmp_path / "state")],
        capture_output=True, text=True, timeout=180, env={**os.environ, "RAY_DEDUP_LOGS": "0"},
    )
    assert done.returncode == 1, done.stderr[-3000:]
    assert f"[kvserve] error: could not serve gRPC on 127.0.0.1:{held_port} (--port)" in done.stderr
    assert "Traceback" not in done.stderr, done.stderr[-3000:]
    assert "loading the model" not in done.stderr, done.stderr[-3000:]
    assert "starting Ray" not in done.stderr and "add_port" not in done.stderr, done.stderr[-3000:]


def test_kvserve_up_on_a_taken_metrics_port_says_so_before_ray_starts(
    redis_server: EmbeddedRedis, tmp_path: Path, held_port: int
) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "cluster.cli", "up", "--redis-url", redis_server.url, "--model", "tiny",
         "--port", "0", "--metrics-port", str(held_port), "--state-dir", str(tmp_path / "state")],
        capture_output=True, text=True, timeout=180, env={**os.environ, "RAY_DEDUP_LOGS": "0"},
    )
    assert done.returncode == 1, done.stderr[-3000:]
    assert f"[kvserve] error: could not serve metrics on 127.0.0.1:{held_port} (--metrics-port;" in done.stderr
    assert "starting Ray" not in done.stderr and "Traceback" not in done.stderr, done.stderr[-3000:]


def test_a_bracketed_ipv6_host_is_probed_as_grpc_binds_it() -> None:
    """gRPC serves `--host [::1]` (and refuses `::1`); the port check before Ray took the
    brackets for an unknown host and refused a free port (found by review)."""
    from router.server import probe_port

    try:
        with socket.socket(socket.AF_INET6) as direct:
            direct.bind(("::1", 0))
        has_ipv6_loopback = True
    except OSError:
        has_ipv6_loopback = False
    assert (probe_port("[::1]", 0) is None) == has_ipv6_loopback
    assert probe_port("[::]", 0) is None or not has_ipv6_loopback


def test_a_second_kvserve_up_on_a_state_dir_in_use_is_told_so_not_that_the_port_is_taken(tmp_path: Path) -> None:
    """Its port is the first one's too: the state dir's lock, which names the pid that holds
    it, is what it is told (the port check came first for a while; found by review)."""
    from cluster.local import Cluster, ClusterConfig
    from cluster.state_dir import StateDirInUse, StateDirLock

    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        lock = StateDirLock(tmp_path)
        lock.acquire()  # the first kvserve up: its state dir and its port
        try:
            config = ClusterConfig(server=ServerConfig(port=held.getsockname()[1]), metrics_port=None,
                                   state_dir=tmp_path)
            with pytest.raises(StateDirInUse):
                asyncio.run(Cluster(config).start())
        finally:
            lock.release()


def _free_port_before_a_held_one() -> tuple[int, socket.socket]:
    """A free loopback port P and a listening socket on P + 1."""
    for _ in range(50):
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            port = probe.getsockname()[1]
        if port >= 65535:
            continue
        held = socket.socket()
        try:
            held.bind(("127.0.0.1", port + 1))
        except OSError:
            held.close()
            continue
        held.listen()
        return port, held
    raise AssertionError("no free port with a free one after it")


@pytest.mark.parametrize("flag", ["--port", "--metrics-port"])
def test_kvserve_up_with_more_routers_finds_the_next_routers_taken_port_before_ray_starts(
    redis_server: EmbeddedRedis, tmp_path: Path, flag: str
) -> None:
    """`kvserve up --routers 2` starts its second router on --port + 1 (and --metrics-port +
    1) only once the model has loaded: a taken one was found then, after Ray, Redis and the
    load (noted in stop 47's note), and ended a start that had looked ready to come."""
    port, held = _free_port_before_a_held_one()
    other = "--metrics-port" if flag == "--port" else "--port"
    with held:
        done = subprocess.run(
            [sys.executable, "-m", "cluster.cli", "up", "--redis-url", redis_server.url, "--model", "tiny",
             "--routers", "2", flag, str(port), other, "0", "--state-dir", str(tmp_path / "state")],
            capture_output=True, text=True, timeout=180, env={**os.environ, "RAY_DEDUP_LOGS": "0"},
        )
    assert done.returncode == 1, done.stderr[-3000:]
    what = "gRPC" if flag == "--port" else "metrics"
    assert f"[kvserve] error: could not serve {what} on 127.0.0.1:{port + 1} ({flag} + 1: router 2 of --routers 2" \
        in done.stderr, done.stderr[-3000:]
    assert "starting Ray" not in done.stderr and "Traceback" not in done.stderr, done.stderr[-3000:]


def test_kvserve_up_with_more_routers_than_ports_after_port_is_refused(redis_server: EmbeddedRedis, tmp_path: Path) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "cluster.cli", "up", "--redis-url", redis_server.url, "--model", "tiny",
         "--routers", "3", "--port", "65534", "--metrics-port", "off", "--state-dir", str(tmp_path / "state")],
        capture_output=True, text=True, timeout=180, env={**os.environ, "RAY_DEDUP_LOGS": "0"},
    )
    assert done.returncode == 1, done.stderr[-3000:]
    assert "[kvserve] error: --routers 3 serve on --port 65534 and the 2 port(s) after it: past 65535" in done.stderr
    assert "starting Ray" not in done.stderr, done.stderr[-3000:]
