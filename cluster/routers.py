"""The routers `kvserve up --routers N` starts beside its own: `kvserve router` processes
over the same workers and Redis, on the ports after its own.

Each is a child process (SIGKILL if this one dies, by setpriv's parent-death signal)
whose log lines are passed on with its number; it counts as started once it says it is
listening. Stopping sends SIGINT (each drains for its own --drain-grace) and waits;
what outlives that is killed.

supervise() (what `kvserve up` runs) starts a router that exits while the cluster serves
again, on the port it listened on, as the embedded Redis is (cluster/redis_supervisor.py):
its requests were adopted by its peers once its lease lapsed, or are adopted by the new
process itself at its start (same port, same router id). More than `max_restarts` exits
within `window_s` of one router: it is not started again, and the others go on serving.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Sequence

from cluster.redis_supervisor import RestartBudget, SupervisionConfig, describe_exit

log = logging.getLogger("kvserve.cluster")

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


class RouterDidNotStart(RuntimeError):
    """A `kvserve router` child exited, or said nothing, before it listened."""


class RouterProcesses:
    """`kvserve router` children, numbered from 2 (this process's router is 1)."""

    def __init__(self) -> None:
        self._processes: list[subprocess.Popen[str]] = []
        self._commands: list[list[str]] = []  # each one's command line, its port as it listened
        self._env: dict[str, str] = {}
        self._stopping = False
        self.addresses: list[str] = []
        self.num_restarts = 0
        self.given_up: set[int] = set()  # numbers of the routers supervise() no longer restarts

    async def start(
        self, count: int, ray_address: str, redis_url: str, flags: Sequence[str], port: int,
        metrics_port: int | None, timeout_s: float = 300.0,
    ) -> None:
        """Start count routers on port+1, port+2, ... (metrics likewise), and wait for each
        to listen; raises RuntimeError naming the one that did not."""
        commands = []
        for index in range(1, count + 1):
            command = [sys.executable, "-m", "cluster.cli", "router", "--ray-address", ray_address, *flags,
                       "--port", str(port + index if port else 0),
                       "--metrics-port", "off" if metrics_port is None else str(metrics_port + index if metrics_port else 0)]
            commands.append(command)
        await self.start_commands(commands, {**os.environ, REDIS_URL_ENV: redis_url}, timeout_s)

    async def start_commands(self, commands: Sequence[list[str]], env: dict[str, str], timeout_s: float) -> None:
        """start() with its command lines made: each names its port after `--port`, and
        logs `router listening on HOST:PORT` once it does."""
        self._env = env
        for command in commands:
            self._commands.append(list(command))
            self._processes.append(self._spawn(self._commands[-1]))
            self.addresses.append(await self._listening(len(self._processes) - 1, timeout_s))

    def _spawn(self, command: list[str]) -> subprocess.Popen[str]:
        # SIGKILL if this process dies (setpriv sets the parent-death signal and execs the
        # router, same pid). Not SIGTERM: a router whose kvserve up was SIGKILLed has lost
        # that cluster's Ray and Redis, and its drain held the port for half a minute (the
        # next start could not bind it) while it told its clients their requests had been
        # cancelled; the next start adopts them, and its clients, cut off, re-attach there.
        setpriv = shutil.which("setpriv")
        if setpriv is not None:
            command = [setpriv, "--pdeathsig", "KILL", "--", *command]
        return subprocess.Popen(
            command, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
            env=self._env,
        )

    async def _listening(self, slot: int, timeout_s: float) -> str:
        """The address router slot + 2 listens on, once it says so; from then on its command
        line names that port, so that a restart listens there again."""
        loop = asyncio.get_running_loop()
        listening: asyncio.Future[str] = loop.create_future()
        threading.Thread(target=_relay, args=(self._processes[slot], slot + 2, listening, loop),
                         daemon=True, name=f"router-{slot + 2}-log").start()
        try:
            done, _ = await asyncio.wait({listening}, timeout=timeout_s)
        finally:
            # A start cancelled meanwhile (Ctrl-C while --routers N start): the relay's later
            # answer would be an exception nobody retrieves, logged as such at exit.
            listening.cancel()
        if not done:
            raise RouterDidNotStart(f"router {slot + 2} did not start listening within {timeout_s:.0f} s")
        address = listening.result()
        command = self._commands[slot]
        command[command.index("--port") + 1] = address.rpartition(":")[2]
        return address

    async def supervise(self, config: SupervisionConfig | None = None, start_timeout_s: float = 300.0) -> None:
        """Start each router that exits (a crash, the OOM killer, a kill from outside) again,
        on the port it listened on, until signal_stop(); one that exits more than
        max_restarts times within window_s stays down (given_up). Run as a task."""
        config = config or SupervisionConfig(poll_interval_s=0.5)
        budgets = [RestartBudget(config.max_restarts, config.window_s) for _ in self._processes]
        while not self._stopping:
            await asyncio.sleep(config.poll_interval_s)
            for slot, process in enumerate(self._processes):
                number = slot + 2
                code = process.poll()
                if self._stopping or code is None or number in self.given_up:
                    continue
                if not budgets[slot].record_crash(time.monotonic()):
                    self.given_up.add(number)
                    log.error("router %d (pid %d) %s: %d exits within %g s, so it is not started again; the other "
                              "routers go on serving", number, process.pid, describe_exit(code),
                              budgets[slot].num_recent, config.window_s)
                    continue
                exited_at = time.monotonic()
                self._processes[slot] = self._spawn(self._commands[slot])
                try:
                    self.addresses[slot] = await self._listening(slot, start_timeout_s)
                except RuntimeError as exc:
                    log.warning("router %d (pid %d) %s, and could not be started again: %s", number, process.pid,
                                describe_exit(code), exc)
                    continue  # its exit counts as one more at the next poll
                self.num_restarts += 1
                log.warning("router %d (pid %d) %s; started it again in %.1f s as pid %d on %s (restart %d; one "
                            "that exits more than %d times within %g s stays down)", number, process.pid,
                            describe_exit(code), time.monotonic() - exited_at, self._processes[slot].pid,
                            self.addresses[slot], self.num_restarts, config.max_restarts, config.window_s)

    @property
    def pids(self) -> list[int]:
        return [process.pid for process in self._processes]  # setpriv execs the router: its pid

    @property
    def started(self) -> bool:
        return bool(self._processes)

    def signal_stop(self) -> None:
        self._stopping = True  # supervise() starts nothing from now on
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
    loop.call_soon_threadsafe(_resolve, listening, "", RouterDidNotStart(
        f"router {number} exited with code {code} before it listened (its log above says why)"))


def _resolve(future: asyncio.Future[str], value: str, error: BaseException | None) -> None:
    if future.done():
        return
    if error is not None:
        future.set_exception(error)
    else:
        future.set_result(value)
