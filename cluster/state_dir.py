"""The state directory's ownership: one `kvserve up` at a time, and what a killed one left.

`StateDirLock` is an flock on `<state_dir>/kvserve.lock`, held by the process that runs the
cluster for as long as it lives. The kernel drops it when that process dies, however it
dies (SIGKILL included), so a stale lock never needs cleaning; a second holder fails at
once, naming the directory and the pid that holds it.

`LeftoverRecord` is `<state_dir>/processes.json`: the processes a cluster started (Ray's,
when it started Ray itself) with their start times. A SIGKILLed `kvserve up` cannot stop
them, and some outlive it (Ray's dashboard and runtime-env agents, reparented to init),
so the next one that takes the lock stops whatever on the record still runs.
"""

from __future__ import annotations

import fcntl
import json
import logging
import os
from collections.abc import Iterable
from pathlib import Path
from typing import IO

from cluster.processes import ProcessId, command_line, stop_processes

log = logging.getLogger("kvserve.cluster")
LOCK_NAME = "kvserve.lock"
RECORD_NAME = "processes.json"


class StateDirInUse(RuntimeError):
    """Another live process holds the state directory's lock."""


class StateDirLock:
    """An exclusive, non-blocking flock on `<state_dir>/kvserve.lock` that records its holder's pid."""

    def __init__(self, state_dir: Path) -> None:
        self.state_dir = state_dir
        self.path = state_dir / LOCK_NAME
        self._file: IO[str] | None = None

    @property
    def held(self) -> bool:
        return self._file is not None

    def acquire(self) -> None:
        """Take the lock, or raise StateDirInUse naming the directory and the holder's pid."""
        if self._file is not None:
            return
        # Created owner-only (an existing directory keeps its mode: it is the user's).
        self.state_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
        # Opened without truncating: the holder's pid must stay readable until we hold it.
        descriptor = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_APPEND, 0o600)
        file = os.fdopen(descriptor, "a+", encoding="utf-8")  # held open for the lock's life
        try:
            fcntl.flock(file.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            file.seek(0)
            holder = file.read().strip() or "unknown"
            file.close()
            raise StateDirInUse(
                f"state dir {self.state_dir} is in use by another kvserve up (pid {holder}, lock {self.path}): "
                f"stop that one first, or give this one another --state-dir"
            ) from None
        except BaseException:
            file.close()
            raise
        file.seek(0)
        file.truncate()
        file.write(f"{os.getpid()}\n")
        file.flush()
        self._file = file

    def release(self) -> None:
        file, self._file = self._file, None
        if file is not None:
            # The pid goes first: whoever takes the lock next finds no stale holder in it.
            file.seek(0)
            file.truncate()
            file.flush()
            fcntl.flock(file.fileno(), fcntl.LOCK_UN)
            file.close()


def live_holder(state_dir: Path) -> int | None:
    """The pid of the process holding the state dir's lock, if one does and it is alive.
    Read from the lock file, without taking the lock (a `kvserve up` starting at that
    moment must not find it taken): a SIGKILLed holder's pid stays there, dead."""
    try:
        pid = int((state_dir / LOCK_NAME).read_text(encoding="utf-8").strip() or 0)
    except (OSError, ValueError):
        return None
    if pid <= 0:
        return None
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return None
    except PermissionError:
        pass  # alive, another user's
    return pid


class LeftoverRecord:
    """The processes this cluster started, on disk, for the next cluster on the directory to stop."""

    def __init__(self, state_dir: Path) -> None:
        self.path = state_dir / RECORD_NAME

    def write(self, processes: Iterable[ProcessId]) -> None:
        rows = [{"pid": p.pid, "start_time": p.start_time, "command": command_line(p.pid)[:200]} for p in processes]
        temporary = self.path.with_suffix(".tmp")
        write_private(temporary, json.dumps({"owner_pid": os.getpid(), "processes": rows}, indent=1))
        temporary.replace(self.path)

    def read(self) -> list[ProcessId]:
        try:
            data = json.loads(self.path.read_text(encoding="utf-8"))
            return [ProcessId(int(row["pid"]), int(row["start_time"])) for row in data["processes"]]
        except FileNotFoundError:
            return []
        except (OSError, ValueError, KeyError, TypeError) as exc:
            log.warning("ignoring %s: unreadable (%s)", self.path, exc)
            return []

    def stop_leftovers(self) -> list[str]:
        """Stop the recorded processes that still run; forget the record. Returns what it stopped
        (pid and command line), for the log."""
        alive = [p for p in self.read() if p.alive()]
        names = [f"{p.pid} {command_line(p.pid)}" for p in alive]
        # A short grace: these are Ray's, of a cluster that is gone. Its workers go at SIGTERM,
        # but its two agents ignore it once their raylet has died (still there 20 s after it,
        # here), and the default 5 s grace was 5 s of every start after a crash.
        stop_processes(alive, grace_s=1.0)
        self.path.unlink(missing_ok=True)
        return names


def write_private(path: Path, text: str) -> None:
    """Write a new file at path, created 0600: never a moment readable by others."""
    path.unlink(missing_ok=True)
    descriptor = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(descriptor, "w", encoding="utf-8") as out:
        out.write(text)
