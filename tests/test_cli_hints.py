"""What `kvserve up` tells a user to type next works as typed, and `kvserve router` finds a
local cluster's Redis by itself.

A first-time user following the README found that `kvserve up` printed
`kvserve generate --address 127.0.0.1:50051` (not on PATH in a venv; without the TLS and
token flags the router needed, and at an address its certificate is not for), and that
nothing said where `kvserve router`'s --redis-url comes from: the embedded Redis has a
generated password and a new port at each start.
"""

from __future__ import annotations

import shlex
import socket
import subprocess
from pathlib import Path

import pytest

from cluster.cli import build_parser
from cluster.local import ClusterConfig, ray_address_file, redis_url_file, write_redis_url
from cluster.routers import REDIS_URL_ENV
from cluster.state_dir import LOCK_NAME, StateDirLock
from cluster.up import _try_it, router_cluster_config_from_args, same_ray_address
from router.server import ServerConfig
from tests.certificates import self_signed

URL = "redis://:secret@127.0.0.1:6390/0"


def test_kvserve_router_takes_the_redis_of_the_kvserve_up_in_its_state_dir(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv(REDIS_URL_ENV, raising=False)
    state_dir = tmp_path / "state"
    state_dir.mkdir()
    router = ["router", "--ray-address", "auto", "--state-dir", str(state_dir)]
    with pytest.raises(ValueError, match=rf"--redis-url: .*no kvserve up running on this machine keeps one in {state_dir}"):
        router_cluster_config_from_args(build_parser().parse_args(router))
    write_redis_url(state_dir, URL)
    # A kvserve up that was SIGKILLed leaves its file, and its pid in the lock file: dead.
    (state_dir / LOCK_NAME).write_text(f"{_dead_pid()}\n")
    with pytest.raises(ValueError, match="no kvserve up running on this machine"):
        router_cluster_config_from_args(build_parser().parse_args(router))
    lock = StateDirLock(state_dir)  # a running one holds the lock
    lock.acquire()
    assert redis_url_file(state_dir).stat().st_mode & 0o777 == 0o600
    assert router_cluster_config_from_args(build_parser().parse_args(router)).redis_url == URL
    write_redis_url(state_dir, URL.replace("6390", "6391"))  # a later start: the file is replaced
    assert router_cluster_config_from_args(build_parser().parse_args(router)).redis_url.endswith(":6391/0")
    # The environment, then the flag, win over the file.
    monkeypatch.setenv(REDIS_URL_ENV, "redis://env:1/0")
    assert router_cluster_config_from_args(build_parser().parse_args(router)).redis_url == "redis://env:1/0"
    flagged = build_parser().parse_args([*router, "--redis-url", "redis://flag:1/0"])
    assert router_cluster_config_from_args(flagged).redis_url == "redis://flag:1/0"
    lock.release()


def test_kvserve_router_joins_the_ray_of_the_kvserve_up_whose_redis_it_takes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`--ray-address auto` alone finds the newest Ray on the machine: with two kvserve ups
    on two state dirs, a router given the second's --state-dir joined the first's workers
    (another model) beside the second's Redis (found by a walkthrough). With the Redis of a
    local kvserve up, `auto` means that kvserve up's Ray, which it keeps beside the URL."""
    monkeypatch.delenv(REDIS_URL_ENV, raising=False)
    state_dir = tmp_path / "state"
    state_dir.mkdir()
    lock = StateDirLock(state_dir)
    lock.acquire()
    write_redis_url(state_dir, URL)
    router = ["router", "--ray-address", "auto", "--state-dir", str(state_dir)]
    assert router_cluster_config_from_args(build_parser().parse_args(router)).ray_address == "auto"  # no file: auto
    ray_address_file(state_dir).write_text("10.1.2.3:6380\n")  # no auth mode said: Ray's default
    config = router_cluster_config_from_args(build_parser().parse_args(router))
    assert (config.ray_address, config.ray_auth_mode) == ("10.1.2.3:6380", None)
    # Ray turns token auth on by itself only for `auto`: a kvserve up's mode goes with its address.
    ray_address_file(state_dir).write_text("10.1.2.3:6380\ntoken\n")
    config = router_cluster_config_from_args(build_parser().parse_args(router))
    assert (config.ray_address, config.ray_auth_mode) == ("10.1.2.3:6380", "token")
    # That Ray's address given: the same, with its auth mode.
    given = ["router", "--ray-address", "10.1.2.3:6380", "--state-dir", str(state_dir)]
    config = router_cluster_config_from_args(build_parser().parse_args(given))
    assert (config.ray_address, config.ray_auth_mode, config.redis_url) == ("10.1.2.3:6380", "token", URL)
    # Another cluster's Ray beside this machine's Redis (found by a walkthrough: its workers
    # would run, and adopt, this Redis's requests): refused, naming the flag that fixes it.
    other = ["router", "--ray-address", "10.9.9.9:6379", "--state-dir", str(state_dir)]
    with pytest.raises(ValueError, match=r"--redis-url: the Redis of the kvserve up in .* belongs to the Ray at "
                                         r"10\.1\.2\.3:6380, not to --ray-address 10\.9\.9\.9:6379"):
        router_cluster_config_from_args(build_parser().parse_args(other))
    # A Redis given is another cluster's, and says nothing of its Ray: the address is the address.
    with_url = [*router, "--redis-url", "redis://flag:1/0"]
    assert router_cluster_config_from_args(build_parser().parse_args(with_url)).ray_address == "auto"
    flagged = [*other, "--redis-url", "redis://flag:1/0"]
    assert router_cluster_config_from_args(build_parser().parse_args(flagged)).ray_address == "10.9.9.9:6379"
    # This machine's Ray, recorded on the node's IP as kvserve up records it, typed as a
    # user may type it (a review found 127.0.0.1 refused: the check took the hostname's
    # entry in /etc/hosts, 127.0.0.1 or Debian's 127.0.1.1, for this machine's addresses).
    ray_address_file(state_dir).write_text(f"{_node_ip()}:6380\ntoken\n")
    local = ["router", "--ray-address", "127.0.0.1:6380", "--state-dir", str(state_dir)]
    config = router_cluster_config_from_args(build_parser().parse_args(local))
    assert (config.ray_address, config.ray_auth_mode, config.redis_url) == ("127.0.0.1:6380", "token", URL)
    lock.release()


def _node_ip() -> str:
    import ray

    return str(ray.util.get_node_ip_address())  # where a kvserve up's Ray serves its GCS


def test_one_ray_is_one_port_on_one_host_or_on_this_machine() -> None:
    node = _node_ip()
    assert same_ray_address("10.1.2.3:6380", "10.1.2.3:6380")
    for typed in ("localhost", "127.0.0.1", socket.gethostname(), node):
        assert same_ray_address(f"{typed}:6380", f"{node}:6380"), typed
        assert same_ray_address(f"{typed}:6380", "127.0.0.1:6380"), typed
    if _bindable("::1"):  # a machine with IPv6 loopback
        assert same_ray_address("[::1]:6380", f"{node}:6380") and same_ray_address("localhost:6380", "[::1]:6380")
    assert not same_ray_address("127.0.0.1:6381", "127.0.0.1:6380")
    assert not same_ray_address("10.9.9.9:6380", "10.1.2.3:6380")
    assert not same_ray_address("10.9.9.9:6380", f"{node}:6380")  # another machine's
    assert not same_ray_address("no-such-host.invalid:6380", "10.1.2.3:6380")


def _bindable(ip: str) -> bool:
    try:
        with socket.socket(socket.AF_INET6 if ":" in ip else socket.AF_INET) as probe:
            probe.bind((ip, 0))
    except OSError:
        return False
    return True


def _dead_pid() -> int:
    process = subprocess.Popen(["true"])
    process.wait()
    return process.pid


def test_the_ready_line_names_the_flags_this_router_needs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("sys.argv", [".venv/bin/kvserve", "up"])
    plain = ClusterConfig(state_dir=tmp_path)
    assert _try_it(plain, 50051) == '.venv/bin/kvserve generate --address 127.0.0.1:50051 "Hello"'
    secured = ClusterConfig(state_dir=tmp_path, server=ServerConfig(
        tls_cert_file=tmp_path / "c.pem", tls_key_file=tmp_path / "k.pem", auth_token="t" * 32))
    assert _try_it(secured, 50051) == (
        '.venv/bin/kvserve generate --address localhost:50051 --tls-ca CERT.pem --auth-token-file TOKEN_FILE "Hello"'
    )
    monkeypatch.setattr("sys.argv", ["/usr/lib/python3/cluster/cli.py", "up"])  # python -m cluster.cli
    assert _try_it(plain, 7).startswith("kvserve generate --address 127.0.0.1:7 ")


def _hint_words(up_args: list[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The `another router:` line `kvserve up <up_args>` prints, as the shell splits it."""
    from cluster.routers import router_flags
    from cluster.up import _another_router, cluster_config_from_args, router_only_parser

    monkeypatch.setattr("sys.argv", [".venv/bin/kvserve", "up"])
    args = build_parser().parse_args(["up", *up_args])
    config = cluster_config_from_args(args)
    return shlex.split(_another_router(config, args.routers - 1, router_flags(router_only_parser(), args)))


def test_the_another_router_line_parses_to_a_router_with_this_one_s_tls_token_and_ports(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Typed as printed, the added router must serve as this one does: a secured cluster's
    hint used to leave out the token and TLS (a router without them, on the same workers),
    `--metrics-port 0` became `--metrics-port 1`, and a state dir with a space was not quoted
    (found by review)."""
    monkeypatch.delenv("KVSERVE_AUTH_TOKEN", raising=False)
    pair = self_signed(tmp_path)
    token = tmp_path / "token"
    token.write_text("t" * 32)
    state_dir = tmp_path / "my state"
    words = _hint_words(["--tls-cert", str(pair.cert), "--tls-key", str(pair.key),
                         "--auth-token-file", str(token), "--host", "0.0.0.0", "--metrics-port", "0",
                         "--state-dir", str(state_dir), "--routers", "2"], tmp_path, monkeypatch)
    assert words[:4] == [".venv/bin/kvserve", "router", "--ray-address", "auto"]
    router = build_parser().parse_args(words[1:])
    assert (router.port, router.metrics_port, router.state_dir) == (50053, 0, state_dir)
    assert (router.tls_cert, router.tls_key, router.auth_token_file) == (pair.cert, pair.key, token)
    assert router.host == "0.0.0.0"
    plain = _hint_words([], tmp_path, monkeypatch)
    assert plain == [".venv/bin/kvserve", "router", "--ray-address", "auto", "--port", "50052",
                     "--metrics-port", "9401"]
    assert _hint_words(["--metrics-port", "off"], tmp_path, monkeypatch)[-1] == "off"


@pytest.mark.parametrize("content", [None, ""])
def test_a_redis_url_file_kvserve_router_cannot_use_is_named_in_one_line(
    content: str | None, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Any OSError reading the file (a directory here; EACCES for a router run as another
    user than the kvserve up, the file being 0600) was a traceback, and an empty file was
    taken for a URL (found by review): both are the --redis-url error, exit 2."""
    from cluster.cli import main

    monkeypatch.delenv(REDIS_URL_ENV, raising=False)
    state_dir = tmp_path / "state"
    if content is None:
        redis_url_file(state_dir).mkdir(parents=True)
    else:
        state_dir.mkdir()
        redis_url_file(state_dir).write_text(content)
    assert main(["router", "--ray-address", "auto", "--state-dir", str(state_dir)]) == 2
    err = capsys.readouterr().err
    assert "--redis-url" in err and "Traceback" not in err
    assert ("cannot be read" if content is None else "no kvserve up running on this machine keeps one") in err


def test_the_cli_says_a_streamed_request_is_queued_not_on_an_empty_worker(capsys: pytest.CaptureFixture[str]) -> None:
    """`kvserve stream` right after `kvserve submit` printed "[r1 on , 3 prompt tokens]": a
    queued request's record has no worker yet (found by review)."""
    from cluster.client import _print_stream
    from protos.kvserve.v1 import serving_pb2 as pb

    _print_stream([pb.GenerateResponse(started=pb.Started(request_id="r1", worker_id="", prompt_tokens=3))])
    _print_stream([pb.GenerateResponse(started=pb.Started(request_id="r2", worker_id="w1", prompt_tokens=3))])
    assert capsys.readouterr().err.splitlines() == ["[r1 queued, 3 prompt tokens]", "[r2 on w1, 3 prompt tokens]"]


def test_status_shows_a_dead_worker_without_its_last_report_s_load() -> None:
    """A SIGKILLed worker's row kept its last numbers ("5% used, running 1") 23 s after its
    requests had moved (found by a walkthrough); and with every worker dead nothing said
    why each call was refused."""
    from cluster.client import format_status
    from protos.kvserve.v1 import serving_pb2 as pb

    def worker(worker_id: str, alive: bool) -> pb.WorkerStatus:
        return pb.WorkerStatus(worker_id=worker_id, alive=alive, free_kv_bytes=95 << 20, total_kv_bytes=100 << 20,
                               free_blocks=95, total_blocks=100, uncommitted_blocks=90, running=1, waiting=2,
                               preemptions=3, report_age_seconds=23.1)

    one_dead = format_status(pb.ClusterStatusResponse(workers=[worker("w0", False), worker("w1", True)],
                                                      alive_workers=1))
    dead_row, live_row = one_dead.splitlines()[2:4]
    assert dead_row.split() == ["w0", "NO", "-", "100.0", "MiB", "-", "-/100", "-", "-", "-", "3", "23.10s"]
    assert live_row.split() == ["w1", "yes", "95.0", "MiB", "100.0", "MiB", "5%", "95/100", "90", "1", "2", "3",
                                "23.10s"]
    assert "no worker alive" not in one_dead
    all_dead = format_status(pb.ClusterStatusResponse(workers=[worker("w0", False)], alive_workers=0))
    assert "no worker alive: new requests are refused (UNAVAILABLE) until one is back (" in all_dead


class _DrainingCluster:
    """Stands in for cluster.local.Cluster in `_serve` (no Ray, no workers): its stop drains
    for the grace it is given unless its router's drain is ended."""

    def __init__(self, config: ClusterConfig) -> None:
        import asyncio

        self.config = config
        self.server = type("Server", (), {"port": 50051})()
        self.redis_url = "redis://x"
        self.address = "127.0.0.1:50051"
        self.router = self
        self.ray_gone = False  # what _serve reads of a Ray it joined (none here)
        self.drain_ended = asyncio.Event()
        self.stopped_after: float | None = None

    async def start(self) -> None:
        return None

    async def wait_for_failure(self) -> str:
        import asyncio

        await asyncio.Event().wait()
        return ""

    def end_drain(self) -> None:
        self.drain_ended.set()

    async def stop(self, grace_s: float = 0.0, others: object = None) -> None:
        import asyncio
        import time

        began = time.monotonic()
        try:
            await asyncio.wait_for(self.drain_ended.wait(), grace_s)
        except asyncio.TimeoutError:
            pass
        self.stopped_after = time.monotonic() - began


def test_a_second_ctrl_c_ends_kvserve_up_s_drain_but_the_same_one_twice_does_not(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Ctrl-C drains for --drain-grace; a second one ends the drain. A terminal's Ctrl-C
    reaches every process of the group and `kvserve up` signals its routers too, so each
    router gets the first Ctrl-C twice: that must not count as the second."""
    import asyncio
    import os
    import signal
    import threading

    import cluster.up

    made: list[_DrainingCluster] = []

    def make(config: ClusterConfig) -> _DrainingCluster:
        made.append(_DrainingCluster(config))
        return made[-1]

    monkeypatch.setattr(cluster.up, "Cluster", make)
    if threading.current_thread() is not threading.main_thread():
        pytest.skip("signal handlers need the main thread")

    def run(*after: float) -> float:
        async def scenario() -> int:
            serving = asyncio.ensure_future(cluster.up._serve(ClusterConfig(state_dir=tmp_path), 60.0))
            await asyncio.sleep(0.2)
            for delay in after:
                await asyncio.sleep(delay)
                os.kill(os.getpid(), signal.SIGINT)
            return await asyncio.wait_for(serving, 120)

        assert asyncio.run(scenario()) == 0
        assert made[-1].stopped_after is not None
        return made[-1].stopped_after

    # The first Ctrl-C twice, 0.05 s apart: drains (here until the third, 3 s later).
    assert run(0.0, 0.05, 3.0) > 2.0
    said = capsys.readouterr().err
    assert said.count("stopping now: in-flight requests are cancelled") == 1, said
    # A second Ctrl-C 1.5 s after the first: the drain ends then, not after 60 s.
    assert run(0.0, 1.5) < 30
