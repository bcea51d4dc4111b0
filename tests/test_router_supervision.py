"""`kvserve up --routers N` keeps its extra routers running (cluster/routers.py supervise()):
one that exits is started again on the port it listened on; one that keeps exiting stays
down after max_restarts within window_s, and the others are left alone; nothing is
started once stopping began. The routers here are stand-in processes that log what a
router logs; the real one, SIGKILLed and started again under `kvserve up --routers 2`, is
tests/test_readme_commands.py::test_the_quickstart_as_typed (its second start)."""

from __future__ import annotations

import asyncio
import os
import sys
import time
from pathlib import Path

from cluster.redis_supervisor import SupervisionConfig
from cluster.routers import RouterProcesses

# A router that listens on --port (when 0, a port of its own choosing: one more at each
# start), says so as a router does, appends its pid and port to a file, then lives for
# `lifetime` seconds and exits with 3 (or until SIGINT, which it takes as a clean stop).
STAND_IN = """
import os, signal, sys, time
argv = sys.argv
record = argv[argv.index("--record") + 1]
starts = len(open(record).readlines()) if os.path.exists(record) else 0
port = int(argv[argv.index("--port") + 1]) or 43200 + 10 * int(argv[argv.index("--number") + 1]) + starts
lifetime = float(argv[argv.index("--lifetime") + 1])
with open(record, "a") as f:
    f.write(f"{os.getpid()} {port}\\n")
signal.signal(signal.SIGINT, lambda *_: sys.exit(0))
print(f"[kvserve] router listening on 127.0.0.1:{port} (a stand-in)", file=sys.stderr, flush=True)
time.sleep(lifetime)
sys.exit(3)
"""


def _command(number: int, lifetime: float, record: Path) -> list[str]:
    return [sys.executable, "-c", STAND_IN, "--port", "0", "--number", str(number), "--lifetime", str(lifetime),
            "--record", str(record)]


def _records(path: Path) -> list[tuple[int, int]]:
    return [(int(pid), int(port)) for pid, port in (line.split() for line in path.read_text().splitlines())]


def test_a_router_that_exits_is_started_again_on_its_port_until_it_exits_too_often(tmp_path: Path) -> None:
    crashing, steady = tmp_path / "crashing", tmp_path / "steady"

    async def scenario() -> RouterProcesses:
        routers = RouterProcesses()
        await routers.start_commands([_command(2, 0.3, crashing), _command(3, 600, steady)], dict(os.environ), 30)
        assert routers.addresses == ["127.0.0.1:43220", "127.0.0.1:43230"]
        config = SupervisionConfig(max_restarts=3, window_s=60, poll_interval_s=0.05)
        supervising = asyncio.create_task(routers.supervise(config, start_timeout_s=30))
        deadline = time.monotonic() + 60
        while 2 not in routers.given_up:
            assert time.monotonic() < deadline, f"router 2 never given up: {_records(crashing)}"
            await asyncio.sleep(0.05)
        await asyncio.sleep(0.5)  # more polls: nothing more is started
        assert not supervising.done()
        routers.signal_stop()
        await asyncio.wait_for(supervising, 5)  # it ends once stopping began
        await routers.wait(10)
        return routers

    routers = asyncio.run(scenario())
    started = _records(crashing)
    # Its first start and three restarts, each on the port it listened on first; then no more.
    assert len(started) == 4 and routers.num_restarts == 3, started
    assert {port for _, port in started} == {43220} and len({pid for pid, _ in started}) == 4
    assert routers.given_up == {2}
    # The router that stayed up was left alone: one process, stopped by signal_stop's SIGINT.
    assert len(_records(steady)) == 1
    assert [p.returncode for p in routers._processes] == [3, 0]


def test_a_router_that_exits_while_stopping_is_not_started_again(tmp_path: Path) -> None:
    record = tmp_path / "record"

    async def scenario() -> RouterProcesses:
        routers = RouterProcesses()
        await routers.start_commands([_command(2, 0.5, record)], dict(os.environ), 30)
        supervising = asyncio.create_task(routers.supervise(SupervisionConfig(poll_interval_s=0.05)))
        routers.signal_stop()  # as `kvserve up` stops: before the router exits of itself
        await asyncio.sleep(1.5)  # it exits (code 3, or 0 from the SIGINT) meanwhile
        await asyncio.wait_for(supervising, 5)
        await routers.wait(10)
        return routers

    routers = asyncio.run(scenario())
    assert len(_records(record)) == 1 and routers.num_restarts == 0


# A parent that starts one stand-in router which ignores SIGTERM (as a draining router
# holds on), prints the router's pid, and waits to be killed.
PARENT = """
import asyncio, os, sys, time
from cluster.routers import RouterProcesses
async def main():
    routers = RouterProcesses()
    await routers.start_commands([sys.argv[1:]], dict(os.environ), 30)
    print(routers._processes[0].pid, flush=True)
    await asyncio.sleep(600)
asyncio.run(main())
"""

DEAF_STAND_IN = STAND_IN.replace("signal.signal(signal.SIGINT", "signal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
                                 "signal.signal(signal.SIGINT")


def test_the_routers_of_a_kvserve_up_that_is_sigkilled_die_with_it(tmp_path: Path) -> None:
    """A SIGKILLed `kvserve up --routers 2` left router 2 draining for 30-60 s on its port:
    the next start failed to bind it, and router 2's clients were told their requests were
    cancelled, which the next start then finished (found by a walkthrough). A router must
    die with its parent at once, however it takes SIGTERM."""
    import shutil
    import signal
    import subprocess

    if shutil.which("setpriv") is None:
        import pytest

        pytest.skip("setpriv (util-linux) sets the parent-death signal; not on this machine")
    stand_in = [sys.executable, "-c", DEAF_STAND_IN, "--port", "0", "--number", "2", "--lifetime", "600",
                "--record", str(tmp_path / "record")]
    parent = subprocess.Popen([sys.executable, "-c", PARENT, *stand_in], stdout=subprocess.PIPE, text=True,
                              cwd=Path(__file__).resolve().parent.parent)
    try:
        assert parent.stdout is not None
        router_pid = int(parent.stdout.readline())
        os.kill(router_pid, 0)  # it runs
        parent.send_signal(signal.SIGKILL)
        parent.wait(30)
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            try:
                os.kill(router_pid, 0)
            except ProcessLookupError:
                return
            time.sleep(0.05)
        os.kill(router_pid, signal.SIGKILL)
        raise AssertionError("the router outlived its SIGKILLed parent by 20 s")
    finally:
        parent.kill()


def test_a_router_start_that_is_cancelled_leaves_no_answer_unread() -> None:
    """Ctrl-C while `kvserve up --routers 2` starts its second router: the relay thread's
    later answer (the router exited before it listened) went into a future nobody waited
    for, and asyncio logged "Future exception was never retrieved" at exit (found by review)."""
    import gc

    async def scenario() -> list[dict[str, object]]:
        errors: list[dict[str, object]] = []
        asyncio.get_running_loop().set_exception_handler(lambda _loop, context: errors.append(context))
        routers = RouterProcesses()
        start = asyncio.create_task(routers.start_commands(
            [[sys.executable, "-c", "import time; time.sleep(0.5)", "--port", "0"]], dict(os.environ), 30))
        await asyncio.sleep(0.2)
        start.cancel()  # what kvserve up does on a stop signal while its routers start
        await asyncio.gather(start, return_exceptions=True)
        routers.signal_stop()
        await routers.wait(5)
        await asyncio.sleep(0.5)  # the process exits, and the relay answers
        gc.collect()
        await asyncio.sleep(0)
        return errors

    errors = asyncio.run(scenario())
    assert not errors, [error.get("message") for error in errors]
