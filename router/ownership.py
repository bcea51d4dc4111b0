"""Which router owns which request, and which routers are alive: leases in Redis.

Any number of routers share the workers and Redis. Each request is owned by one router
at a time, the one that places it and writes its log:

    {prefix}:routers              sorted set: router id -> when its lease ends (ms, Redis's clock)
    {prefix}:routers:address      hash: router id -> its address
    {prefix}:req:{request_id}     hash field router_id: the request's owner

The leases sit in two keys of their own, so that finding the live routers reads those keys
only. They were keys `{prefix}:router:{id}` with a TTL, found by SCAN over the whole
keyspace: one lookup cost a round trip per 500 keys of every request Redis keeps
(400,000 keys: 800 SCAN calls, 250 ms), and each router made one every renewal while a
peer had requests running. Lease ends are Redis's own time (TIME in the scripts), so the
routers' clocks need not agree. Both keys expire with the last lease in them.

A router renews its lease every lease_ttl_s / 4; the renewal answers which routers hold a
lease. When one dies its lease lapses, the peers see it gone (PeerWatch), and a peer
claims each of its active requests (a compare-and-set on router_id, so exactly one
peer does) and adopts it (router/moves.py): the request moves under its next engine key
and goes on from its log. A router adopts only once it has held its own lease for a whole
TTL without a gap, so that after a Redis outage, when every lease lapsed at once, its peers
have renewed theirs before anyone is taken for dead.

A router that was only stalled past its TTL may find its requests claimed: Redis then
refuses its writes to them (the store's fence, router/state.py), and it lets them go.

A client may cancel a request through any router. One that does not own it marks the
request's hash and tells the owner on the owner's Pub/Sub channel; the owner cancels it
as if asked itself, wherever it is (in its admission queue, where no other router can
reach it, or on a worker). A message sent while the owner was not subscribed is not lost
for good: the owner checks the marks of what it tracks each time it subscribes, and a
router that adopts a marked request ends it instead of running it.

    {prefix}:req:{request_id}     hash field cancel_requested: "1" once asked
    {prefix}:cancels:{router_id}  channel: request ids this router is asked to cancel
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Sequence
from typing import Any

import redis

from router.backoff import Backoff
from router.records import RequestStatus
from router.state import ENDED_STATUSES_LUA, RequestStore

log = logging.getLogger("kvserve.router")

# KEYS: the request's hash. ARGV: the owner seen, the claimant.
# Returns 1 when the claimant owns it now, 0 when it ended or someone else claimed it first.
_CLAIM_LUA = f"""
local ended = {ENDED_STATUSES_LUA}
local status = redis.call('HGET', KEYS[1], 'status')
if (not status) or ended[status] then return 0 end
local owner = redis.call('HGET', KEYS[1], 'router_id') or ''
if owner ~= ARGV[1] then return 0 end
redis.call('HSET', KEYS[1], 'router_id', ARGV[2])
return 1
"""


# KEYS: the request's hash. ARGV: the cancel channels' prefix, the request id.
# Returns false for no such request, else {status, owner}: a request that has not ended is
# marked and its owner, if it has one, is told.
_ASK_CANCEL_LUA = f"""
local status = redis.call('HGET', KEYS[1], 'status')
if not status then return false end
local ended = {ENDED_STATUSES_LUA}
local owner = redis.call('HGET', KEYS[1], 'router_id') or ''
if not ended[status] then
  redis.call('HSET', KEYS[1], 'cancel_requested', '1')
  if owner ~= '' then redis.call('PUBLISH', ARGV[1] .. owner, ARGV[2]) end
end
return {{status, owner}}
"""

# The time on Redis's clock, in ms (scripts may call TIME; its effects are what replicate).
_NOW_MS_LUA = """
local clock = redis.call('TIME')
local now = tonumber(clock[1]) * 1000 + math.floor(tonumber(clock[2]) / 1000)
"""

# After a change to the leases (KEYS: the leases, the addresses; `now` set): the leases
# that ended go (theirs are lapsed for everyone already), and both keys live as long as the
# longest lease left, or go with the last one.
_KEEP_FOR_LAST_LEASE_LUA = """
local ended = redis.call('ZRANGEBYSCORE', KEYS[1], '-inf', now)
for _, id in ipairs(ended) do
  redis.call('ZREM', KEYS[1], id)
  redis.call('HDEL', KEYS[2], id)
end
local last = redis.call('ZRANGE', KEYS[1], -1, -1, 'WITHSCORES')
if #last == 0 then
  redis.call('DEL', KEYS[1], KEYS[2])
else
  local keep = math.max(1, tonumber(last[2]) - now)
  redis.call('PEXPIRE', KEYS[1], keep)
  redis.call('PEXPIRE', KEYS[2], keep)
end
"""

# KEYS: the leases (sorted set), the addresses (hash). ARGV: router id, address, TTL in ms.
# Sets this router's lease end to now + TTL; returns the ids of the leases that have not ended.
_RENEW_LUA = _NOW_MS_LUA + """
redis.call('ZADD', KEYS[1], now + tonumber(ARGV[3]), ARGV[1])
redis.call('HSET', KEYS[2], ARGV[1], ARGV[2])
""" + _KEEP_FOR_LAST_LEASE_LUA + """
return redis.call('ZRANGEBYSCORE', KEYS[1], '(' .. now, '+inf')
"""

# KEYS: the leases, the addresses. ARGV: router id. Drops its lease now (a clean stop).
_RELEASE_LUA = _NOW_MS_LUA + """
redis.call('ZREM', KEYS[1], ARGV[1])
redis.call('HDEL', KEYS[2], ARGV[1])
""" + _KEEP_FOR_LAST_LEASE_LUA + """
return 1
"""

# KEYS: the leases, the addresses. Returns {id, address, id, address, ...} of the leases
# that have not ended.
_LIVE_LUA = _NOW_MS_LUA + """
local ids = redis.call('ZRANGEBYSCORE', KEYS[1], '(' .. now, '+inf')
local out = {}
for _, id in ipairs(ids) do
  out[#out + 1] = id
  out[#out + 1] = redis.call('HGET', KEYS[2], id) or ''
end
return out
"""

_CANCEL_POLL_S = 1.0  # a subscription's read waits this long at most, so its task stays responsive
_FIELDS_PER_PIPELINE = 500
PEER_SWEEP_EVERY_S = 60.0  # PeerWatch's safety net: a sweep at least this often


class UnguardedBesideGuarded(RuntimeError):
    """This router would serve without a bearer token beside routers of its cluster that
    require one: anyone reaching its port could use the workers they guard."""


GUARDS_TTL_S = 7 * 24 * 3600  # how long `{prefix}:routers:guard` outlives its last write


class OlderRouters(RuntimeError):
    """Routers of an earlier kvserve version hold leases in this Redis (keys
    `{prefix}:router:{id}`, one per router, before the leases moved to `{prefix}:routers`).
    Neither version sees the other's leases: each would take the other's routers for dead
    and claim their requests, moving them back and forth until max_migrations fails them."""


class PeerWatch:
    """When a router looks for requests that dead peers left.

    Looking (a sweep: Mover.adopt) reads Redis's whole active set and the owner of every
    request in it that this router does not track: O(requests in flight in the cluster).
    Each renewal used to sweep, every lease_ttl_s / 4 in every router, while no peer had
    died. A request can only be orphaned when its owner's lease ends, and renew() answers
    which routers hold one, so a router sweeps after a renewal only when
      - it has just become steady (its first look, or its own lease lapsed meanwhile, a
        gap in which a peer may have come and gone unseen);
      - a router it saw holding a lease at its last look holds none now (it died, stalled
        past its TTL, or stopped and released it);
      - the last sweep did not finish (Redis went away, or it raised): it is due again;
      - sweep_every_s passed since the last one: a safety net for an orphan nothing above
        announced, such as one left by a router of an older version.
    A peer cannot come and go between two looks unseen: a lease is visible for a whole TTL
    after its last renewal, and looks more than a TTL apart make this router unsteady.
    """

    def __init__(self, sweep_every_s: float = PEER_SWEEP_EVERY_S) -> None:
        if not sweep_every_s > 0:
            raise ValueError(f"sweep_every_s must be positive, got {sweep_every_s}")
        self.sweep_every_s = sweep_every_s
        self._seen: frozenset[str] | None = None  # the leases at the last steady look
        self._due: str | None = None  # why a sweep is due, until one finishes
        self._swept_at: float | None = None
        self.sweeps = 0  # sweeps finished, for tests and logs

    def due(self, live: set[str], steady: bool, now: float) -> str | None:
        """After a renewal (live: renew()'s answer; now: monotonic): why to sweep now, or
        None when nothing can have been orphaned since the last sweep."""
        if not steady:
            self._seen = None  # not a look: a lapse meanwhile may hide peers' ends
            return None
        seen, self._seen = self._seen, frozenset(live)
        if seen is None:
            self._due = self._due or "this router's lease is steady"
        elif gone := seen - live:
            self._due = f"the lease of router(s) {', '.join(sorted(gone))} ended"
        elif self._due is None and (self._swept_at is None or now - self._swept_at >= self.sweep_every_s):
            self._due = f"{self.sweep_every_s:g} s since the last sweep"
        return self._due

    def swept(self, now: float) -> None:
        """A sweep finished: nothing is due until the next end of a lease."""
        self._due = None
        self._swept_at = now
        self.sweeps += 1


class Ownership:
    """This router's lease in Redis, its peers', and claims of what a dead peer owned."""

    def __init__(self, store: RequestStore, router_id: str, ttl_s: float) -> None:
        if not ttl_s > 0:
            raise ValueError(f"lease ttl_s must be positive, got {ttl_s}")
        self.store = store
        self.router_id = router_id
        self.ttl_s = ttl_s
        self.address = ""
        self._held_since: float | None = None  # monotonic time of the first renewal since a gap
        self._renewed_at = 0.0

    @property
    def renew_interval_s(self) -> float:
        return self.ttl_s / 4

    def _lease_keys(self) -> list[str]:
        return [self.store.key("routers"), self.store.key("routers:address")]

    async def renew(self) -> set[str]:
        """Set this router's lease for another TTL; the ids of every router holding a lease
        now, this one's included (StoreUnavailable if Redis is down)."""
        ttl_ms = max(1, int(self.ttl_s * 1000))
        now = time.monotonic()
        try:
            live = await self.store.run_script(
                _RENEW_LUA, self._lease_keys(), [self.router_id, self.address, str(ttl_ms)]
            )
        except Exception:
            self._held_since = None
            raise
        if self._held_since is None or now - self._renewed_at > self.ttl_s:
            self._held_since = now  # a gap longer than the TTL: the lease lapsed meanwhile
        self._renewed_at = now
        return {str(router_id) for router_id in live}

    async def older_routers(self) -> dict[str, int]:
        """Router id -> ms left on its lease, of the routers of an earlier version (keys
        `{prefix}:router:{id}` with a TTL, which they renew). Found by SCAN over the whole
        keyspace, so only at a start (refuse_beside_older_routers)."""
        prefix = self.store.key("router:")

        async def scan(client: Any) -> dict[str, int]:
            keys = [str(key) async for key in client.scan_iter(match=prefix + "*", count=1000)]
            if not keys:
                return {}
            async with client.pipeline(transaction=False) as pipe:
                for key in keys:
                    pipe.pttl(key)
                left = await pipe.execute()
            return {key.removeprefix(prefix): int(ms) for key, ms in zip(keys, left) if int(ms) != -2}

        return dict(await self.store.call(scan))

    async def refuse_beside_older_routers(self, poll_s: float = 0.5) -> None:
        """Raise OlderRouters while routers of an earlier version hold leases here. A lease
        left by one that stopped lapses by itself: this waits for those, as long as their
        TTLs say (plus a second); one still renewed outlasts that and is named."""
        older = await self.older_routers()
        if not older:
            return
        deadline = time.monotonic() + max(max(older.values()), 0) / 1000 + 1.0
        while older and time.monotonic() < deadline:
            await asyncio.sleep(poll_s)
            older = await self.older_routers()
        if older:
            raise OlderRouters(
                f"routers of an earlier kvserve version hold leases in this Redis: {', '.join(sorted(older))} "
                f"(keys {self.store.key('router:')}ID); a router of this version cannot run beside them, since "
                f"each would take the other's routers for dead and move their requests: stop them all, then "
                f"start this version (docs/deploy.md, Upgrading the routers)"
            )

    async def release(self) -> None:
        """Drop the lease now (a clean stop): peers adopt what this router leaves at once."""
        self._held_since = None
        await self.store.run_script(_RELEASE_LUA, self._lease_keys(), [self.router_id])

    @property
    def held(self) -> bool:
        """The lease was renewed within its TTL: peers see this router alive."""
        return self._held_since is not None and time.monotonic() - self._renewed_at < self.ttl_s

    @property
    def steady(self) -> bool:
        """This router has held its lease for a whole TTL: a peer's lapsed lease means it died."""
        return self._held_since is not None and time.monotonic() - self._held_since >= self.ttl_s

    def _draining_key(self, router_id: str) -> str:
        return self.store.key(f"draining:{router_id}")

    async def mark_draining(self, for_s: float) -> None:
        """Tell peers this router is draining, for for_s seconds at most (a key with a TTL:
        a router that dies draining leaves no mark behind for long): they hand it nothing."""
        ms = max(1, int(for_s * 1000))
        await self.store.call(lambda client: client.set(self._draining_key(self.router_id), "1", px=ms))

    async def record_guard(self, guarded: bool) -> None:
        """Say in Redis whether this router requires a bearer token (`{prefix}:routers:guard`,
        router id -> "token" or "open"), for a router that starts later to compare."""
        key = self.store.key("routers:guard")

        async def write(client: Any) -> None:
            async with client.pipeline(transaction=False) as pipe:
                pipe.hset(key, self.router_id, "token" if guarded else "open")
                pipe.expire(key, GUARDS_TTL_S)
                await pipe.execute()

        await self.store.call(write)

    async def peers_by_guard(self) -> tuple[dict[str, str], dict[str, str]]:
        """Router id -> address of the other routers holding a lease: (those that require a
        token, those that said they do not). One that said nothing yet is in neither."""
        live = await self.live_routers()
        guards = await self.store.call(lambda client: client.hgetall(self.store.key("routers:guard")))
        peers = [(router_id, address) for router_id, address in live.items() if router_id != self.router_id]
        return ({r: a for r, a in peers if guards.get(r) == "token"}, {r: a for r, a in peers if guards.get(r) == "open"})

    async def clear_draining(self) -> None:
        """At a start: a mark left by this router id's previous run is not this run's."""
        await self.store.call(lambda client: client.delete(self._draining_key(self.router_id)))

    async def serving_peers(self) -> list[str]:
        """The other routers that hold a lease and are not draining: those that would adopt
        what this router hands over."""
        peers = sorted(set(await self.live_routers()) - {self.router_id})
        if not peers:
            return []
        marks = await self.store.call(lambda client: client.mget([self._draining_key(p) for p in peers]))
        return [peer for peer, mark in zip(peers, marks) if mark is None]

    async def lease_end(self, router_id: str) -> float | None:
        """When router_id's lease runs out (Redis's clock, ms), or None if it holds none. It
        moves at each renewal: one that stays put over more than ttl_s / 4 is a router that
        has stopped renewing."""
        score = await self.store.call(lambda client: client.zscore(self.store.key("routers"), router_id))
        return None if score is None else float(score)

    async def live_routers(self) -> dict[str, str]:
        """Router id -> address, of every router holding a lease now."""
        flat = await self.store.run_script(_LIVE_LUA, self._lease_keys(), [])
        return dict(zip(flat[::2], flat[1::2]))

    async def _field_of_each(self, request_ids: Sequence[str], name: str) -> list[str | None]:
        """One hash field of each request (None where it has none), in pipelines of
        _FIELDS_PER_PIPELINE: the router's loop runs its streams between two. One pipeline
        of 50,000 held the loop for 259 ms at a time, pipelines of 500 for 46 ms."""
        found: list[str | None] = []
        for start in range(0, len(request_ids), _FIELDS_PER_PIPELINE):
            chunk = request_ids[start : start + _FIELDS_PER_PIPELINE]

            async def read(client: Any, chunk: Sequence[str] = chunk) -> list[Any]:
                async with client.pipeline(transaction=False) as pipe:
                    for request_id in chunk:
                        pipe.hget(self.store.hash_key(request_id), name)
                    return list(await pipe.execute())

            found.extend(await self.store.call(read))
            await asyncio.sleep(0)
        return found

    async def owners(self, request_ids: Sequence[str]) -> dict[str, str]:
        """Request id -> its owner ("" for none, or for no record), for each of request_ids."""
        found = await self._field_of_each(request_ids, "router_id")
        return {request_id: owner or "" for request_id, owner in zip(request_ids, found)}

    async def orphans(self, request_ids: Sequence[str], include_own: bool = False) -> dict[str, str]:
        """Of request_ids, those whose owner holds no lease (or that have none): id -> owner.
        This router's own only with include_own (at its start: its previous run's; later,
        one it owns without tracking it has ended here, its end still on its way to Redis)."""
        owners = await self.owners(request_ids)
        live = await self.live_routers()
        return {
            rid: owner for rid, owner in owners.items()
            if (owner == self.router_id and include_own) or (owner != self.router_id and owner not in live)
        }

    async def claim(self, request_id: str, owner: str) -> bool:
        """Take the request over from owner: True if this router owns it now."""
        claimed = await self.store.run_script(
            _CLAIM_LUA, [self.store.hash_key(request_id)], [owner, self.router_id]
        )
        return bool(claimed)

    # -- cancels asked for through other routers ---------------------------------------

    def _cancel_channel(self, router_id: str) -> str:
        return self.store.key(f"cancels:{router_id}")

    async def ask_to_cancel(self, request_id: str) -> tuple[RequestStatus, str] | None:
        """Mark the request cancelled-on-request and tell its owner; its status and owner
        now ("" for none), or None when there is no such request."""
        answer = await self.store.run_script(
            _ASK_CANCEL_LUA, [self.store.hash_key(request_id)], [self._cancel_channel(""), request_id]
        )
        if answer is None:
            return None
        status, owner = answer
        return RequestStatus(status), owner

    async def cancel_requests(self) -> AsyncIterator[str | None]:
        """The request ids peers ask this router to cancel, for the router's life: None each
        time the subscription starts (again, after Redis was away), when the caller checks
        the marks of what it tracks (cancel_marked), since asks made meanwhile were missed."""
        backoff = Backoff(0.5, 5.0)
        channel = self._cancel_channel(self.router_id)
        while True:
            client = self.store.subscriber_client()
            try:
                async with client.pubsub(ignore_subscribe_messages=True) as pubsub:
                    await pubsub.subscribe(channel)
                    backoff.reset()
                    yield None
                    while True:
                        message = await pubsub.get_message(timeout=_CANCEL_POLL_S)
                        if message is not None and message["type"] == "message":
                            yield str(message["data"])
            except (redis.exceptions.RedisError, OSError) as exc:
                log.info("cancel requests: the subscription to %s broke (%s); subscribing again", channel, exc)
            finally:
                await client.aclose()
            await backoff.sleep()

    async def cancel_marked(self, request_ids: Sequence[str]) -> list[str]:
        """Of request_ids, those a client asked another router to cancel (StoreUnavailable
        when Redis is down)."""
        marks = await self._field_of_each(request_ids, "cancel_requested")
        return [request_id for request_id, mark in zip(request_ids, marks) if mark == "1"]
