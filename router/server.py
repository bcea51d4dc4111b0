"""The router process's gRPC server: KVServe, standard health checking, and reflection;
optionally TLS, a bearer token and a per-client stream limit (router/auth.py)."""

from __future__ import annotations

import asyncio
import logging
import socket
import ssl
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1.health import aio as health_aio
from grpc_reflection.v1alpha import reflection

from protos.kvserve.v1 import serving_pb2 as pb
from protos.kvserve.v1 import serving_pb2_grpc as pb_grpc
from router.auth import BearerTokenAuth, StreamLimit, check_token, guarded
from router.core import Router
from router.errors import InvalidArgument
from router.service import KVServeService
from router.tracker import DEFAULT_MAX_PENDING_TOKENS
from router.validation import decode_request

if TYPE_CHECKING:
    from router.auth import Context

log = logging.getLogger("kvserve.router")
SERVICE_NAME = pb.DESCRIPTOR.services_by_name["KVServe"].full_name
_REQUEST_TYPES: dict[str, Any] = {
    f"/{SERVICE_NAME}/{method.name}": getattr(pb, method.input_type.name)
    for method in pb.DESCRIPTOR.services_by_name["KVServe"].methods
}
STREAMING_METHODS = (f"/{SERVICE_NAME}/Generate", f"/{SERVICE_NAME}/Stream")  # what max_streams_per_client counts


@dataclass(frozen=True)
class ServerConfig:
    """How the router serves. Everything beyond host and port is off unless asked for:
    TLS (tls_cert_file and tls_key_file, PEM), a bearer token every call but health checks
    must carry, and at most max_streams_per_client Generate/Stream calls open per client."""

    host: str = "127.0.0.1"  # localhost by default; 0.0.0.0 to serve other machines
    port: int = 50051  # 0 picks a free port
    max_message_bytes: int = 4 * 1024 * 1024  # larger requests get RESOURCE_EXHAUSTED from gRPC itself
    tls_cert_file: Path | None = None  # the certificate chain, PEM
    tls_key_file: Path | None = None  # its private key, PEM
    auth_token: str | None = field(default=None, repr=False)  # a secret: kept out of reprs and logs
    max_streams_per_client: int | None = None  # None: unlimited
    # A Generate/Stream client's output not yet sent, in tokens, past which its call ends
    # RESOURCE_EXHAUSTED (the request runs on; the client re-attaches with Stream).
    max_pending_tokens: int = DEFAULT_MAX_PENDING_TOKENS
    # Tokens a client's next delta waits for, after its first (router/tracker.py's Listener):
    # 1 sends each step's token at once; more costs the router fewer messages.
    stream_interval: int = 1

    def __post_init__(self) -> None:
        if not 0 <= self.port < 65536:
            raise ValueError(f"ServerConfig.port must be in [0, 65536), got {self.port}")
        if self.max_message_bytes < 1024:
            raise ValueError(f"ServerConfig.max_message_bytes must be >= 1024, got {self.max_message_bytes}")
        if (self.tls_cert_file is None) != (self.tls_key_file is None):
            missing = "tls_key_file" if self.tls_key_file is None else "tls_cert_file"
            raise ValueError(f"ServerConfig.{missing} must be set too: TLS needs both a certificate and its key")
        if self.auth_token is not None:
            check_token(self.auth_token, "ServerConfig.auth_token")
        if self.max_streams_per_client is not None and self.max_streams_per_client < 1:
            raise ValueError(
                f"ServerConfig.max_streams_per_client must be >= 1 or None, got {self.max_streams_per_client}"
            )
        if self.max_pending_tokens < 1:
            raise ValueError(f"ServerConfig.max_pending_tokens must be >= 1, got {self.max_pending_tokens}")
        if self.stream_interval < 1:
            raise ValueError(f"ServerConfig.stream_interval must be >= 1, got {self.stream_interval}")

    @property
    def tls(self) -> bool:
        return self.tls_cert_file is not None


class PortUnavailable(RuntimeError):
    """A port the router was to serve on (gRPC, metrics) cannot be bound."""


def grpc_port_unavailable(address: str, flag: str = "--port") -> str:
    return (f"could not serve gRPC on {address} ({flag}): the port is taken (another kvserve up or "
            f"kvserve router?) or the address is not this machine's")


def probe_port(host: str, port: int) -> OSError | None:
    """Why host:port cannot be listened on now, or None (also for a host it cannot resolve,
    which gRPC's own bind then judges): bound as gRPC and prometheus bind
    (SO_REUSEADDR, so that a previous run's connections in TIME_WAIT do not count), and
    let go at once. A start checks its ports with it before Ray and Redis start; the real
    bind still decides (another process may take the port in between)."""
    try:
        # gRPC takes an IPv6 host in brackets ([::1]); getaddrinfo takes it bare.
        found = socket.getaddrinfo(host.strip("[]"), port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except (OSError, UnicodeError):
        return None  # a host it cannot resolve: not checked here, gRPC's bind decides
    family, kind, proto, _, address = found[0]
    try:
        with socket.socket(family, kind, proto) as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            probe.bind(address)
            probe.listen()
    except OSError as exc:
        return exc
    return None


HEALTH_INTERVAL_S = 0.2  # how often health is re-judged (and Redis pinged: a few PINGs a second)

# HTTP/2 keepalive. gRPC's server default takes a client's ping as abuse unless 5 minutes
# passed since the last one with nothing sent back, or if no call is open, and after two
# such pings closes the connection (GOAWAY too_many_pings) and every call on it: a client
# pinging every 5-30 s (common behind load balancers and NATs) lost its streams whenever
# one was quiet, e.g. a Generate waiting in the queue, which was then recorded CANCELLED.
# Clients may ping every second, with or without calls; the server pings a connection
# that was quiet for a minute, and closes it if no answer comes in 20 s, so a client that
# vanished without closing its socket does not hold its requests' KV for hours.
# And no SO_REUSEPORT (gRPC sets it by default): with it, a second router on a taken port
# started without a word and took a share of the first one's connections.
KEEPALIVE_OPTIONS: tuple[tuple[str, int], ...] = (
    ("grpc.http2.min_ping_interval_without_data_ms", 1_000),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.keepalive_time_ms", 60_000),
    ("grpc.keepalive_timeout_ms", 20_000),
)


class RouterServer:
    """Serves a Router over gRPC. grpc.health.v1 says SERVING while the router can take a new
    request: at least one worker alive, not draining, and Redis answering PING (every new
    request is written there first, so without it each would get UNAVAILABLE); else
    NOT_SERVING, so a load balancer sends its traffic elsewhere. Requests already running
    are not what health is about: they go on while Redis is down."""

    def __init__(self, router: Router, config: ServerConfig) -> None:
        self.router = router
        self.config = config
        # Outermost first: refuse a caller without the token before it can hold a stream
        # slot; a request that does not parse is refused inside both.
        interceptors: list[grpc.aio.ServerInterceptor] = []
        if config.auth_token is not None:
            interceptors.append(BearerTokenAuth(config.auth_token))
        self.stream_limit: StreamLimit | None = None
        if config.max_streams_per_client is not None:
            self.stream_limit = StreamLimit(
                config.max_streams_per_client, STREAMING_METHODS, by_token=config.auth_token is not None
            )
            interceptors.append(self.stream_limit)
        interceptors.append(StrictDecoding())
        self.server = grpc.aio.server(
            interceptors=interceptors,
            options=[
                ("grpc.max_receive_message_length", config.max_message_bytes),
                ("grpc.max_send_message_length", config.max_message_bytes),
                *KEEPALIVE_OPTIONS,
                ("grpc.so_reuseport", 0),
            ],
        )
        self.service = KVServeService(router, config.max_pending_tokens, config.stream_interval)
        pb_grpc.add_KVServeServicer_to_server(self.service, self.server)
        self.health = health_aio.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        reflection.enable_server_reflection(
            (SERVICE_NAME, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name, reflection.SERVICE_NAME),
            self.server,
        )
        self.port = 0
        self._health_task: asyncio.Task[None] | None = None
        self._serving: bool | None = None
        self._ready = False

    async def start(self) -> int:
        address = f"{self.config.host}:{self.config.port}"
        try:
            if self.config.tls:
                self.port = self.server.add_secure_port(address, _server_credentials(self.config))
            else:
                self.port = self.server.add_insecure_port(address)
        except RuntimeError:  # grpcio's "Failed to bind to address"
            self.port = 0
        if self.port == 0:
            raise PortUnavailable(grpc_port_unavailable(address))
        await self.server.start()
        self._health_task = asyncio.create_task(self._track_health())
        return self.port

    async def judge_health(self) -> None:
        """Set the health status from the router's state now (also done every HEALTH_INTERVAL_S)."""
        now = bool(self.router.alive_workers) and not self.router.draining and await self._redis_answers()
        if now != self._serving:
            status = health_pb2.HealthCheckResponse.SERVING if now else health_pb2.HealthCheckResponse.NOT_SERVING
            await self.health.set("", status)
            await self.health.set(SERVICE_NAME, status)
            if self._serving is not None and self._ready:
                log.warning("health: %s", "SERVING" if now else f"NOT_SERVING ({self._why_not()})")
            self._serving = now

    def ready(self) -> None:
        """The start is over: changes of health from now on are news, and logged."""
        self._ready = True

    async def _track_health(self) -> None:
        while True:
            await self.judge_health()
            await asyncio.sleep(HEALTH_INTERVAL_S)

    async def _redis_answers(self) -> bool:
        # A Redis that hangs rather than refuses would hold the ping for the store's socket
        # timeout; health is judged again at the next tick instead.
        try:
            return await asyncio.wait_for(self.router.store.ping(), 1.0)
        except asyncio.TimeoutError:
            return False

    def _why_not(self) -> str:
        if self.router.draining:
            return "draining"
        if not self.router.alive_workers:
            return "no worker alive"
        return "Redis does not answer: new requests cannot be recorded"

    async def stop(self, grace_s: float = 1.0) -> None:
        if self._health_task is not None:
            self._health_task.cancel()
        await self.server.stop(grace_s)


def _server_credentials(config: ServerConfig) -> grpc.ServerCredentials:
    pem: dict[str, bytes] = {}
    for name in ("tls_cert_file", "tls_key_file"):
        path = Path(getattr(config, name))
        try:
            pem[name] = path.read_bytes()
        except OSError as exc:
            raise ValueError(f"ServerConfig.{name}: cannot read {path}: {exc.strerror}") from None
    check_tls_pair(Path(str(config.tls_cert_file)), Path(str(config.tls_key_file)))
    return grpc.ssl_server_credentials([(pem["tls_key_file"], pem["tls_cert_file"])])


def check_tls_pair(cert: Path, key: Path) -> None:
    """Raise ValueError naming --tls-cert and --tls-key unless they are a PEM certificate
    chain and its own unencrypted private key. gRPC refuses such a pair only as it binds,
    with the error it gives a taken port."""
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    try:
        # password: an encrypted key fails here, where OpenSSL would prompt on the terminal.
        context.load_cert_chain(cert, key, password=lambda: b"")
    except ssl.SSLError as exc:
        why = "the key is not the certificate's" if "MISMATCH" in str(exc).upper() else (
            f"not a PEM certificate chain and its unencrypted private key ({exc.reason or exc})")
        raise ValueError(f"--tls-cert {cert} / --tls-key {key}: {why}") from None


class _Undecodable:
    """What the strict deserializer hands on for bytes that are not a valid request."""

    def __init__(self, error: InvalidArgument) -> None:
        self.error = error


class StrictDecoding(grpc.aio.ServerInterceptor):
    """KVServe requests are parsed by validation.decode_request, so bad UTF-8 in a string
    field or a corrupt message gets INVALID_ARGUMENT naming the field; gRPC's own
    deserializer would raise inside the server and answer UNKNOWN."""

    async def intercept_service(self, continuation: Any, handler_call_details: grpc.HandlerCallDetails) -> Any:
        handler = await continuation(handler_call_details)
        message_type = _REQUEST_TYPES.get(handler_call_details.method)
        if handler is None or message_type is None or handler.request_streaming:
            return handler

        def deserialize(raw: bytes) -> Any:
            try:
                return decode_request(message_type, raw)
            except InvalidArgument as exc:
                return _Undecodable(exc)

        async def refuse_undecodable(request: Any, context: Context) -> None:
            if isinstance(request, _Undecodable):
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(request.error))
            return None

        return guarded(handler, refuse_undecodable, deserialize)
