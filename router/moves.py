"""Moves and adoption: requests that lose their worker, or their router, go on elsewhere.

A request whose worker died moves: its prompt plus the tokens it already produced are
prefilled on another worker and generation goes on at the next offset; with the sampler
keyed on (seed, position) the output equals an uninterrupted run. Moves are counted and
capped (max_migrations). A restarted router adopts the requests Redis holds as active:
each is rebuilt from its record and its logged output and moves the same way.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import TYPE_CHECKING, Any

from router.backoff import Backoff
from router.errors import Cancelled, ResourceExhausted, Unavailable
from router.ownership import PeerWatch
from router.records import sampling_params
from router.recorder import StepOp
from router.state import RequestRecord, RequestStatus, StepWrite, StoreUnavailable
from router.tracker import RequestTracker, split_engine_key
from router.validation import prompt_block_hashes
from workers.engine.config import blocks_for_tokens
from workers.engine.request import FinishReason

if TYPE_CHECKING:
    from router.core import Router
    from router.placement import WorkerView

log = logging.getLogger("kvserve.router")


class Mover:
    """The router's moves: off a dead worker, and in from Redis after a restart."""

    def __init__(self, router: Router) -> None:
        self.router = router
        self.peer_watch = PeerWatch()
        # Requests being taken over (claimed, their log being read, not tracked yet): id ->
        # whether a cancel was asked meanwhile. The ask reaches this router then, finds no
        # tracker, and would be dropped: the request would run to its end.
        self._taking: dict[str, bool] = {}

    async def move_all_off(self, view: WorkerView, why: str) -> None:
        """The worker is dead: move each request it ran to another worker."""
        router = self.router
        router.notify("worker_dead", view)
        handle = router.registry.handle(view.worker_id)
        for key in list(view.outstanding):
            view.release(key)
            request_id, attempt = split_engine_key(key)
            # A worker that was only silent (a frozen process, a hung step) may come back: it
            # must not go on with requests that now run elsewhere.
            if handle is not None:
                try:
                    handle.abort.remote(key)
                except Exception:  # noqa: BLE001 - a dead actor refuses calls
                    pass
            tracker = router.trackers.get(request_id)
            # A request still on its way there (worker_id unset) is re-placed by _admit.
            if tracker is not None and tracker.num_migrations == attempt and tracker.worker_id == view.worker_id:
                await self.move(tracker, f"worker {view.worker_id} died ({why})")

    async def move(self, tracker: RequestTracker, why: str) -> None:
        """Re-place a request that lost its worker, resuming from its output so far; or end
        it, clearly, when it was cancelled or has moved max_migrations times already."""
        router = self.router
        if tracker.finished:
            return
        if tracker.cancel_requested:
            await router.end(tracker, FinishReason.CANCELLED, None)
            return
        max_migrations = router.config.max_migrations
        if tracker.num_migrations >= max_migrations:
            await router.end(
                tracker,
                FinishReason.ERROR,
                f"{why}; the request already moved {tracker.num_migrations} times (max_migrations={max_migrations})",
            )
            return
        moved_from = tracker.worker_id
        tracker.num_migrations += 1
        tracker.worker_id = ""
        tracker.num_cached_tokens = 0  # Usage's is of the placement that finishes it: the next one's
        log.info("request %s moves off %s (%s), resuming at token %d", tracker.request_id, moved_from, why,
                 tracker.num_output_tokens)
        router.notify("migrated", (tracker, moved_from))
        await router.recorder.record(
            [StepOp(router.store, [StepWrite(tracker.request_id, None, {
                "num_migrations": tracker.num_migrations, "status": RequestStatus.QUEUED.value, "worker_id": "",
                "cached_prompt_tokens": 0})])]
        )
        router.spawn(self._resume(tracker))

    async def _resume(self, tracker: RequestTracker) -> None:
        router = self.router
        try:
            await router.place_and_send(tracker, None, resumed=True)
        except asyncio.CancelledError:
            if tracker.cancel_requested:  # cancelled while it waited for a worker
                await router.end(tracker, FinishReason.CANCELLED, None)
            # else the router is closing: the request stays active in Redis, to be adopted
            raise
        except Cancelled:  # cancelled while it waited for room: by its client, or by a drain (its reason)
            await router.end(tracker, FinishReason.CANCELLED, tracker.cancel_reason)
        except Unavailable:  # let go to another router while it waited: that router ends it
            pass
        except ResourceExhausted as exc:
            if not tracker.accepted_at:  # adopted, and no worker ever took it: refused as a new one is
                await router.end(tracker, FinishReason.ERROR, str(exc))
                return
            await router.end(
                tracker,
                FinishReason.ERROR,
                f"its worker died and no live worker took it over within max_queue_wait_s="
                f"{router.config.max_queue_wait_s:g} s ({len(router.alive_workers)} alive)",
            )
        except Exception as exc:  # noqa: BLE001 - e.g. Redis down while it was sent again
            await router.end(tracker, FinishReason.ERROR, f"could not resume after a move: {exc}")

    async def adopt(self, include_own: bool = False) -> int:
        """Take over the requests no live router owns (Redis's active set, each owned by a
        router whose lease has lapsed, or by none; with include_own, at start, also this
        router id's, left by its previous run): each is claimed, re-placed from its prompt
        and its logged output, and goes on; clients re-attach with
        Stream(request_id, from_offset). Returns how many were adopted."""
        router = self.router
        assert router.limits is not None, "adopt() needs registered workers"
        if router.draining:
            return 0  # it takes no new work; a peer that is not draining adopts them
        ownership = router.ownership
        candidates = [request_id for request_id in await router.store.active_ids() if request_id not in router.trackers]
        adopted = 0
        for request_id, owner in (await ownership.orphans(candidates, include_own)).items():
            if request_id in router.trackers or not await ownership.claim(request_id, owner):
                continue  # a peer claimed it first, or it ended meanwhile
            adopted += await self._take_claimed(request_id, owner)
        if adopted:
            log.warning("adopted %d in-flight requests from Redis", adopted)
        return adopted

    async def end_cancelled(self, request_id: str, owner: str) -> bool:
        """Claim a request marked cancelled from its owner, which has not ended it and has
        stopped renewing its lease (it died; the lease has not lapsed yet), and end it here:
        CANCELLED in Redis, its placement stopped. An owner that comes back finds its writes
        to it refused (router/ownership.py) and lets it go. False if another router claimed
        it first, or it ended meanwhile."""
        router = self.router
        if request_id in router.trackers or not await router.ownership.claim(request_id, owner):
            return False
        return bool(await self._take_claimed(request_id, owner, adopted=False))

    def cancel_asked(self, request_id: str) -> None:
        """A cancel asked of this router for a request it does not track: kept, if it is
        taking that request over, for when it does."""
        if request_id in self._taking:
            self._taking[request_id] = True

    async def _take_claimed(self, request_id: str, owner: str, adopted: bool = True) -> int:
        """A request this router has just claimed from owner: track it, stop its old
        placement, and move it here (or end it, if a client asked to cancel it). 1 if it was
        taken, 0 if it had ended or cannot be rebuilt. adopted: counted as an adoption (not
        for a cancel's claim, which ends it)."""
        router = self.router
        self._taking[request_id] = False
        try:
            record = await router.store.get(request_id)
            if record is None or record.is_finished:
                return 0
            tracker = await self._tracker_from_record(record)
            if tracker is None:
                return 0
            router.trackers[request_id] = tracker
        finally:
            cancel_asked = self._taking.pop(request_id)
        if adopted:
            router.notify("adopted", (tracker, owner))
        # Its placement may still be running: stop it where it runs, or, where Redis does
        # not say (a QUEUED record: the RUNNING write, or a move's, had not landed), on
        # every worker. Then it moves, under the next engine key, so nothing the old
        # placement still sends is taken for the new one's.
        if record.status is RequestStatus.RUNNING:
            handles = [router.registry.handle(record.worker_id)]
        else:
            handles = [router.registry.handle(view.worker_id) for view in router.workers.values()]
        for handle in handles:
            if handle is not None:
                router.spawn(quietly(handle.abort.remote(tracker.engine_key)))
        tracker.worker_id = record.worker_id
        if record.cancel_requested or cancel_asked:
            # A client cancelled it through another router while its owner was away, or
            # while this router was taking it over.
            await router.end(tracker, FinishReason.CANCELLED, None)
            return 1
        if owner == router.router_id or not owner:
            why = "adopted by a restarted router"
        else:
            why = f"adopted from router {owner}, whose lease lapsed"
        await self.move(tracker, why)
        return 1

    async def hold_lease_and_watch_peers(self) -> None:
        """Renew this router's lease, and adopt what a peer leaves when its lease lapses
        (peer_watch says when to look); for the router's life. Redis down: retried at the
        next renewal."""
        ownership = self.router.ownership
        while True:
            try:
                live = await ownership.renew()
                # Each renewal says this router's guard again and compares it with its peers':
                # one that came since, or was not seen at the start (Redis down then).
                problem = await self.router.check_guards()
                if problem is not None:
                    self.router.found_unguarded(problem)
                why = self.peer_watch.due(live, ownership.steady, time.monotonic())
                if why is not None:
                    log.debug("looking for requests dead routers left: %s", why)
                    await self.adopt()
                    self.peer_watch.swept(time.monotonic())
            except StoreUnavailable as exc:
                log.info("router lease: Redis is unavailable (%s); retrying", exc)
            except Exception:  # noqa: BLE001 - the lease must outlive any failure
                log.exception("router lease: a renewal or an adoption failed; going on")
            await asyncio.sleep(ownership.renew_interval_s)

    async def adopt_when_redis_returns(self) -> None:
        """adopt(include_own=True), as at a start, retrying with backoff while Redis is unavailable.
        The lease is taken first, as create() does: requests claimed under a lapsed lease
        look like a dead router's to peers (and ClusterStatus would not list this router)."""
        backoff = Backoff(0.5, 5.0)
        ownership = self.router.ownership
        while True:
            try:
                if not ownership.held:
                    await ownership.renew()
                await self.adopt(include_own=True)
                return
            except StoreUnavailable as exc:
                log.info("adoption waits for Redis: %s", exc)
                await backoff.sleep()

    async def _tracker_from_record(self, record: RequestRecord) -> RequestTracker | None:
        router = self.router
        assert router.limits is not None
        try:
            params = sampling_params(record.sampling)
        except Exception as exc:  # noqa: BLE001 - a record this router cannot read
            log.error("cannot adopt %s: its sampling is unreadable: %s", record.request_id, exc)
            await quietly(router.store.finish(record.request_id, RequestStatus.FAILED, FinishReason.ERROR.value,
                                              f"could not be adopted: {exc}"))
            return None
        entries = await router.store.read_log(record.request_id, 0)
        block_size = router.limits.block_size
        tracker = RequestTracker(
            record.request_id,
            tuple(record.prompt_ids),
            params,
            blocks_for_tokens(len(record.prompt_ids) + params.max_tokens - 1, block_size),
            block_hashes=prompt_block_hashes(tuple(record.prompt_ids), block_size, record.cache_salt or None),
            cache_salt=record.cache_salt or None,
            created_at=record.created_at,
            num_migrations=record.num_migrations,
        )
        for entry in entries:
            tracker.output_ids.extend(entry.token_ids)
            tracker.num_text_chars += len(entry.text)
        tracker.first_token_at = record.first_token_at
        # A worker took it before: its queue time was observed then, not again here. (Not
        # from its status: a placement a worker refused leaves RUNNING, and an adoption
        # counts as a move.)
        tracker.accepted_at = record.accepted_at
        return tracker


async def quietly(awaitable: Any) -> None:
    try:
        await awaitable
    except Exception as exc:  # noqa: BLE001 - best effort during failure handling
        log.debug("ignored during cleanup: %s", exc)
