"""The workers a router knows: their views and actor handles, the reader of each one's
event stream, and the liveness rules that say when one is dead.

A worker is dead when its stream ends (the actor died), when it is silent for
worker_timeout_s (a frozen process), or when its engine makes no step for
progress_timeout_s while it has requests (a hung step). A worker that comes back (a Ray
restart, or a thaw) rejoins. Only the stream itself decides liveness: a failure while the
router handles a batch (Redis refusing a write, a bug) is logged and the worker stays.

Each router reads a stream of its own from each worker, named by its router id: every
worker's KV reports and prefix-cache events, and the token events of the requests this
router placed (workers/actor.py). A worker joins placement only once its stream has
delivered its first batch: the stream is then this router's.

The stream is a TCP connection to the worker actor (workers/events_wire.py; Ray carries
the calls), with backpressure in bytes: past events_wire.BUFFER_BYTES in each buffer on
the way to a router that has not taken them, the actor merges the steps it produces into
one batch (workers/actor.py), so a busy router costs the worker bounded memory.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any

from router.backoff import Backoff
from router.placement import ViewColumns, WorkerView
from router.prefix_index import PrefixIndex
from workers.events_wire import EventsConnection
from workers.messages import AddRefused, AddRequest, StepBatch, WorkerInfo, WorkerLoadError

log = logging.getLogger("kvserve.router")

JOIN_TIMEOUT_S = 30.0  # how long add() waits for a worker's first batch


class WorkerLeft(Exception):
    """A worker's stream ended before it joined."""

OnBatch = Callable[[WorkerView, StepBatch], Awaitable[None]]
OnDead = Callable[[WorkerView, str], Awaitable[None]]
OnJoin = Callable[[WorkerInfo], None]


class WorkerRegistry:
    """Owns the worker views, their handles and the tasks that follow them.

    on_join(info) runs when a worker (re)joins, before its stream is read; on_batch(view,
    batch) for each batch it sends; on_dead(view, why) once when it is declared dead
    (its requests are the caller's to move)."""

    def __init__(
        self,
        worker_timeout_s: float,
        progress_timeout_s: float,
        prefix_index: PrefixIndex,
        count_seq_slots: bool,
        on_join: OnJoin,
        on_batch: OnBatch,
        on_dead: OnDead,
        router_id: str = "",
    ) -> None:
        self.router_id = router_id  # the worker's stream for this router carries this router's tokens
        self.worker_timeout_s = worker_timeout_s
        self.progress_timeout_s = progress_timeout_s
        self.prefix_index = prefix_index
        self.count_seq_slots = count_seq_slots
        self.views: dict[str, WorkerView] = {}
        self._handles: dict[str, Any] = {}
        self._connections: dict[str, EventsConnection] = {}  # each worker's events connection, once opened
        self._tasks: dict[str, asyncio.Task[None]] = {}
        self._watchdog: asyncio.Task[None] | None = None
        self._on_join = on_join
        self._on_batch = on_batch
        self._on_dead = on_dead
        self._alive: ViewColumns | None = None  # the live views, kept until one joins or dies

    @property
    def alive(self) -> ViewColumns:
        """The views placement may choose from (read-only: built once per change of
        liveness, not per placement, which at 1,000 workers would cost a pass of its own;
        its columns are what the kv pass reads)."""
        if self._alive is None:
            self._alive = ViewColumns([w for w in self.views.values() if w.alive])
        return self._alive

    def _set_alive(self, view: WorkerView, alive: bool) -> None:
        view.set_alive(alive)
        self._alive = None

    def handle(self, worker_id: str) -> Any | None:
        return self._handles.get(worker_id)

    def send_add(self, worker_id: str, request: AddRequest) -> Awaitable[AddRefused | None]:
        """Send an AddRequest over the worker's events connection (workers/events_wire.py);
        its answer, or an exception if the worker is gone before it answers."""
        connection = self._connections.get(worker_id)
        if connection is None or not connection.open:
            handle = self._handles[worker_id]
            return handle.add_request.remote(request)  # type: ignore[no-any-return]  # joining: over Ray
        return connection.add_request(request)

    async def add(self, handle: Any, join_timeout_s: float = JOIN_TIMEOUT_S) -> WorkerInfo:
        """Register a worker actor: read its info, follow its event stream, and return once
        the stream's first batch has come (the worker is in placement from then on), or after
        join_timeout_s, with the worker still joining (it joins when its stream starts)."""
        info: WorkerInfo = await handle.info.remote()
        joined = self._follow(info, handle)
        try:
            await asyncio.wait_for(asyncio.shield(joined), timeout=join_timeout_s)
        except asyncio.TimeoutError:
            log.warning("worker %s: its event stream sent nothing within %.0f s; it joins placement once it does",
                        info.worker_id, join_timeout_s)
        return info

    def _follow(self, info: WorkerInfo, handle: Any) -> asyncio.Future[None]:
        """Follow the worker's stream; the future is done once its first batch has come."""
        # Not alive, so not placed on, until its stream is this router's (module docstring).
        view = WorkerView(info, count_seq_slots=self.count_seq_slots, alive=False)
        self.views[info.worker_id] = view
        self._alive = None
        self._handles[info.worker_id] = handle
        self._on_join(info)
        joined: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._tasks[info.worker_id] = asyncio.create_task(
            self._consume(view, info, handle, joined), name=f"consume-{info.worker_id}"
        )
        if self._watchdog is None:
            self._watchdog = asyncio.create_task(self._watch(), name="worker-watchdog")
        return joined

    async def _resync_prefix_index(self, view: WorkerView, handle: Any) -> None:
        """Replace the index's picture of one worker's cache with the worker's snapshot."""
        self.prefix_index.reset(view.worker_id, await handle.kv_snapshot.remote(self.router_id))

    async def _consume(self, view: WorkerView, info: WorkerInfo, handle: Any, joined: asyncio.Future[None]) -> None:
        try:
            # A (re)joining worker, or any worker a starting router finds: what its cache holds.
            await self._resync_prefix_index(view, handle)
            connection = self._connections[view.worker_id] = EventsConnection(
                info.events_address, info.events_token, self.router_id
            )
            async for batch in connection.batches():
                view.apply_report(batch.report, batch.added_ids, time.monotonic())
                if batch.kv_events is not None and not self.prefix_index.apply(view.worker_id, batch.kv_events):
                    log.info("worker %s: a gap in its KV events before #%d: resyncing its prefix index",
                             view.worker_id, batch.kv_events.seq)
                    await self._resync_prefix_index(view, handle)
                if not joined.done():
                    # Its first batch: the actor now hands everything to this stream.
                    self._set_alive(view, True)
                    view.progress_at = time.monotonic()
                    joined.set_result(None)
                elif not view.alive and not batch.heartbeat:
                    # Back from silence or a hung step: its engine is publishing again.
                    self._set_alive(view, True)
                    view.progress_at = time.monotonic()
                    log.info("worker %s is reporting again", view.worker_id)
                try:
                    await self._on_batch(view, batch)
                except asyncio.CancelledError:
                    raise
                except Exception:  # noqa: BLE001 - the router's failure, not the worker's
                    log.exception("worker %s: handling its batch failed; the worker stays in service", view.worker_id)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # noqa: BLE001 - any failure of the stream means the worker is gone
            log.warning("worker %s stream ended: %s", view.worker_id, exc)
        if not joined.done():  # it never joined: nothing was placed on it
            joined.set_exception(WorkerLeft(f"worker {view.worker_id}: its event stream ended before its first batch"))
            joined.exception()  # retrieved: nobody need await it
        await self.mark_dead(view, "its event stream ended")
        self._tasks[view.worker_id] = asyncio.create_task(self._rejoin(view, handle), name=f"rejoin-{view.worker_id}")

    async def _rejoin(self, view: WorkerView, handle: Any) -> None:
        """Wait for a worker whose stream ended to come back (Ray restarts an actor with
        max_restarts), then follow it again; a worker that is gone for good stays dead."""
        import ray
        from ray.exceptions import ActorDiedError

        backoff = Backoff(0.5, 5.0)
        while True:
            await backoff.sleep()
            try:
                info: WorkerInfo = await asyncio.wait_for(handle.info.remote(), timeout=300)
            except ActorDiedError as exc:
                log.warning("worker %s is gone for good: %s", view.worker_id, exc)
                return
            except WorkerLoadError as exc:  # restarted, but its model did not load again
                log.warning("worker %s is gone for good: %s", view.worker_id, WorkerLoadError.why(exc))
                # Ended, as an actor whose restart died is: it would hold its CPUs or GPU, and
                # a router joining later would find it by its name.
                ray.kill(handle, no_restart=True)
                return
            except Exception as exc:  # noqa: BLE001 - restarting: try again
                log.info("worker %s not back yet: %s", view.worker_id, exc)
                continue
            log.info("worker %s is back; it rejoins placement once it reports", view.worker_id)
            self._follow(info, handle)
            return

    async def _watch(self) -> None:
        while True:
            await asyncio.sleep(min(0.25, self.worker_timeout_s / 4))
            try:
                await self._check_liveness(time.monotonic())
            except asyncio.CancelledError:
                raise
            except Exception:  # noqa: BLE001 - the watchdog must outlive any failure
                log.exception("worker watchdog: a check failed; watching on")

    async def _check_liveness(self, now: float) -> None:
        for view in list(self.views.values()):
            if not view.alive:
                continue
            if now - view.last_report_at > self.worker_timeout_s:
                await self.mark_dead(view, f"no message for {now - view.last_report_at:.1f} s")
            elif not view.has_work:
                view.progress_at = now
            elif now - view.progress_at > self.progress_timeout_s:
                await self.mark_dead(
                    view,
                    f"its engine made no step for {now - view.progress_at:.1f} s "
                    f"with {len(view.outstanding)} requests",
                )

    async def mark_dead(self, view: WorkerView, why: str) -> None:
        """Stop placing on the worker; the caller's on_dead moves its requests."""
        if not view.alive:
            return
        self._set_alive(view, False)
        # A worker Ray restarts comes back with an empty cache; one that thaws is resynced.
        self.prefix_index.forget(view.worker_id)
        log.warning("worker %s is dead: %s", view.worker_id, why)
        await self._on_dead(view, why)

    def tasks(self) -> list[asyncio.Task[None]]:
        """The stream readers, rejoin waits and the watchdog, for close() to cancel."""
        return [*self._tasks.values(), *([self._watchdog] if self._watchdog else [])]

    def forget_tasks(self) -> None:
        self._tasks.clear()
        self._watchdog = None
