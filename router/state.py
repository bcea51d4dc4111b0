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
        router_id          the router that owns it (router/ownership.py)
        cached_prompt_tokens  prompt tokens its worker's prefix cache held
        cancel_requested   "1" once a client asked another router to cancel it (else absent)
        cache_salt         GenerateRequest.cache_salt (absent when none)

    {prefix}:log:{request_id}   stream, one entry per engine step that gave this
                                request output, then one end marker:
        output entry   field "e": {"o": offset of the first token, "ids": [token ids],
                       "t": "text delta", "lp": [logprob objects]}  ("lp" omitted when none)
        end marker     fields "end": the ended status, "finish_reason", "error",
                       "n": num_output_tokens; written by the script that ends the request

    {prefix}:active             set of the ids of requests that have not ended

Stream entry ids are derived from output offsets, so a reader seeks by offset:

    an entry with tokens [o, e)   id e-0    (the offset just past its last token)
    a text-only entry at o        id o-k    k >= 1, after whatever already sits at o
    the end marker                id n-k    k >= 1, n = num_output_tokens

    offset   0   1   2   3   4   5
    entry  [ A   A ][ B   B   B ] C  end      A: tokens 0-1   B: tokens 2-4   C: text only
    id     A = 2-0    B = 5-0    C = 5-1    end = 5-2

Everything at offsets >= f is then exactly the ids after f-0: an entry that straddles f
(B for f = 3, id 5-0), a text-only entry at f (its id is f-k with k >= 1), and not an
entry that ends at f (id f-0). So `XRANGE key (f-0 +` reads from an offset and
`XREAD BLOCK ... STREAMS key f-0` follows from it, with no whole-log read; a follower
learns that the request ended from the marker, in the same stream, without polling.

When a request ends (FINISHED, CANCELLED or FAILED) both of its keys get
`EXPIRE ttl_seconds` and its id leaves the active set, so nothing is left without
an expiry once requests end. Every write goes through one Lua script (one call per
engine step, looping over the step's requests), which makes these guarantees hold
whatever the caller does:

- writes to an unknown (or expired) request are dropped, so no key is ever created
  without an expiry; writes to an ended request are dropped too (its log is final,
  and the first end wins: a late cancel cannot turn FINISHED into CANCELLED);
- setting a terminal status through any method ends the request (end marker, EXPIRE,
  SREM), in the same script;
- a store that has an owner (set_owner) writes only requests that owner owns, or that
  have none: a router that lost a request to a peer (its lease lapsed while it was
  stalled) cannot append to its log or end it; the write answers "fenced";
- a log entry whose offset is below `num_output_tokens`, or that equals the last
  entry, is a duplicate (a pipeline resent after a lost connection, or the recorder's
  replay of what Redis acknowledged just before an outage) and is skipped, so a retried
  step is harmless; the store sets `num_output_tokens` to the end of each entry it
  appends, and a write never lowers it.

A log entry's text delta belongs to the entry's LAST token: the text of a
multi-token entry is never split. `read_log(from_offset)` slices an entry that
starts before `from_offset` (its token ids and logprobs), but keeps its whole text,
so a reader resuming mid-entry may get text for tokens it already had. An entry
may carry text and no tokens (text the detokenizer released late, e.g. at the
end); it sits at the offset of the next token and is read from that offset.

Following live (`follow`) blocks on a connection of its own, never on the shared
pool's, and at most `StoreConfig.max_followers` follow at once per store.

A `RequestStore` belongs to the event loop that first uses it (redis.asyncio
connections are bound to their loop).
"""

from __future__ import annotations

import asyncio
import enum
import hashlib
import json
import logging
import time
import urllib.parse
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, TypeVar

import redis.asyncio
import redis.connection
import redis.exceptions
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff

from router.backoff import Backoff
from router.records import _ENDED_STATUSES, LogEnd, LogEntry, RequestRecord, RequestStatus, StepWrite
from router.redis_errors import is_transient_refusal

log = logging.getLogger("kvserve.router")

__all__ = [
    "FollowersExhausted",
    "LogEnd",
    "LogEntry",
    "RequestRecord",
    "RequestStatus",
    "RequestStore",
    "StepWrite",
    "StoreConfig",
    "StoreUnavailable",
]

_T = TypeVar("_T")

# Errors that mean "Redis is not reachable right now" rather than a bug in a command.
# AuthenticationError and BusyLoadingError (AOF still loading) are ConnectionErrors.
_UNAVAILABLE_ERRORS: tuple[type[BaseException], ...] = (
    redis.exceptions.ConnectionError,
    redis.exceptions.TimeoutError,
    asyncio.TimeoutError,
    OSError,
)

ENDED_STATUSES_LUA = "{FINISHED=true, CANCELLED=true, FAILED=true}"

# Creates several requests, in turn, each unless its id exists. KEYS: active. ARGV: ttl,
# the key prefix, then per request: its id, the number n of field/value arguments, and
# those n arguments. A request's hash and log keys are made from the prefix, as in
# _WRITE_LUA. Returns, per request in order, false when it created it, else the existing
# hash (HGETALL): a second create of one id in the same call finds the first. A request
# Redis refuses (a key of the wrong type) gets its error in its place: the script goes on
# with the others, since what it wrote before the error would stay written anyway.
_CREATE_LUA = f"""
local ttl, prefix = ARGV[1], ARGV[2]
local ended = {ENDED_STATUSES_LUA}
local function create_one(request_id, first, last)
  local hash, log = prefix .. ':req:' .. request_id, prefix .. ':log:' .. request_id
  local existing = redis.call('HGETALL', hash)
  if #existing > 0 then return existing end
  -- A log left behind by an earlier request with this id must not leak into this one.
  redis.call('DEL', log)
  redis.call('HSET', hash, unpack(ARGV, first, last))
  if ended[redis.call('HGET', hash, 'status')] then
    redis.call('EXPIRE', hash, ttl)
  else
    redis.call('SADD', KEYS[1], request_id)
  end
  return false
end
local results = {{}}
local i = 3
while i <= #ARGV do
  local n = tonumber(ARGV[i + 1])
  local ok, result = pcall(create_one, ARGV[i], i + 2, i + 1 + n)
  if not ok and type(result) ~= 'table' then result = {{err = tostring(result)}} end
  results[#results + 1] = result
  i = i + 2 + n
end
return results
"""

# One call writes a whole engine step: every request's share in turn.
# KEYS: active. ARGV: ttl, the writer's router id or "", the key prefix, and the step as
# a JSON array with one [request_id, entry JSON or "", entry offset, entry end offset,
# {field: value}] per request. A request's hash and log keys are made here from the
# prefix (see RequestStore.hash_key): declaring them would cost the router two encoded
# arguments per request per step; the store runs on one Redis node, never a cluster.
# Returns one digit per request, in order. 0: dropped (an ended request, or one never
# created), 1: applied, 2: entry was a duplicate, 3: fenced (another router owns the
# request; nothing written), 4: its record is gone (evicted under an allkeys-*
# maxmemory-policy, or deleted: its id was active or it has a log): nothing written, and
# what is left of it goes: its log gets the TTL (it had none until the end, which would
# never be recorded) and its id leaves the active set (adoption could not rebuild it, and
# every sweep read it again).
# Entry ids follow the module docstring's scheme; an id that would not be above the
# newest (only a log with a hole could ask for one) takes the next one after it, so the
# script never fails half-way. Readers trust the entry's own offsets, not its id.
_WRITE_LUA = f"""
local ended = {ENDED_STATUSES_LUA}
local ttl, owner, prefix = ARGV[1], ARGV[2], ARGV[3]
local function write_one(request_id, entry, offset, end_offset, fields)
  local hash, log = prefix .. ':req:' .. request_id, prefix .. ':log:' .. request_id
  local status = redis.call('HGET', hash, 'status')
  if not status then
    -- Gone, or never made (a create that failed: the recorder's Barrier): only a request
    -- that left a trace (its id active, or a log) was made, and then lost.
    if redis.call('SREM', KEYS[1], request_id) == 0 and redis.call('EXISTS', log) == 0 then return 0 end
    redis.call('EXPIRE', log, ttl)
    return 4
  end
  if ended[status] then return 0 end
  if owner ~= '' then
    local holder = redis.call('HGET', hash, 'router_id')
    if holder and holder ~= '' and holder ~= owner then return 3 end
  end
  local newest_ms, newest_seq, newest_fields = nil, nil, nil
  local function set_newest(id, stored)
    local dash = string.find(id, '-', 1, true)
    newest_ms = tonumber(string.sub(id, 1, dash - 1))
    newest_seq = tonumber(string.sub(id, dash + 1))
    newest_fields = stored
  end
  local function next_id(ms, first_seq)
    if newest_ms and ms <= newest_ms then return newest_ms .. '-' .. (newest_seq + 1) end
    return ms .. '-' .. first_seq
  end
  local found = redis.call('XREVRANGE', log, '+', '-', 'COUNT', 1)[1]
  if found then set_newest(found[1], found[2]) end
  local result = 1
  local logged = tonumber(redis.call('HGET', hash, 'num_output_tokens') or '0') or 0
  if entry ~= '' then
    if offset < logged or (newest_fields and newest_fields[1] == 'e' and newest_fields[2] == entry) then
      result = 2
    else
      local id
      if end_offset > offset then id = next_id(end_offset, 0) else id = next_id(offset, 1) end
      set_newest(redis.call('XADD', log, id, 'e', entry), {{'e', entry}})
    end
  end
  local pairs_ = {{}}
  for name, value in pairs(fields) do
    pairs_[#pairs_ + 1] = name
    pairs_[#pairs_ + 1] = value
  end
  if #pairs_ > 0 then redis.call('HSET', hash, unpack(pairs_)) end
  if result == 1 and entry ~= '' then
    redis.call('HSET', hash, 'num_output_tokens', tostring(end_offset))
  elseif tonumber(redis.call('HGET', hash, 'num_output_tokens') or '0') < logged then
    -- A write sent again (a replay after an outage) carries its time's count: never lower it,
    -- or the next one sent again would pass for new.
    redis.call('HSET', hash, 'num_output_tokens', tostring(logged))
  end
  local now = redis.call('HGET', hash, 'status')
  if ended[now] then
    local fields = redis.call('HMGET', hash, 'finish_reason', 'error', 'num_output_tokens')
    local total = tonumber(fields[3] or '0') or 0
    redis.call('XADD', log, next_id(total, 1), 'end', now, 'finish_reason', fields[1] or '',
               'error', fields[2] or '', 'n', tostring(total))
    redis.call('EXPIRE', hash, ttl)
    redis.call('EXPIRE', log, ttl)
    redis.call('SREM', KEYS[1], request_id)
  end
  return result
end
local results = {{}}
for i, write in ipairs(cjson.decode(ARGV[4])) do
  results[i] = write_one(write[1], write[2], write[3], write[4], write[5])
end
return table.concat(results)
"""

_json_str = json.encoder.encode_basestring_ascii  # a str as a JSON string, as json.dumps writes it
_FENCED = "3"  # what _WRITE_LUA answers (a digit in its string) for a request another router owns
_RECORD_GONE = "4"  # ... for a request whose record is not in Redis
_RECORD_GONE_SAID = 1024  # the ids write_step has warned about, kept to say each once
_PAGE = 256  # stream entries per XRANGE / XREAD reply
_FOLLOW_BLOCK_S = 5.0  # one XREAD BLOCK; after one that saw nothing the follower checks the hash
FOLLOW_OUTAGE_S = 10.0  # how long a live follower waits for Redis to come back before it gives up


class StoreUnavailable(Exception):
    """Redis could not be reached (refused, timed out, loading, or auth failed)."""


class StoreRefused(StoreUnavailable):
    """Redis refused this client's credentials (the user or password in the URL), or denies
    its user what a router needs (check_rights): waiting does not fix either, so a start
    fails on it; once serving it is an outage like any other."""


class FollowersExhausted(Exception):
    """This store already follows `max_followers` logs live; the message names the limit."""


# Connections the router's commands share (followers and subscribers hold their own): Redis
# runs one command at a time, so more would only queue there instead of here.
_POOL_CONNECTIONS = 64


@dataclass(frozen=True)
class StoreConfig:
    """Where the request store lives and how long ended requests are kept."""

    url: str = "redis://127.0.0.1:6379/0"
    prefix: str = "kvserve"
    ttl_seconds: int = 3600
    socket_timeout: float = 2.0
    # Logs followed live at once (each blocks a connection of its own in XREAD BLOCK).
    max_followers: int = 256

    def __post_init__(self) -> None:
        if urllib.parse.urlsplit(self.url).scheme not in ("redis", "rediss", "unix"):
            raise ValueError(f"url must be a redis://, rediss:// or unix:// URL, got {mask_url(self.url)!r}")
        if not self.prefix or any(c.isspace() for c in self.prefix):
            raise ValueError(f"prefix must be non-empty without whitespace, got {self.prefix!r}")
        if self.ttl_seconds < 1:
            raise ValueError(f"ttl_seconds must be at least 1, got {self.ttl_seconds}")
        if not self.socket_timeout > 0:
            raise ValueError(f"socket_timeout must be positive, got {self.socket_timeout}")
        if self.max_followers < 1:
            raise ValueError(f"max_followers must be at least 1, got {self.max_followers}")


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
        self._num_followers = 0
        self._owner = ""  # set_owner: the router whose writes this store fences
        self._create_sha = _sha1(_CREATE_LUA)
        self._write_sha = _sha1(_WRITE_LUA)
        self._gone_said: dict[str, None] = {}  # requests whose record write_step found gone, in order

    @property
    def config(self) -> StoreConfig:
        return self._config

    def set_owner(self, router_id: str) -> None:
        """Write from now on as router_id: a request another router owns is not written."""
        self._owner = router_id

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
        result = (await self.create_many([record]))[0]
        if isinstance(result, redis.exceptions.ResponseError):
            raise result
        return result

    async def create_many(
        self, records: Sequence[RequestRecord]
    ) -> list[RequestRecord | None | redis.exceptions.ResponseError]:
        """create() for each record, in order, in ONE script call (one round trip). A record
        Redis refused gets the error in its place; the others are created all the same."""
        if not records:
            return []
        args = [str(self._config.ttl_seconds), self._config.prefix]
        for record in records:
            fields = record.to_fields()
            args += (record.request_id, str(2 * len(fields)))
            for name, value in fields.items():
                args += (name, value)
        results = (await self._run_scripts([(self._create_sha, _CREATE_LUA, [self._active_key()], args)]))[0]
        created: list[RequestRecord | None | redis.exceptions.ResponseError] = []
        for record, result in zip(records, results, strict=True):
            if isinstance(result, redis.exceptions.ResponseError):
                created.append(result)
                continue
            if not result:
                created.append(None)
                continue
            fields = {_text(k): _text(v) for k, v in zip(result[0::2], result[1::2])}
            created.append(RequestRecord.from_fields(record.request_id, fields))
        return created

    async def get(self, request_id: str) -> RequestRecord | None:
        """The request's record, or None when there is none (never created, or expired)."""
        raw = await self._call(lambda client: client.hgetall(self.hash_key(request_id)))
        if not raw:
            return None
        return RequestRecord.from_fields(request_id, {_text(k): _text(v) for k, v in raw.items()})

    async def update(self, request_id: str, **fields: str | int | float) -> None:
        """Set hash fields of a live request; dropped if it is unknown or has ended."""
        await self.write_step([StepWrite(request_id, None, fields)])

    async def write_step(self, writes: Sequence[StepWrite]) -> list[str]:
        """Apply one engine step's writes for every request in it, in ONE script call.
        Returns the ids of requests another router owns, whose writes were fenced."""
        if not writes:
            return []
        # What json.dumps would write, built by hand: this runs for every token.
        step = "[" + ",".join(
            f"[{_json_str(write.request_id)},{_json_str(write.entry_json)},{write.offset},{write.end_offset},{{"
            + ",".join(f"{_json_str(name)}:{_json_str(_encode_field(value))}" for name, value in write.fields.items())
            + "}]"
            for write in writes
        ) + "]"
        args = [str(self._config.ttl_seconds), self._owner, self._config.prefix, step]
        results = _text((await self._run_scripts([(self._write_sha, _WRITE_LUA, [self._active_key()], args)]))[0])
        if _RECORD_GONE in results:  # rare: the per-step common case skips the loop
            self._say_records_gone(writes, results)
        return [write.request_id for write, result in zip(writes, results) if result == _FENCED]

    def _say_records_gone(self, writes: Sequence[StepWrite], results: str) -> None:
        """Warn once per request whose record write_step found gone (_WRITE_LUA's 4)."""
        for write, result in zip(writes, results):
            if result == _RECORD_GONE and write.request_id not in self._gone_said:
                self._gone_said[write.request_id] = None
                if len(self._gone_said) > _RECORD_GONE_SAID:
                    self._gone_said.pop(next(iter(self._gone_said)))
                log.warning(
                    "request %s: its record is gone from Redis, so its writes are dropped (GetRequest and a Stream "
                    "from Redis no longer find it, nor can a router adopt it). Evicted? Redis must keep kvserve's "
                    "keys: maxmemory-policy noeviction or volatile-* (a running request's keys have no expiry)",
                    write.request_id,
                )

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
        await self.write_step([self.finish_write(request_id, status, finish_reason, error, finished_at)])

    @staticmethod
    def finish_write(
        request_id: str,
        status: RequestStatus,
        finish_reason: str = "",
        error: str = "",
        finished_at: float | None = None,
    ) -> StepWrite:
        """finish() as a StepWrite, for a write_step that carries other writes too."""
        if not status.is_finished:
            raise ValueError(f"status must be FINISHED, CANCELLED or FAILED, got {status.value}")
        fields: dict[str, str | int | float] = {
            "status": status.value,
            "finish_reason": finish_reason,
            "error": error,
            "finished_at": _now() if finished_at is None else finished_at,
        }
        return StepWrite(request_id, None, fields)

    async def read_log(self, request_id: str, from_offset: int = 0) -> list[LogEntry]:
        """Log entries covering output offsets >= `from_offset`, in order.

        An entry that straddles `from_offset` is sliced to start there (token ids and
        logprobs); its text is not split and comes whole with the slice. Reads from the
        offset on (XRANGE from `from_offset`-0, in pages), never the entries before it.
        """
        entries = []
        async for item in self._log_items(request_id, _StreamCursor.at(from_offset)):
            if isinstance(item, LogEntry):
                entries.append(item)
        return entries

    async def follow(self, request_id: str, from_offset: int = 0) -> AsyncGenerator[LogEntry | LogEnd, None]:
        """The log from `from_offset` on as it grows: entries (sliced as in read_log), then
        the end, once; nothing after it.

        What is there already is read without blocking; then it waits with XREAD BLOCK on a
        connection of its own (raises FollowersExhausted when `max_followers` already wait).
        A log with no marker ends as the hash says once it has ended, or with a FAILED end
        ("record expired") once it is gone; the hash is read only after a BLOCK of
        _FOLLOW_BLOCK_S that saw nothing. Close it (aclose) when leaving it early.
        """
        cursor = _StreamCursor.at(from_offset)
        async for item in self._log_items(request_id, cursor):
            yield item
            if isinstance(item, LogEnd):
                return
        if cursor.last_id == f"{from_offset}-0" and from_offset > 0:
            # Nothing at or past from_offset yet. If it is past the log's end, what comes next
            # (the end marker too) gets an id below from_offset-0, which an XREAD from there
            # would never see: follow from the newest entry instead (the cursor drops what
            # lies below from_offset), and if that entry is the end, the request has ended.
            newest: Any = await self._call(lambda client: client.xrevrange(self._log_key(request_id), count=1))
            if not newest:
                cursor.last_id = "0-0"  # no entry yet
            for entry_id, fields in _stream_entries(newest):
                if _id_pair(entry_id) > _id_pair(cursor.last_id):
                    # A step landed between the two reads, at or past from_offset (and the end
                    # may be right behind it): read it from from_offset, as above.
                    async for item in self._log_items(request_id, cursor):
                        yield item
                        if isinstance(item, LogEnd):
                            return
                elif "end" in fields:
                    yield LogEnd.from_fields(fields)
                    return
                else:
                    cursor.last_id = entry_id
        # Caught up: wait for more on a connection of its own.
        if self._num_followers >= self._config.max_followers:
            raise FollowersExhausted(
                f"this router already follows {self._num_followers} requests live from Redis "
                f"(max_followers={self._config.max_followers})"
            )
        self._num_followers += 1
        follower = self._follower_client()
        try:
            outage_since: float | None = None
            backoff = Backoff(0.05, 1.0)
            while True:
                try:
                    with self._unavailable_as_store_error():
                        reply: Any = await follower.xread(
                            {self._log_key(request_id): cursor.last_id}, count=_PAGE, block=int(_FOLLOW_BLOCK_S * 1000)
                        )
                except StoreUnavailable:
                    # Redis restarting (the embedded one is back within about a second, then
                    # loads its AOF): a live follower waits it out from where it was, rather
                    # than cut off a client that would re-attach to the same place.
                    now = time.monotonic()
                    if outage_since is None:
                        outage_since = now
                        backoff.reset()
                    if now - outage_since >= FOLLOW_OUTAGE_S:
                        raise
                    await backoff.sleep()
                    continue
                outage_since = None
                if not reply:
                    record = await self.get(request_id)
                    if record is not None and not record.is_finished:
                        continue
                    # Ended (or gone) while nothing came: what landed since, then its end.
                    async for item in self._log_items(request_id, cursor):
                        yield item
                        if isinstance(item, LogEnd):
                            return
                    yield LogEnd.of_record(record) if record is not None else _GONE
                    return
                for entry_id, fields in _stream_entries(reply[0][1]):
                    taken = cursor.take(entry_id, fields)
                    if taken is not None:
                        yield taken
                        if isinstance(taken, LogEnd):
                            return
        finally:
            self._num_followers -= 1
            await follower.aclose()

    async def _log_items(self, request_id: str, cursor: _StreamCursor) -> AsyncIterator[LogEntry | LogEnd]:
        """What the log holds now after the cursor, in pages of XRANGE on the shared pool;
        the cursor moves along."""
        while True:
            start = "(" + cursor.last_id
            page: Any = await self._call(
                lambda client: client.xrange(self._log_key(request_id), start, "+", count=_PAGE)
            )
            for entry_id, fields in _stream_entries(page):
                item = cursor.take(entry_id, fields)
                if item is not None:
                    yield item
            if len(page) < _PAGE:
                return

    @property
    def num_followers(self) -> int:
        """Logs followed live now (each holding a connection of its own)."""
        return self._num_followers

    def _follower_client(self) -> redis.asyncio.Redis:
        # One connection, its own: a blocked XREAD never holds a connection others wait for.
        # Its reads may wait a whole BLOCK, so its socket timeout is longer by that much.
        return redis.asyncio.Redis.from_url(
            self._config.url,
            decode_responses=True,
            single_connection_client=True,
            socket_timeout=_FOLLOW_BLOCK_S + self._config.socket_timeout,
            socket_connect_timeout=self._config.socket_timeout,
            retry=Retry(NoBackoff(), 1, supported_errors=(redis.exceptions.ConnectionError,)),
        )

    def subscriber_client(self) -> redis.asyncio.Redis:
        """A client of its own for a Pub/Sub subscription: one connection that waits for
        messages as long as there are none (its reads poll with a timeout of their own)."""
        return redis.asyncio.Redis.from_url(
            self._config.url,
            decode_responses=True,
            single_connection_client=True,
            socket_timeout=None,
            socket_connect_timeout=self._config.socket_timeout,
        )

    async def active_ids(self) -> list[str]:
        """Ids of requests that have not ended, sorted."""
        members = await self._call(lambda client: client.smembers(self._active_key()))
        return sorted(_text(member) for member in members)

    async def ttl(self, request_id: str) -> tuple[int, int]:
        """Seconds to live of (hash, log): -1 no expiry, -2 no such key (Redis's TTL)."""

        async def both(client: redis.asyncio.Redis) -> list[int]:
            async with client.pipeline(transaction=False) as pipe:
                pipe.ttl(self.hash_key(request_id))
                pipe.ttl(self._log_key(request_id))
                return list(await pipe.execute())

        hash_ttl, log_ttl = await self._call(both)
        return int(hash_ttl), int(log_ttl)

    def hash_key(self, request_id: str) -> str:
        """The key of a request's hash (router/ownership.py reads its owner there)."""
        return f"{self._config.prefix}:req:{request_id}"

    def _log_key(self, request_id: str) -> str:
        return f"{self._config.prefix}:log:{request_id}"

    def _active_key(self) -> str:
        return f"{self._config.prefix}:active"

    def _redis(self) -> redis.asyncio.Redis:
        loop = asyncio.get_running_loop()
        if self._client is not None and self._loop is not loop:
            if self._loop is not None and not self._loop.is_closed():
                raise RuntimeError("a RequestStore is used from one event loop only")
            # Its loop is gone (e.g. an earlier asyncio.run): so are its connections.
            self._client = None
        if self._client is None:
            # A pool that waits for a free connection (up to socket_timeout) when all are in
            # use: redis-py's default pool raises MaxConnectionsError past its 100 (redis-py
            # 8), and a burst of 320 requests got UNAVAILABLE "Too many connections" from it.
            pool = redis.asyncio.BlockingConnectionPool.from_url(
                self._config.url,
                max_connections=_POOL_CONNECTIONS,
                timeout=self._config.socket_timeout,
                decode_responses=True,
                socket_timeout=self._config.socket_timeout,
                socket_connect_timeout=self._config.socket_timeout,
                # One immediate retry on a connection error only: it turns a pooled
                # connection that died with a restarted Redis into a fresh one, while a
                # Redis that is really down still fails within one timeout. Timeouts are
                # not retried: the command may have run.
                retry=Retry(NoBackoff(), 1, supported_errors=(redis.exceptions.ConnectionError,)),
            )
            self._client = redis.asyncio.Redis.from_pool(pool)  # closing the client closes the pool
            self._loop = loop
        return self._client

    def key(self, name: str) -> str:
        """A key of this store's prefix, for the other parts that keep state beside it."""
        return f"{self._config.prefix}:{name}"

    async def call(self, operation: Callable[[redis.asyncio.Redis], Awaitable[_T]]) -> _T:
        """Run operation on the shared pool; StoreUnavailable when Redis cannot be reached."""
        return await self._call(operation)

    async def check_rights(self) -> None:
        """Raise StoreRefused when this Redis user may not do what a router does beyond its
        keys: load and run scripts, and publish and subscribe on the prefix's channels (a Cancel
        through another router). Redis 7 gives a user made as `~{prefix}:*` no channel at
        all (acl-pubsub-default resetchannels): its routers logged a broken subscription
        twice a second for ever, and a Cancel through a peer answered INTERNAL with a Lua
        error (an outside check). README, Redis, names the rights."""

        async def probe(client: redis.asyncio.Redis) -> None:
            # What it sends: scripts by SCRIPT LOAD and EVALSHA (never EVAL), and PUBLISH.
            await client.evalsha(await client.script_load("return 1"), 0)
            await client.publish(self.key("cancels:rights-check"), "")

        try:
            await self._call(probe)
        except redis.exceptions.ResponseError as error:  # NOPERM; or EVAL renamed away, an unknown command
            if is_transient_refusal(error):
                raise StoreUnavailable(f"Redis at {mask_url(self._config.url)} is unavailable: {error}") from error
            raise StoreRefused(
                f"Redis at {mask_url(self._config.url)} does not let this user do what a router needs ({error}): "
                f"it needs the keys ~{self._config.prefix}:*, the channels &{self._config.prefix}:* and "
                f"+@all -@dangerous, SCRIPT and EVALSHA included (README, Redis)"
            ) from error

    async def run_script(self, source: str, keys: list[str], args: list[str]) -> Any:
        """EVALSHA source (loaded if Redis lacks it); StoreUnavailable as any call."""
        return (await self._run_scripts([(_sha1(source), source, keys, args)]))[0]

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
        if len(calls) == 1:  # a pipeline costs ~45 us of CPU more than the call itself
            sha, _source, keys, args = calls[0]
            try:
                return [await client.evalsha(sha, len(keys), *keys, *args)]
            except redis.exceptions.ResponseError as error:
                return [error]
        async with client.pipeline(transaction=False) as pipe:
            for sha, _source, keys, args in calls:
                pipe.evalsha(sha, len(keys), *keys, *args)
            return list(await pipe.execute(raise_on_error=False))

    @contextmanager
    def _unavailable_as_store_error(self) -> Iterator[None]:
        try:
            yield
        except redis.exceptions.AuthenticationError as error:
            raise StoreRefused(
                f"Redis at {mask_url(self._config.url)} refused the credentials in its URL (the user and password "
                f"of --redis-url: redis://[USER]:PASSWORD@HOST:PORT/DB): {type(error).__name__}: {error}"
            ) from error
        except _UNAVAILABLE_ERRORS as error:
            raise StoreUnavailable(
                f"Redis at {mask_url(self._config.url)} is unavailable: {type(error).__name__}: {error}"
            ) from error


class _StreamCursor:
    """Decodes stream entries read after `last_id`, keeping what reaches `from_offset`."""

    def __init__(self, last_id: str, from_offset: int) -> None:
        self.last_id = last_id
        self.from_offset = from_offset

    @classmethod
    def at(cls, from_offset: int) -> _StreamCursor:
        """Before everything at offsets >= from_offset: the id from_offset-0 (module docstring)."""
        if from_offset < 0:
            raise ValueError(f"from_offset must be >= 0, got {from_offset}")
        return cls(f"{from_offset}-0", from_offset)

    def take(self, entry_id: str, fields: dict[str, str]) -> LogEntry | LogEnd | None:
        self.last_id = entry_id
        if "end" in fields:
            return LogEnd.from_fields(fields)
        entry = LogEntry.from_json(fields["e"])
        # The id located it; the entry's own offsets decide (see _WRITE_LUA on holes).
        if entry.end_offset > self.from_offset or (not entry.token_ids and entry.offset >= self.from_offset):
            return entry.starting_at(self.from_offset)
        return None


# A follower whose request's record is gone (expired, or lost with Redis) ends with this.
_GONE = LogEnd(RequestStatus.FAILED, "error", "record expired", 0)


_PERCENT_ENCODE = ("percent-encode the password's special characters (@ : / # ? % as %40 %3A %2F %23 %3F %25)")


def _cut_by_a_special_character(url: str) -> bool:
    """Whether an unencoded '#', '/', '?' or '@' of a password cut the URL where it should
    not be cut: a fragment (no Redis URL has one), or, in a redis:// or rediss:// URL, an
    '@' in the db path, or one after a netloc with no host (where user info ends: the
    password's start was read as a port). `redis://:2024#Secure@host:6379/0` and
    `redis://:2024?Secure=1@host:6379/0` read as port 2024 with no host and no password,
    which redis-py takes without a word (two reviews' finds). A unix socket's path may hold
    an '@', and a query's password value may."""
    if "#" in url:
        return True
    parts = urllib.parse.urlsplit(url)
    if parts.scheme not in ("redis", "rediss"):
        return False
    after_netloc = url.partition("://")[2][len(parts.netloc):]
    return "@" in parts.path or (not parts.hostname and "@" in after_netloc)


def redis_url_problem(url: str) -> str | None:
    """Why redis-py cannot read url as meant, without quoting any of it (a password with an
    unencoded '/' or '@' is cut into host and port, which redis-py's message quotes), or
    None when it can."""
    if _cut_by_a_special_character(url):
        return f"a special character cuts it where it should not be cut: {_PERCENT_ENCODE}"
    try:
        redis.connection.parse_url(url)  # type: ignore[no-untyped-call]
    except ValueError as exc:
        if "scheme" in str(exc):
            return "it is not a Redis URL (redis://, rediss:// or unix://)"
        return f"its host and port cannot be read: {_PERCENT_ENCODE}"
    return None


def mask_url(url: str) -> str:
    """The URL with its password replaced by ***, for messages and logs: in the user info,
    and in the query (`?password=`, redis-py's form for a unix socket). A URL an unencoded
    character of its password cut (_cut_by_a_special_character) shows its scheme only."""
    if _cut_by_a_special_character(url):
        return url.partition("://")[0] + "://***"
    head, sep, query = url.partition("?")
    if query:
        pairs = urllib.parse.parse_qsl(query, keep_blank_values=True)
        if any(key == "password" for key, _ in pairs):
            query = urllib.parse.urlencode([(k, "***" if k == "password" else v) for k, v in pairs], safe="*")
    parts = urllib.parse.urlsplit(head)
    if parts.password is not None:
        user = parts.username or ""
        host = parts.hostname or ""
        if ":" in host:
            host = f"[{host}]"
        port = f":{parts.port}" if parts.port is not None else ""
        head = urllib.parse.urlunsplit(parts._replace(netloc=f"{user}:***@{host}{port}"))
    return head + sep + query


def _encode_field(value: str | int | float) -> str:
    if isinstance(value, bool):
        raise ValueError(f"hash field values are str, int or float, got bool {value!r}")
    if isinstance(value, enum.Enum):
        return str(value.value)
    return value if isinstance(value, str) else repr(value)


def _id_pair(entry_id: str) -> tuple[int, int]:
    """A stream entry id "ms-seq" as numbers, in the order Redis keeps them."""
    ms, _, seq = entry_id.partition("-")
    return int(ms), int(seq)


def _stream_entries(raw: Any) -> list[tuple[str, dict[str, str]]]:
    """An XRANGE reply (or one stream's part of an XREAD reply) as (id, fields) pairs."""
    return [(_text(entry_id), {_text(k): _text(v) for k, v in fields.items()}) for entry_id, fields in raw]


def _text(value: bytes | str) -> str:
    # The client decodes responses; the stubs cannot know that.
    return value.decode("utf-8") if isinstance(value, bytes) else value


def _sha1(source: str) -> str:
    return hashlib.sha1(source.encode("utf-8")).hexdigest()


def _now() -> float:
    return time.time()
