"""Clients that read slowly, or never: each one's pending output is coalesced and bounded.

A client's output that it has not taken yet is one growing delta (router/tracker.py's
Listener), not a queue of events; past `max_pending_tokens` its call ends
RESOURCE_EXHAUSTED naming the limit and the offset to re-attach from, and the request
runs on for a later Stream.

To make a client's HTTP/2 flow control stop the router's writes early, the slow clients
here open their channels with a 1 KiB stream window and no BDP probing (a client that
reads slowly over a slow link): the router then holds the rest itself.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from cluster.redis_server import EmbeddedRedis
from protos.kvserve.v1 import serving_pb2 as pb
from protos.kvserve.v1 import serving_pb2_grpc as pb_grpc
from router.tracker import Listener, PendingOutputOverflow, RequestTracker
from tests.cluster_harness import (
    ClusterHarness,
    ReferenceEngine,
    cluster_config,
    greedy_request,
    parse_stream,
    request_info,
    running_cluster,
    wait_for,
    wait_idle,
)
from workers.engine.plan import SampledToken, TokenEvent
from workers.engine.request import FinishReason
from workers.engine.sampling import SamplingParams

SLOW_CLIENT = [("grpc.http2.lookahead_bytes", 1024), ("grpc.http2.bdp_probe", 0)]
ROOT = Path(__file__).resolve().parent.parent


def _event(offset: int, ids: list[int], text: str = "", finish: FinishReason | None = None,
           logprobs: tuple[SampledToken, ...] = ()) -> TokenEvent:
    return TokenEvent("r", tuple(ids), text, offset, logprobs, finish_reason=finish)


# -- the coalescing buffer ------------------------------------------------------------------


def test_a_listener_merges_what_its_client_has_not_taken() -> None:
    async def scenario() -> None:
        listener = Listener("r", start_offset=3, max_pending_tokens=1000)
        waiting = asyncio.ensure_future(listener.get())
        await asyncio.sleep(0)
        assert not waiting.done(), "nothing pending: get() waits"
        listener.put(_event(3, [30], "a"))
        assert await waiting == _event(3, [30], "a")

        lp = tuple(SampledToken(t, -0.5 * t, ()) for t in (31, 32, 33))
        listener.put(_event(4, [31], "b", logprobs=lp[:1]))
        listener.put(_event(5, [32, 33], "cd", logprobs=lp[1:]))
        listener.put(_event(5, [32, 33], "cd", logprobs=lp[1:]))  # repeated: nothing new
        listener.put(_event(7, [], "!", FinishReason.LENGTH))  # text released at the end, and the finish
        assert listener.num_pending_tokens == 3
        merged = await listener.get()
        assert merged == TokenEvent("r", (31, 32, 33), "bcd!", 4, lp, finish_reason=FinishReason.LENGTH)
        assert listener.num_pending_tokens == 0

        # After a finish a new delta starts (an event of a later placement cannot join it).
        listener.put(_event(7, [34], "e"))
        assert await listener.get() == _event(7, [34], "e")
        # Many small texts become one string as they pile up; the text is the same.
        for i in range(300):
            listener.put(_event(8 + i, [i % 200], chr(97 + i % 26)))
        many = await listener.get()
        assert many.offset == 8 and many.token_ids == tuple(i % 200 for i in range(300))
        assert many.text == "".join(chr(97 + i % 26) for i in range(300))

    asyncio.run(scenario())


def test_with_a_stream_interval_a_listener_wakes_its_client_every_n_tokens() -> None:
    async def scenario() -> None:
        listener = Listener("r", start_offset=0, max_pending_tokens=1000, stream_interval=3)
        listener.put(_event(0, [1], "a"))
        assert await listener.get() == _event(0, [1], "a"), "the first delta goes at once"
        waiting = asyncio.ensure_future(listener.get())
        for offset in (1, 2):
            listener.put(_event(offset, [offset + 1]))
            await asyncio.sleep(0)
            assert not waiting.done(), f"{offset} of 3 tokens wait: the client is not woken"
        listener.put(_event(3, [4], "d"))
        assert await waiting == _event(1, [2, 3, 4], "d")
        listener.put(_event(4, [5]))
        listener.put(_event(5, [6], "!", FinishReason.LENGTH))  # the finish goes at once, short of 3
        assert await listener.get() == _event(4, [5, 6], "!", FinishReason.LENGTH)

    asyncio.run(scenario())
    with pytest.raises(ValueError, match="stream_interval"):
        Listener("r", 0, stream_interval=0)


def test_past_the_bound_a_listener_lets_go_and_says_so() -> None:
    async def scenario() -> None:
        listener = Listener("r", start_offset=0, max_pending_tokens=4)
        listener.put(_event(0, [1, 2, 3]))
        listener.put(_event(3, [4]))
        assert not listener.overflowed and listener.num_pending_tokens == 4  # at the bound: kept
        listener.put(_event(4, [5]))
        assert listener.overflowed
        listener.put(_event(5, [6], finish=FinishReason.LENGTH))  # ignored from now on
        with pytest.raises(PendingOutputOverflow, match="max_pending_tokens=4") as raised:
            await listener.get()
        assert raised.value.num_pending_tokens == 5
        with pytest.raises(PendingOutputOverflow):
            await listener.get()

    asyncio.run(scenario())
    with pytest.raises(ValueError, match="max_pending_tokens"):
        Listener("r", 0, max_pending_tokens=0)


def test_a_finished_request_subscribes_listeners_that_hold_its_finish() -> None:
    async def scenario() -> None:
        tracker = RequestTracker("r", (1, 2), SamplingParams(max_tokens=2), need_blocks=1)
        live = tracker.subscribe()
        tracker.publish(TokenEvent("r", (7,), "x", 0))
        tracker.publish(TokenEvent("r", (8,), "y", 1, finish_reason=FinishReason.LENGTH))
        assert await live.get() == TokenEvent("r", (7, 8), "xy", 0, finish_reason=FinishReason.LENGTH)
        late = tracker.subscribe()
        assert late not in tracker.listeners and late.start_offset == 2
        assert await asyncio.wait_for(late.get(), 1) == TokenEvent("r", (), "", 2, finish_reason=FinishReason.LENGTH)

    asyncio.run(scenario())


# -- through a cluster ----------------------------------------------------------------------

BOUND = 48


@pytest.fixture(scope="module")
def cluster(
    ray_session: None, redis_server: EmbeddedRedis, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[ClusterHarness]:
    with running_cluster(cluster_config(redis_server.url, tmp_path_factory.mktemp("slow"))) as harness:
        yield harness


@contextlib.contextmanager
def pending_bound(cluster: ClusterHarness, max_pending_tokens: int) -> Iterator[None]:
    """The service's max_pending_tokens (a constructor parameter) for one test."""
    service = cluster.cluster.server.service
    before = service.max_pending_tokens
    service.max_pending_tokens = max_pending_tokens
    try:
        yield
    finally:
        service.max_pending_tokens = before


def _read_until_error(call: Iterator[pb.GenerateResponse]) -> tuple[list[pb.GenerateResponse], grpc.RpcError]:
    messages: list[pb.GenerateResponse] = []
    try:
        for message in call:
            messages.append(message)
    except grpc.RpcError as error:
        return messages, error
    raise AssertionError(f"the call ended without an error after {len(messages)} messages")


def _output_tokens(cluster: ClusterHarness, request_id: str) -> int:
    try:
        return len(request_info(cluster.stub, request_id).output_token_ids)
    except grpc.RpcError as error:  # not created yet: the call has only just been sent
        assert error.code() == grpc.StatusCode.NOT_FOUND, error
        return 0


@pytest.mark.parametrize("attach", ["generate", "stream"])
def test_a_client_past_the_bound_is_told_to_reattach_and_its_request_runs_on(
    cluster: ClusterHarness, reference_engine: ReferenceEngine, attach: str
) -> None:
    prompt, max_tokens = list(range(50, 62)), 480
    expected = reference_engine.greedy([(prompt, max_tokens)])[0].output_ids
    request_id = f"behind-{attach}-{uuid.uuid4().hex[:8]}"
    with pending_bound(cluster, BOUND), grpc.insecure_channel(cluster.cluster.address, options=SLOW_CLIENT) as slow:
        stub = pb_grpc.KVServeStub(slow)
        if attach == "generate":
            call = stub.Generate(greedy_request(prompt, max_tokens, request_id), timeout=120)
        else:
            cluster.stub.Submit(greedy_request(prompt, max_tokens, request_id), timeout=10)
            call = stub.Stream(pb.StreamRequest(request_id=request_id), timeout=120)
        # The client does not read while the request gets well past its window and the bound.
        wait_for(lambda: _output_tokens(cluster, request_id), lambda n: n >= 200, timeout=60, what="200 tokens")
        messages, error = _read_until_error(call)
    received = [t for m in messages if m.WhichOneof("event") == "delta" for t in m.delta.token_ids]
    assert error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, error
    details = error.details() or ""
    assert f"max_pending_tokens={BOUND}" in details and f"from_offset={len(received)}" in details, details
    assert f"request_id={request_id!r}" in details
    assert 0 < len(received) < max_tokens and received == expected[: len(received)]
    # Not cancelled: it is still running (or has finished), and the rest comes from Stream.
    info = request_info(cluster.stub, request_id)
    assert info.status in (pb.REQUEST_STATUS_RUNNING, pb.REQUEST_STATUS_FINISHED), info.status
    rest = parse_stream(cluster.stub.Stream(
        pb.StreamRequest(request_id=request_id, from_offset=len(received)), timeout=120), len(received))
    assert received + rest.token_ids == expected
    assert rest.finished.finish_reason == pb.FINISH_REASON_LENGTH
    wait_idle(cluster.stub)


def test_a_client_that_reads_late_gets_everything_coalesced(
    cluster: ClusterHarness, reference_engine: ReferenceEngine
) -> None:
    prompt, max_tokens = list(range(70, 82)), 300
    expected = reference_engine.greedy([(prompt, max_tokens)])[0].output_ids
    request_id = f"late-{uuid.uuid4().hex[:8]}"
    with grpc.insecure_channel(cluster.cluster.address, options=SLOW_CLIENT) as slow:
        call = pb_grpc.KVServeStub(slow).Generate(greedy_request(prompt, max_tokens, request_id), timeout=120)
        wait_for(lambda: _output_tokens(cluster, request_id), lambda n: n == max_tokens,
                 timeout=60, what="the request to finish while its client does not read")
        result = parse_stream(call)
    assert result.token_ids == expected and result.finished.finish_reason == pb.FINISH_REASON_LENGTH
    # One token per step, but what piled up came merged: far fewer deltas than tokens.
    assert len(result.deltas) < max_tokens // 2, len(result.deltas)
    wait_idle(cluster.stub)


def test_a_router_with_a_stream_interval_sends_fewer_larger_deltas(
    cluster: ClusterHarness, reference_engine: ReferenceEngine
) -> None:
    """What `--stream-interval 4` sets, through gRPC: deltas of 4 tokens after the first
    (or fewer at the end), the same output."""
    prompt, max_tokens = list(range(40, 52)), 30
    expected = reference_engine.greedy([(prompt, max_tokens)])[0].output_ids
    assert cluster.cluster.server is not None
    service = cluster.cluster.server.service
    service.stream_interval = 4
    try:
        result = parse_stream(cluster.stub.Generate(greedy_request(prompt, max_tokens), timeout=120))
    finally:
        service.stream_interval = 1
    assert result.token_ids == expected and result.finished.finish_reason == pb.FINISH_REASON_LENGTH
    sizes = [len(delta.token_ids) for delta in result.deltas]
    assert sizes[0] >= 1 and all(size >= 4 for size in sizes[1:-1]) and sum(sizes) == max_tokens, sizes
    assert len(sizes) <= 1 + -(-(max_tokens - 1) // 4), sizes
    wait_idle(cluster.stub)


# -- the router's memory, from outside ------------------------------------------------------

NUM_STREAMS = 40
WARM_TOKENS = 300
LONG_TOKENS = 1000
START_TIMEOUT_S = 240.0


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port: int = probe.getsockname()[1]
        return port


def _rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise AssertionError(f"no VmRSS for {pid}")


class _Up:
    """`kvserve up` in a session of its own, its output collected by a thread."""

    def __init__(self, args: list[str], env: dict[str, str]) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "cluster.cli", "up", *args], cwd=ROOT, env=env, stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True,
        )  # fmt: skip
        self.lines: list[str] = []
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.append(line)

    def wait_for(self, text: str, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while not any(text in line for line in self.lines):
            assert self.proc.poll() is None, "kvserve up exited:\n" + "".join(self.lines[-40:])
            assert time.monotonic() < deadline, f"no {text!r} in {timeout_s:g} s:\n" + "".join(self.lines[-40:])
            time.sleep(0.2)

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGINT)  # drains (1 s), stops Ray and Redis
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(timeout=10)


def test_streams_that_never_read_leave_the_routers_rss_flat(tmp_path: Path) -> None:
    """A router of its own (kvserve up, two tiny workers). 40 fast readers warm it up; then
    40 streams of 1,000 tokens are opened and never read, so the router holds ~950 tokens of
    each. The router's RSS stays flat while they run to their end, and each stream, read at
    last, has every token. (With a queue of events per client, 600-token streams already
    grew it 9 MiB, 311 to 320, and each came back one delta per token.)"""
    port = _free_port()
    env = {**os.environ, "RAY_USAGE_STATS_ENABLED": "0", "OMP_NUM_THREADS": "1", "RAY_AUTH_MODE": "disabled"}
    for name in ("RAY_ADDRESS", "KVSERVE_AUTH_TOKEN"):
        env.pop(name, None)
    up = _Up([
        "--model", "tiny", "--workers", "2", "--kv-cache-memory", "256MiB", "--num-threads", "1",
        "--port", str(port), "--metrics-port", "off", "--state-dir", str(tmp_path / "state"),
        "--drain-grace", "1", "--max-queue-wait", "300",
    ], env)  # fmt: skip
    address = f"127.0.0.1:{port}"
    try:
        up.wait_for("router listening on", START_TIMEOUT_S)
        with grpc.insecure_channel(address) as channel:
            stub = pb_grpc.KVServeStub(channel)

            def fast(index: int, max_tokens: int) -> int:
                request = greedy_request([index % 200 + 1] * 8, max_tokens)
                return len(parse_stream(stub.Generate(request, timeout=300)).token_ids)

            from concurrent.futures import ThreadPoolExecutor

            with ThreadPoolExecutor(NUM_STREAMS) as pool:
                for _ in range(2):  # two rounds: the second finds the router's pools grown
                    assert list(pool.map(lambda i: fast(i, WARM_TOKENS), range(NUM_STREAMS))) == [WARM_TOKENS] * NUM_STREAMS
            baseline = _rss_mib(up.proc.pid)

            request_ids = [f"never-{i}-{uuid.uuid4().hex[:6]}" for i in range(NUM_STREAMS)]
            with grpc.insecure_channel(address, options=SLOW_CLIENT) as slow:
                slow_stub = pb_grpc.KVServeStub(slow)
                calls = [
                    slow_stub.Generate(greedy_request([i % 200 + 1] * 8, LONG_TOKENS, request_id), timeout=600)
                    for i, request_id in enumerate(request_ids)
                ]
                samples = [baseline]

                def all_finished() -> bool:
                    samples.append(_rss_mib(up.proc.pid))
                    for request_id in request_ids:
                        try:
                            info = stub.GetRequest(pb.GetRequestRequest(request_id=request_id), timeout=10)
                        except grpc.RpcError as error:  # its call is on its way
                            assert error.code() == grpc.StatusCode.NOT_FOUND, error
                            return False
                        if info.status != pb.REQUEST_STATUS_FINISHED:
                            return False
                    return True

                started = time.monotonic()
                wait_for(all_finished, bool, timeout=500, what="the never-read requests to finish")
                ran_s = time.monotonic() - started
                held = _rss_mib(up.proc.pid)
                results = [parse_stream(call) for call in calls]
        growth = max(samples) - baseline
        print(f"router RSS: {baseline:.0f} MiB after warm-up, at most {max(samples):.0f} MiB while {NUM_STREAMS} "
              f"streams of {LONG_TOKENS} tokens went unread ({ran_s:.0f} s), {held:.0f} MiB holding them all")
        assert all(len(r.token_ids) == LONG_TOKENS for r in results)
        assert all(r.finished.finish_reason == pb.FINISH_REASON_LENGTH for r in results)
        assert all(len(r.deltas) < LONG_TOKENS // 2 for r in results), "what piled up came merged"
        assert growth < 8, f"the router's RSS grew {growth:.1f} MiB over {baseline:.0f} MiB"
    finally:
        up.stop()
