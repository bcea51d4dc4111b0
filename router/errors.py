"""Every error the API can return, as one typed exception per gRPC status, mapped in one place."""

from __future__ import annotations

import grpc

from workers.engine.errors import InvalidRequestError


class RouterError(Exception):
    """An error with the gRPC status it maps to."""

    code: grpc.StatusCode = grpc.StatusCode.INTERNAL


class InvalidArgument(RouterError):
    code = grpc.StatusCode.INVALID_ARGUMENT

    def __init__(self, field: str, message: str) -> None:
        self.field = field
        self.detail = message
        super().__init__(f"{field}: {message}")


class AlreadyExists(RouterError):
    code = grpc.StatusCode.ALREADY_EXISTS


class NotFound(RouterError):
    code = grpc.StatusCode.NOT_FOUND


class ResourceExhausted(RouterError):
    code = grpc.StatusCode.RESOURCE_EXHAUSTED


class Unavailable(RouterError):
    code = grpc.StatusCode.UNAVAILABLE


class DeadlineExceeded(RouterError):
    code = grpc.StatusCode.DEADLINE_EXCEEDED


class Cancelled(RouterError):
    """A Cancel call ended the request while it waited for a worker."""

    code = grpc.StatusCode.CANCELLED


def status_of(exc: BaseException) -> tuple[grpc.StatusCode, str]:
    """The status and message a client sees for an exception raised while serving it."""
    from router.redis_errors import is_transient_refusal
    from router.state import StoreUnavailable

    if isinstance(exc, RouterError):
        return exc.code, str(exc)
    if isinstance(exc, InvalidRequestError):
        return grpc.StatusCode.INVALID_ARGUMENT, str(exc)
    if isinstance(exc, StoreUnavailable):
        return grpc.StatusCode.UNAVAILABLE, str(exc)
    if is_transient_refusal(exc):
        return grpc.StatusCode.UNAVAILABLE, f"Redis refuses writes for now (try again later): {exc}"
    return grpc.StatusCode.INTERNAL, f"internal error: {type(exc).__name__}: {exc}"
