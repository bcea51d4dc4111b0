"""README.md's commands, run the way a person types them: from the repository root, with
the default flags, the default port and state directory and the default model.

`make serve` runs in a session of its own and is stopped as Ctrl-C stops it: SIGINT to its
whole process group. After that nothing it started may be left (no process of its session,
no redis-server on its state directory, no listener on its ports), and the next start in the
same place (the "More than one router" section's `kvserve up --routers 2`, with the same
default state directory) must find the same state (the first run's request is still there).

Where a default port is taken on this machine (a developer's own `make serve`, say) the
cluster tests skip, printing why; under CI=true they fail instead (a fresh machine: a taken
port is something the suite left running). `test_every_command_in_the_docs_is_run_or_said_why_not`
keeps the list below in step with the documents: a new command in a ```bash block fails it
until it is run by a test or named as one that cannot run here.
"""

from __future__ import annotations

import csv
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Iterator, Sequence
from pathlib import Path

import grpc
import pytest

from cluster.local import default_state_dir
from cluster.processes import command_line, redis_servers_in, session_members
from protos.kvserve.v1 import serving_pb2 as pb
from protos.kvserve.v1 import serving_pb2_grpc as pb_grpc
from tests.cluster_harness import greedy_request, read_deltas, read_rest
from tests.readme_commands import ROOT, all_commands, commands, port_taken, skip_unless_free

DEFAULT_PORTS = (50051, 9400)  # the router, its metrics
SECOND_ROUTER_PORTS = (50052, 9401)  # `kvserve up --routers 2`'s second router, its metrics
LOCUST_UI_PORT = 8089
START_TIMEOUT_S = 300.0
DRAIN_GRACE_S = 30.0  # kvserve up's default --drain-grace
STOP_SLACK_S = 20.0
HERE = "tests/test_readme_commands.py::"

# Every command in README.md's and docs/deploy.md's ```bash blocks, and what runs it.
RUN_BY: dict[str, str] = {
    "make serve": HERE + "test_the_quickstart_as_typed",
    "make test": ".ci/run (CI runs exactly this on every submission)",
    '.venv/bin/kvserve generate "What is the capital of France?"': HERE + "test_the_quickstart_as_typed",
    ".venv/bin/kvserve status": HERE + "test_the_quickstart_as_typed",
    ".venv/bin/locust -f loadtest/locustfile.py --host localhost:50051": HERE + "test_the_quickstart_as_typed",
    ".venv/bin/locust -f loadtest/locustfile.py --host localhost:50051 --headless -u 4 -r 4 -t 10s "
    "--csv results/locust/run --html results/locust/run.html": HERE + "test_the_quickstart_as_typed",
    ".venv/bin/locust -f loadtest/locustfile.py --host localhost:50051 --headless -u 2 -r 2 -t 10s "
    "--load-shape poisson --arrival-rate 1 -s 60": HERE + "test_the_quickstart_as_typed",
    ".venv/bin/kvserve up --tls-cert cert.pem --tls-key key.pem --auth-token-file token --max-streams-per-client 8 "
    "--max-message-bytes 1MiB --max-prompt-tokens 4096 --max-tokens-limit 1024": HERE + "test_the_secured_quickstart",
    ".venv/bin/kvserve status --tls-ca cert.pem --auth-token-file token": HERE + "test_the_secured_quickstart",
    'grpcurl -cacert cert.pem -H "authorization: Bearer $(cat token)" localhost:50051 '
    "kvserve.v1.KVServe/ClusterStatus": "not run: grpcurl is not packaged for this machine's registries; "
    + HERE + "test_the_secured_quickstart makes the same call over gRPC with the same certificate and token",
    ".venv/bin/kvserve up --routers 2": HERE + "test_the_quickstart_as_typed",
    '.venv/bin/kvserve generate --address localhost:50052 "What is the capital of France?"':
        HERE + "test_the_quickstart_as_typed",
    "make venv": HERE + "test_the_offline_quickstart",
    '.venv/bin/kvserve offline --chat --prompt "What is the capital of France?" --max-tokens 32 --temperature 0':
        HERE + "test_the_offline_quickstart",
    ".venv/bin/kvserve offline --model tiny --prompt-ids 1,2,3 --prompt-ids 72,105 --max-tokens 8 --json":
        HERE + "test_the_offline_quickstart",
    ".venv/bin/kvserve offline --model /path/to/hf-checkpoint --requests requests.jsonl --json "
    "--kv-cache-memory 512MiB --block-size 16": HERE + "test_the_offline_quickstart (with a tiny checkpoint's path)",
    "make bench-engine": "benchmark, run by hand: docs/benchmarks/",
    "make bench-decode": "benchmark, run by hand: docs/benchmarks/bench_decode/",
    "make bench-prefix": "benchmark, run by hand: docs/benchmarks/bench_prefix/",
    "make bench-router": "benchmark, run by hand: docs/benchmarks/",
    ".venv/bin/python -m loadtest.bench_router --model smollm2-135m-instruct --warmup-s 10 --window-s 20 "
    "--out results/bench_router_real": "benchmark, run by hand: docs/benchmarks/bench_router/2026-12-04-smollm2/",
    "make bench-burst": "benchmark, run by hand: docs/benchmarks/bench_burst/",
    "make bench-policies": "benchmark, run by hand: docs/benchmarks/ (tests/test_bench_policies.py runs it small)",
    "make sim": "benchmark, run by hand: docs/benchmarks/ (tests/test_simulator.py runs the simulator small)",
    ".venv/bin/python -m loadtest.sim.run --workers 16,64,256,1000 --policies kv,round-robin --unequal --workload mixed":
        "benchmark, run by hand: docs/benchmarks/",
    "make gpu-check": "needs a CUDA GPU (none on this machine)",
    "(umask 077; printf '%s\\n' KVSERVE_NUM_GPUS=2 KVSERVE_MODEL=/home/ubuntu/models/Llama-3.2-1B > deploy/ray/kvserve.env)":
        "tests/test_deploy.py::test_the_head_reads_its_settings_from_the_env_file_docs_deploy_md_writes",
    ".venv/bin/python -m loadtest.gpu_check --device cpu --smoke": "tests/test_cuda_path.py::test_gpu_check_smoke_on_cpu",
}
CLOUD_ONLY = ("gcloud ", "ray up ", "ray exec ", "ray attach ", "docker ", "kubectl ", "sed -i ", "export ")
FROM_A_LAPTOP = {  # need a cluster deployed by the commands above
    'kvserve generate "What is the capital of France?" --address localhost:50051 --auth-token-file kvserve-token',
    "kvserve status --address localhost:50051 --auth-token-file kvserve-token",
    "locust -f loadtest/locustfile.py --host localhost:50051 --auth-token-file kvserve-token",
}


def test_every_command_in_the_docs_is_run_or_said_why_not() -> None:
    texts = {c.text for c in all_commands()}
    local = {t for t in texts if not t.startswith(CLOUD_ONLY) and t not in FROM_A_LAPTOP}
    assert local == set(RUN_BY), (
        f"run by nothing listed: {sorted(local - set(RUN_BY))}; listed but not in the docs: {sorted(set(RUN_BY) - local)}"
    )
    for where in RUN_BY.values():
        for path, name in re.findall(r"(tests/\w+\.py)::(\w+)", where):
            assert re.search(rf"^def {name}\(", (ROOT / path).read_text(), re.M), f"{path}::{name} does not exist"
    assert "make test" in (ROOT / ".ci" / "run").read_text()


def test_a_taken_port_skips_here_and_fails_under_ci(monkeypatch: pytest.MonkeyPatch) -> None:
    import socket

    from tests import readme_commands

    monkeypatch.setattr(readme_commands, "FREE_WAIT_S", 0.5)
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen()
        port = server.getsockname()[1]
        monkeypatch.delenv("CI", raising=False)
        with pytest.raises(pytest.skip.Exception, match=rf"\[{port}\] are taken on this machine; the test's"):
            skip_unless_free([port], "the test's")
        monkeypatch.setenv("CI", "true")
        with pytest.raises(pytest.fail.Exception, match="CI=true: something the suite started still holds them"):
            skip_unless_free([port], "the test's")
    skip_unless_free([port], "the test's")  # free again: neither


def test_a_port_taken_for_a_moment_counts_as_free(monkeypatch: pytest.MonkeyPatch) -> None:
    """The README's ports are in Linux's ephemeral range: a connection of a test running
    beside this one may hold one for a moment (a CI run failed so on 50052). Under CI a
    port held for 1 s of a 20 s wait is free; one held for the whole wait is not."""
    import socket

    from tests import readme_commands

    monkeypatch.setenv("CI", "true")
    monkeypatch.setattr(readme_commands, "FREE_WAIT_S", 20.0)
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen()
    port = server.getsockname()[1]
    assert port_taken(port)
    closer = threading.Timer(1.0, server.close)
    closer.start()
    began = time.monotonic()
    skip_unless_free([port], "the test's")  # returns once it is free: no fail
    assert 0.5 < time.monotonic() - began < 20.0
    closer.join()
    monkeypatch.setattr(readme_commands, "FREE_WAIT_S", 0.5)
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        with pytest.raises(pytest.fail.Exception, match="CI=true"):
            skip_unless_free([held.getsockname()[1]], "the test's")


def _environment() -> dict[str, str]:
    env = dict(os.environ)
    for name in ("KVSERVE_AUTH_TOKEN", "RAY_ADDRESS", "VIRTUAL_ENV"):
        env.pop(name, None)
    return env


def _skip_if_taken(ports: Sequence[int]) -> None:
    skip_unless_free(ports, "the README's commands need them")


class Typed:
    """A command typed at a shell prompt and left running, in a session of its own."""

    def __init__(self, command: str, cwd: Path) -> None:
        self.command = command
        self.proc = subprocess.Popen(
            ["bash", "-c", command], cwd=cwd, env=_environment(), stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True,
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

    def wait_for(self, text: str, timeout_s: float = START_TIMEOUT_S) -> None:
        deadline = time.monotonic() + timeout_s
        while text not in self.output():
            if self.proc.poll() is not None:
                time.sleep(0.5)  # the reader's last lines
                raise AssertionError(f"{self.command!r} exited ({self.proc.returncode}) before {text!r}:\n{self.output()}")
            assert time.monotonic() < deadline, f"{self.command!r}: no {text!r} in {timeout_s} s:\n{self.output()}"
            time.sleep(0.2)

    def ctrl_c(self, within_s: float) -> float:
        """SIGINT to the process group, as a terminal's Ctrl-C; seconds until the command exited."""
        start = time.monotonic()
        os.killpg(self.proc.pid, signal.SIGINT)
        try:
            self.proc.wait(timeout=within_s)
        except subprocess.TimeoutExpired:
            self.kill()
            raise AssertionError(f"{self.command!r} still running {within_s} s after Ctrl-C:\n{self.output()}") from None
        self._reader.join(timeout=10)
        return time.monotonic() - start

    def ctrl_c_twice(self, apart_s: float, within_s: float) -> None:
        """Ctrl-C, and Ctrl-C again apart_s later: the second ends the drain."""
        os.killpg(self.proc.pid, signal.SIGINT)
        time.sleep(apart_s)
        self.ctrl_c(within_s)

    def stop(self, grace_s: float = 15.0) -> None:
        """SIGTERM to the process group, SIGKILL to what is left after grace_s."""
        try:
            os.killpg(self.proc.pid, signal.SIGTERM)
            self.proc.wait(timeout=grace_s)
        except (ProcessLookupError, subprocess.TimeoutExpired):
            pass
        if self.proc.poll() is None:
            self.kill()

    def kill(self) -> None:
        for pid in [self.proc.pid, *session_members(self.proc.pid)]:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        self.proc.wait(timeout=30)


def _typed(command: str, cwd: Path = ROOT, timeout_s: float = 300.0) -> subprocess.CompletedProcess[str]:
    result = subprocess.run(["bash", "-c", command], cwd=cwd, env=_environment(), stdin=subprocess.DEVNULL,
                            capture_output=True, text=True, timeout=timeout_s)
    assert result.returncode == 0, f"{command!r} failed ({result.returncode}):\n{result.stdout}\n{result.stderr}"
    return result


def _assert_stopped_clean(serve: Typed, state_dir: Path, stopped: bool = False) -> None:
    """Ctrl-C (unless it has stopped already), and nothing of it is left."""
    seconds = 0.0 if stopped else serve.ctrl_c(within_s=DRAIN_GRACE_S + STOP_SLACK_S)
    output = serve.output()
    assert "Traceback" not in output, output
    assert "[kvserve] stopped" in output, output
    time.sleep(1.0)  # children reparented at exit finish theirs
    left = session_members(serve.proc.pid)
    assert not left, f"left running after Ctrl-C: {[(pid, _cmdline(pid)) for pid in left]}"
    # Found by working directory: redis-server rewrites its command line to "redis-server host:port".
    assert not redis_servers_in(state_dir / "redis"), f"a redis-server still runs on {state_dir / 'redis'}"
    assert not [port for port in DEFAULT_PORTS if port_taken(port)], "a default port is still held"
    print(f"stopped {seconds:.1f} s after Ctrl-C", file=sys.stderr)


def _cmdline(pid: int) -> str:
    try:
        return (Path("/proc") / str(pid) / "cmdline").read_bytes().replace(b"\0", b" ").decode()
    except OSError:
        return "?"


@pytest.fixture
def serving_quickstart() -> Iterator[list[str]]:
    _skip_if_taken([*DEFAULT_PORTS, *SECOND_ROUTER_PORTS, LOCUST_UI_PORT])  # all before anything runs
    yield [c.text for c in commands(ROOT / "README.md") if c.section == "Quickstart: a cluster"]


def test_the_quickstart_as_typed(serving_quickstart: list[str]) -> None:
    first, *client_commands = serving_quickstart
    assert first == "make serve", serving_quickstart
    state_dir = default_state_dir()
    serve = Typed(first, ROOT)
    try:
        serve.wait_for("router listening on")
        assert f"data in {state_dir / 'redis'}" in serve.output(), serve.output()
        request_id = ""
        for command in client_commands:
            result = _typed(command)
            if " generate " in command:
                assert "Paris" in result.stdout, result.stdout + result.stderr
                found = re.search(r"^\[(\S+) on (w\d+)", result.stderr, re.M)
                assert found, result.stderr
                request_id = found.group(1)
            if command.endswith(" status"):
                assert "2 alive" in result.stdout, result.stdout
        _run_the_locust_block()
        _assert_stopped_clean(serve, state_dir)
    finally:
        if serve.proc.poll() is None:
            serve.kill()
    # Started again in the same place (one start less in the suite than a second `make serve`).
    _more_than_one_router_as_typed(first_run_request=request_id)


def _run_the_locust_block() -> None:
    block = [c.text for c in commands(ROOT / "README.md") if c.section == "Load testing with Locust"]
    assert block[0] == "make serve"  # the cluster already serving
    ui_command, *headless = block[1:]
    ui = Typed(ui_command, ROOT)
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                with urllib.request.urlopen(f"http://localhost:{LOCUST_UI_PORT}/", timeout=5) as page:
                    assert page.status == 200 and b"Locust" in page.read()
                    break
            except OSError:
                assert time.monotonic() < deadline, ui.output()
                time.sleep(0.5)
    finally:
        # The UI is only checked for serving; how fast Locust's web runner quits is not ours.
        ui.stop()
    for command in headless:
        _typed(command, timeout_s=180)
        if "--csv results/locust/run" in command:
            with open(ROOT / "results" / "locust" / "run_stats.csv", newline="") as f:
                rows = {row["Name"]: row for row in csv.DictReader(f)}
            assert int(rows["E2E"]["Request Count"]) > 0 and int(rows["E2E"]["Failure Count"]) == 0, rows


def _router_pid(serve: Typed, port: int) -> int:
    """The `kvserve router` process `kvserve up` started on port."""
    for pid in session_members(serve.proc.pid):
        argv = command_line(pid).split()
        if "router" in argv and "--port" in argv and argv[argv.index("--port") + 1] == str(port):
            return pid
    raise AssertionError(f"no router process on port {port} among {session_members(serve.proc.pid)}")


def _more_than_one_router_as_typed(first_run_request: str) -> None:
    """`kvserve up --routers 2` where `make serve` ran: the first run's request is found again
    (the same Redis data, the same default state directory); a second router process on 50052
    (metrics 9401) over the same workers and Redis; a request through it, answered by the
    first; when it is SIGKILLed, `kvserve up` starts it again on 50052 and the command
    through it works again; Ctrl-C stops both."""
    second_ports = SECOND_ROUTER_PORTS
    up, generate = [c.text for c in commands(ROOT / "README.md") if c.section == "More than one router"]
    state_dir = default_state_dir()
    serve = Typed(up, ROOT)
    try:
        serve.wait_for("routers listening on")
        assert "[kvserve router 2] router listening on 127.0.0.1:50052" in serve.output(), serve.output()
        with grpc.insecure_channel("localhost:50051") as channel:
            info = pb_grpc.KVServeStub(channel).GetRequest(pb.GetRequestRequest(request_id=first_run_request),
                                                           timeout=30)
        assert info.status == pb.REQUEST_STATUS_FINISHED, info  # the first run's Redis data, found again
        _typed(".venv/bin/kvserve status")
        result = _typed(generate)
        assert "Paris" in result.stdout, result.stdout + result.stderr
        found = re.search(r"^\[(\S+) on (w\d+)", result.stderr, re.M)
        assert found, result.stderr
        with grpc.insecure_channel("localhost:50051") as channel:
            info = pb_grpc.KVServeStub(channel).GetRequest(pb.GetRequestRequest(request_id=found.group(1)), timeout=30)
        assert info.status == pb.REQUEST_STATUS_FINISHED and "Paris" in info.output_text, info

        second = _router_pid(serve, second_ports[0])
        os.kill(second, signal.SIGKILL)
        serve.wait_for(f"router 2 (pid {second}) killed by SIGKILL; started it again", timeout_s=120)
        assert _router_pid(serve, second_ports[0]) != second
        again = _typed(generate)
        assert "Paris" in again.stdout, again.stdout + again.stderr

        # A second Ctrl-C ends the drain: what still runs, on either router, is cancelled and
        # its client told why (the first alone would wait out the 30 s grace).
        channels = [grpc.insecure_channel(f"localhost:{port}") for port in (50051, second_ports[0])]
        try:
            calls = [pb_grpc.KVServeStub(c).Generate(greedy_request(list(range(100, 120)), 400), timeout=120)
                     for c in channels]
            heads = [read_deltas(call, 1) for call in calls]
            serve.ctrl_c_twice(apart_s=1.5, within_s=STOP_SLACK_S)
            ends = [read_rest(started, deltas, call) for (started, deltas), call in zip(heads, calls)]
        finally:
            for channel in channels:
                channel.close()
        reason = "the router stopped: a second stop signal cut its drain short"
        assert [(end.finished.finish_reason, end.finished.error) for end in ends] == \
            [(pb.FINISH_REASON_CANCELLED, reason)] * 2, ends
        assert all(len(end.token_ids) < 400 for end in ends)
        assert "stopping now: in-flight requests are cancelled" in serve.output(), serve.output()
        _assert_stopped_clean(serve, state_dir, stopped=True)
        assert not [port for port in second_ports if port_taken(port)], "the second router's port is still held"
    finally:
        if serve.proc.poll() is None:
            serve.kill()


def test_the_secured_quickstart(tmp_path: Path) -> None:
    """The Security section's commands, typed in a directory holding cert.pem, key.pem and token."""
    from tests.certificates import self_signed

    _skip_if_taken(DEFAULT_PORTS)
    self_signed(tmp_path)
    token = "readme-token-" + os.urandom(12).hex()
    (tmp_path / "token").write_text(token + "\n")
    (tmp_path / ".venv").symlink_to(ROOT / ".venv")
    block = [c.text for c in commands(ROOT / "README.md") if c.section == "Security"]
    up, status = block[0], block[1]
    serve = Typed(up, tmp_path)
    try:
        serve.wait_for("router listening on")
        result = _typed(status, cwd=tmp_path)
        assert "2 alive" in result.stdout, result.stdout
        # grpcurl's call, made with grpc: TLS with cert.pem as the CA, the token from the file.
        credentials = grpc.composite_channel_credentials(
            grpc.ssl_channel_credentials((tmp_path / "cert.pem").read_bytes()),
            grpc.access_token_call_credentials(token),
        )
        with grpc.secure_channel("localhost:50051", credentials) as channel:
            reply = pb_grpc.KVServeStub(channel).ClusterStatus(pb.ClusterStatusRequest(), timeout=30)
        assert reply.alive_workers == 2
        with grpc.secure_channel("localhost:50051", grpc.ssl_channel_credentials(
                (tmp_path / "cert.pem").read_bytes())) as channel:
            with pytest.raises(grpc.RpcError) as refused:
                pb_grpc.KVServeStub(channel).ClusterStatus(pb.ClusterStatusRequest(), timeout=30)
        assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED
        serve.ctrl_c(within_s=DRAIN_GRACE_S + STOP_SLACK_S)
        assert "[kvserve] stopped" in serve.output(), serve.output()
    finally:
        if serve.proc.poll() is None:
            serve.kill()


def test_the_offline_quickstart(tmp_path: Path) -> None:
    from tests.hf_checkpoints import make_checkpoint

    block = [c.text for c in commands(ROOT / "README.md") if c.section == "Quickstart: the engine in-process"]
    assert block[0] == "make venv"
    _typed(block[0])
    answer = _typed(block[1])
    assert "Paris" in answer.stdout, answer.stdout + answer.stderr
    ids = [json.loads(line) for line in _typed(block[2]).stdout.splitlines()]
    assert [len(r["output_ids"]) for r in ids] == [8, 8] and ids[0]["prompt_ids"] == [1, 2, 3]
    checkpoint = tmp_path / "hf-checkpoint"
    make_checkpoint(checkpoint, "gqa")
    (tmp_path / "requests.jsonl").write_text(
        json.dumps({"prompt_ids": [1, 2, 3], "max_tokens": 4, "temperature": 0}) + "\n"
    )
    (tmp_path / ".venv").symlink_to(ROOT / ".venv")
    result = _typed(block[3].replace("/path/to/hf-checkpoint", str(checkpoint)), cwd=tmp_path)
    (row,) = [json.loads(line) for line in result.stdout.splitlines()]
    assert len(row["output_ids"]) == 4 and row["finish_reason"] == "length"
