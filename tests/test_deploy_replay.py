"""The `ray up` configs' own start commands, replayed on this machine as far as it goes
without a cloud: a Redis already on 6379 (as Debian's redis-server package leaves on an
Ubuntu image), then the head's start commands, then a GPU worker node's, then a client
that needs the token the head generated.

What cannot run here is changed, and only that:
- the commands run inside PID and mount namespaces of their own (`unshare`), so `ray stop`
  stops only their Ray (not the test session's) and /tmp/ray is theirs (a bind mount over
  it, so a checkout under /tmp stays visible); the worker node
  runs in a namespace nested in the head's, as another machine would;
- HOME is a fresh directory where ~/venv is this checkout's .venv and ~/kvserve this
  checkout (what setup_commands and file_mounts make on a real head);
- `--autoscaling-config=~/ray_bootstrap_config.yaml` is dropped (`ray up` writes that file);
- the worker node advertises one GPU (`--num-gpus=1`) and takes another object-manager port,
  since it shares this machine's network with the head; its workers still run on the CPU;
- the model is the `tiny` preset (KVSERVE_MODEL), one worker (KVSERVE_NUM_GPUS=1).
"""

from __future__ import annotations

import os
import shlex
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import grpc
import pytest
import yaml

from cluster.redis_server import find_redis_server
from protos.kvserve.v1 import serving_pb2 as pb
from protos.kvserve.v1 import serving_pb2_grpc as pb_grpc
from tests.readme_commands import port_taken, skip_unless_free

ROOT = Path(__file__).resolve().parent.parent
RAY_CONFIGS = sorted((ROOT / "deploy" / "ray").glob("*.yaml"))
# Ports the configs fix: the Debian Redis, Ray's GCS, the object managers, the router, metrics.
FIXED_PORTS = (6379, 6380, 8076, 8077, 50051, 9400)
START_TIMEOUT_S = 300.0
PORTS_RELEASE_S = 30.0


def _start_commands(path: Path) -> tuple[list[str], list[str]]:
    config = yaml.safe_load(path.read_text())
    return list(config["head_start_ray_commands"]), list(config["worker_start_ray_commands"])


def test_the_configs_start_the_same_way() -> None:
    """Both clouds' start commands are one text, so replaying one replays both."""
    assert len({repr(_start_commands(p)) for p in RAY_CONFIGS}) == 1, [p.name for p in RAY_CONFIGS]


def _replay_script(head: list[str], worker: list[str], home: Path) -> str:
    redis_server = find_redis_server()
    head_lines = [c.replace(" --autoscaling-config=~/ray_bootstrap_config.yaml", "") for c in head]
    worker_lines = [
        c.replace("--object-manager-port=8076", "--object-manager-port=8077 --num-gpus=1") for c in worker
    ]
    worker_script = "\n".join(_checked(c) for c in worker_lines) + "\nexec sleep infinity\n"
    return "\n".join([
        "set -e",
        # Ray keeps its sessions (and the address `ray start` leaves for `--address auto`)
        # under /tmp/ray: give these nodes their own, without hiding the rest of /tmp.
        f"mkdir -p {home}/ray /tmp/ray && mount --bind {home}/ray /tmp/ray",
        # What Debian's redis-server package starts on an Ubuntu image.
        f"{shlex.quote(redis_server)} --port 6379 --bind 127.0.0.1 --save '' --appendonly no --daemonize yes",
        *(_checked(c) for c in head_lines),
        "export RAY_HEAD_IP=127.0.0.1",
        f"unshare --pid --fork --mount-proc --kill-child bash -c {shlex.quote(worker_script)} &",
        "exec sleep infinity",
    ])  # fmt: skip


def _checked(command: str) -> str:
    """One config command as `ray up` runs it: a shell line of its own, judged by its exit code."""
    return f"( {command} ) || {{ echo {shlex.quote('failed: ' + command)}; exit 1; }}"


def _call(address: str, method: str, request: object, token: str | None) -> object:
    metadata = () if token is None else (("authorization", f"Bearer {token}"),)
    with grpc.insecure_channel(address) as channel:
        stub = pb_grpc.KVServeStub(channel)
        call = getattr(stub, method)
        if method == "Generate":
            return list(call(request, metadata=metadata, timeout=120))
        return call(request, metadata=metadata, timeout=30)


def test_the_head_and_worker_start_commands_bring_up_a_secured_cluster_beside_a_system_redis() -> None:
    if shutil.which("unshare") is None or os.geteuid() != 0:
        pytest.skip("needs root and util-linux's unshare for PID and mount namespaces")
    skip_unless_free(FIXED_PORTS, "the configs' start commands bind them")
    head, worker = _start_commands(RAY_CONFIGS[0])
    home = Path(tempfile.mkdtemp(prefix="kvserve-deploy-", dir="/var/tmp"))
    (home / "venv").symlink_to(ROOT / ".venv")
    (home / "kvserve").symlink_to(ROOT)
    env = {
        "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
        "HOME": str(home),
        "KVSERVE_NUM_GPUS": "1",
        "KVSERVE_MODEL": "tiny",
        "RAY_USAGE_STATS_ENABLED": "0",
        "OMP_NUM_THREADS": "1",
    }
    process = subprocess.Popen(
        ["unshare", "--pid", "--fork", "--mount-proc", "--mount", "--kill-child",
         "bash", "-c", _replay_script(head, worker, home)],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True,
    )  # fmt: skip
    log = home / "kvserve-up.log"
    try:
        deadline = time.monotonic() + START_TIMEOUT_S
        while "router listening on" not in (log.read_text() if log.exists() else ""):
            if process.poll() is not None:
                raise AssertionError(f"the start commands failed:\n{process.stdout.read() if process.stdout else ''}")
            assert time.monotonic() < deadline, f"no router within {START_TIMEOUT_S} s; its log:\n{log.read_text()}"
            time.sleep(0.5)

        token_file = home / "kvserve-token"
        assert stat.S_IMODE(token_file.stat().st_mode) == 0o600
        token = token_file.read_text().strip()
        assert len(token) >= 32

        address = "127.0.0.1:50051"
        with pytest.raises(grpc.RpcError) as refused:
            _call(address, "ClusterStatus", pb.ClusterStatusRequest(), token=None)
        assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED
        status = _call(address, "ClusterStatus", pb.ClusterStatusRequest(), token=token)
        assert [w.alive for w in status.workers] == [True], status  # type: ignore[attr-defined]
        request = pb.GenerateRequest(
            token_ids=pb.TokenIds(ids=[72, 105]), sampling=pb.SamplingParams(max_tokens=8, temperature=0.0)
        )
        events = _call(address, "Generate", request, token=token)
        assert events[-1].WhichOneof("event") == "finished"  # type: ignore[index]
        assert events[-1].finished.usage.completion_tokens >= 1  # type: ignore[index]
        # The image's own Redis on 6379 is untouched: kvserve's is elsewhere, with a password.
        assert "embedded redis-server on 127.0.0.1:6379 " not in log.read_text()
    finally:
        try:
            os.killpg(process.pid, signal.SIGKILL)  # unshare --kill-child: the namespaces go with it
        except ProcessLookupError:
            pass
        process.wait(timeout=30)
        shutil.rmtree(home, ignore_errors=True)
        # The namespaces' processes die after unshare does, and hold the ports until they have.
        # The README's tests bind the same ports next when one pytest-xdist process runs both files.
        killed = time.monotonic()
        deadline = killed + PORTS_RELEASE_S
        while (held := [port for port in FIXED_PORTS if port_taken(port)]) and time.monotonic() < deadline:
            time.sleep(0.2)
        print(f"the fixed ports were free {time.monotonic() - killed:.1f} s after the kill", file=sys.stderr)
    assert not held, f"the replayed cluster still holds ports {held} {PORTS_RELEASE_S:.0f} s after it was killed"
