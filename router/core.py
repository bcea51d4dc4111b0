"""The router's core: workers, placement, admission, and the flow of token batches.

The router owns where each request runs and its in-flight reservations. Every worker
streams StepBatches (one per engine step); a consumer task per worker applies the KV
report, writes the step's tokens for all requests in one Redis pipeline, and hands
each event to the request's listeners. Requests that no worker can hold now wait in a
bounded FIFO queue and are placed, in order, as reports show room.

No request is lost with its worker. A worker is dead when its stream ends (the actor
died), when it is silent for worker_timeout_s (a frozen process), or when its engine
makes no step for progress_timeout_s while it has requests (a hung step). Each of its
requests then moves: its prompt plus the tokens it already produced are prefilled on
another worker and generation goes on at the next offset; with the sampler keyed on
(seed, position) the output equals an uninterrupted run. Moves are counted and capped
(max_migrations). A worker that comes back (a Ray restart, or a thaw) rejoins.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import logging
import secrets
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from router.admission import AdmissionQueue
from router.chat import ChatTemplate
from router.errors import AlreadyExists, Cancelled, NotFound, ResourceExhausted, Unavailable
from router.placement import CacheHits, PlacementPolicy, PrefixWeights, WorkerView, make_policy
from router.prefix_index import PrefixIndex
from router.recorder import OrderedRecorder, StoreOp
from router.records import sampling_params
from router.state import LogEntry, RequestRecord, RequestStatus, RequestStore, StepWrite, StoreUnavailable
from router.tracker import RequestTracker, split_engine_key
from router.validation import ClusterLimits, ValidRequest, prompt_block_hashes
from workers.engine.config import blocks_for_tokens
from workers.engine.plan import TokenEvent
from workers.engine.request import FinishReason, Resume
from workers.engine.sampling import SamplingParams
from workers.messages import AddRequest, StepBatch, WorkerInfo
from workers.model.tokenizer import Tokenizer

log = logging.getLogger("kvserve.router")

_FINISH_STATUS = {
    FinishReason.LENGTH: RequestStatus.FINISHED,
    FinishReason.STOP: RequestStatus.FINISHED,
    FinishReason.EOS: RequestStatus.FINISHED,
    FinishReason.CANCELLED: RequestStatus.CANCELLED,
    FinishReason.ERROR: RequestStatus.FAILED,
}


@dataclass(frozen=True)
class RouterConfig:
    policy: str = "kv"
    max_queue: int = 256  # requests waiting for room, beyond which RESOURCE_EXHAUSTED
    max_queue_wait_s: float = 30.0
    # A worker silent this long is dead (workers say "alive" every 0.25 s, even mid-step).
    worker_timeout_s: float = 2.0
    # A worker whose engine makes no step this long while it has requests is dead.
    progress_timeout_s: float = 10.0
    max_migrations: int = 3  # moves to another worker per request, beyond which it FAILS
    max_outstanding_per_worker: int = 512
    max_prompt_tokens: int | None = None
    max_tokens_limit: int | None = None
    prefix_weights: PrefixWeights = field(default_factory=PrefixWeights)  # the `prefix` policy's
    # How long a placement predicts its prompt's blocks on the chosen worker, before the
    # worker's own events say so (a burst with a new shared prefix lands together).
    prefix_prediction_ttl_s: float = 2.0

    def __post_init__(self) -> None:
        make_policy(self.policy, 1)  # validates the name
        if not self.prefix_prediction_ttl_s > 0:
            raise ValueError(f"RouterConfig.prefix_prediction_ttl_s must be positive, got {self.prefix_prediction_ttl_s}")
        if self.max_queue < 0:
            raise ValueError(f"RouterConfig.max_queue must be >= 0, got {self.max_queue}")
        for name in ("max_prompt_tokens", "max_tokens_limit"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ValueError(f"RouterConfig.{name} must be >= 1 or None (no limit), got {value}")
        if self.max_migrations < 0:
            raise ValueError(f"RouterConfig.max_migrations must be >= 0, got {self.max_migrations}")
        for name in ("max_queue_wait_s", "worker_timeout_s", "progress_timeout_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"RouterConfig.{name} must be positive, got {getattr(self, name)}")
        if self.max_outstanding_per_worker < 1:
            raise ValueError(
                f"RouterConfig.max_outstanding_per_worker must be >= 1, got {self.max_outstanding_per_worker}"
            )


class _WorkerLost(Exception):
    """The worker a request was being sent to died before it took the request."""


class Router:
    """Owns the worker views, the admission queue and the live requests of this process."""

    def __init__(self, config: RouterConfig, store: RequestStore) -> None:
        self.config = config
        self.store = store
        self.policy: PlacementPolicy = make_policy(
            config.policy, config.max_outstanding_per_worker, config.prefix_weights
        )
        # Which worker's prefix cache holds which block: from the workers' KV events.
        self.prefix_index = PrefixIndex(config.prefix_prediction_ttl_s)
        self.workers: dict[str, WorkerView] = {}
        self._handles: dict[str, Any] = {}
        self._tasks: dict[str, asyncio.Task[None]] = {}
        self.trackers: dict[str, RequestTracker] = {}
        self.queue = AdmissionQueue(config.max_queue, config.max_queue_wait_s, self._try_place, self._notify)
        self.tokenizer: Tokenizer | None = None
        self.chat_template: ChatTemplate | None = None  # the tokenizer's, compiled; None: it has none
        self.limits: ClusterLimits | None = None
        self.draining = False
        self._watchdog: asyncio.Task[None] | None = None
        self._background: set[asyncio.Task[Any]] = set()  # moves, and aborts of requests dropped on their way
        self.recorder = OrderedRecorder()
        # Metrics hooks, called as observer(event name, payload) on this loop: "report" (view,
        # batch), "tokens" (tracker, event) per event with tokens, "placed" (tracker, view),
        # "finished" tracker, "queued" queue length, "rejected" (tracker, reason), "worker_dead"
        # view, "migrated" (tracker, from worker id).
        self.observers: list[Callable[[str, Any], None]] = []

    # -- workers ----------------------------------------------------------------------

    async def add_worker(self, handle: Any) -> WorkerInfo:
        """Register a worker actor: read its info, then follow its event stream."""
        info: WorkerInfo = await handle.info.remote()
        self._follow(info, handle)
        return info

    def _follow(self, info: WorkerInfo, handle: Any) -> None:
        view = WorkerView(info)
        self.workers[info.worker_id] = view
        self._handles[info.worker_id] = handle
        if self.tokenizer is None:
            self.tokenizer = info.tokenizer.build()
            self.chat_template = _compile_chat_template(self.tokenizer)
        self._update_limits()
        self._tasks[info.worker_id] = asyncio.create_task(self._consume(view, handle), name=f"consume-{info.worker_id}")
        if self._watchdog is None:
            self._watchdog = asyncio.create_task(self._watch(), name="worker-watchdog")
        self.queue.drain()

    def _update_limits(self) -> None:
        infos = [w.info for w in self.workers.values()]
        self.limits = ClusterLimits(
            vocab_size=min(i.vocab_size for i in infos),
            max_model_len=min(i.max_model_len for i in infos),
            block_size=infos[0].block_size,
            max_worker_blocks=max(i.num_blocks for i in infos),
            max_prompt_tokens=self.config.max_prompt_tokens,
            max_tokens_limit=self.config.max_tokens_limit,
        )

    @property
    def alive_workers(self) -> list[WorkerView]:
        return [w for w in self.workers.values() if w.alive]

    async def _resync_prefix_index(self, view: WorkerView, handle: Any) -> None:
        """Replace the index's picture of one worker's cache with the worker's snapshot."""
        self.prefix_index.reset(view.worker_id, await handle.kv_snapshot.remote())

    async def _consume(self, view: WorkerView, handle: Any) -> None:
        try:
            # A (re)joining worker, or any worker a starting router finds: what its cache holds.
            await self._resync_prefix_index(view, handle)
            async for ref in handle.events.remote():
                batch: StepBatch = await ref
                view.apply_report(batch.report, batch.added_ids, time.monotonic())
                if batch.kv_events is not None and not self.prefix_index.apply(view.worker_id, batch.kv_events):
                    log.info("worker %s: a gap in its KV events before #%d: resyncing its prefix index",
                             view.worker_id, batch.kv_events.seq)
                    await self._resync_prefix_index(view, handle)
                if not view.alive and not batch.heartbeat:
                    # Back from silence or a hung step: its engine is publishing again.
                    view.alive = True
                    view.progress_at = time.monotonic()
                    log.info("worker %s is reporting again", view.worker_id)
                await self._on_batch(view, batch)
                self.queue.drain()
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # noqa: BLE001 - any failure of the stream means the worker is gone
            log.warning("worker %s stream ended: %s", view.worker_id, exc)
        await self._mark_dead(view, "its event stream ended")
        self._tasks[view.worker_id] = asyncio.create_task(self._rejoin(view, handle), name=f"rejoin-{view.worker_id}")

    async def _rejoin(self, view: WorkerView, handle: Any) -> None:
        """Wait for a worker whose stream ended to come back (Ray restarts an actor with
        max_restarts), then follow it again; a worker that is gone for good stays dead."""
        from ray.exceptions import ActorDiedError

        delay = 0.5
        while True:
            await asyncio.sleep(delay)
            try:
                info: WorkerInfo = await asyncio.wait_for(handle.info.remote(), timeout=300)
            except ActorDiedError as exc:
                log.warning("worker %s is gone for good: %s", view.worker_id, exc)
                return
            except Exception as exc:  # noqa: BLE001 - restarting: try again
                log.info("worker %s not back yet: %s", view.worker_id, exc)
                delay = min(2 * delay, 5.0)
                continue
            log.info("worker %s is back; it rejoins placement once it reports", view.worker_id)
            self._follow(info, handle)
            return

    async def _watch(self) -> None:
        while True:
            await asyncio.sleep(min(0.25, self.config.worker_timeout_s / 4))
            now = time.monotonic()
            for view in list(self.workers.values()):
                if not view.alive:
                    continue
                if now - view.last_report_at > self.config.worker_timeout_s:
                    await self._mark_dead(view, f"no message for {now - view.last_report_at:.1f} s")
                elif not view.has_work:
                    view.progress_at = now
                elif now - view.progress_at > self.config.progress_timeout_s:
                    await self._mark_dead(
                        view,
                        f"its engine made no step for {now - view.progress_at:.1f} s "
                        f"with {len(view.outstanding)} requests",
                    )

    async def _mark_dead(self, view: WorkerView, why: str) -> None:
        """Stop placing on the worker and move each of its requests to another one."""
        if not view.alive:
            return
        view.alive = False
        # A worker Ray restarts comes back with an empty cache; one that thaws is resynced.
        self.prefix_index.forget(view.worker_id)
        log.warning("worker %s is dead: %s", view.worker_id, why)
        self._notify("worker_dead", view)
        handle = self._handles.get(view.worker_id)
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
            tracker = self.trackers.get(request_id)
            # A request still on its way there (worker_id unset) is re-placed by _admit.
            if tracker is not None and tracker.num_migrations == attempt and tracker.worker_id == view.worker_id:
                await self._move(tracker, f"worker {view.worker_id} died ({why})")

    async def _move(self, tracker: RequestTracker, why: str) -> None:
        """Re-place a request that lost its worker, resuming from its output so far; or end
        it, clearly, when it was cancelled or has moved max_migrations times already."""
        if tracker.finished:
            return
        if tracker.cancel_requested:
            await self._end(tracker, FinishReason.CANCELLED, None)
            return
        if tracker.num_migrations >= self.config.max_migrations:
            await self._end(
                tracker,
                FinishReason.ERROR,
                f"{why}; the request already moved {tracker.num_migrations} times (max_migrations="
                f"{self.config.max_migrations})",
            )
            return
        moved_from = tracker.worker_id
        tracker.num_migrations += 1
        tracker.worker_id = ""
        log.info("request %s moves off %s (%s), resuming at token %d", tracker.request_id, moved_from, why,
                 tracker.num_output_tokens)
        self._notify("migrated", (tracker, moved_from))
        await self.recorder.record(
            [functools.partial(self.store.update, tracker.request_id, num_migrations=tracker.num_migrations,
                               status=RequestStatus.QUEUED.value, worker_id="")]
        )
        self._spawn(self._resume(tracker))

    async def _resume(self, tracker: RequestTracker) -> None:
        try:
            await self._admit(tracker, None, resumed=True)
        except asyncio.CancelledError:
            if tracker.cancel_requested:  # cancelled while it waited for a worker
                await self._end(tracker, FinishReason.CANCELLED, None)
            # else the router is closing: the request stays active in Redis, to be adopted
            raise
        except ResourceExhausted:
            await self._end(
                tracker,
                FinishReason.ERROR,
                f"its worker died and no live worker took it over within max_queue_wait_s="
                f"{self.config.max_queue_wait_s:g} s ({len(self.alive_workers)} alive)",
            )
        except Exception as exc:  # noqa: BLE001 - e.g. Redis down while it was sent again
            await self._end(tracker, FinishReason.ERROR, f"could not resume after a move: {exc}")

    async def _end(self, tracker: RequestTracker, reason: FinishReason, error: str | None) -> None:
        """Finish a request here, not on a worker (it has none now)."""
        if tracker.finished:
            return
        event = TokenEvent(tracker.engine_key, (), "", tracker.num_output_tokens, finish_reason=reason, error=error)
        await self._on_events(None, [event])

    # -- the flow of tokens -------------------------------------------------------------

    async def _on_batch(self, view: WorkerView, batch: StepBatch) -> None:
        self._notify("report", (view, batch))
        if batch.events:
            await self._on_events(view, batch.events)

    async def _on_events(self, view: WorkerView | None, events: Sequence[TokenEvent]) -> None:
        writes: list[StepWrite] = []
        finished: list[tuple[RequestTracker, TokenEvent]] = []
        for event in events:
            if view is not None and event.finish_reason is not None:
                view.release(event.request_id)
            request_id, attempt = split_engine_key(event.request_id)
            tracker = self.trackers.get(request_id)
            if tracker is None or tracker.num_migrations != attempt or tracker.finished:
                continue  # an earlier placement of a request that has moved on, or one gone
            had_tokens = tracker.num_output_tokens > 0
            cached_before = tracker.num_cached_tokens
            tracker.publish(event)
            if event.token_ids and self.observers:
                self._notify("tokens", (tracker, event))
            fields: dict[str, str | int | float] = {"num_output_tokens": tracker.num_output_tokens}
            if tracker.num_cached_tokens != cached_before:
                fields["cached_prompt_tokens"] = tracker.num_cached_tokens
            if event.token_ids and not had_tokens:
                fields["first_token_at"] = tracker.first_token_at
            entry = None
            if event.token_ids or event.text:
                entry = LogEntry(
                    offset=event.offset,
                    token_ids=event.token_ids,
                    text=event.text,
                    logprobs=tuple(_logprob_json(s) for s in event.logprobs),
                )
            writes.append(StepWrite(request_id, entry, fields))
            if event.finish_reason is not None:
                finished.append((tracker, event))
                self._notify("finished", tracker)
        ops: list[StoreOp] = []
        if writes:
            ops.append(functools.partial(self.store.write_step, writes))
        for tracker, event in finished:
            assert event.finish_reason is not None
            ops.append(
                functools.partial(
                    self.store.finish,
                    tracker.request_id,
                    _FINISH_STATUS[event.finish_reason],
                    event.finish_reason.value,
                    event.error or "",
                    time.time(),
                )
            )
        await self.recorder.record(ops)
        for tracker, _ in finished:
            self.trackers.pop(tracker.request_id, None)

    def _notify(self, name: str, payload: Any) -> None:
        for observer in self.observers:
            observer(name, payload)

    def _spawn(self, coroutine: Any) -> None:
        task = asyncio.ensure_future(coroutine)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    # -- requests -----------------------------------------------------------------------

    async def create(self, request: ValidRequest, keep_running_without_client: bool) -> RequestTracker:
        """Record a new request in Redis (QUEUED) and track it here; admit() places it.

        A sampled request without a seed gets one here, so that a move to another worker
        continues the same random stream. Raises AlreadyExisting, carrying the existing
        record, if the id is taken."""
        if self.draining:
            raise Unavailable("the router is draining and takes no new requests")
        if not self.alive_workers:
            raise Unavailable("no live worker")
        params = request.params
        if params.seed is None and params.temperature > 0:
            params = dataclasses.replace(params, seed=secrets.randbelow(2**63))
            request = dataclasses.replace(request, params=params)
        record = RequestRecord(
            request_id=request.request_id,
            status=RequestStatus.QUEUED,
            prompt_ids=list(request.prompt_ids),
            sampling=_sampling_json(request.params),
            seed=request.params.seed,
            created_at=time.time(),
            prompt_text=request.prompt_text,
        )
        creating = asyncio.ensure_future(self.store.create(record))
        try:
            existing = await asyncio.shield(creating)
        except asyncio.CancelledError:
            # The caller left while Redis was creating the record: end it if it was made, or it
            # would stay QUEUED, in the active set and without expiry, for ever.
            try:
                if await creating is None:
                    await self.store.finish(record.request_id, RequestStatus.CANCELLED, FinishReason.CANCELLED.value, "")
            except Exception as exc:  # noqa: BLE001 - best effort; the caller is gone
                log.debug("could not end an abandoned request: %s", exc)
            raise
        if existing is not None:
            raise AlreadyExisting(existing)
        tracker = RequestTracker(
            request.request_id,
            request.prompt_ids,
            request.params,
            request.need_blocks,
            block_hashes=request.block_hashes,
            created_at=record.created_at,
            keep_running_without_client=keep_running_without_client,
        )
        self.trackers[tracker.request_id] = tracker
        return tracker

    async def adopt(self) -> int:
        """Take over the requests a previous router left running (Redis's active set): each is
        re-placed from its prompt and its logged output, and goes on; clients re-attach with
        Stream(request_id, from_offset). Returns how many were adopted."""
        assert self.limits is not None, "adopt() needs registered workers"
        adopted = 0
        for request_id in await self.store.active_ids():
            if request_id in self.trackers:
                continue
            record = await self.store.get(request_id)
            if record is None or record.is_finished:
                continue
            tracker = await self._tracker_from_record(record)
            if tracker is None:
                continue
            self.trackers[request_id] = tracker
            adopted += 1
            if record.status is RequestStatus.RUNNING:
                old = self._handles.get(record.worker_id)
                if old is not None:  # it may still be running there: stop that placement
                    self._spawn(_quietly(old.abort.remote(tracker.engine_key)))
                tracker.worker_id = record.worker_id
                await self._move(tracker, "adopted by a restarted router")
            else:
                self._spawn(self._resume(tracker))
        if adopted:
            log.warning("adopted %d in-flight requests from Redis", adopted)
        return adopted

    def adopt_when_redis_returns(self) -> None:
        """adopt() in the background, retrying with backoff while Redis is unavailable."""

        async def retrying() -> None:
            delay = 0.5
            while True:
                try:
                    await self.adopt()
                    return
                except StoreUnavailable as exc:
                    log.info("adoption waits for Redis: %s", exc)
                    await asyncio.sleep(delay)
                    delay = min(2 * delay, 5.0)

        self._spawn(retrying())

    async def _tracker_from_record(self, record: RequestRecord) -> RequestTracker | None:
        assert self.limits is not None
        try:
            params = sampling_params(record.sampling)
        except Exception as exc:  # noqa: BLE001 - a record this router cannot read
            log.error("cannot adopt %s: its sampling is unreadable: %s", record.request_id, exc)
            await _quietly(self.store.finish(record.request_id, RequestStatus.FAILED, FinishReason.ERROR.value,
                                             f"could not be adopted: {exc}"))
            return None
        entries = await self.store.read_log(record.request_id, 0)
        need = blocks_for_tokens(len(record.prompt_ids) + params.max_tokens - 1, self.limits.block_size)
        tracker = RequestTracker(
            record.request_id,
            tuple(record.prompt_ids),
            params,
            need,
            block_hashes=prompt_block_hashes(tuple(record.prompt_ids), self.limits.block_size),
            created_at=record.created_at,
            keep_running_without_client=True,
            num_migrations=record.num_migrations,
        )
        for entry in entries:
            tracker.output_ids.extend(entry.token_ids)
            tracker.num_text_chars += len(entry.text)
        tracker.first_token_at = record.first_token_at
        return tracker

    def check_admissible(self, tracker: RequestTracker) -> None:
        """Raise ResourceExhausted now if admit() could only fail on a full queue."""
        if len(self.queue):
            self.queue.refuse_if_full(tracker)

    async def admit(self, tracker: RequestTracker, deadline: float | None) -> None:
        """Place the request on a worker, waiting in the FIFO queue for room if needed.

        On failure (queue full, waited too long, deadline, cancellation) the request is
        recorded as ended and forgotten here, and the error propagates."""
        try:
            await self._admit(tracker, deadline)
        except BaseException as exc:
            await self.abandon(tracker, exc)
            raise

    async def abandon(self, tracker: RequestTracker, exc: BaseException) -> None:
        """End a request that was never placed: record why, and forget it here."""
        self.trackers.pop(tracker.request_id, None)
        cancelled = isinstance(exc, (asyncio.CancelledError, Cancelled))
        status = RequestStatus.CANCELLED if cancelled else RequestStatus.FAILED
        reason = FinishReason.CANCELLED if cancelled else FinishReason.ERROR
        tracker.publish(
            TokenEvent(tracker.request_id, (), "", 0, finish_reason=reason, error=None if cancelled else str(exc))
        )
        # Through the recorder: with Redis down it is written once Redis is back, or the
        # record would stay QUEUED, active and without expiry.
        finish = functools.partial(self.store.finish, tracker.request_id, status, reason.value,
                                   "" if cancelled else str(exc))
        await _quietly(self.recorder.record([finish]))

    async def _admit(self, tracker: RequestTracker, deadline: float | None, resumed: bool = False) -> None:
        """Place and send; a worker that dies while the request is on its way there is
        left for another. A resumed request (moved off a dead worker) goes before the queue."""
        while True:
            view = await self._place(tracker, deadline, resumed)
            try:
                await self._dispatch(tracker, view)
                return
            except _WorkerLost as exc:
                log.warning("request %s: %s; placing it elsewhere", tracker.request_id, exc)

    async def _place(self, tracker: RequestTracker, deadline: float | None, resumed: bool) -> WorkerView:
        if resumed or not len(self.queue):
            view = self._try_place(tracker)
            if view is not None:
                return view
        if not resumed:
            self.queue.refuse_if_full(tracker)
        return await self.queue.wait(tracker, deadline, first=resumed)

    def _try_place(self, tracker: RequestTracker) -> WorkerView | None:
        """Choose a worker with room and reserve the request's blocks there, or None."""
        hits = None
        if tracker.block_hashes:
            hits = CacheHits(len(tracker.block_hashes), self.prefix_index.hits(tracker.block_hashes))
        view = self.policy.choose(self.alive_workers, tracker.need_blocks, hits)
        if view is not None:
            # The whole need, cached blocks included: a hit on a block nobody holds commits it
            # again. The worker's next report counts a block the request shares once.
            view.place(tracker.engine_key, tracker.need_blocks)
            if tracker.block_hashes:
                self.prefix_index.predict(view.worker_id, tracker.block_hashes)
        return view

    async def _dispatch(self, tracker: RequestTracker, view: WorkerView) -> None:
        """Send the request to its worker (the reservation is already on the view).

        tracker.worker_id is set only once the worker holds the request, so cancel() never
        sends an abort that could reach the worker first and be lost. A cancel() that came
        while the request was on its way finished it here; it is taken back from the worker.
        Raises _WorkerLost if the worker dies before it takes the request."""
        self._notify("placed", (tracker, view))
        handle = self._handles[view.worker_id]
        key = tracker.engine_key
        resume = Resume(tuple(tracker.output_ids), tracker.num_text_chars) if tracker.output_ids else None
        sending = handle.add_request.remote(AddRequest(key, tracker.prompt_ids, tracker.params, resume))
        # The worker gets the request first; recording RUNNING overlaps with it (the store
        # drops the write if the request has already ended; while Redis is down it waits in
        # the backlog, so a request moving during an outage still moves).
        running = functools.partial(
            self.store.update, tracker.request_id, status=RequestStatus.RUNNING.value, worker_id=view.worker_id
        )
        recording = asyncio.ensure_future(self.recorder.record([running]))
        try:
            try:
                await sending
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # noqa: BLE001 - the actor died under it
                raise _WorkerLost(f"worker {view.worker_id} died before it took the request: {exc}") from exc
            await recording
        except BaseException:
            view.release(key)
            recording.cancel()
            # The worker may take it all the same: abort it once it has (sent now, the abort
            # could overtake the add on the async actor and be lost).
            self._spawn(_abort_once_added(handle, sending, key))
            raise
        tracker.worker_id = view.worker_id
        if tracker.finished or tracker.cancel_requested:
            view.release(key)
            await _quietly(handle.abort.remote(key))
            await self._end(tracker, FinishReason.CANCELLED, None)
        elif not view.alive:
            # It died after taking the request, and _mark_dead did not see it here yet.
            await self._move(tracker, f"worker {view.worker_id} died as the request reached it")

    async def cancel(self, request_id: str) -> RequestStatus:
        """Abort a request wherever it is; its KV is freed on its worker."""
        tracker = self.trackers.get(request_id)
        if tracker is None:
            record = await self.store.get(request_id)
            if record is None:
                raise NotFound(f"request_id: no request {request_id!r}")
            return record.status
        tracker.cancel_requested = True
        if self.queue.remove(tracker):  # admit() (or _resume) then records it as cancelled
            return RequestStatus.CANCELLED
        view = self.workers.get(tracker.worker_id)
        if view is not None and view.alive:
            await _quietly(self._handles[tracker.worker_id].abort.remote(tracker.engine_key))
            return RequestStatus.CANCELLED
        if tracker.worker_id:
            # Its worker just died: the move sees cancel_requested and ends it.
            return RequestStatus.CANCELLED
        # On its way to a worker, or never placed: _dispatch takes it back; it finishes here.
        await self._end(tracker, FinishReason.CANCELLED, None)
        return RequestStatus.CANCELLED

    async def drain(self, grace_s: float) -> None:
        """Stop taking requests; let running ones finish for up to grace_s; cancel the rest."""
        self.draining = True
        end = time.monotonic() + grace_s
        while self.trackers and time.monotonic() < end:
            await asyncio.sleep(0.05)
        for request_id in list(self.trackers):
            await _quietly(self.cancel(request_id))

    async def close(self, timeout_s: float = 5.0) -> None:
        """Cancel the router's tasks and wait for them, at most timeout_s: a task that does
        not end by then is logged with where it is stuck and left behind, so a stop is
        bounded (a busy machine once saw a cluster stop take over 60 s here)."""
        self.recorder.close()
        tasks = [*self._tasks.values(), *self._background, *([self._watchdog] if self._watchdog else [])]
        for task in tasks:
            task.cancel()
        if tasks:
            _, pending = await asyncio.wait(tasks, timeout=timeout_s)
            for task in pending:
                frames = task.get_stack(limit=3)
                where = "; ".join(f"{f.f_code.co_filename}:{f.f_lineno} {f.f_code.co_name}" for f in frames)
                log.warning("router close: task %s still running %.0f s after its cancel, left behind (at %s)",
                            task.get_name(), timeout_s, where or "?")
        self._tasks.clear()
        self._watchdog = None

    @property
    def queue_length(self) -> int:
        return len(self.queue)


class AlreadyExisting(AlreadyExists):
    """The id is taken: carries the existing record so Submit can return it."""

    def __init__(self, record: RequestRecord) -> None:
        self.record = record
        super().__init__(f"request_id: {record.request_id!r} already exists (status {record.status.value})")


def _sampling_json(p: SamplingParams) -> dict[str, Any]:
    return {
        "max_tokens": p.max_tokens,
        "temperature": p.temperature,
        "top_p": p.top_p,
        "top_k": p.top_k,
        "seed": p.seed,
        "stop": list(p.stop),
        "stop_token_ids": list(p.stop_token_ids),
        "ignore_eos": p.ignore_eos,
        "logprobs": p.logprobs,
    }


def _logprob_json(sampled: Any) -> dict[str, Any]:
    return {
        "id": sampled.token_id,
        "lp": sampled.logprob,
        "top": [[t.token_id, t.logprob] for t in sampled.top_logprobs],
    }


async def _abort_once_added(handle: Any, sending: Any, request_id: str) -> None:
    try:
        await sending
    except Exception:  # noqa: BLE001 - it never reached the worker
        return
    await _quietly(handle.abort.remote(request_id))


async def _quietly(awaitable: Any) -> None:
    try:
        await awaitable
    except Exception as exc:  # noqa: BLE001 - best effort during failure handling
        log.debug("ignored during cleanup: %s", exc)


def _compile_chat_template(tokenizer: Tokenizer) -> ChatTemplate | None:
    """The model's chat template; one that does not compile is logged and treated as none,
    so chat requests are refused (INVALID_ARGUMENT) while text and ids still serve."""
    try:
        return ChatTemplate.of(tokenizer)
    except ValueError as exc:
        log.error("the model's chat template is unusable, chat requests will be refused: %s", exc)
        return None
