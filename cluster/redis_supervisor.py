"""Supervision of the embedded redis-server: when it dies (SIGKILL, OOM kill, a crash), start
it again on the same port, password and AOF, and give up only after repeated crashes.

The router needs no help to come back: its Redis pool replaces dead connections on the next
call and its recorder replays the writes it held (router/recorder.py). What was missing is
the server itself; without this, every new request got UNAVAILABLE until someone restarted
redis-server by hand. An external Redis (`--redis-url`) is not supervised: it is the
operator's to run.

Giving up: more than `max_restarts` crashes within `window_s` means something restarting
will not fix (a full disk, a corrupt AOF, an OOM loop). The supervisor logs an error with
the server's last log lines and sets `gave_up`; `kvserve up` then drains and exits 1.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import time
from collections import deque
from dataclasses import dataclass

from cluster.redis_server import EmbeddedRedis

log = logging.getLogger("kvserve.cluster")


@dataclass(frozen=True)
class SupervisionConfig:
    """How the embedded redis-server is kept running: at most `max_restarts` restarts within
    any `window_s` seconds (one crash more gives up), exits noticed within `poll_interval_s`."""

    max_restarts: int = 5
    window_s: float = 60.0
    poll_interval_s: float = 0.1
    start_timeout_s: float = 10.0

    def __post_init__(self) -> None:
        if self.max_restarts < 0:
            raise ValueError(f"SupervisionConfig.max_restarts must be >= 0, got {self.max_restarts}")
        for name in ("window_s", "poll_interval_s", "start_timeout_s"):
            value = getattr(self, name)
            if not value > 0:
                raise ValueError(f"SupervisionConfig.{name} must be > 0, got {value}")


class RestartBudget:
    """The crashes of the last `window_s` seconds, and whether one more may be restarted."""

    def __init__(self, max_restarts: int, window_s: float) -> None:
        self.max_restarts = max_restarts
        self.window_s = window_s
        self._crashes: deque[float] = deque()

    @property
    def num_recent(self) -> int:
        """Crashes counted at the last record_crash (within its window)."""
        return len(self._crashes)

    def record_crash(self, now: float) -> bool:
        """Count a crash at `now` (monotonic seconds); True when it may be restarted."""
        while self._crashes and self._crashes[0] <= now - self.window_s:
            self._crashes.popleft()
        self._crashes.append(now)
        return len(self._crashes) <= self.max_restarts


def describe_exit(code: int | None) -> str:
    """`killed by SIGKILL`, `exited with code 1`."""
    if code is None:
        return "did not start"
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exited with code {code}"


class RedisSupervisor:
    """Watches one started EmbeddedRedis from an asyncio loop and restarts it when it exits."""

    def __init__(self, server: EmbeddedRedis, config: SupervisionConfig | None = None) -> None:
        self.server = server
        self.config = config or SupervisionConfig()
        self.num_restarts = 0
        self.error: str | None = None
        self.gave_up = asyncio.Event()
        self._budget = RestartBudget(self.config.max_restarts, self.config.window_s)
        self._task: asyncio.Task[None] | None = None
        self._starting: asyncio.Future[str] | None = None

    def start(self) -> None:
        """Begin watching (the server must be running already)."""
        if self._task is None:
            self._task = asyncio.create_task(self._watch(), name="redis-supervisor")

    async def stop(self) -> None:
        """Stop watching, before the server is stopped on purpose; waits for a restart under way,
        so the server is not started behind the caller's back."""
        task, self._task = self._task, None
        starting = self._starting  # taken first: the cancelled task forgets it
        if task is not None:
            task.cancel()
            try:
                await task
            except asyncio.CancelledError:
                pass
        if starting is not None:
            try:
                await starting
            except RuntimeError:
                pass

    async def _watch(self) -> None:
        while True:
            code = await self._wait_for_exit()
            old_pid = self.server.pid
            exited_at = time.monotonic()
            start_error: str | None = None  # why the last try to start it again failed
            while True:
                if not self._budget.record_crash(time.monotonic()):
                    self._give_up(code, start_error)
                    return
                self._starting = asyncio.ensure_future(asyncio.to_thread(self.server.start, self.config.start_timeout_s))
                try:
                    # Shielded: a stop() while it starts waits for it rather than leaving a thread behind.
                    await asyncio.shield(self._starting)
                except RuntimeError as exc:
                    log.warning("redis-server in %s could not be restarted: %s", self.server.config.state_dir, exc)
                    start_error = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
                    await asyncio.sleep(self.config.poll_interval_s)
                    continue
                finally:
                    self._starting = None
                break
            self.num_restarts += 1
            log.warning(
                "embedded redis-server (pid %s) %s; restarted it in %.1f s as pid %s on port %d, with the same "
                "password and AOF (restart %d; it gives up after %d crashes within %g s)",
                old_pid, describe_exit(code), time.monotonic() - exited_at, self.server.pid, self.server.port,
                self.num_restarts, self.config.max_restarts + 1, self.config.window_s,
            )  # fmt: skip

    async def _wait_for_exit(self) -> int | None:
        pid = self.server.pid
        if pid is not None:
            # Linux: a pidfd turns readable when the process ends, so an idle cluster does
            # not wake every poll_interval_s to ask (the child stays unreaped, its pid ours,
            # until exit_code() below reaps it).
            await _ended(pid)
        while True:  # where there is no pidfd, and after one said it ended
            code = self.server.exit_code()
            if code is not None:
                return code
            await asyncio.sleep(self.config.poll_interval_s)

    def _give_up(self, code: int | None, start_error: str | None) -> None:
        what, counted = describe_exit(code), "crashes"
        if start_error is not None:  # it exited, and then would not start: say both
            what, counted = f"{what}, and starting it again failed ({start_error})", "crashes and failed starts"
        self.error = (
            f"embedded redis-server in {self.server.config.state_dir} {what}: "
            f"{self._budget.num_recent} {counted} within {self.config.window_s:g} s, so it is not "
            f"restarted again (new requests get UNAVAILABLE while it is down)\n{self.server.log_tail()}"
        )
        log.error("%s", self.error)
        self.gave_up.set()


async def _ended(pid: int) -> None:
    """Return once the process `pid` has ended, or at once where that cannot be waited for
    (no os.pidfd_open, a kernel before 5.3, a process already gone)."""
    try:
        fd = os.pidfd_open(pid)
    except (AttributeError, OSError):
        return
    loop = asyncio.get_running_loop()
    readable = loop.create_future()
    try:
        loop.add_reader(fd, lambda: readable.done() or readable.set_result(None))
        try:
            await readable
        finally:
            loop.remove_reader(fd)
    finally:
        os.close(fd)
