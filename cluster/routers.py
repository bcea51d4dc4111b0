"""The routers `kvserve up --routers N` starts beside its own: `kvserve router` processes
over the same workers and Redis, on the ports after its own.

Each is a child process (SIGTERM if this one dies, by setpriv's parent-death signal)
whose log lines are passed on with its number; it counts as started once it says it is
listening. Stopping sends SIGINT (each drains for its own --drain-grace) and waits;
what outlives that is killed.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Sequence

REDIS_URL_ENV = "KVSERVE_REDIS_URL"  # the Redis URL (with its password) reaches a router here, not in argv
_LISTENING = "router listening on "
_NOT_PASSED = ("port", "metrics_port")  # each router gets its own


def router_flags(parser: argparse.ArgumentParser, args: argparse.Namespace) -> list[str]:
    """The router flags of args that differ from their defaults, as a command line: what
    every router `kvserve up` starts gets too. parser has only add_router_arguments' flags."""
    flags: list[str] = []
    for action in parser._actions:  # argparse has no public list of a parser's options
        if not action.option_strings or action.dest in _NOT_PASSED or action.dest == "help":
            continue
        value = getattr(args, action.dest, action.default)
        if value == action.default:
            continue
        flags += [action.option_strings[0], _flag_value(value)]
    return flags


def _flag_value(value: object) -> str:
    return "off" if value is None else str(value)  # None: the one optional number, --metrics-port


class RouterProcesses:
    """`kvserve router` children, numbered from 2 (this process's router is 1)."""

    def __init__(self) -> None:
        self._processes: list[subprocess.Popen[str]] = []
        self.addresses: list[str] = []

    async def start(
        self, count: int, ray_address: str, redis_url: str, flags: Sequence[str], port: int,
        metrics_port: int | None, timeout_s: float = 300.0,
    ) -> None:
        """Start count routers on port+1, port+2, ... (metrics likewise), and wait for each
        to listen; raises RuntimeError naming the one that did not."""
        for index in range(1, count + 1):
            command = [sys.executable, "-m", "cluster.cli", "router", "--ray-address", ray_address, *flags,
                       "--port", str(port + index if port else 0),
                       "--metrics-port", "off" if metrics_port is None else str(metrics_port + index if metrics_port else 0)]
            setpriv = shutil.which("setpriv")
            if setpriv is not None:
                command = [setpriv, "--pdeathsig", "TERM", "--", *command]
            process = subprocess.Popen(
                command, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                env={**os.environ, REDIS_URL_ENV: redis_url},
            )
            self._processes.append(process)
            listening: asyncio.Future[str] = asyncio.get_running_loop().create_future()
            threading.Thread(target=_relay, args=(process, index + 1, listening, asyncio.get_running_loop()),
                             daemon=True, name=f"router-{index + 1}-log").start()
            done, _ = await asyncio.wait({listening}, timeout=timeout_s)
            if not done:
                raise RuntimeError(f"router {index + 1} did not start listening within {timeout_s:.0f} s")
            self.addresses.append(listening.result())

    @property
    def pids(self) -> list[int]:
        return [process.pid for process in self._processes]  # setpriv execs the router: its pid

    @property
    def started(self) -> bool:
        return bool(self._processes)

    def signal_stop(self) -> None:
        for process in self._processes:
            if process.poll() is None:
                process.send_signal(signal.SIGINT)  # SIGTERM would have Ray print a stack

    async def wait(self, timeout_s: float) -> None:
        """Wait for every router to exit, at most timeout_s; then kill what is left."""
        deadline = time.monotonic() + timeout_s
        for process in self._processes:
            left = max(0.0, deadline - time.monotonic())
            try:
                await asyncio.to_thread(process.wait, left)
            except subprocess.TimeoutExpired:
                process.kill()
                await asyncio.to_thread(process.wait)


def _relay(process: subprocess.Popen[str], number: int, listening: asyncio.Future[str],
           loop: asyncio.AbstractEventLoop) -> None:
    """Pass the router's log on, marked with its number; resolve listening with its address
    (or an error, if it exits first)."""
    assert process.stderr is not None
    for line in process.stderr:
        line = line.rstrip("\n")
        print(line.replace("[kvserve]", f"[kvserve router {number}]", 1), file=sys.stderr, flush=True)
        if _LISTENING in line:
            address = line.split(_LISTENING, 1)[1].split()[0]
            loop.call_soon_threadsafe(_resolve, listening, address, None)
    code = process.wait()
    loop.call_soon_threadsafe(_resolve, listening, "", RuntimeError(f"router {number} exited with code {code}"))


def _resolve(future: asyncio.Future[str], value: str, error: BaseException | None) -> None:
    if future.done():
        return
    if error is not None:
        future.set_exception(error)
    else:
        future.set_result(value)
