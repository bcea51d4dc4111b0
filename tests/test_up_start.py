"""`kvserve up` while it starts: a stop signal is heard, and workers that cannot fit fail it.

An outside check found both unheard: Ctrl-C and SIGTERM set a flag that nothing read
until the cluster was serving (minutes, for a big model), and `--workers 3` on a Ray of two
CPUs left the third actor waiting for ever, so that only SIGKILL ended it, leaving Ray's
agents behind. Each test runs `kvserve up` as a user does, with its own Ray."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from cluster.processes import session_members
from cluster.redis_server import EmbeddedRedis

ROOT = Path(__file__).resolve().parent.parent


def _up_command(redis_server: EmbeddedRedis, state_dir: Path, *flags: str) -> list[str]:
    return [sys.executable, "-m", "cluster.cli", "up", "--redis-url", redis_server.url, "--port", "0",
            "--metrics-port", "off", "--state-dir", str(state_dir), *flags]


def _env(**changes: str | None) -> dict[str, str]:
    env = {**os.environ, "RAY_USAGE_STATS_ENABLED": "0", "RAY_AUTH_MODE": "disabled"}
    env.pop("RAY_ADDRESS", None)
    for name, value in changes.items():
        if value is None:
            env.pop(name, None)
        else:
            env[name] = value
    return env


class _Starting:
    """`kvserve up` in a session of its own, its output read by a thread; `seen` is set once
    a line holds `mark`. interrupt() signals it there and checks how it stopped."""

    def __init__(self, command: list[str], mark: str, env: dict[str, str] | None = None) -> None:
        self.proc = subprocess.Popen(command, cwd=ROOT, env=env or _env(), stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                     stderr=subprocess.STDOUT, text=True, start_new_session=True)
        self.lines: list[str] = []
        self.seen = threading.Event()
        self._reader = threading.Thread(target=self._read, args=(mark,), daemon=True)
        self._reader.start()

    def _read(self, mark: str) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.append(line)
            if mark in line:
                self.seen.set()

    def stopped_before_it_was_ready(self, send: Callable[[], None]) -> float:
        """send() the signal once the mark is seen; it must stop as a start interrupted does,
        leaving nothing. Returns the seconds it took."""
        try:
            assert self.seen.wait(120), "".join(self.lines)
            send()
            signalled = time.monotonic()
            exit_status = self.proc.wait(timeout=60)
            stopped_in = time.monotonic() - signalled
            self._reader.join(10)
            output = "".join(self.lines)
            said = [line.strip() for line in self.lines if line.startswith("[kvserve]")]
            assert exit_status == 0, output
            assert said[-2:] == ["[kvserve] stopping before it was ready: a stop signal came while it started",
                                 "[kvserve] stopped"], output
            assert "router listening" not in output and "Traceback" not in output, output
            assert "never retrieved" not in output, output
            time.sleep(1.0)  # children reparented at exit finish theirs
            assert not session_members(self.proc.pid), f"left running: {session_members(self.proc.pid)}"
            return stopped_in
        finally:
            if self.proc.poll() is None:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(10)


def test_workers_that_cannot_fit_the_ray_it_starts_are_refused_naming_the_flag(
    redis_server: EmbeddedRedis, tmp_path: Path
) -> None:
    done = subprocess.run(_up_command(redis_server, tmp_path / "state", "--model", "tiny", "--worker-cpus", "1000"),
                          cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=180)
    assert done.returncode == 2, done.stderr[-3000:]
    assert "[kvserve] stopped" in done.stderr and "loading the model" not in done.stderr, done.stderr[-3000:]
    assert done.stderr.rstrip().splitlines()[-1].startswith(
        "kvserve up: --workers: 2 workers of 1000 CPUs each (--worker-cpus) do not fit the "), done.stderr[-3000:]
    assert "Traceback" not in done.stderr


def test_ctrl_c_while_the_model_loads_stops_what_started_at_once(redis_server: EmbeddedRedis, tmp_path: Path) -> None:
    """Ctrl-C right after "loading the model": the real model takes seconds to load (its
    dequantization alone ~3 s), the signal a fraction of one to arrive."""
    up = _Starting(_up_command(redis_server, tmp_path / "state", "--workers", "1"), "loading the model on")
    # A terminal's Ctrl-C reaches the whole group.
    stopped_in = up.stopped_before_it_was_ready(lambda: os.killpg(up.proc.pid, signal.SIGINT))
    print(f"stopped {stopped_in:.1f} s after Ctrl-C, while the model loaded", file=sys.stderr)


def test_the_ray_token_that_guards_rays_ports_is_its_owners_alone(redis_server: EmbeddedRedis, tmp_path: Path) -> None:
    """Ray's ports listen on every interface, guarded by its token auth (on by default);
    ray.init wrote the token to ~/.ray/auth_token 0644, so with a home directory others may
    enter (0755 here) any local user could join the cluster and run code as its user (an
    outside security check did). The start makes it 0600. RAY_AUTH_MODE unset: Ray's default."""
    import stat

    home = tmp_path / "home"
    home.mkdir(mode=0o755)
    up = _Starting(_up_command(redis_server, tmp_path / "state", "--workers", "1"), "loading the model on",
                   _env(HOME=str(home), RAY_AUTH_MODE=None))
    token = home / ".ray" / "auth_token"
    try:
        assert up.seen.wait(120), "".join(up.lines)[-3000:]
        assert token.exists(), "Ray made a token: its auth is on"
        assert stat.S_IMODE(token.stat().st_mode) == 0o600, oct(token.stat().st_mode)
    finally:
        up.stopped_before_it_was_ready(lambda: os.killpg(up.proc.pid, signal.SIGINT))


def test_a_worker_ray_cannot_place_yet_is_named_with_what_ray_has_free(
    ray_session: None, redis_server: EmbeddedRedis, tmp_path: Path, capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """On a Ray it joined (an autoscaler may add a node), a worker asking for more CPUs than
    are free waits; after PLACEMENT_NOTICE_S the start says so, and a stop ends the wait.
    The session's Ray has 8 CPUs: two workers of 5 do not both fit."""
    import asyncio
    import dataclasses

    import cluster.local
    from cluster.local import Cluster
    import ray

    from tests.cluster_harness import cluster_config, wait_until

    # An earlier test's workers let go of their CPUs a moment after ray.kill.
    wait_until(lambda: ray.available_resources().get("CPU") == 8, timeout=60, what="the session's 8 CPUs free")
    monkeypatch.setattr(cluster.local, "PLACEMENT_NOTICE_S", 2.0)
    config = dataclasses.replace(cluster_config(redis_server.url, tmp_path), worker_cpus=5)

    said: list[str] = []

    async def scenario() -> None:
        running = Cluster(config)
        starting = asyncio.create_task(running.start())
        try:
            deadline = time.monotonic() + 120
            while not any(line.startswith("[kvserve] worker w1 is not ready") for line in said):
                assert not starting.done() and time.monotonic() < deadline, said
                await asyncio.sleep(0.2)
                said.extend(capsys.readouterr().err.splitlines())
        finally:
            starting.cancel()  # as a stop signal does
            await asyncio.gather(starting, return_exceptions=True)
            await running.stop()

    asyncio.run(scenario())
    notice = next(line for line in said if line.startswith("[kvserve] worker w1 is not ready"))
    assert notice.startswith("[kvserve] worker w1 is not ready after 2 s: its model may still be loading, or Ray "
                             "cannot place it yet (3 of its 8 CPUs are free, a worker asks for 5)"), said


def test_fractional_worker_cpus_that_fit_exactly_are_not_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """25 workers of 0.56 CPUs on 14: in floating point 14.000000000000002, refused as too
    many; Ray counts in steps of 0.0001 and places them (found by review)."""
    import ray

    from cluster.local import Cluster, ClusterConfig

    monkeypatch.setattr(ray, "cluster_resources", lambda: {"CPU": 14.0})
    Cluster(ClusterConfig(worker_cpus=0.56, state_dir=tmp_path))._check_resources(25, 0)
    with pytest.raises(ValueError, match="26 workers of 0.56 CPUs each"):
        Cluster(ClusterConfig(worker_cpus=0.56, state_dir=tmp_path))._check_resources(26, 0)


def test_sigterm_while_ray_starts_stops_what_started(redis_server: EmbeddedRedis, tmp_path: Path) -> None:
    """While ray.init runs, Ray's own SIGTERM handler is in place and raised SystemExit in the
    start: exit 15 and a traceback of an unretrieved task (found by review). systemd,
    Docker and Kubernetes stop with SIGTERM, to the process alone."""
    up = _Starting(_up_command(redis_server, tmp_path / "state", "--model", "tiny", "--workers", "1"), "starting Ray")

    def sigterm_into_ray_init() -> None:
        # Into ray.init, which starts Ray's processes for 2 s or more and sets its handler
        # first thing: sent at once, the signal may come before it, as the old code's did.
        time.sleep(0.5)
        up.proc.send_signal(signal.SIGTERM)

    up.stopped_before_it_was_ready(sigterm_into_ray_init)
