"""The embedded redis-server supervised: SIGKILLed, it is back on the same port, password and
AOF; after too many crashes in a window it is given up with a clear error; and the router's
health says NOT_SERVING while Redis cannot take the writes a new request needs."""

from __future__ import annotations

import asyncio
import os
import signal
import time
from dataclasses import replace
from pathlib import Path

import grpc
import pytest
import redis
from grpc_health.v1 import health_pb2, health_pb2_grpc
from redis.backoff import NoBackoff
from redis.retry import Retry

from cluster.redis_server import EmbeddedRedis, RedisServerConfig
from cluster.redis_supervisor import RedisSupervisor, RestartBudget, SupervisionConfig, describe_exit
from protos.kvserve.v1 import serving_pb2 as pb
from router.server import SERVICE_NAME
from tests.cluster_harness import (
    ClusterHarness,
    ReferenceEngine,
    cluster_config,
    greedy_request,
    parse_stream,
    request_info,
    running_cluster,
    wait_for,
    wait_until,
)

BACK_WITHIN_S = 10.0  # a restart takes well under a second; this bound holds on a loaded 2-core machine
PROMPT = list(range(40, 52))


def test_the_budget_allows_max_restarts_within_the_window_and_forgets_older_crashes() -> None:
    budget = RestartBudget(max_restarts=2, window_s=10.0)
    assert budget.record_crash(100.0) and budget.record_crash(101.0)
    assert not budget.record_crash(102.0), "a third crash within 10 s is one too many"
    assert budget.num_recent == 3
    # 10 s after the first two, only the one at 102 is still in the window.
    assert budget.record_crash(111.5) and budget.num_recent == 2
    assert not budget.record_crash(111.9)
    never = RestartBudget(max_restarts=0, window_s=1.0)
    assert not never.record_crash(0.0)


@pytest.mark.parametrize(
    ("field", "value"),
    [("max_restarts", -1), ("window_s", 0.0), ("poll_interval_s", -0.1), ("start_timeout_s", 0.0)],
)
def test_a_bad_supervision_config_names_its_field(field: str, value: float) -> None:
    with pytest.raises(ValueError, match=f"SupervisionConfig.{field} must be"):
        SupervisionConfig(**{field: value})  # type: ignore[arg-type]


def test_exits_are_described_by_signal_or_code() -> None:
    assert describe_exit(-signal.SIGKILL) == "killed by SIGKILL"
    assert describe_exit(1) == "exited with code 1"


def _crash(server: EmbeddedRedis) -> int:
    """SIGKILL the server from outside, as the OOM killer would; returns the pid it had."""
    pid = server.pid
    assert pid is not None and server.running
    os.kill(pid, signal.SIGKILL)
    return pid


async def _restarted(supervisor: RedisSupervisor, old_pid: int, num_restarts: int) -> float:
    """Seconds until the supervisor has restarted the server `num_restarts` times in all, as another
    process that answers (it counts a restart once the server has loaded its data)."""
    began = time.monotonic()
    while supervisor.num_restarts < num_restarts:
        assert time.monotonic() - began < BACK_WITHIN_S, f"redis-server not back within {BACK_WITHIN_S} s"
        await asyncio.sleep(0.02)
    assert supervisor.server.running and supervisor.server.pid != old_pid
    return time.monotonic() - began


# A process that starts the embedded server as `kvserve up` does and, like it, takes Ctrl-C itself.
_HOLDER = """
import signal, sys, time
from pathlib import Path
from cluster.redis_server import EmbeddedRedis, RedisServerConfig
signal.signal(signal.SIGINT, lambda *_: print("interrupted", flush=True))
server = EmbeddedRedis(RedisServerConfig(state_dir=Path(sys.argv[1]), exit_with_parent=True))
print(server.start(), server.pid, flush=True)
signal.signal(signal.SIGTERM, lambda *_: (server.stop(), sys.exit(0)))
while True:
    time.sleep(1)
"""


def test_a_terminals_ctrl_c_reaches_kvserve_up_and_not_its_redis_server(tmp_path: Path) -> None:
    """A terminal sends Ctrl-C's SIGINT to its whole foreground process group. redis-server took it
    as a shutdown, and the supervisor restarted it in the middle of `kvserve up`'s drain. It now
    runs in a session of its own: the SIGINT reaches only its holder, which stops it itself."""
    import subprocess
    import sys

    holder = subprocess.Popen(
        [sys.executable, "-c", _HOLDER, str(tmp_path / "redis")], stdout=subprocess.PIPE, text=True,
        cwd=Path(__file__).resolve().parent.parent, start_new_session=True,
    )  # fmt: skip
    try:
        assert holder.stdout is not None
        url, pid = holder.stdout.readline().split()
        with redis.Redis.from_url(url, socket_timeout=10) as client:
            assert client.ping()
            os.killpg(holder.pid, signal.SIGINT)  # Ctrl-C
            assert holder.stdout.readline().strip() == "interrupted"
            time.sleep(0.5)  # a redis-server that took the SIGINT has shut down by now
            assert client.ping() and int(client.info("server")["process_id"]) == int(pid)
        assert os.getsid(int(pid)) != os.getsid(holder.pid)
        holder.terminate()
        assert holder.wait(timeout=30) == 0
        wait_until(lambda: not Path(f"/proc/{pid}").exists(), 10, "its redis-server to stop with it")
    finally:
        if holder.poll() is None:
            os.killpg(holder.pid, signal.SIGKILL)
            holder.wait(timeout=10)


def test_a_killed_server_comes_back_with_its_port_password_and_data_until_it_crashes_too_often(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    server = EmbeddedRedis(RedisServerConfig(state_dir=tmp_path / "redis", password="supervised"))
    server.start()
    url, port = server.url, server.port
    supervisor_config = SupervisionConfig(max_restarts=2, window_s=60.0)

    async def scenario() -> list[float]:
        supervisor = RedisSupervisor(server, supervisor_config)
        supervisor.start()
        try:
            with redis.Redis.from_url(url) as client:
                client.set("before", "the crash")
            seconds = []
            for crash in range(2):
                seconds.append(await _restarted(supervisor, _crash(server), crash + 1))
                assert server.port == port and server.url == url, "same port, same password"
                with redis.Redis.from_url(url) as client:  # the old URL, so the old password
                    assert client.get("before") == b"the crash", "the AOF was replayed"
                    client.set(f"after-{crash}", "ok")
                with pytest.raises(redis.exceptions.AuthenticationError):
                    redis.Redis(host="127.0.0.1", port=port, password="wrong", retry=Retry(NoBackoff(), 0)).ping()
            assert supervisor.num_restarts == 2 and not supervisor.gave_up.is_set()

            _crash(server)  # the third within the window: max_restarts=2 allows no more
            await asyncio.wait_for(supervisor.gave_up.wait(), BACK_WITHIN_S)
            assert not server.running
            return seconds
        finally:
            await supervisor.stop()

    try:
        seconds = asyncio.run(scenario())
    finally:
        server.stop()
    restarts = [r.getMessage() for r in caplog.records if "restarted it in" in r.getMessage()]
    assert len(restarts) == 2 and "killed by SIGKILL" in restarts[0] and f"port {port}" in restarts[0], restarts
    errors = [r for r in caplog.records if r.levelname == "ERROR"]
    assert len(errors) == 1, [r.getMessage() for r in caplog.records]
    message = errors[0].getMessage()
    assert "3 crashes within 60 s" in message and "not restarted again" in message, message
    assert str(tmp_path / "redis") in message, message
    print(f"back after a SIGKILL in {', '.join(f'{s:.2f}' for s in seconds)} s")


def test_a_server_that_will_not_start_again_is_given_up_saying_why(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A crash after which redis-server refuses to start (here its AOF holds what is not
    Redis's): the give-up says how it exited and why the starts failed. It said "did not
    start", which read as if it had never run."""
    server = EmbeddedRedis(RedisServerConfig(state_dir=tmp_path / "redis"))
    server.start()

    async def scenario() -> None:
        supervisor = RedisSupervisor(server, SupervisionConfig(max_restarts=1, window_s=60.0, poll_interval_s=0.1))
        supervisor.start()
        try:
            with open(tmp_path / "redis" / "appendonly.aof", "ab") as aof:
                aof.write(b"this is not a Redis command\r\n")
            _crash(server)
            await asyncio.wait_for(supervisor.gave_up.wait(), BACK_WITHIN_S)
            assert supervisor.num_restarts == 0 and not server.running
        finally:
            await supervisor.stop()

    try:
        asyncio.run(scenario())
    finally:
        server.stop()
    errors = [r.getMessage() for r in caplog.records if r.levelname == "ERROR"]
    assert len(errors) == 1, [r.getMessage() for r in caplog.records]
    first_line = errors[0].splitlines()[0]
    assert first_line.startswith(f"embedded redis-server in {tmp_path / 'redis'} killed by SIGKILL, and starting it "
                                 "again failed (redis-server exited with code 1 while starting on port "), first_line
    assert first_line.endswith("2 crashes and failed starts within 60 s, so it is not restarted again (new requests "
                               "get UNAVAILABLE while it is down)"), first_line


def _health(channel: grpc.Channel, service: str = "") -> int:
    stub = health_pb2_grpc.HealthStub(channel)
    status: int = stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=5).status
    return status


def test_under_a_cluster_the_killed_redis_is_back_with_its_data_and_health_follows_redis(
    ray_session: None, tmp_path: Path, reference_engine: ReferenceEngine
) -> None:
    """A cluster on its own embedded Redis: SIGKILL redis-server; it is back on the same port
    with the same password, a request recorded before is still readable, new requests succeed.
    A second crash is one more than this cluster's supervision allows: the cluster reports the
    failure (kvserve up drains and exits 1 on it), health says NOT_SERVING while Redis is down,
    and SERVING once it is started again."""
    expected = reference_engine.greedy([(PROMPT, 12)])[0].output_ids
    supervision = SupervisionConfig(max_restarts=1, window_s=600.0)
    config = replace(cluster_config("unused", tmp_path), redis_url=None, redis_supervision=supervision)
    with running_cluster(config) as harness:
        cluster = harness.cluster
        server, supervisor = cluster.redis, cluster.redis_supervisor
        assert server is not None and supervisor is not None
        url, port = server.url, server.port
        before = parse_stream(harness.stub.Generate(greedy_request(PROMPT, 12), timeout=60))
        assert before.token_ids == expected
        # Recorded before the crash: a client's stream ends from the router's memory, and the
        # finish's write may still be on its way to Redis (it failed 2 of 9 runs on a busy
        # machine, the record read RUNNING after the restart, until that write was retried).
        wait_for(lambda: request_info(harness.stub, before.started.request_id),
                 lambda info: info.status == pb.REQUEST_STATUS_FINISHED, what="the request recorded as finished")
        serving = health_pb2.HealthCheckResponse.SERVING
        not_serving = health_pb2.HealthCheckResponse.NOT_SERVING
        assert _health(harness.channel) == serving and _health(harness.channel, SERVICE_NAME) == serving

        old_pid = _crash(server)
        began = time.monotonic()
        wait_until(lambda: supervisor.num_restarts == 1, timeout=BACK_WITHIN_S, what="redis-server back")
        assert server.running and server.pid != old_pid
        back_after = time.monotonic() - began
        assert (server.url, server.port) == (url, port)
        info = wait_for(
            lambda: _info_or_none(harness, before.started.request_id),
            lambda info: info is not None,
            timeout=BACK_WITHIN_S,
            what="the request recorded before the crash to be readable",
        )
        assert info is not None and info.status == pb.REQUEST_STATUS_FINISHED
        assert list(info.output_token_ids) == expected
        after = parse_stream(harness.stub.Generate(greedy_request(PROMPT, 12), timeout=60))
        assert after.token_ids == expected
        wait_until(lambda: _health(harness.channel) == serving, timeout=BACK_WITHIN_S, what="SERVING after the restart")

        # The second crash is given up: Redis stays down, as an external one nobody restarts.
        _crash(server)
        began = time.monotonic()
        failure = harness.call(cluster.wait_for_failure(), timeout=BACK_WITHIN_S)
        assert "2 crashes within 600 s" in failure and "not restarted again" in failure, failure
        assert not server.running
        wait_until(lambda: _health(harness.channel) == not_serving, timeout=BACK_WITHIN_S, what="NOT_SERVING")
        said_down_after = time.monotonic() - began
        assert _health(harness.channel, SERVICE_NAME) == not_serving
        server.start()
        wait_until(lambda: _health(harness.channel) == serving, timeout=BACK_WITHIN_S, what="SERVING again")
        assert parse_stream(harness.stub.Generate(greedy_request(PROMPT, 12), timeout=60)).token_ids == expected
    print(f"redis-server back {back_after:.2f} s after its SIGKILL; health NOT_SERVING {said_down_after:.2f} s after Redis went down")


def _info_or_none(harness: ClusterHarness, request_id: str) -> pb.RequestInfo | None:
    try:
        return request_info(harness.stub, request_id)
    except grpc.RpcError as exc:
        if exc.code() == grpc.StatusCode.UNAVAILABLE:
            return None
        raise
