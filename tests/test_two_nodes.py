"""Beyond one node: two Ray nodes on this machine, `kvserve up --ray-address` joining
them, a worker on each, and greedy requests through the one router reaching both. Then
the router process is SIGKILLed mid-stream (its embedded Redis with it) and started again:
the new one finds the detached workers by name, adopts the requests Redis lists as active,
and a client re-attaches with Stream(request_id, from_offset) for the rest, exactly once.

Every process here is a subprocess of the test with its own ports and temp dir, so it
neither sees nor disturbs the suite's in-process Ray; they are stopped by process group
in the finally block (never `ray stop`, which would stop every Ray on the machine).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc

from protos.kvserve.v1 import serving_pb2 as pb
from protos.kvserve.v1 import serving_pb2_grpc as pb_grpc

BIN = Path(sys.executable).parent
START_TIMEOUT_S = 240.0
PROMPT = [72, 101, 108, 108, 111, 32, 75, 86]
# Long enough to be still decoding when the router is killed at its 20th token (the tiny
# model makes ~750 tokens/s on one thread of this machine's cores; a wait of 1.2 s for the
# AOF's fsync, here before, left a faster machine under 2x of finishing before the kill).
SURVIVOR_TOKENS = 1500
MAX_TOKENS = 12


def _free_ports(count: int) -> list[int]:
    sockets = [socket.socket() for _ in range(count)]
    try:
        for s in sockets:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in sockets]
    finally:
        for s in sockets:
            s.close()


class Process:
    """A subprocess in its own process group whose output is collected by a thread."""

    def __init__(self, args: Sequence[str], env: dict[str, str]) -> None:
        self.args = list(args)
        self.proc = subprocess.Popen(
            self.args, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, start_new_session=True
        )
        self.lines: list[str] = []
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.append(line)

    def wait_for(self, text: str, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if any(text in line for line in self.lines):
                return
            if self.proc.poll() is not None:
                break
            time.sleep(0.2)
        raise AssertionError(f"{self.args[:3]} never printed {text!r}; its output:\n{self.output()}")

    def output(self) -> str:
        return "".join(self.lines[-80:])

    def stop(self, first: signal.Signals = signal.SIGTERM, grace_s: float = 20.0) -> None:
        """Signal the whole group (the command and what it spawned), then SIGKILL what is left."""
        try:
            os.killpg(self.proc.pid, first)
        except ProcessLookupError:
            return
        try:
            self.proc.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            pass
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.proc.wait(timeout=10)


def _ray_node(temp_dir: str, resource: str, head_port: int, head: bool, env: dict[str, str]) -> Process:
    node_manager, object_manager, metrics, agent, agent_grpc, runtime_env, client = _free_ports(7)
    # Worker ports between Ray's default range (10002-19999) and the kernel's ephemeral one.
    worker_base = 20000 + (os.getpid() % 50) * 200 + (0 if head else 100)
    args = [
        str(BIN / "ray"), "start", "--block", "--disable-usage-stats",
        "--num-cpus=2", f"--resources={json.dumps({resource: 4})}", f"--temp-dir={temp_dir}",
        "--object-store-memory=100000000",
        f"--node-manager-port={node_manager}", f"--object-manager-port={object_manager}",
        f"--metrics-export-port={metrics}", f"--dashboard-agent-listen-port={agent}",
        f"--dashboard-agent-grpc-port={agent_grpc}", f"--runtime-env-agent-port={runtime_env}",
        f"--min-worker-port={worker_base}", f"--max-worker-port={worker_base + 99}",
    ]
    if head:
        args += ["--head", f"--port={head_port}", f"--ray-client-server-port={client}", "--include-dashboard=false",
                 "--node-ip-address=127.0.0.1"]
    else:
        args += [f"--address=127.0.0.1:{head_port}", "--node-ip-address=127.0.0.1"]
    return Process(args, env)


def _generate(address: str, max_tokens: int = MAX_TOKENS) -> tuple[str, list[int], str]:
    sampling = pb.SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    request = pb.GenerateRequest(token_ids=pb.TokenIds(ids=PROMPT), sampling=sampling)
    worker, tokens, reason = "", [], ""
    with grpc.insecure_channel(address) as channel:
        for message in pb_grpc.KVServeStub(channel).Generate(request, timeout=120):
            kind = message.WhichOneof("event")
            if kind == "started":
                worker = message.started.worker_id
            elif kind == "delta":
                tokens.extend(message.delta.token_ids)
            elif kind == "finished":
                reason = pb.FinishReason.Name(message.finished.finish_reason)
    return worker, tokens, reason


def _up(head_port: int, router_port: int, state_dir: Path, env: dict[str, str]) -> Process:
    return Process([
        str(BIN / "kvserve"), "up", "--ray-address", f"127.0.0.1:{head_port}",
        "--workers", "2", "--worker-resources", "node_a,node_b", "--worker-cpus", "1",
        "--model", "tiny", "--kv-cache-memory", "16MiB", "--num-threads", "1",
        "--port", str(router_port), "--metrics-port", "off", "--state-dir", str(state_dir),
        "--drain-grace", "1",
    ], env)  # fmt: skip


def _stream_rest(address: str, request_id: str, from_offset: int) -> tuple[list[int], list[int], str]:
    """Offsets and token ids of a Stream from `from_offset`, and how it finished."""
    offsets, tokens, reason = [], [], ""
    with grpc.insecure_channel(address) as channel:
        request = pb.StreamRequest(request_id=request_id, from_offset=from_offset)
        for message in pb_grpc.KVServeStub(channel).Stream(request, timeout=120):
            kind = message.WhichOneof("event")
            if kind == "delta":
                offsets.append(message.delta.offset)
                tokens.extend(message.delta.token_ids)
            elif kind == "finished":
                reason = pb.FinishReason.Name(message.finished.finish_reason)
    return offsets, tokens, reason


def test_workers_on_two_ray_nodes_serve_through_one_router_that_survives_a_crash(tmp_path: Path) -> None:
    # Unix sockets live under the temp dir and their paths must stay short.
    temp_dir = tempfile.mkdtemp(prefix="kv2n", dir="/tmp")
    # RAY_AUTH_MODE explicit: a head finding ~/.ray/auth_token turns token auth on, and a
    # second node (or driver) without the mode set is then refused.
    env = {**os.environ, "RAY_USAGE_STATS_ENABLED": "0", "OMP_NUM_THREADS": "1", "RAY_AUTH_MODE": "disabled"}
    env.pop("RAY_ADDRESS", None)
    head_port, router_port = _free_ports(2)
    processes: list[Process] = []
    try:
        head = _ray_node(temp_dir, "node_a", head_port, head=True, env=env)
        processes.append(head)
        head.wait_for("Ray runtime started", START_TIMEOUT_S)
        second = _ray_node(temp_dir, "node_b", head_port, head=False, env=env)
        processes.append(second)
        second.wait_for("Ray runtime started", START_TIMEOUT_S)

        up = _up(head_port, router_port, tmp_path / "state", env)
        processes.insert(0, up)  # stopped first
        up.wait_for("router listening on", START_TIMEOUT_S)
        address = f"127.0.0.1:{router_port}"

        with grpc.insecure_channel(address) as channel:
            status = pb_grpc.KVServeStub(channel).ClusterStatus(pb.ClusterStatusRequest(), timeout=10)
        assert len(status.workers) == 2 and all(w.alive for w in status.workers), status
        node_ids = {w.node_id for w in status.workers}
        assert len(node_ids) == 2, f"both workers are on one node: {status}"

        with ThreadPoolExecutor(max_workers=6) as pool:
            results = list(pool.map(lambda _: _generate(address), range(6)))
        assert {reason for _, _, reason in results} == {"FINISH_REASON_LENGTH"}
        # Same preset, same seed on both nodes: greedy tokens agree whichever node served.
        assert all(tokens == results[0][1] and len(tokens) == MAX_TOKENS for _, tokens, _ in results)
        assert {worker for worker, _, _ in results} == {w.worker_id for w in status.workers}, results

        # The router process dies mid-stream (SIGKILL: no drain; its embedded Redis too).
        long_request = pb.GenerateRequest(
            request_id="survivor", token_ids=pb.TokenIds(ids=PROMPT),
            sampling=pb.SamplingParams(max_tokens=SURVIVOR_TOKENS, temperature=0.0, ignore_eos=True),
        )  # fmt: skip
        received: list[int] = []
        with grpc.insecure_channel(address) as channel:
            call = pb_grpc.KVServeStub(channel).Generate(long_request, timeout=120)
            for message in call:
                received.extend(message.delta.token_ids)
                if len(received) >= 20:
                    break
            # No wait for the AOF's fsync: the embedded Redis gets SIGTERM when `kvserve up`
            # dies (its parent-death signal), and its clean shutdown writes the whole AOF.
            up.stop(signal.SIGKILL)
        processes.remove(up)

        again = _up(head_port, router_port, tmp_path / "state", env)
        processes.insert(0, again)
        again.wait_for("router listening on", START_TIMEOUT_S)
        # The workers are detached: the new router found them running, and adopted the request.
        for worker in ("w0", "w1"):
            assert f"worker {worker} is still running from a previous router" in again.output(), again.output()
        assert "adopted 1 in-flight request" in again.output(), again.output()
        offsets, rest, reason = _stream_rest(address, "survivor", len(received))
        assert reason == "FINISH_REASON_LENGTH"
        assert offsets[0] == len(received) and len(received) + len(rest) == SURVIVOR_TOKENS
        whole = received + rest
        _, uninterrupted, _ = _generate(address, max_tokens=SURVIVOR_TOKENS)
        assert whole == uninterrupted
    finally:
        # SIGINT, as Ctrl-C, to each: `kvserve up` drains, and `ray start --block` stops its
        # processes at once (1.3 s here). On SIGTERM a Ray node drains for up to 30 s first,
        # and each sat out the 20 s grace before its SIGKILL: 40 s of this test's 58.
        for process in processes:
            process.stop(signal.SIGINT)
        shutil.rmtree(temp_dir, ignore_errors=True)
