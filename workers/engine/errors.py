"""Typed errors of the engine core.

Every error raised for input from outside names the field it is about, so the router
can map it to one gRPC status with a message a client can act on.
"""

from __future__ import annotations


class InvalidRequestError(ValueError):
    """A request field has a value the engine will never accept (maps to INVALID_ARGUMENT)."""

    def __init__(self, field: str, message: str) -> None:
        self.field = field
        self.detail = message
        super().__init__(f"{field}: {message}")


class RequestTooLargeError(InvalidRequestError):
    """The request could never fit: beyond max_model_len or beyond the whole KV pool."""


class DuplicateRequestError(InvalidRequestError):
    """A request with this id is already in the engine (maps to ALREADY_EXISTS)."""
