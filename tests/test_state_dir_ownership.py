"""One `kvserve up` and one redis-server per state directory, ever; a SIGKILLed `kvserve up`
leaves nothing that the next one's start or Ctrl-C does not clean up."""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
import redis

from cluster.local import RAY_GONE_AFTER_S
from cluster.processes import ProcessId, command_line, descendants, process_id, redis_servers_in, session_members
from cluster.redis_server import EmbeddedRedis, RedisServerConfig
from cluster.state_dir import LeftoverRecord, StateDirInUse, StateDirLock
from protos.kvserve.v1 import serving_pb2 as pb
from protos.kvserve.v1 import serving_pb2_grpc as pb_grpc
from tests.cluster_harness import ReferenceEngine, generate, greedy_request, output_ids, wait_for, wait_until

ROOT = Path(__file__).resolve().parent.parent
PYTHON = str(ROOT / ".venv" / "bin" / "python")
START_TIMEOUT_S = 240.0  # Ray and two tiny workers on a loaded 2-core machine
NUM_SUBMITTED = 6
MAX_TOKENS = 400  # long enough to be mid-run when `kvserve up` is killed


class Background:
    """A command in a session of its own, its output collected; it leads the session, so what it
    starts (and what outlives it) can be found by session id."""

    def __init__(self, argv: list[str]) -> None:
        env = {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS", "KVSERVE_AUTH_TOKEN")}
        self.proc = subprocess.Popen(
            argv, cwd=ROOT, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT, text=True, start_new_session=True,
        )  # fmt: skip
        self.lines: list[str] = []
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.append(line)

    def output(self) -> str:
        return "".join(self.lines)

    def wait_for_line(self, pattern: str, timeout_s: float) -> re.Match[str]:
        deadline = time.monotonic() + timeout_s
        while True:
            found = re.search(pattern, self.output(), re.M)
            if found:
                return found
            if self.proc.poll() is not None:
                self._reader.join(timeout=5)
                raise AssertionError(f"exited ({self.proc.returncode}) before {pattern!r}:\n{self.output()}")
            assert time.monotonic() < deadline, f"no {pattern!r} in {timeout_s} s:\n{self.output()}"
            time.sleep(0.1)

    def kill_all(self) -> None:
        """SIGKILL the command and everything left in its session (cleanup after a failure)."""
        for pid in [self.proc.pid, *session_members(self.proc.pid)]:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        self.proc.wait(timeout=30)


def _hold_lock_in_a_child(state_dir: Path) -> Background:
    code = textwrap.dedent(f"""
        import time
        from pathlib import Path
        from cluster.state_dir import StateDirLock
        lock = StateDirLock(Path({str(state_dir)!r}))  # kept: a collected lock closes its file
        lock.acquire()
        print("held", flush=True)
        time.sleep(600)
    """)
    child = Background([PYTHON, "-c", code])
    child.wait_for_line("^held$", timeout_s=60)
    return child


def test_the_lock_refuses_a_second_holder_naming_the_dir_and_pid_until_the_first_dies(tmp_path: Path) -> None:
    holder = _hold_lock_in_a_child(tmp_path)
    try:
        with pytest.raises(StateDirInUse) as refused:
            StateDirLock(tmp_path).acquire()
        assert str(tmp_path) in str(refused.value) and f"pid {holder.proc.pid}" in str(refused.value)
        os.kill(holder.proc.pid, signal.SIGKILL)  # the kernel drops a dead holder's flock
        holder.proc.wait(timeout=30)
        lock = StateDirLock(tmp_path)
        lock.acquire()
        # A second lock in the same process is refused too (an flock is per open file).
        with pytest.raises(StateDirInUse, match=f"pid {os.getpid()}"):
            StateDirLock(tmp_path).acquire()
        lock.release()
        StateDirLock(tmp_path).acquire()
    finally:
        holder.kill_all()


def _redis_owner(state_dir: Path, exit_with_parent: bool) -> tuple[Background, int]:
    """A process that starts an EmbeddedRedis, writes a key and waits; returns it and the server's pid."""
    code = textwrap.dedent(f"""
        import time
        from pathlib import Path
        import redis
        from cluster.redis_server import EmbeddedRedis, RedisServerConfig
        config = RedisServerConfig(state_dir=Path({str(state_dir)!r}), password="first", exit_with_parent={exit_with_parent})
        server = EmbeddedRedis(config)
        server.start()
        redis.Redis.from_url(server.url).set("written", "by the first")
        print("pid", server.pid, flush=True)
        time.sleep(600)
    """)
    owner = Background([PYTHON, "-c", code])
    return owner, int(owner.wait_for_line(r"^pid (\d+)$", timeout_s=60).group(1))


def test_a_redis_server_orphaned_by_a_sigkill_is_stopped_before_another_starts_on_its_directory(
    tmp_path: Path,
) -> None:
    """The owner of a redis-server is SIGKILLed, so its server lives on (parent: init) with a
    password nobody has any more. A new EmbeddedRedis on the directory, with a password of its
    own, stops the orphan (SIGTERM: it writes its AOF) and serves the orphan's data alone."""
    state_dir = tmp_path / "redis"
    owner, orphan_pid = _redis_owner(state_dir, exit_with_parent=False)
    try:
        os.kill(owner.proc.pid, signal.SIGKILL)
        owner.proc.wait(timeout=30)
        time.sleep(0.5)
        orphan = process_id(orphan_pid)
        assert orphan is not None and redis_servers_in(state_dir) == [orphan], "the orphan lives on"

        server = EmbeddedRedis(RedisServerConfig(state_dir=state_dir, password="second"))
        server.start()
        try:
            assert not orphan.alive()
            assert [p.pid for p in redis_servers_in(state_dir)] == [server.pid]
            with redis.Redis.from_url(server.url) as client:
                assert client.get("written") == b"by the first"
        finally:
            server.stop()
        assert redis_servers_in(state_dir) == []
    finally:
        owner.kill_all()


@pytest.mark.skipif(shutil.which("setpriv") is None, reason="exit_with_parent needs util-linux setpriv")
def test_a_server_started_to_exit_with_its_parent_shuts_down_cleanly_when_the_parent_is_sigkilled(
    tmp_path: Path,
) -> None:
    state_dir = tmp_path / "redis"
    owner, server_pid = _redis_owner(state_dir, exit_with_parent=True)
    try:
        server_id = process_id(server_pid)
        assert server_id is not None and "redis-server" in command_line(server_pid)  # setpriv exec'd it
        os.kill(owner.proc.pid, signal.SIGKILL)
        owner.proc.wait(timeout=30)
        wait_until(lambda: not server_id.alive(), timeout=10, what="the server to exit with its parent")
        assert "Redis is now ready to exit" in (state_dir / "redis.log").read_text(), "a clean shutdown"
        with EmbeddedRedis(RedisServerConfig(state_dir=state_dir)) as server, redis.Redis.from_url(server.url) as client:
            assert client.get("written") == b"by the first"
    finally:
        owner.kill_all()


DEAF_TO_SIGTERM = "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); print('deaf', flush=True); time.sleep(600)"


def test_the_leftover_record_stops_the_recorded_processes_and_no_other(tmp_path: Path) -> None:
    recorded = subprocess.Popen(["sleep", "600"])
    reused = subprocess.Popen(["sleep", "600"])  # stands for a pid the kernel gave to another process
    # Stands for Ray's agents, which ignore SIGTERM once their raylet is gone.
    deaf = subprocess.Popen([PYTHON, "-c", DEAF_TO_SIGTERM], stdout=subprocess.PIPE, text=True)
    try:
        assert deaf.stdout is not None and deaf.stdout.readline().strip() == "deaf"
        time.sleep(0.2)
        recorded_id, reused_id, deaf_id = process_id(recorded.pid), process_id(reused.pid), process_id(deaf.pid)
        assert recorded_id is not None and reused_id is not None and deaf_id is not None
        record = LeftoverRecord(tmp_path)
        record.write([recorded_id, ProcessId(reused.pid, reused_id.start_time - 1), deaf_id])
        began = time.monotonic()
        stopped = record.stop_leftovers()
        took = time.monotonic() - began
        assert stopped == [f"{recorded.pid} sleep 600", f"{deaf.pid} {PYTHON} -c {DEAF_TO_SIGTERM}"]
        assert recorded.wait(timeout=10) == -signal.SIGTERM
        assert deaf.wait(timeout=10) == -signal.SIGKILL
        # A 1 s grace before the SIGKILL (it was 5 s, paid by every start after a crash).
        assert took < 4.0, f"stopping the leftovers took {took:.1f} s"
        assert reused.poll() is None, "a process that only shares a recorded pid is left alone"
        assert record.read() == [] and not record.path.exists()
    finally:
        for proc in (recorded, reused, deaf):
            proc.kill()
            proc.wait()


# -- the whole sequence, from outside ----------------------------------------------------------


def _up(state_dir: Path) -> Background:
    """`kvserve up` (the same main as the console script, run from this checkout) on a tiny model."""
    return Background([
        PYTHON, "-m", "cluster.cli", "up", "--model", "tiny", "--kv-cache-memory", "16MiB",
        "--num-threads", "1", "--port", "0", "--metrics-port", "0", "--state-dir", str(state_dir),
        "--drain-grace", "5",
    ])  # fmt: skip


def _address(up: Background) -> str:
    return up.wait_for_line(r"router listening on (\S+)", START_TIMEOUT_S).group(1)


@pytest.fixture
def ups() -> Iterator[list[Background]]:
    """The `kvserve up`s a test starts; whatever of theirs is still running at its end is SIGKILLed."""
    started: list[Background] = []
    yield started
    for up in started:
        up.kill_all()


def test_a_sigkilled_up_leaves_nothing_that_the_next_start_and_a_sigterm_do_not_clean_up(
    tmp_path: Path, reference_engine: ReferenceEngine, ups: list[Background]
) -> None:
    """The issue's sequence: `kvserve up`, Submit 6 requests, SIGKILL `kvserve up` mid-run (its
    redis-server shuts down with it; two Ray agents live on as orphans), `kvserve up` again on the
    same state dir: one redis-server holds the dir and the 6 requests finish with the reference's tokens.
    Ctrl-C: no redis-server on the dir, and no process of either run is left."""
    state_dir = tmp_path / "state"
    prompts = [list(range(10 + 7 * i, 20 + 7 * i)) for i in range(NUM_SUBMITTED)]
    expected = [out.output_ids for out in reference_engine.greedy([(p, MAX_TOKENS) for p in prompts])]

    began = time.monotonic()
    first = _up(state_dir)
    ups.append(first)
    first_address = _address(first)
    phases = {"first up ready": time.monotonic() - began}
    with grpc.insecure_channel(first_address) as channel:
        stub = pb_grpc.KVServeStub(channel)
        ids = [stub.Submit(greedy_request(p, MAX_TOKENS), timeout=30).request_id for p in prompts]
        wait_for(
            lambda: [stub.GetRequest(pb.GetRequestRequest(request_id=r), timeout=10) for r in ids],
            lambda infos: all(i.status == pb.REQUEST_STATUS_RUNNING and i.output_token_ids for i in infos),
            timeout=60,
            what="the submitted requests to decode",
        )
    phases["submitted and decoding"] = time.monotonic() - began
    # No wait for the AOF's fsync: the embedded Redis gets SIGTERM when `kvserve up` dies (its
    # parent-death signal), and its clean shutdown writes the whole AOF. (A 1.1 s wait let a
    # fast machine's tiny model all but finish the 400-token requests before the kill.)
    os.kill(first.proc.pid, signal.SIGKILL)
    first.proc.wait(timeout=30)
    time.sleep(1.0)
    orphans = {pid: command_line(pid) for pid in session_members(first.proc.pid)}
    print(f"left running by the SIGKILLed kvserve up: {sorted(orphans.values())}")
    # Its redis-server goes with it (exit_with_parent); Ray's agents do not.
    wait_until(lambda: not redis_servers_in(state_dir / "redis"), timeout=10, what="the orphaned redis-server to exit")

    second = _up(state_dir)
    ups.append(second)
    address = _address(second)
    phases["second up ready"] = time.monotonic() - began
    servers = redis_servers_in(state_dir / "redis")
    assert len(servers) == 1, f"redis-servers on {state_dir}: {servers}"
    # Its own session (out of reach of a terminal's Ctrl-C), but the second run's child.
    assert servers[0] in descendants(second.proc.pid), "the one is the second run's own"
    said = second.output()
    assert "a killed kvserve up left running" in said, said
    with grpc.insecure_channel(address) as channel:
        stub = pb_grpc.KVServeStub(channel)
        infos = wait_for(
            lambda: [stub.GetRequest(pb.GetRequestRequest(request_id=r), timeout=10) for r in ids],
            lambda infos: all(i.status == pb.REQUEST_STATUS_FINISHED for i in infos),
            timeout=180,
            what="the adopted requests to finish",
        )
    phases["adopted requests finished"] = time.monotonic() - began
    assert [list(info.output_token_ids) for info in infos] == expected
    # At its start if the first run's lease had lapsed by then, else when it lapses (the start
    # is ~4 s sooner than the first run's 5 s grace for Ray's leftover agents made it). Each
    # adopted request moved off its worker; one the first run finished before the kill (a
    # machine with the cores to itself decodes 400 tiny tokens in well under a second) did not.
    # The router logs each adoption once ("from Redis"); at the start `kvserve up` says it again.
    adopted = re.findall(r"adopted (\d+) in-flight requests from Redis", second.output())
    moved = [info.request_id for info in infos if info.num_migrations == 1]
    print(f"adopted {adopted}; {len(moved)} of {NUM_SUBMITTED} moved")
    assert sum(map(int, adopted)) == len(moved) >= 1, second.output()

    # Its Redis's URL, for a `kvserve router` on this machine: readable by its owner alone.
    url_file = state_dir / "redis-url"
    redis_port = second.wait_for_line(r"embedded redis-server on 127\.0\.0\.1:(\d+)", 5).group(1)
    assert url_file.stat().st_mode & 0o777 == 0o600
    assert re.fullmatch(rf"redis://:[0-9a-f]{{32}}@127\.0\.0\.1:{redis_port}/0\n", url_file.read_text())
    # And its Ray's address and auth mode, which `kvserve router --ray-address auto` joins
    # rather than the newest Ray on the machine (another test's, here, as often as not).
    ray_file = state_dir / "ray-address"
    assert re.fullmatch(r"[0-9.]+:\d+\n(token|disabled)?\n", ray_file.read_text()), ray_file.read_text()
    # The README's `kvserve router` beside it, as typed but for its ports: it joins this
    # cluster's Ray (Ray's token auth, on by default, refused the address given alone) and
    # Redis, and serves this cluster's workers.
    joined, left_behind = (
        Background([PYTHON, "-m", "cluster.cli", "router", "--ray-address", "auto", "--port", "0",
                    "--metrics-port", "off", "--state-dir", str(state_dir)])
        for _ in range(2)
    )
    ups.extend((joined, left_behind))
    joined_address = _address(joined)
    _address(left_behind)
    with grpc.insecure_channel(joined_address) as channel:
        stub = pb_grpc.KVServeStub(channel)
        through_joined = output_ids(generate(stub, greedy_request(prompts[0], 8)))
    assert through_joined == expected[0][:8]
    joined.proc.send_signal(signal.SIGINT)
    assert joined.proc.wait(timeout=60) == 0, joined.output()
    phases["a kvserve router joined and served"] = time.monotonic() - began
    # SIGTERM to it alone, as systemd, Docker and Kubernetes stop a service (Ctrl-C's SIGINT
    # to the group: tests/test_readme_commands.py). Ray's own SIGTERM handler, which
    # ray.init put in, ended it in a segfault with nothing drained.
    os.kill(second.proc.pid, signal.SIGTERM)
    assert second.proc.wait(timeout=60) == 0, second.output()
    said = second.output()
    assert "Traceback" not in said and "SIGSEGV" not in said and "SIGTERM received" not in said, said
    assert said.rstrip().endswith("[kvserve] stopped"), said[-2000:]
    assert not url_file.exists(), "a stopped cluster's URL is not left to mislead a router"
    assert not ray_file.exists()
    # The other joined router outlives its cluster: it says so, and stops, once the GCS has
    # refused it for RAY_GONE_AFTER_S. (It went on answering UNAVAILABLE, and Ray's driver
    # ended it ~60 s later with exit 1 and no word of kvserve's.)
    assert left_behind.proc.wait(timeout=RAY_GONE_AFTER_S + 40) == 1, left_behind.output()
    said = left_behind.output()
    assert "[kvserve] error: the cluster's Ray is gone: its GCS at " in said, said[-2000:]
    assert "Traceback" not in said and said.rstrip().endswith("[kvserve] stopped"), said[-2000:]
    phases["the joined router left behind stopped"] = time.monotonic() - began
    wait_until(lambda: not redis_servers_in(state_dir / "redis"), timeout=10, what="no redis-server on the dir")
    # Processes reparented at exit may take a moment to go (Ray's workers end their own way).
    deadline = time.monotonic() + 15
    while True:
        left = {pid: command_line(pid) for up in (first, second) for pid in session_members(up.proc.pid)}
        if not left or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    assert not left, f"left running after the second run's Ctrl-C: {left}"
    phases["all stopped"] = time.monotonic() - began
    print("seconds from the start: " + ", ".join(f"{name} {t:.1f}" for name, t in phases.items()))
