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

    def __init__(self, cut: int | None, finished: pb.Finished | None = None) -> None:
        self.cut = cut
        self.finished = finished or pb.Finished(finish_reason=pb.FINISH_REASON_LENGTH)  # how a Generate ends
        self.sent_started = threading.Event()
        self.generated: list[pb.GenerateRequest] = []

    def Generate(self, request: pb.GenerateRequest, context: grpc.ServicerContext) -> Iterator[pb.GenerateResponse]:  # noqa: N802
        self.generated.append(request)
        yield pb.GenerateResponse(started=pb.Started(request_id="g1", worker_id="w0", prompt_tokens=1))
        yield pb.GenerateResponse(delta=pb.TokenDelta(token_ids=[5], text="ok", offset=0))
        yield pb.GenerateResponse(finished=self.finished)

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
    # With the flags that reach this router: as printed, the hint went to localhost:50051 (an
    # outside check pasted it there).
    assert lines[1] == ("[cut off after offset 7: the request may go on; re-attach with "
                        f"kvserve stream 'req 1' --from-offset 7 --address {address}]")
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


@pytest.mark.parametrize(("finished", "exit_status"), [
    (pb.Finished(finish_reason=pb.FINISH_REASON_STOP), 0),
    (pb.Finished(finish_reason=pb.FINISH_REASON_CANCELLED, error="the router stopped: it ran past the drain grace"), 1),
    (pb.Finished(finish_reason=pb.FINISH_REASON_ERROR, error="its worker died and no live worker took it over"), 1),
], ids=["stop", "cancelled", "error"])
def test_generate_exits_1_when_its_answer_was_cancelled_or_failed(finished: pb.Finished, exit_status: int) -> None:
    """An outside check found `generate` exit 0 on `[finish_reason=cancelled, 915 tokens]`:
    a script's `kvserve generate ... && next` took a cut-short answer for a whole one."""
    server, address = _serve(_Router(cut=0, finished=finished))
    try:
        cli = _kvserve("generate", "hi", "--raw", "--address", address, stdout=subprocess.PIPE)
        out, err = cli.communicate(timeout=60)
    finally:
        server.stop(0)
    assert (cli.returncode, out) == (exit_status, "ok\n"), err
    assert f"finish_reason={pb.FinishReason.Name(finished.finish_reason).removeprefix('FINISH_REASON_').lower()}" in err
    assert (finished.error in err) if finished.error else ("error:" not in err)


@pytest.mark.parametrize(("args", "said"), [
    (["generate", ""], "kvserve generate: prompt: must not be empty"),
    (["generate", "hi", "--address", "127.0.0.1:99999"], "--address: port 99999 of '127.0.0.1:99999' is not in 1-65535"),
    (["generate", "hi", "--max-tokens", "99999999999999999999"], "argument --max-tokens: 99999999999999999999 is out of range"),
    (["stream", "r1", "--from-offset", "-99999999999999999999"], "argument --from-offset: -99999999999999999999 is out of range"),
    (["generate", b"caf\xe9"], "kvserve generate: prompt: not valid UTF-8 text"),
    (["generate", "hi", "--system", b"\xff"], "kvserve generate: --system: not valid UTF-8 text"),
    (["get", b"r\xff"], "kvserve get: request_id: not valid UTF-8 text"),
], ids=["empty-prompt", "address-port", "max-tokens", "from-offset", "prompt-bytes", "system-bytes", "id-bytes"])
def test_a_bad_argument_is_refused_naming_it_before_anything_is_sent(args: list[str | bytes], said: str) -> None:
    """What an outside check typed and got: an empty prompt answered in chat mode (an unset
    shell variable), port 99999 became 34463, a huge --max-tokens said `Value out of range`,
    and a Latin-1 byte said `'utf-8' codec can't encode ...`, naming no argument."""
    router = _Router(cut=0)
    server, address = _serve(router)
    try:
        has_address = "--address" in args
        command = [sys.executable.encode(), b"-m", b"cluster.cli",
                   *(a if isinstance(a, bytes) else a.encode() for a in args),
                   *([] if has_address else [b"--address", address.encode()])]
        cli = subprocess.run(command, cwd=ROOT, capture_output=True, timeout=60)
    finally:
        server.stop(0)
    err = cli.stderr.decode(errors="replace")
    assert cli.returncode == 2, err
    assert said in err and "Traceback" not in err, err
    assert router.generated == []
