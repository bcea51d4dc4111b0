"""Which Redis errors pass by themselves: the write is kept and retried, not dropped."""

from __future__ import annotations

import re

import redis.exceptions

# Error replies Redis gives while it cannot take a write for now: out of memory under
# maxmemory (frees as keys expire), a read-only replica (a failover in progress), busy
# with a script, a master down, or a cluster resharding.
_TRANSIENT_CODES = frozenset({"OOM", "READONLY", "BUSY", "MASTERDOWN", "LOADING", "TRYAGAIN", "CLUSTERDOWN", "NOREPLICAS"})
_TRANSIENT_CLASSES = (
    redis.exceptions.OutOfMemoryError,
    redis.exceptions.ReadOnlyError,
    redis.exceptions.BusyLoadingError,
    redis.exceptions.TryAgainError,
    redis.exceptions.MasterDownError,
    redis.exceptions.ClusterDownError,
)
# Inside a script the reply is wrapped: "Error running script (...): @user_script:1: -OOM command ...".
_SCRIPT_CODE = re.compile(r"@user_script:[^-]*-([A-Z]+) ")


def is_transient_refusal(error: BaseException) -> bool:
    """True for an error reply that says "not now" rather than "never" (see above)."""
    if isinstance(error, _TRANSIENT_CLASSES):
        return True
    if isinstance(error, redis.exceptions.ResponseError):
        message = str(error)
        code = message.split(" ", 1)[0].upper()
        wrapped = _SCRIPT_CODE.search(message)
        return code in _TRANSIENT_CODES or (wrapped is not None and wrapped.group(1) in _TRANSIENT_CODES)
    return False
