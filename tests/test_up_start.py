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
from pathlib import Path

from cluster.processes import session_members
from cluster.redis_server import EmbeddedRedis

ROOT = Path(__file__).resolve().parent.parent


def _up_command(redis_server: EmbeddedRedis, state_dir: Path, *flags: str) -> list[str]:
    return [sys.executable, "-m", "cluster.cli", "up", "--redis-url", redis_server.url, "--port", "0",
            "--metrics-port", "off", "--state-dir", str(state_dir), *flags]


def _env() -> dict[str, str]:
    env = {**os.environ, "RAY_USAGE_STATS_ENABLED": "0", "RAY_AUTH_MODE": "disabled"}
    env.pop("RAY_ADDRESS", None)
    return env


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
    up = subprocess.Popen(_up_command(redis_server, tmp_path / "state", "--workers", "1"), cwd=ROOT, env=_env(),
                          stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                          start_new_session=True)
    lines: list[str] = []
    loading = threading.Event()

    def read() -> None:
        assert up.stdout is not None
        for line in up.stdout:
            lines.append(line)
            if "loading the model on" in line:
                loading.set()

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    try:
        assert loading.wait(120), "".join(lines)
        os.killpg(up.pid, signal.SIGINT)  # a terminal's Ctrl-C reaches the whole group
        signalled = time.monotonic()
        exit_status = up.wait(timeout=60)
        stopped_in = time.monotonic() - signalled
        reader.join(10)
        output = "".join(lines)
        said = [line.strip() for line in lines if line.startswith("[kvserve]")]
        assert exit_status == 0, output
        assert said[-2:] == ["[kvserve] stopping before it was ready: a stop signal came while it started",
                             "[kvserve] stopped"], output
        assert "router listening" not in output and "Traceback" not in output, output
        time.sleep(1.0)  # children reparented at exit finish theirs
        assert not session_members(up.pid), f"left running: {session_members(up.pid)}"
        print(f"stopped {stopped_in:.1f} s after Ctrl-C, while the model loaded", file=sys.stderr)
    finally:
        if up.poll() is None:
            os.killpg(up.pid, signal.SIGKILL)
            up.wait(10)
