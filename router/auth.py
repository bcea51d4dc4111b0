"""Who may call the API and how much one client may hold, as grpc.aio server interceptors.

BearerTokenAuth: every call carries the metadata `authorization: Bearer <token>`, or it is
refused with UNAUTHENTICATED before any handler runs. Health checks (`grpc.health.v1`)
stay open without a token, so load balancers and Kubernetes probes need no secret; they
tell only SERVING or NOT_SERVING. Reflection and every KVServe RPC need the token.

StreamLimit: at most `max_streams_per_client` Generate and Stream calls open at once per
client; one more is refused with RESOURCE_EXHAUSTED. A client is its token when auth is
on (everyone holding one token shares its limit), else its peer's host.
"""

from __future__ import annotations

import collections
import hashlib
import hmac
import inspect
from collections.abc import AsyncIterator, Awaitable, Callable, Collection, Sequence
from typing import TYPE_CHECKING, Any, cast

import grpc

if TYPE_CHECKING:
    from typing import TypeAlias

    # The stubs' generics; at run time grpc's classes take no parameters.
    Handler: TypeAlias = grpc.RpcMethodHandler[Any, Any]
    Context: TypeAlias = grpc.aio.ServicerContext[Any, Any]
    Continuation: TypeAlias = Callable[[grpc.HandlerCallDetails], Awaitable[Handler | None]]

OPEN_METHOD_PREFIXES = ("/grpc.health.v1.Health/",)
AUTHORIZATION = "authorization"
_SCHEME = "bearer "

Guard = Callable[[Any, "Context"], Awaitable[Callable[[], None] | None]]
"""Runs before a behaviour with its request and context; may abort the call, or return a
release to call when the call ends (however it ends)."""


MIN_TOKEN_LENGTH = 16


def check_token(token: str, field: str = "auth_token") -> None:
    """A token goes into an HTTP/2 header: printable ASCII without spaces, and long enough
    not to be guessed. The message names the field but never shows the value (a secret)."""
    if len(token) < MIN_TOKEN_LENGTH or not all(33 <= ord(c) <= 126 for c in token):
        raise ValueError(
            f"{field} must be at least {MIN_TOKEN_LENGTH} printable ASCII characters without spaces "
            f"(got {len(token)} characters)"
        )


def bearer_token(metadata: Sequence[tuple[str, str | bytes]] | None) -> str | None:
    """The token of the first `authorization: Bearer <token>` entry, or None."""
    for key, value in metadata or ():
        if key == AUTHORIZATION:
            text = value.decode("latin-1") if isinstance(value, bytes) else value
            if text[: len(_SCHEME)].lower() == _SCHEME:
                return text[len(_SCHEME) :].strip()
            return None
    return None


class BearerTokenAuth(grpc.aio.ServerInterceptor):
    """Refuses every call but health checks unless it carries the token."""

    def __init__(self, token: str) -> None:
        check_token(token)
        self._expected = token.encode()

    async def intercept_service(
        self,
        continuation: Continuation,
        handler_call_details: grpc.HandlerCallDetails,
    ) -> Handler | None:
        handler = await continuation(handler_call_details)
        if handler is None or handler_call_details.method.startswith(OPEN_METHOD_PREFIXES):
            return handler
        given = bearer_token(handler_call_details.invocation_metadata)
        if given is None:
            return refusal(
                handler,
                grpc.StatusCode.UNAUTHENTICATED,
                f"missing `{AUTHORIZATION}` metadata: send `{AUTHORIZATION}: Bearer <token>`",
            )
        # compare_digest takes as long for a near miss as for a far one: no timing oracle.
        if not hmac.compare_digest(given.encode("utf-8", "surrogateescape"), self._expected):
            return refusal(handler, grpc.StatusCode.UNAUTHENTICATED, f"the token in `{AUTHORIZATION}` is not valid")
        return handler


class StreamLimit(grpc.aio.ServerInterceptor):
    """At most `max_streams_per_client` of `methods` open at once per client."""

    def __init__(self, max_streams_per_client: int, methods: Collection[str], by_token: bool) -> None:
        if max_streams_per_client < 1:
            raise ValueError(f"max_streams_per_client must be >= 1, got {max_streams_per_client}")
        self.max_streams_per_client = max_streams_per_client
        self._methods = frozenset(methods)
        self._by_token = by_token
        self._open: collections.Counter[str] = collections.Counter()

    def open_streams(self, client: str) -> int:
        return self._open[client]

    def client_of(self, metadata: Sequence[tuple[str, str | bytes]] | None, peer: str) -> str:
        """The name a client's streams are counted under; never the token itself."""
        if self._by_token:
            token = bearer_token(metadata) or ""
            return "token:" + hashlib.sha256(token.encode("utf-8", "surrogateescape")).hexdigest()[:16]
        return peer_host(peer)

    async def intercept_service(
        self,
        continuation: Continuation,
        handler_call_details: grpc.HandlerCallDetails,
    ) -> Handler | None:
        handler = await continuation(handler_call_details)
        if handler is None or handler_call_details.method not in self._methods:
            return handler
        metadata = handler_call_details.invocation_metadata

        async def take_slot(request: Any, context: Context) -> Callable[[], None]:
            client = self.client_of(metadata, context.peer())
            if self._open[client] >= self.max_streams_per_client:
                who = "this token" if self._by_token else f"client {client}"
                await context.abort(
                    grpc.StatusCode.RESOURCE_EXHAUSTED,
                    f"max_streams_per_client: {who} already has {self._open[client]} Generate/Stream calls "
                    f"open (the limit is {self.max_streams_per_client}); end one first",
                )
            self._open[client] += 1

            def release() -> None:
                self._open[client] -= 1
                if self._open[client] <= 0:
                    del self._open[client]

            return release

        return guarded(handler, take_slot)


def peer_host(peer: str) -> str:
    """The host of a grpc peer string: 'ipv4:10.0.0.7:5312' -> '10.0.0.7',
    'ipv6:[::1]:5312' -> '::1'; anything else (a unix socket) whole."""
    kind, _, address = peer.partition(":")
    if kind == "ipv4":
        return address.rpartition(":")[0] or address
    if kind == "ipv6":
        host = address.rpartition(":")[0] if address.startswith("[") else address
        return host.strip("[]") or address
    return peer


# -- building handlers ------------------------------------------------------------------------


def refusal(handler: Handler, code: grpc.StatusCode, message: str) -> Handler:
    """A handler of the same kind as `handler` that ends every call with `code`."""

    async def refuse(request: Any, context: Context) -> None:
        await context.abort(code, message)

    return with_behavior(handler, refuse)


def guarded(
    handler: Handler,
    guard: Guard,
    request_deserializer: Callable[[bytes], Any] | None = None,
) -> Handler:
    """`handler` whose unary-request behaviour first awaits `guard`, and calls the release
    the guard returned when the call ends: finished, failed, cancelled or disconnected.
    `request_deserializer`, when given, replaces the handler's."""
    assert not handler.request_streaming, "guards are for unary-request methods"
    if handler.response_streaming:
        inner = handler.unary_stream
        if inspect.isasyncgenfunction(inner):

            async def stream(request: Any, context: Context) -> AsyncIterator[Any]:
                release = await guard(request, context)
                try:
                    async for response in inner(request, context):
                        yield response
                finally:
                    if release is not None:
                        release()

            return with_behavior(handler, stream, request_deserializer)
    # On a grpc.aio server a behaviour is a coroutine function (the stubs type grpc's sync ones).
    behavior = cast("Callable[[Any, Context], Awaitable[Any]]",
                    handler.unary_stream if handler.response_streaming else handler.unary_unary)

    async def call(request: Any, context: Context) -> Any:
        release = await guard(request, context)
        try:
            return await behavior(request, context)
        finally:
            if release is not None:
                release()

    return with_behavior(handler, call, request_deserializer)


def with_behavior(
    handler: Handler,
    behavior: Callable[..., Any],
    request_deserializer: Callable[[bytes], Any] | None = None,
) -> Handler:
    """A handler of the same kind and serializers as `handler`, running `behavior`."""
    deserializer = request_deserializer or handler.request_deserializer
    serializer = handler.response_serializer
    if handler.request_streaming and handler.response_streaming:
        return grpc.stream_stream_rpc_method_handler(behavior, deserializer, serializer)
    if handler.request_streaming:
        return grpc.stream_unary_rpc_method_handler(behavior, deserializer, serializer)
    if handler.response_streaming:
        return grpc.unary_stream_rpc_method_handler(behavior, deserializer, serializer)
    return grpc.unary_unary_rpc_method_handler(behavior, deserializer, serializer)
