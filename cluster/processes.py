"""Processes seen through Linux's /proc: who descends from whom, which redis-server runs in
a directory, and stopping processes that are not our children.

A pid alone names a process only while it lives; after that the kernel may give the number
to another. `ProcessId` pairs it with the process's start time (clock ticks since boot, from
/proc/<pid>/stat), which together name one process forever, so a pid written to disk by one
run can be checked and stopped safely by the next.
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import NamedTuple

_PROC = Path("/proc")
_POLL_SECONDS = 0.05


class ProcessId(NamedTuple):
    """One process, not just a pid: the pid and the start time the kernel recorded for it."""

    pid: int
    start_time: int

    def alive(self) -> bool:
        """Whether this very process still runs (a zombie or a reused pid does not count)."""
        stat = _stat_fields(self.pid)
        return stat is not None and stat.state != "Z" and stat.start_time == self.start_time


class _Stat(NamedTuple):
    state: str
    ppid: int
    session_id: int
    start_time: int


def _stat_fields(pid: int) -> _Stat | None:
    try:
        text = (_PROC / str(pid) / "stat").read_text()
    except OSError:
        return None
    # The command name (field 2) is in parentheses and may hold spaces or parentheses itself.
    fields = text[text.rindex(")") + 2 :].split()
    return _Stat(state=fields[0], ppid=int(fields[1]), session_id=int(fields[3]), start_time=int(fields[19]))


def process_id(pid: int) -> ProcessId | None:
    """The ProcessId of the running process `pid`, or None when there is none."""
    stat = _stat_fields(pid)
    if stat is None or stat.state == "Z":
        return None
    return ProcessId(pid, stat.start_time)


def _all_pids() -> Iterator[int]:
    for entry in _PROC.iterdir():
        if entry.name.isdigit():
            yield int(entry.name)


def descendants(root_pid: int) -> list[ProcessId]:
    """Every living process below `root_pid` (children, their children, ...)."""
    children: dict[int, list[int]] = {}
    stats: dict[int, _Stat] = {}
    for pid in _all_pids():
        stat = _stat_fields(pid)
        if stat is not None and stat.state != "Z":
            stats[pid] = stat
            children.setdefault(stat.ppid, []).append(pid)
    found: list[ProcessId] = []
    pending = list(children.get(root_pid, []))
    while pending:
        pid = pending.pop()
        found.append(ProcessId(pid, stats[pid].start_time))
        pending.extend(children.get(pid, []))
    return found


def session_members(session_id: int) -> list[int]:
    """Living processes of this session (a process started with start_new_session leads one,
    and what it starts stays in it even once orphaned)."""
    members = []
    for pid in _all_pids():
        stat = _stat_fields(pid)
        if stat is not None and stat.state != "Z" and stat.session_id == session_id:
            members.append(pid)
    return members


def command_line(pid: int) -> str:
    """/proc/<pid>/cmdline with spaces for its NULs ("?" once the process is gone). Ray's
    processes and redis-server rewrite theirs (`ray::DashboardAgent`, `redis-server 127.0.0.1:6379`)."""
    try:
        return (_PROC / str(pid) / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()
    except OSError:
        return "?"


def redis_servers_in(directory: Path, binary: str | None = None) -> list[ProcessId]:
    """redis-server processes whose working directory is `directory`: the embedded Redis runs
    with its state directory as cwd and `dir`, so this finds one however it was started. A
    process counts when its executable is named redis-server or is `binary` (some packages
    install redis-server as a link to a binary of another name)."""
    target = directory.resolve()
    wanted = {Path(binary).resolve()} if binary is not None else set()
    found = []
    for pid in _all_pids():
        proc = _PROC / str(pid)
        try:
            executable = Path(os.readlink(proc / "exe").removesuffix(" (deleted)"))  # a replaced binary
            cwd = Path(os.readlink(proc / "cwd"))
        except OSError:  # gone, or another user's
            continue
        if cwd != target or not (executable.name == "redis-server" or executable in wanted):
            continue
        identity = process_id(pid)
        if identity is not None:
            found.append(identity)
    return found


def stop_processes(processes: Iterable[ProcessId], grace_s: float = 5.0) -> list[ProcessId]:
    """SIGTERM each process still alive, SIGKILL those left after grace_s; returns the ones it
    signalled. They need not be our children: an orphan is reaped by whoever adopted it."""
    signalled = [p for p in processes if p.alive()]
    for process in signalled:
        _signal(process.pid, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    while any(p.alive() for p in signalled) and time.monotonic() < deadline:
        time.sleep(_POLL_SECONDS)
    for process in signalled:
        if process.alive():
            _signal(process.pid, signal.SIGKILL)
    deadline = time.monotonic() + grace_s
    while any(p.alive() for p in signalled) and time.monotonic() < deadline:
        time.sleep(_POLL_SECONDS)
    return signalled


def _signal(pid: int, sig: signal.Signals) -> None:
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        pass
