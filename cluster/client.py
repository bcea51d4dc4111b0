"""`kvserve generate`, `submit`, `stream`, `cancel`, `get` and `status`: a terminal client
of a running router, one subcommand per RPC."""

from __future__ import annotations

import argparse
import os
import shlex
import sys
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any

import grpc

from protos.kvserve.v1 import serving_pb2 as pb
from protos.kvserve.v1 import serving_pb2_grpc as pb_grpc


TOKEN_ENV = "KVSERVE_AUTH_TOKEN"
CACHE_SALT_ENV = "KVSERVE_CACHE_SALT"  # a tenant's secret, like the token: not on the command line
DEFAULT_ADDRESS = "localhost:50051"


def load_auth_token(token_file: Path | None, environ: Mapping[str, str] | None = None) -> str | None:
    """The bearer token: the file's first line when a file is given, else $KVSERVE_AUTH_TOKEN,
    else None (no auth). Read when the command runs, never at import."""
    if token_file is not None:
        try:
            lines = token_file.read_text(encoding="utf-8").splitlines()
        except OSError as exc:
            raise ValueError(f"--auth-token-file: cannot read {token_file}: {exc.strerror}") from None
        token = lines[0].strip() if lines else ""
        if not token:
            raise ValueError(f"--auth-token-file: {token_file} is empty")
        return token
    token = (os.environ if environ is None else environ).get(TOKEN_ENV, "").strip()
    return token or None


def add_connection_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--address", default=DEFAULT_ADDRESS, help=f"the router (default: {DEFAULT_ADDRESS})")
    parser.add_argument("--tls-ca", type=Path, default=None,
                        help="connect with TLS, trusting this CA certificate (PEM); default: plaintext")
    parser.add_argument("--tls-server-name", default=None,
                        help="the name the server's certificate must carry, when it is not the --address host")
    parser.add_argument("--auth-token-file", type=Path, default=None,
                        help=f"send the bearer token in this file (default: ${TOKEN_ENV} if set)")


def open_channel(args: argparse.Namespace) -> grpc.Channel:
    """A channel to the router, TLS when --tls-ca is given."""
    _check_address(args.address)
    if args.tls_ca is None:
        return grpc.insecure_channel(args.address)
    try:
        root = args.tls_ca.read_bytes()
    except OSError as exc:
        raise ValueError(f"--tls-ca: cannot read {args.tls_ca}: {exc.strerror}") from None
    options = [] if args.tls_server_name is None else [("grpc.ssl_target_name_override", args.tls_server_name)]
    return grpc.secure_channel(args.address, grpc.ssl_channel_credentials(root_certificates=root), options=options)


def _check_address(address: str) -> None:
    """A host:port whose port cannot be one: gRPC would take 99999 modulo 65536 and report a
    connection refused on another port."""
    if "://" in address or address.startswith("unix:"):
        return  # a gRPC target URI: gRPC's to parse
    _, sep, port = address.rpartition(":")
    if sep and port.isdigit() and not 0 < int(port) < 65536:
        raise ValueError(f"--address: port {port} of {address!r} is not in 1-65535")


def _connection_flags(args: argparse.Namespace) -> str:
    """The connection flags that differ from the defaults, as typed: what a command given as a
    hint needs to reach the same router the same way."""
    flags = []
    if args.address != DEFAULT_ADDRESS:
        flags += ["--address", args.address]
    for flag, value in (("--tls-ca", args.tls_ca), ("--tls-server-name", args.tls_server_name),
                        ("--auth-token-file", args.auth_token_file)):
        if value is not None:
            flags += [flag, str(value)]
    return "".join(f" {shlex.quote(flag)}" for flag in flags)


def call_metadata(token: str | None) -> tuple[tuple[str, str], ...]:
    """What every call sends: the `authorization` metadata when there is a token."""
    return () if token is None else (("authorization", f"Bearer {token}"),)


def add_client_parsers(subparsers: Any) -> None:
    g = subparsers.add_parser(
        "generate",
        help="stream a completion from a running router",
        description="Stream a completion. When the model has a chat template (ClusterStatus says so), "
        "the prompt is sent as a user message, after a --system message if given; else, or with --raw, "
        "as plain text.",
    )
    _add_request_arguments(g)
    g.set_defaults(func=run_generate)
    u = subparsers.add_parser(
        "submit", help="start a request that runs with no client attached; prints its id",
        description="Submit a request as generate would send it, and print its id: it runs to its end whether "
        "or not a client attaches (kvserve stream ID). Submitting an existing id starts nothing.",
    )
    _add_request_arguments(u)
    u.set_defaults(func=run_submit)
    a = subparsers.add_parser("stream", help="attach to a request: its output from an offset on, then live")
    a.add_argument("request_id")
    a.add_argument("--from-offset", type=_int64, default=0, help="the first output token to send (default 0)")
    add_connection_arguments(a)
    a.set_defaults(func=run_stream)
    c = subparsers.add_parser("cancel", help="cancel a request; prints how it ended")
    c.add_argument("request_id")
    add_connection_arguments(c)
    c.set_defaults(func=run_cancel)
    r = subparsers.add_parser("get", help="a request's status, timings and output so far")
    r.add_argument("request_id")
    add_connection_arguments(r)
    r.set_defaults(func=run_get)
    s = subparsers.add_parser("status", help="print the cluster's KV table")
    add_connection_arguments(s)
    s.set_defaults(func=run_status)


def _add_request_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("prompt", help="the prompt text")
    add_connection_arguments(parser)
    parser.add_argument("--system", default=None, help="a system message before the prompt (chat models only)")
    parser.add_argument("--raw", action="store_true", help="send the prompt as plain text, without the chat template")
    parser.add_argument("--max-tokens", type=_int64, default=64)
    # Greedy unless asked: a terminal user comparing answers wants the model's best one (the
    # API's own default, for clients that leave the field unset, stays 1.0).
    parser.add_argument("--temperature", type=float, default=0.0, help="0 is greedy (default); the API's default is 1.0")
    parser.add_argument("--top-p", type=float, default=None)
    parser.add_argument("--top-k", type=_int64, default=None)
    parser.add_argument("--seed", type=_int64, default=None)
    parser.add_argument("--stop", action="append", default=[])
    parser.add_argument("--request-id", default="")
    parser.add_argument("--cache-salt", default=None,
                        help="share cached prompt KV only with requests of this salt (one per tenant; default: "
                             f"${CACHE_SALT_ENV} if set, which keeps it out of ps and the shell's history)")


def _int64(value: str) -> int:
    """A whole number the API's int64 fields can carry; the router checks its range."""
    try:
        number = int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number, got {value!r}") from None
    if not -(2**63) <= number < 2**63:
        raise argparse.ArgumentTypeError(f"{value} is out of range (the API's integers are 64-bit)")
    return number


def _text(flag: str, value: str) -> str:
    """An argument sent as a string field: UTF-8, or refused naming its flag (a shell passes
    invalid bytes through as surrogates, which protobuf cannot encode)."""
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        raise _Refused(f"{flag}: not valid UTF-8 text") from None
    return value


class _Refused(Exception):
    """The CLI's own refusal of its flags: printed, exit 2."""


def _generate_request(args: argparse.Namespace, stub: pb_grpc.KVServeStub,
                      metadata: tuple[tuple[str, str], ...]) -> pb.GenerateRequest:
    """The request the flags describe: chat messages when the model has a template."""
    if not args.prompt:
        # The API takes an empty chat message; from a terminal it is an unset shell variable.
        raise _Refused("prompt: must not be empty")
    for flag, value in (("prompt", args.prompt), ("--system", args.system), ("--request-id", args.request_id),
                        ("--cache-salt", args.cache_salt), *(("--stop", stop) for stop in args.stop)):
        if value is not None:
            _text(flag, value)
    sampling = pb.SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, stop=args.stop)
    for name in ("top_p", "top_k", "seed"):
        if getattr(args, name) is not None:
            setattr(sampling, name, getattr(args, name))
    if args.raw and args.system is not None:
        raise ValueError("--system: a system message needs the chat template, which --raw leaves out")
    request = pb.GenerateRequest(request_id=args.request_id, sampling=sampling)
    cache_salt = args.cache_salt if args.cache_salt is not None else os.environ.get(CACHE_SALT_ENV) or None
    if cache_salt is not None:
        request.cache_salt = cache_salt
    # One ClusterStatus call first: the CLI cannot know the model otherwise, and a typed
    # answer beats retrying on an error message.
    status = None if args.raw else stub.ClusterStatus(pb.ClusterStatusRequest(), timeout=10, metadata=metadata)
    if status is not None and status.has_chat_template:
        request.messages.CopyFrom(chat_messages(args.prompt, args.system))
    elif args.system is not None:
        raise _Refused("--system: the model has no chat template")
    else:
        request.text = args.prompt
    return request


def _print_stream(messages: Iterable[pb.GenerateResponse], from_offset: int = 0, flags: str = "") -> int:
    """The text on stdout, ending its line there (a file or pipe gets a whole line); what the
    request was and how it ended on stderr, each on a line of its own. A stream cut off
    (its router stopped, the connection went) says where to re-attach, with `flags` (those
    that reach this router, _connection_flags). Returns the exit status: 0 for an answer
    that ended as asked (length, stop, EOS), 1 for one cancelled or failed, which a script
    must not take for a whole answer."""
    request_id, offset, exit_status = "", from_offset, 1
    try:
        for message in messages:
            offset = _print_message(message, offset)
            kind = message.WhichOneof("event")
            if kind == "started":
                request_id = message.started.request_id
            elif kind == "finished":
                exit_status = 1 if message.finished.finish_reason in _NOT_AN_ANSWER else 0
    except grpc.RpcError:
        if request_id:
            print(flush=True)
            print(f"[cut off after offset {offset}: the request may go on; re-attach with "
                  f"kvserve stream {shlex.quote(request_id)} --from-offset {offset}{flags}]",
                  file=sys.stderr)
        raise
    return exit_status


_NOT_AN_ANSWER = (pb.FINISH_REASON_CANCELLED, pb.FINISH_REASON_ERROR, pb.FINISH_REASON_UNSPECIFIED)


def _print_message(message: pb.GenerateResponse, offset: int) -> int:
    """Print one message; the output offset after it."""
    kind = message.WhichOneof("event")
    if kind == "started":
        s = message.started
        where = f"on {s.worker_id}" if s.worker_id else "queued"  # Stream of a request not placed yet
        print(f"[{s.request_id} {where}, {s.prompt_tokens} prompt tokens]", file=sys.stderr)
    elif kind == "delta":
        print(message.delta.text, end="", flush=True)
        return message.delta.offset + len(message.delta.token_ids)
    elif kind == "finished":
        f = message.finished
        print(flush=True)
        print(f"[finish_reason={_reason(f.finish_reason)}, {f.usage.completion_tokens} tokens]", file=sys.stderr)
        if f.error:
            print(f"error: {f.error}", file=sys.stderr)
    return offset


def _reason(finish_reason: int) -> str:
    return pb.FinishReason.Name(finish_reason).removeprefix("FINISH_REASON_").lower()


def _status(status: int) -> str:
    return pb.RequestStatus.Name(status).removeprefix("REQUEST_STATUS_")


def _call(command: str, args: argparse.Namespace, body: Callable[[pb_grpc.KVServeStub, Any], int]) -> int:
    """Run body(stub, metadata) on a channel to the router; a gRPC error is one line, exit 1."""
    metadata = call_metadata(load_auth_token(args.auth_token_file))
    with open_channel(args) as channel:
        try:
            return body(pb_grpc.KVServeStub(channel), metadata)
        except grpc.RpcError as exc:
            print(f"kvserve {command}: {exc.code().name}: {exc.details()}", file=sys.stderr)
            return 1
        except _Refused as exc:
            print(f"kvserve {command}: {exc}", file=sys.stderr)
            return 2


def run_generate(args: argparse.Namespace) -> int:
    def body(stub: pb_grpc.KVServeStub, metadata: Any) -> int:
        call = stub.Generate(_generate_request(args, stub, metadata), metadata=metadata)
        return _print_stream(call, flags=_connection_flags(args))

    return _call("generate", args, body)


def run_submit(args: argparse.Namespace) -> int:
    def body(stub: pb_grpc.KVServeStub, metadata: Any) -> int:
        answer = stub.Submit(_generate_request(args, stub, metadata), timeout=30, metadata=metadata)
        print(answer.request_id)
        what = "submitted" if answer.created else "exists already, nothing new started"
        print(f"[{what}: {_status(answer.status)}; kvserve stream {answer.request_id}]", file=sys.stderr)
        return 0

    return _call("submit", args, body)


def run_stream(args: argparse.Namespace) -> int:
    def body(stub: pb_grpc.KVServeStub, metadata: Any) -> int:
        request = pb.StreamRequest(request_id=_text("request_id", args.request_id), from_offset=args.from_offset)
        return _print_stream(stub.Stream(request, metadata=metadata), args.from_offset, _connection_flags(args))

    return _call("stream", args, body)


def run_cancel(args: argparse.Namespace) -> int:
    def body(stub: pb_grpc.KVServeStub, metadata: Any) -> int:
        answer = stub.Cancel(pb.CancelRequest(request_id=_text("request_id", args.request_id)), timeout=30,
                             metadata=metadata)
        print(_status(answer.status))
        return 0

    return _call("cancel", args, body)


def run_get(args: argparse.Namespace) -> int:
    def body(stub: pb_grpc.KVServeStub, metadata: Any) -> int:
        info = stub.GetRequest(pb.GetRequestRequest(request_id=_text("request_id", args.request_id)), timeout=30,
                               metadata=metadata)
        ended = f", finish_reason={_reason(info.finish_reason)}" if info.finish_reason else ""
        print(f"[{info.request_id}: {_status(info.status)}{ended}; worker {info.worker_id or '-'}; "
              f"{len(info.prompt_token_ids)} prompt tokens ({info.cached_prompt_tokens} cached), "
              f"{len(info.output_token_ids)} output tokens]", file=sys.stderr)
        if info.error:
            print(f"error: {info.error}", file=sys.stderr)
        print(info.output_text)
        return 0

    return _call("get", args, body)


def chat_messages(prompt: str, system: str | None) -> pb.ChatMessages:
    """The conversation `kvserve generate` sends: an optional system message, then the prompt."""
    messages = [] if system is None else [pb.ChatMessage(role="system", content=system)]
    messages.append(pb.ChatMessage(role="user", content=prompt))
    return pb.ChatMessages(messages=messages)


def run_status(args: argparse.Namespace) -> int:
    metadata = call_metadata(load_auth_token(args.auth_token_file))
    with open_channel(args) as channel:
        try:
            stub = pb_grpc.KVServeStub(channel)
            status = stub.ClusterStatus(pb.ClusterStatusRequest(), timeout=10, metadata=metadata)
        except grpc.RpcError as exc:
            print(f"kvserve status: {exc.code().name}: {exc.details()}", file=sys.stderr)
            return 1
    print(format_status(status))
    return 0


def format_status(status: pb.ClusterStatusResponse) -> str:
    header = (
        f"{'worker':<10}{'alive':<7}{'free KV':>12}{'total KV':>12}{'used':>7}{'free/total blocks':>20}"
        f"{'headroom':>10}{'running':>9}{'waiting':>9}{'preempt':>9}{'report age':>12}"
    )
    lines = [header, "-" * len(header)]
    for w in status.workers:
        used = 1 - w.free_kv_bytes / w.total_kv_bytes if w.total_kv_bytes else 0.0
        # A dead worker's last report is of a worker that is gone (its requests moved): "-".
        live = (_mib(w.free_kv_bytes), f"{used:.0%}", str(w.free_blocks), str(w.uncommitted_blocks), str(w.running),
                str(w.waiting)) if w.alive else ("-",) * 6
        free, used_pct, free_blocks, headroom, running, waiting = live
        lines.append(
            f"{w.worker_id:<10}{'yes' if w.alive else 'NO':<7}{free:>12}{_mib(w.total_kv_bytes):>12}"
            f"{used_pct:>7}{f'{free_blocks}/{w.total_blocks}':>20}{headroom:>10}{running:>9}"
            f"{waiting:>9}{w.preemptions:>9}{w.report_age_seconds:>11.2f}s"
        )
    lines.append("-" * len(header))
    if status.workers and not status.alive_workers:
        lines.append("no worker alive: new requests are refused (UNAVAILABLE) until one is back (Ray restarts "
                     "a worker up to --worker-max-restarts times; else start kvserve up again)")
    lines.append(
        f"{status.alive_workers} alive; free {_mib(status.free_kv_bytes)} of {_mib(status.total_kv_bytes)}; "
        f"{status.running} running, {status.waiting} waiting on workers, {status.queued} queued at the router"
    )
    if status.routers_known:
        routers = [f"{r.router_id} at {r.address}{' (answered)' if r.answering else ''}" for r in status.routers]
        lines.append(f"{len(routers)} router(s): {', '.join(routers)}")
    else:
        lines.append("routers: unknown (Redis did not answer)")
    return "\n".join(lines)


def _mib(num_bytes: int) -> str:
    return f"{num_bytes / 2**20:.1f} MiB"
