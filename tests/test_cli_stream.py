"""`kvserve generate` and `kvserve stream` when the stream does not end well: cut off by
its router, interrupted with Ctrl-C, or read by a pipe that closes early. A walkthrough
found a cut-off stream printed only `UNAVAILABLE` (the CLI shows text, never the offset a
re-attach needs), and Ctrl-C and `| head` printed tracebacks. The CLI is run as a user
runs it, against a real gRPC server whose KVServe streams what each case needs."""

from __future__ import annotations

import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from concurrent import futures
from pathlib import Path

import grpc
import pytest

from protos.kvserve.v1 import serving_pb2 as pb
from protos.kvserve.v1 import serving_pb2_grpc as pb_grpc

ROOT = Path(__file__).resolve().parent.parent


class _Router(pb_grpc.KVServeServicer):
    """Streams `started`, then deltas of one token each from the asked offset: `cut` of them
    and then UNAVAILABLE, or without end (a slow request)."""

    def __init__(self, cut: int | None) -> None:
        self.cut = cut
        self.sent_started = threading.Event()
        self.generated: list[pb.GenerateRequest] = []

    def Generate(self, request: pb.GenerateRequest, context: grpc.ServicerContext) -> Iterator[pb.GenerateResponse]:  # noqa: N802
        self.generated.append(request)
        yield pb.GenerateResponse(started=pb.Started(request_id="g1", worker_id="w0", prompt_tokens=1))
        yield pb.GenerateResponse(delta=pb.TokenDelta(token_ids=[5], text="ok", offset=0))
        yield pb.GenerateResponse(finished=pb.Finished(finish_reason=pb.FINISH_REASON_LENGTH))

    def Stream(self, request: pb.StreamRequest, context: grpc.ServicerContext) -> Iterator[pb.GenerateResponse]:  # noqa: N802
        yield pb.GenerateResponse(started=pb.Started(request_id=request.request_id, worker_id="w0", prompt_tokens=3))
        self.sent_started.set()
        offset = request.from_offset
        while self.cut is None or offset < request.from_offset + self.cut:
            yield pb.GenerateResponse(delta=pb.TokenDelta(token_ids=[offset], text=f"t{offset} ", offset=offset))
            offset += 1
            if self.cut is None:
                time.sleep(0.001)
        context.abort(grpc.StatusCode.UNAVAILABLE, "the router is stopping")


def _serve(router: _Router) -> tuple[grpc.Server, str]:
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    pb_grpc.add_KVServeServicer_to_server(router, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    return server, f"127.0.0.1:{port}"


def _kvserve(*args: str, **popen: object) -> subprocess.Popen[str]:
    return subprocess.Popen([sys.executable, "-m", "cluster.cli", *args], cwd=ROOT, text=True,
                            stderr=subprocess.PIPE, **popen)  # type: ignore[call-overload]


def test_a_stream_cut_off_says_where_to_re_attach() -> None:
    server, address = _serve(_Router(cut=4))
    try:
        cli = _kvserve("stream", "req 1", "--from-offset", "3", "--address", address, stdout=subprocess.PIPE)
        out, err = cli.communicate(timeout=60)
    finally:
        server.stop(0)
    assert cli.returncode == 1, err
    assert out == "t3 t4 t5 t6 \n"
    lines = err.splitlines()
    assert lines[0] == "[req 1 on w0, 3 prompt tokens]"
    assert lines[1] == ("[cut off after offset 7: the request may go on; re-attach with "
                        "kvserve stream 'req 1' --from-offset 7]")
    assert lines[2] == "kvserve stream: UNAVAILABLE: the router is stopping"


def test_ctrl_c_and_a_pipe_that_closes_end_the_cli_without_a_traceback() -> None:
    router = _Router(cut=None)
    server, address = _serve(router)
    try:
        cli = _kvserve("stream", "r1", "--address", address, stdout=subprocess.DEVNULL)
        assert router.sent_started.wait(60)
        time.sleep(0.5)
        cli.send_signal(signal.SIGINT)
        _, err = cli.communicate(timeout=60)
        assert cli.returncode == 130, err
        assert "Traceback" not in err and err.rstrip().endswith("kvserve stream: interrupted"), err
        # `kvserve stream r1 | head -c 20`: head leaves after 20 bytes of an endless stream.
        piped = subprocess.run(
            f"{sys.executable} -m cluster.cli stream r1 --address {address} | head -c 20", shell=True, cwd=ROOT,
            capture_output=True, text=True, timeout=60,
        )
        assert piped.stdout == "t0 t1 t2 t3 t4 t5 t6"
        assert "Traceback" not in piped.stderr and "Error" not in piped.stderr, piped.stderr
    finally:
        server.stop(0)


def test_generate_sends_its_cache_salt_only_when_given(monkeypatch: pytest.MonkeyPatch) -> None:
    """From --cache-salt, else from $KVSERVE_CACHE_SALT (out of ps and the shell's history)."""
    router = _Router(cut=0)
    server, address = _serve(router)
    try:
        for salt, environment in ((["--cache-salt", "tenant-1"], "tenant-env"), ([], "tenant-2"), ([], None)):
            if environment is None:
                monkeypatch.delenv("KVSERVE_CACHE_SALT", raising=False)
            else:
                monkeypatch.setenv("KVSERVE_CACHE_SALT", environment)
            cli = _kvserve("generate", "hi", "--raw", *salt, "--address", address, stdout=subprocess.PIPE)
            out, err = cli.communicate(timeout=60)
            assert cli.returncode == 0 and out == "ok\n", err
    finally:
        server.stop(0)
    flag, environ, plain = router.generated
    assert flag.HasField("cache_salt") and flag.cache_salt == "tenant-1" and flag.text == "hi"
    assert environ.cache_salt == "tenant-2"
    assert not plain.HasField("cache_salt")


@pytest.fixture(autouse=True)
def _no_token(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("KVSERVE_AUTH_TOKEN", raising=False)
