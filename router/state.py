"""The request store: every request's lifecycle and token log, kept in Redis.

Redis owns this state so a client can re-attach to a request and resume its
stream, a request can outlive the worker that ran it, and a restarted router can
adopt the requests that were running.

Key layout (`{prefix}` is `StoreConfig.prefix`, "kvserve" by default):

    {prefix}:req:{request_id}   hash, one per request
        status             QUEUED | RUNNING | FINISHED | CANCELLED | FAILED
        prompt_ids         JSON list of token ids
        sampling           JSON object of sampling parameters
        seed               integer, or "" for none
        worker_id          the worker running it ("" while queued)
        created_at         unix seconds
        first_token_at     unix seconds, 0 until the first token
        finished_at        unix seconds, 0 until it ends
        finish_reason      e.g. "stop", "length" ("" until it ends)
        num_output_tokens  tokens in the log (kept by the store as entries land)
        error              message of a FAILED request
        num_migrations     times it moved to another worker
        prompt_text        the text prompt_ids were encoded from: the prompt text, or
                           the chat template's rendering of the messages ("" for ids)

    {prefix}:log:{request_id}   list, one JSON element per engine step that gave
                                this request output:
        {"o": offset of the first token, "ids": [token ids], "t": "text delta",
         "lp": [logprob objects]}            ("lp" omitted when there are none)

    {prefix}:active             set of the ids of requests that have not ended

When a request ends (FINISHED, CANCELLED or FAILED) both of its keys get
`EXPIRE ttl_seconds` and its id leaves the active set, so nothing is left without
an expiry once requests end. Every write goes through one small Lua script per
request, which makes these guarantees hold whatever the caller does:

- writes to an unknown (or expired) request are dropped, so no key is ever created
  without an expiry; writes to an ended request are dropped too (its log is final,
  and the first end wins: a late cancel cannot turn FINISHED into CANCELLED);
- setting a terminal status through any method ends the request (EXPIRE + SREM);
- a log entry whose offset is below `num_output_tokens`, or that equals the last
  entry, is a duplicate (a pipeline resent after a lost connection) and is skipped,
  so a retried step is harmless; the store sets `num_output_tokens` to the end of
  each entry it appends.

A log entry's text delta belongs to the entry's LAST token: the text of a
multi-token entry is never split. `read_log(from_offset)` slices an entry that
starts before `from_offset` (its token ids and logprobs), but keeps its whole text,
so a reader resuming mid-entry may get text for tokens it already had. An entry
may carry text and no tokens (text the detokenizer released late, e.g. at the
end); it sits at the offset of the next token and is read from that offset.

A `RequestStore` belongs to the event loop that first uses it (redis.asyncio
connections are bound to their loop).
"""

from __future__ import annotations

import asyncio
import enum
import hashlib
import time
import urllib.parse
from collections.abc import Awaitable, Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, TypeVar

import redis.asyncio
import redis.exceptions
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff

from router.records import _ENDED_STATUSES, LogEntry, RequestRecord, RequestStatus, StepWrite

__all__ = ["LogEntry", "RequestRecord", "RequestStatus", "RequestStore", "StepWrite", "StoreConfig", "StoreUnavailable"]

_T = TypeVar("_T")

# Errors that mean "Redis is not reachable right now" rather than a bug in a command.
# AuthenticationError and BusyLoadingError (AOF still loading) are ConnectionErrors.
_UNAVAILABLE_ERRORS: tuple[type[BaseException], ...] = (
    redis.exceptions.ConnectionError,
    redis.exceptions.TimeoutError,
    asyncio.TimeoutError,
    OSError,
)

_ENDED_STATUSES_LUA = "{FINISHED=true, CANCELLED=true, FAILED=true}"

# KEYS: hash, log, active. ARGV: request_id, ttl, then field/value pairs.
# Returns false when it created the request, else the existing hash (HGETALL).
_CREATE_LUA = f"""
local existing = redis.call('HGETALL', KEYS[1])
if #existing > 0 then return existing end
-- A log left behind by an earlier request with this id must not leak into this one.
redis.call('DEL', KEYS[2])
redis.call('HSET', KEYS[1], unpack(ARGV, 3))
local ended = {_ENDED_STATUSES_LUA}
if ended[redis.call('HGET', KEYS[1], 'status')] then
  redis.call('EXPIRE', KEYS[1], ARGV[2])
else
  redis.call('SADD', KEYS[3], ARGV[1])
end
return false
"""

# KEYS: hash, log, active. ARGV: request_id, ttl, entry JSON or "", entry offset,
# entry end offset, then field/value pairs.
# Returns 0: dropped (unknown or ended request), 1: applied, 2: entry was a duplicate.
_WRITE_LUA = f"""
local ended = {_ENDED_STATUSES_LUA}
local status = redis.call('HGET', KEYS[1], 'status')
if (not status) or ended[status] then return 0 end
local result = 1
if ARGV[3] ~= '' then
  local logged = tonumber(redis.call('HGET', KEYS[1], 'num_output_tokens') or '0') or 0
  if tonumber(ARGV[4]) < logged or redis.call('LINDEX', KEYS[2], -1) == ARGV[3] then
    result = 2
  else
    redis.call('RPUSH', KEYS[2], ARGV[3])
  end
end
if #ARGV > 5 then redis.call('HSET', KEYS[1], unpack(ARGV, 6)) end
if result == 1 and ARGV[3] ~= '' then
  redis.call('HSET', KEYS[1], 'num_output_tokens', ARGV[5])
end
if ended[redis.call('HGET', KEYS[1], 'status')] then
  redis.call('EXPIRE', KEYS[1], ARGV[2])
  redis.call('EXPIRE', KEYS[2], ARGV[2])
  redis.call('SREM', KEYS[3], ARGV[1])
end
return result
"""


class StoreUnavailable(Exception):
    """Redis could not be reached (refused, timed out, loading, or auth failed)."""


@dataclass(frozen=True)
class StoreConfig:
    """Where the request store lives and how long ended requests are kept."""

    url: str = "redis://127.0.0.1:6379/0"
    prefix: str = "kvserve"
    ttl_seconds: int = 3600
    socket_timeout: float = 2.0

    def __post_init__(self) -> None:
        if urllib.parse.urlsplit(self.url).scheme not in ("redis", "rediss", "unix"):
            raise ValueError(f"url must be a redis://, rediss:// or unix:// URL, got {mask_url(self.url)!r}")
        if not self.prefix or any(c.isspace() for c in self.prefix):
            raise ValueError(f"prefix must be non-empty without whitespace, got {self.prefix!r}")
        if self.ttl_seconds < 1:
            raise ValueError(f"ttl_seconds must be at least 1, got {self.ttl_seconds}")
        if not self.socket_timeout > 0:
            raise ValueError(f"socket_timeout must be positive, got {self.socket_timeout}")


class RequestStore:
    """Request records and token logs in Redis (see the module docstring for keys).

    Every method but `ping` raises StoreUnavailable, within about
    `socket_timeout` seconds, when Redis cannot be reached; the connection pool
    reconnects by itself once Redis is back.
    """

    def __init__(self, config: StoreConfig) -> None:
        self._config = config
        # Created on first use: connections belong to the loop that opens them.
        self._client: redis.asyncio.Redis | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._create_sha = _sha1(_CREATE_LUA)
        self._write_sha = _sha1(_WRITE_LUA)

    @property
    def config(self) -> StoreConfig:
        return self._config

    async def close(self) -> None:
        """Close the connections; the store reconnects if it is used again."""
        client, self._client, self._loop = self._client, None, None
        if client is not None:
            await client.aclose()

    async def ping(self) -> bool:
        """True when Redis answers; never raises."""
        try:
            return bool(await self._redis().ping())
        except (redis.exceptions.RedisError, OSError, asyncio.TimeoutError):
            return False

    async def create(self, record: RequestRecord) -> RequestRecord | None:
        """Create the request unless its id exists, atomically.

        Returns None when this call created it, else the existing record, so a
        resubmitted id never starts a second generation. Adds it to the active set.
        """
        flat: list[str] = []
        for name, value in record.to_fields().items():
            flat += (name, value)
        keys = self._keys(record.request_id)
        args = [record.request_id, str(self._config.ttl_seconds), *flat]
        existing = await self._run_scripts([(self._create_sha, _CREATE_LUA, keys, args)])
        if existing[0] is None:
            return None
        pairs = existing[0]
        fields = {_text(k): _text(v) for k, v in zip(pairs[0::2], pairs[1::2])}
        return RequestRecord.from_fields(record.request_id, fields)

    async def get(self, request_id: str) -> RequestRecord | None:
        """The request's record, or None when there is none (never created, or expired)."""
        raw = await self._call(lambda client: client.hgetall(self._hash_key(request_id)))
        if not raw:
            return None
        return RequestRecord.from_fields(request_id, {_text(k): _text(v) for k, v in raw.items()})

    async def update(self, request_id: str, **fields: str | int | float) -> None:
        """Set hash fields of a live request; dropped if it is unknown or has ended."""
        await self.write_step([StepWrite(request_id, None, fields)])

    async def write_step(self, writes: Sequence[StepWrite]) -> None:
        """Apply one engine step's writes for every request in it, in ONE pipeline."""
        calls = []
        for write in writes:
            entry = write.entry
            args = [
                write.request_id,
                str(self._config.ttl_seconds),
                "" if entry is None else entry.to_json(),
                "0" if entry is None else str(entry.offset),
                "0" if entry is None else str(entry.end_offset),
            ]
            for name, value in write.fields.items():
                args += (name, _encode_field(value))
            calls.append((self._write_sha, _WRITE_LUA, self._keys(write.request_id), args))
        if calls:
            await self._run_scripts(calls)

    async def finish(
        self,
        request_id: str,
        status: RequestStatus,
        finish_reason: str = "",
        error: str = "",
        finished_at: float | None = None,
    ) -> None:
        """End the request: set its status and finish fields, EXPIRE both keys, leave the active set.

        One atomic script. The first end wins: finishing an ended request does nothing.
        """
        if not status.is_finished:
            raise ValueError(f"status must be FINISHED, CANCELLED or FAILED, got {status.value}")
        fields: dict[str, str | int | float] = {
            "status": status.value,
            "finish_reason": finish_reason,
            "error": error,
            "finished_at": _now() if finished_at is None else finished_at,
        }
        await self.write_step([StepWrite(request_id, None, fields)])

    async def read_log(self, request_id: str, from_offset: int = 0) -> list[LogEntry]:
        """Log entries covering output offsets >= `from_offset`, in order.

        An entry that straddles `from_offset` is sliced to start there (token ids and
        logprobs); its text is not split and comes whole with the slice.
        """
        if from_offset < 0:
            raise ValueError(f"from_offset must be >= 0, got {from_offset}")
        raw = await self._call(lambda client: client.lrange(self._log_key(request_id), 0, -1))
        entries = []
        for element in raw:
            entry = LogEntry.from_json(_text(element))
            if entry.end_offset > from_offset or (not entry.token_ids and entry.offset >= from_offset):
                entries.append(entry.starting_at(from_offset))
        return entries

    async def active_ids(self) -> list[str]:
        """Ids of requests that have not ended, sorted."""
        members = await self._call(lambda client: client.smembers(self._active_key()))
        return sorted(_text(member) for member in members)

    async def ttl(self, request_id: str) -> tuple[int, int]:
        """Seconds to live of (hash, log): -1 no expiry, -2 no such key (Redis's TTL)."""

        async def both(client: redis.asyncio.Redis) -> list[int]:
            async with client.pipeline(transaction=False) as pipe:
                pipe.ttl(self._hash_key(request_id))
                pipe.ttl(self._log_key(request_id))
                return list(await pipe.execute())

        hash_ttl, log_ttl = await self._call(both)
        return int(hash_ttl), int(log_ttl)

    def _hash_key(self, request_id: str) -> str:
        return f"{self._config.prefix}:req:{request_id}"

    def _log_key(self, request_id: str) -> str:
        return f"{self._config.prefix}:log:{request_id}"

    def _active_key(self) -> str:
        return f"{self._config.prefix}:active"

    def _keys(self, request_id: str) -> list[str]:
        return [self._hash_key(request_id), self._log_key(request_id), self._active_key()]

    def _redis(self) -> redis.asyncio.Redis:
        loop = asyncio.get_running_loop()
        if self._client is not None and self._loop is not loop:
            if self._loop is not None and not self._loop.is_closed():
                raise RuntimeError("a RequestStore is used from one event loop only")
            # Its loop is gone (e.g. an earlier asyncio.run): so are its connections.
            self._client = None
        if self._client is None:
            self._client = redis.asyncio.Redis.from_url(
                self._config.url,
                decode_responses=True,
                socket_timeout=self._config.socket_timeout,
                socket_connect_timeout=self._config.socket_timeout,
                # One immediate retry on a connection error only: it turns a pooled
                # connection that died with a restarted Redis into a fresh one, while a
                # Redis that is really down still fails within one timeout. Timeouts are
                # not retried: the command may have run.
                retry=Retry(NoBackoff(), 1, supported_errors=(redis.exceptions.ConnectionError,)),
            )
            self._loop = loop
        return self._client

    async def _call(self, operation: Callable[[redis.asyncio.Redis], Awaitable[_T]]) -> _T:
        with self._unavailable_as_store_error():
            return await operation(self._redis())

    async def _run_scripts(self, calls: Sequence[tuple[str, str, list[str], list[str]]]) -> list[Any]:
        """EVALSHA every (sha, source, keys, args) in one pipeline; load scripts Redis lacks.

        Redis forgets scripts when it restarts; calls answered NOSCRIPT did nothing,
        so they are loaded and sent again (one more round trip, once per restart).
        """
        with self._unavailable_as_store_error():
            client = self._redis()
            results = await self._pipeline_evalsha(client, calls)
            missing = [i for i, result in enumerate(results) if isinstance(result, redis.exceptions.NoScriptError)]
            if missing:
                sources = {calls[i][1] for i in missing}
                async with client.pipeline(transaction=False) as pipe:
                    for source in sources:
                        pipe.script_load(source)
                    await pipe.execute()
                retried = await self._pipeline_evalsha(client, [calls[i] for i in missing])
                for i, result in zip(missing, retried):
                    results[i] = result
            for result in results:
                if isinstance(result, Exception):
                    raise result
            return results

    @staticmethod
    async def _pipeline_evalsha(
        client: redis.asyncio.Redis, calls: Sequence[tuple[str, str, list[str], list[str]]]
    ) -> list[Any]:
        async with client.pipeline(transaction=False) as pipe:
            for sha, _source, keys, args in calls:
                pipe.evalsha(sha, len(keys), *keys, *args)
            return list(await pipe.execute(raise_on_error=False))

    @contextmanager
    def _unavailable_as_store_error(self) -> Iterator[None]:
        try:
            yield
        except _UNAVAILABLE_ERRORS as error:
            raise StoreUnavailable(
                f"Redis at {mask_url(self._config.url)} is unavailable: {type(error).__name__}: {error}"
            ) from error


def mask_url(url: str) -> str:
    """The URL with its password replaced by ***, for messages and logs."""
    parts = urllib.parse.urlsplit(url)
    if parts.password is None:
        return url
    user = parts.username or ""
    host = parts.hostname or ""
    if ":" in host:
        host = f"[{host}]"
    port = f":{parts.port}" if parts.port is not None else ""
    return urllib.parse.urlunsplit(parts._replace(netloc=f"{user}:***@{host}{port}"))


def _encode_field(value: str | int | float) -> str:
    if isinstance(value, bool):
        raise ValueError(f"hash field values are str, int or float, got bool {value!r}")
    if isinstance(value, enum.Enum):
        return str(value.value)
    return value if isinstance(value, str) else repr(value)


def _text(value: bytes | str) -> str:
    # The client decodes responses; the stubs cannot know that.
    return value.decode("utf-8") if isinstance(value, bytes) else value


def _sha1(source: str) -> str:
    return hashlib.sha1(source.encode("utf-8")).hexdigest()


def _now() -> float:
    return time.time()
