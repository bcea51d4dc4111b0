"""Which router owns which request, and which routers are alive: leases in Redis.

Any number of routers share the workers and Redis. Each request is owned by one router
at a time, the one that places it and writes its log:

    {prefix}:router:{router_id}   string: the router's address, PX lease_ttl_s
    {prefix}:req:{request_id}     hash field router_id: the request's owner

A router renews its lease every lease_ttl_s / 4. When one dies its lease lapses, and a
peer claims each of its active requests (a compare-and-set on router_id, so exactly one
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

_CANCEL_POLL_S = 1.0  # a subscription's read waits this long at most, so its task stays responsive


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

    def _lease_key(self, router_id: str) -> str:
        return self.store.key(f"router:{router_id}")

    async def renew(self) -> None:
        """Set this router's lease for another TTL (StoreUnavailable if Redis is down)."""
        ttl_ms = max(1, int(self.ttl_s * 1000))
        now = time.monotonic()
        try:
            await self.store.call(lambda client: client.set(self._lease_key(self.router_id), self.address, px=ttl_ms))
        except Exception:
            self._held_since = None
            raise
        if self._held_since is None or now - self._renewed_at > self.ttl_s:
            self._held_since = now  # a gap longer than the TTL: the lease lapsed meanwhile
        self._renewed_at = now

    async def release(self) -> None:
        """Drop the lease now (a clean stop): peers adopt what this router leaves at once."""
        self._held_since = None
        await self.store.call(lambda client: client.delete(self._lease_key(self.router_id)))

    @property
    def held(self) -> bool:
        """The lease was renewed within its TTL: peers see this router alive."""
        return self._held_since is not None and time.monotonic() - self._renewed_at < self.ttl_s

    @property
    def steady(self) -> bool:
        """This router has held its lease for a whole TTL: a peer's lapsed lease means it died."""
        return self._held_since is not None and time.monotonic() - self._held_since >= self.ttl_s

    async def live_routers(self) -> dict[str, str]:
        """Router id -> address, of every router holding a lease now."""
        prefix = self.store.key("router:")

        async def scan(client: Any) -> dict[str, str]:
            keys = [key async for key in client.scan_iter(match=prefix + "*", count=500)]
            if not keys:
                return {}
            values = await client.mget(keys)
            return {key[len(prefix):]: value for key, value in zip(keys, values) if value is not None}

        return await self.store.call(scan)

    async def _field_of_each(self, request_ids: Sequence[str], name: str) -> list[str | None]:
        """One hash field of each request (None where it has none), in one pipeline."""
        if not request_ids:
            return []

        async def read(client: Any) -> list[Any]:
            async with client.pipeline(transaction=False) as pipe:
                for request_id in request_ids:
                    pipe.hget(self.store.hash_key(request_id), name)
                return list(await pipe.execute())

        return await self.store.call(read)

    async def owners(self, request_ids: Sequence[str]) -> dict[str, str]:
        """Request id -> its owner ("" for none), for those that still have a record."""
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
