"""The router's core: workers, placement, admission, and the flow of token batches.

The router owns where each request runs and its in-flight reservations. Every worker
streams StepBatches (one per engine step); a consumer task per worker applies the KV
report, writes the step's tokens for all requests in one Redis pipeline, and hands
each event to the request's listeners. Requests that no worker can hold now wait in a
bounded FIFO queue and are placed, in order, as reports show room.
"""

from __future__ import annotations

import asyncio
import collections
import functools
import logging
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any

from router.errors import AlreadyExists, DeadlineExceeded, NotFound, ResourceExhausted, Unavailable
from router.placement import PlacementPolicy, WorkerView, make_policy
from router.state import LogEntry, RequestRecord, RequestStatus, RequestStore, StepWrite, StoreUnavailable
from router.tracker import RequestTracker
from router.validation import ModelLimits, ValidRequest
from workers.engine.plan import TokenEvent
from workers.engine.request import FinishReason
from workers.messages import AddRequest, StepBatch, WorkerInfo
from workers.model.tokenizer import Tokenizer

log = logging.getLogger("kvserve.router")

_StoreOp = Callable[[], Awaitable[None]]
MAX_BACKLOG = 200_000  # Redis writes kept while it is down, beyond which the oldest go

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
    worker_timeout_s: float = 10.0  # a worker silent this long is dead (a step must fit well inside it)
    max_outstanding_per_worker: int = 512
    max_prompt_tokens: int | None = None
    max_tokens_limit: int | None = None

    def __post_init__(self) -> None:
        make_policy(self.policy, 1)  # validates the name
        if self.max_queue < 0:
            raise ValueError(f"RouterConfig.max_queue must be >= 0, got {self.max_queue}")
        for name in ("max_queue_wait_s", "worker_timeout_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"RouterConfig.{name} must be positive, got {getattr(self, name)}")
        if self.max_outstanding_per_worker < 1:
            raise ValueError(
                f"RouterConfig.max_outstanding_per_worker must be >= 1, got {self.max_outstanding_per_worker}"
            )


@dataclass
class _Waiter:
    tracker: RequestTracker
    placed: asyncio.Future[WorkerView]


class Router:
    """Owns the worker views, the admission queue and the live requests of this process."""

    def __init__(self, config: RouterConfig, store: RequestStore) -> None:
        self.config = config
        self.store = store
        self.policy: PlacementPolicy = make_policy(config.policy, config.max_outstanding_per_worker)
        self.workers: dict[str, WorkerView] = {}
        self._handles: dict[str, Any] = {}
        self._tasks: dict[str, asyncio.Task[None]] = {}
        self.trackers: dict[str, RequestTracker] = {}
        self._queue: collections.deque[_Waiter] = collections.deque()
        self.tokenizer: Tokenizer | None = None
        self.limits: ModelLimits | None = None
        self.draining = False
        self._watchdog: asyncio.Task[None] | None = None
        self._cleanups: set[asyncio.Task[None]] = set()  # aborts of requests dropped on their way
        self._backlog: collections.deque[_StoreOp] = collections.deque()  # Redis writes kept while it is down
        self._flusher: asyncio.Task[None] | None = None
        # Metrics hooks, called as observer(event name, payload) on this loop: "report" (view,
        # batch), "tokens" (tracker, event) per event with tokens, "placed" (tracker, view),
        # "finished" tracker, "queued" queue length, "rejected" (tracker, reason), "worker_dead" view.
        self.observers: list[Callable[[str, Any], None]] = []

    # -- workers ----------------------------------------------------------------------

    async def add_worker(self, handle: Any) -> WorkerInfo:
        """Register a worker actor: read its info, then follow its event stream."""
        info: WorkerInfo = await handle.info.remote()
        view = WorkerView(info)
        self.workers[info.worker_id] = view
        self._handles[info.worker_id] = handle
        if self.tokenizer is None:
            self.tokenizer = info.tokenizer.build()
        self._update_limits()
        self._tasks[info.worker_id] = asyncio.create_task(self._consume(view, handle), name=f"consume-{info.worker_id}")
        if self._watchdog is None:
            self._watchdog = asyncio.create_task(self._watch(), name="worker-watchdog")
        self._drain_queue()
        return info

    def _update_limits(self) -> None:
        infos = [w.info for w in self.workers.values()]
        self.limits = ModelLimits(
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

    async def _consume(self, view: WorkerView, handle: Any) -> None:
        try:
            async for ref in handle.events.remote():
                batch: StepBatch = await ref
                view.apply_report(batch.report, batch.added_ids, time.monotonic())
                if not view.alive:
                    view.alive = True
                    log.info("worker %s is reporting again", view.worker_id)
                await self._on_batch(view, batch)
                self._drain_queue()
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # noqa: BLE001 - any failure of the stream means the worker is gone
            log.warning("worker %s stream ended: %s", view.worker_id, exc)
        await self._mark_dead(view, "its event stream ended")

    async def _watch(self) -> None:
        while True:
            await asyncio.sleep(min(0.5, self.config.worker_timeout_s / 4))
            now = time.monotonic()
            for view in list(self.workers.values()):
                if view.alive and now - view.last_report_at > self.config.worker_timeout_s:
                    await self._mark_dead(view, f"no report for {now - view.last_report_at:.1f} s")

    async def _mark_dead(self, view: WorkerView, why: str) -> None:
        if not view.alive:
            return
        view.alive = False
        log.warning("worker %s is dead: %s", view.worker_id, why)
        self._notify("worker_dead", view)
        # Until migration exists, its requests fail, clearly.
        for request_id in list(view.outstanding):
            tracker = self.trackers.get(request_id)
            view.release(request_id)
            if tracker is not None and not tracker.finished:
                event = TokenEvent(
                    request_id, (), "", tracker.num_output_tokens,
                    finish_reason=FinishReason.ERROR, error=f"worker {view.worker_id} died ({why})",
                )
                await self._on_events(view, [event])
            # A worker that was only silent (a stuck step) may come back: it must not keep
            # decoding requests that have already failed here.
            handle = self._handles.get(view.worker_id)
            if handle is not None:
                try:
                    handle.abort.remote(request_id)
                except Exception:  # noqa: BLE001 - a dead actor refuses calls
                    pass

    # -- the flow of tokens -------------------------------------------------------------

    async def _on_batch(self, view: WorkerView, batch: StepBatch) -> None:
        self._notify("report", (view, batch))
        if batch.events:
            await self._on_events(view, batch.events)

    async def _on_events(self, view: WorkerView | None, events: Sequence[TokenEvent]) -> None:
        writes: list[StepWrite] = []
        finished: list[tuple[RequestTracker, TokenEvent]] = []
        for event in events:
            tracker = self.trackers.get(event.request_id)
            if tracker is None:
                continue
            had_tokens = tracker.num_output_tokens > 0
            tracker.publish(event)
            if event.token_ids and self.observers:
                self._notify("tokens", (tracker, event))
            fields: dict[str, str | int | float] = {"num_output_tokens": tracker.num_output_tokens}
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
            writes.append(StepWrite(event.request_id, entry, fields))
            if event.finish_reason is not None:
                finished.append((tracker, event))
                if view is not None:
                    view.release(event.request_id)
                self._notify("finished", tracker)
        ops: list[_StoreOp] = []
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
        await self._record(ops)
        for tracker, _ in finished:
            self.trackers.pop(tracker.request_id, None)

    async def _record(self, ops: Sequence[_StoreOp]) -> None:
        """Write to Redis in order. While Redis is down, writes wait in a bounded backlog
        (connected clients still get every token) and are replayed, in order, once it is
        back; the store drops a replayed entry it already has."""
        if self._backlog:
            self._backlog.extend(ops)
            self._trim_backlog()
            return
        for index, op in enumerate(ops):
            try:
                await op()
            except StoreUnavailable as exc:
                log.warning("Redis is unavailable; keeping writes until it returns: %s", exc)
                self._backlog.extend(ops[index:])
                if self._flusher is None or self._flusher.done():
                    self._flusher = asyncio.create_task(self._flush_backlog(), name="redis-backlog")
                return

    def _trim_backlog(self) -> None:
        dropped = 0
        while len(self._backlog) > MAX_BACKLOG:
            self._backlog.popleft()
            dropped += 1
        if dropped:
            log.error("Redis backlog over %d writes: dropped the %d oldest", MAX_BACKLOG, dropped)

    async def _flush_backlog(self) -> None:
        delay = 0.1
        while self._backlog:
            await asyncio.sleep(delay)
            while self._backlog:
                try:
                    await self._backlog[0]()
                except StoreUnavailable:
                    delay = min(2 * delay, 2.0)
                    break
                self._backlog.popleft()
        log.info("Redis is back: the writes kept while it was down are recorded")

    def _notify(self, name: str, payload: Any) -> None:
        for observer in self.observers:
            observer(name, payload)

    # -- requests -----------------------------------------------------------------------

    async def create(self, request: ValidRequest, keep_running_without_client: bool) -> RequestTracker:
        """Record a new request in Redis (QUEUED) and track it here; admit() places it.

        Raises AlreadyExisting, carrying the existing record, if the id is taken."""
        if self.draining:
            raise Unavailable("the router is draining and takes no new requests")
        if not self.alive_workers:
            raise Unavailable("no live worker")
        record = RequestRecord(
            request_id=request.request_id,
            status=RequestStatus.QUEUED,
            prompt_ids=list(request.prompt_ids),
            sampling=_sampling_json(request),
            seed=request.params.seed,
            created_at=time.time(),
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
            created_at=record.created_at,
            keep_running_without_client=keep_running_without_client,
        )
        self.trackers[tracker.request_id] = tracker
        return tracker

    def check_admissible(self, tracker: RequestTracker) -> None:
        """Raise ResourceExhausted now if admit() could only fail on a full queue."""
        if self._queue and len(self._queue) >= self.config.max_queue:
            raise ResourceExhausted(
                f"the admission queue is full ({len(self._queue)} waiting, max_queue={self.config.max_queue})"
            )

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
        cancelled = isinstance(exc, asyncio.CancelledError)
        status = RequestStatus.CANCELLED if cancelled else RequestStatus.FAILED
        reason = FinishReason.CANCELLED if cancelled else FinishReason.ERROR
        tracker.publish(
            TokenEvent(tracker.request_id, (), "", 0, finish_reason=reason, error=None if cancelled else str(exc))
        )
        await _quietly(self.store.finish(tracker.request_id, status, reason.value, "" if cancelled else str(exc)))

    async def _admit(self, tracker: RequestTracker, deadline: float | None) -> None:
        if not self._queue:
            view = self.policy.choose(self.alive_workers, tracker.need_blocks)
            if view is not None:
                view.place(tracker.request_id, tracker.need_blocks)
                await self._dispatch(tracker, view)
                return
        if len(self._queue) >= self.config.max_queue:
            self._notify("rejected", (tracker, "queue_full"))
            raise ResourceExhausted(
                f"no worker has KV room for this request now and the admission queue is full "
                f"({len(self._queue)} waiting, max_queue={self.config.max_queue})"
            )
        waiter = _Waiter(tracker, asyncio.get_running_loop().create_future())
        self._queue.append(waiter)
        self._notify("queued", len(self._queue))
        wait = self.config.max_queue_wait_s
        client_limited = deadline is not None and deadline - time.monotonic() < wait
        if deadline is not None:
            wait = min(wait, max(0.0, deadline - time.monotonic()))
        try:
            view = await asyncio.wait_for(asyncio.shield(waiter.placed), wait)
        except TimeoutError:
            if waiter.placed.done() and not waiter.placed.cancelled():
                view = waiter.placed.result()  # placed in the same instant
            else:
                self._remove_waiter(waiter)
                self._notify("rejected", (tracker, "deadline" if client_limited else "queue_timeout"))
                if client_limited:
                    raise DeadlineExceeded("the deadline passed while waiting for KV room") from None
                raise ResourceExhausted(
                    f"waited {self.config.max_queue_wait_s:g} s (max_queue_wait_s) and no worker had KV room"
                ) from None
        except asyncio.CancelledError:
            self._remove_waiter(waiter)
            if waiter.placed.done() and not waiter.placed.cancelled():
                waiter.placed.result().release(tracker.request_id)
            raise
        await self._dispatch(tracker, view)

    def _remove_waiter(self, waiter: _Waiter) -> None:
        if waiter in self._queue:
            self._queue.remove(waiter)
        if not waiter.placed.done():
            waiter.placed.cancel()
        self._notify("queued", len(self._queue))

    def _drain_queue(self) -> None:
        """Place waiting requests in FIFO order while the head one fits somewhere."""
        while self._queue:
            waiter = self._queue[0]
            if waiter.placed.done():
                self._queue.popleft()
                continue
            view = self.policy.choose(self.alive_workers, waiter.tracker.need_blocks)
            if view is None:
                break
            self._queue.popleft()
            view.place(waiter.tracker.request_id, waiter.tracker.need_blocks)
            waiter.placed.set_result(view)
        self._notify("queued", len(self._queue))

    async def _dispatch(self, tracker: RequestTracker, view: WorkerView) -> None:
        """Send the request to its worker (the reservation is already on the view).

        tracker.worker_id is set only once the worker holds the request, so cancel() never
        sends an abort that could reach the worker first and be lost. A cancel() that came
        while the request was on its way finished it here; it is taken back from the worker."""
        self._notify("placed", (tracker, view))
        handle = self._handles[view.worker_id]
        sending = None
        try:
            # The worker gets the request first; recording RUNNING overlaps with it (the
            # store drops the write if the request has already ended).
            sending = handle.add_request.remote(AddRequest(tracker.request_id, tracker.prompt_ids, tracker.params))
            await asyncio.gather(
                self.store.update(tracker.request_id, status=RequestStatus.RUNNING.value, worker_id=view.worker_id),
                sending,
            )
        except BaseException:
            view.release(tracker.request_id)
            if sending is not None:
                # The worker may take it all the same: abort it once it has (sent now, the
                # abort could overtake the add on the async actor and be lost).
                task = asyncio.ensure_future(_abort_once_added(handle, sending, tracker.request_id))
                self._cleanups.add(task)
                task.add_done_callback(self._cleanups.discard)
            raise
        tracker.worker_id = view.worker_id
        if tracker.finished:
            view.release(tracker.request_id)
            await _quietly(handle.abort.remote(tracker.request_id))

    async def cancel(self, request_id: str) -> RequestStatus:
        """Abort a request wherever it is; its KV is freed on its worker."""
        tracker = self.trackers.get(request_id)
        if tracker is None:
            record = await self.store.get(request_id)
            if record is None:
                raise NotFound(f"request_id: no request {request_id!r}")
            return record.status
        for waiter in list(self._queue):
            if waiter.tracker is tracker:
                self._remove_waiter(waiter)  # admit() then records it as cancelled
                return RequestStatus.CANCELLED
        if tracker.worker_id and tracker.worker_id in self._handles:
            await self._handles[tracker.worker_id].abort.remote(request_id)
            return RequestStatus.CANCELLED
        # Never placed: it finishes here.
        event = TokenEvent(request_id, (), "", tracker.num_output_tokens, finish_reason=FinishReason.CANCELLED)
        await self._on_events(None, [event])
        return RequestStatus.CANCELLED

    async def drain(self, grace_s: float) -> None:
        """Stop taking requests; let running ones finish for up to grace_s; cancel the rest."""
        self.draining = True
        end = time.monotonic() + grace_s
        while self.trackers and time.monotonic() < end:
            await asyncio.sleep(0.05)
        for request_id in list(self.trackers):
            await _quietly(self.cancel(request_id))

    async def close(self) -> None:
        if self._flusher is not None:
            self._flusher.cancel()
        for task in [*self._tasks.values(), *([self._watchdog] if self._watchdog else [])]:
            task.cancel()
        for task in [*self._tasks.values(), *([self._watchdog] if self._watchdog else [])]:
            try:
                await task
            except (asyncio.CancelledError, Exception):  # noqa: BLE001
                pass
        self._tasks.clear()
        self._watchdog = None

    @property
    def queue_length(self) -> int:
        return len(self._queue)


class AlreadyExisting(AlreadyExists):
    """The id is taken: carries the existing record so Submit can return it."""

    def __init__(self, record: RequestRecord) -> None:
        self.record = record
        super().__init__(f"request_id: {record.request_id!r} already exists (status {record.status.value})")


def _sampling_json(request: ValidRequest) -> dict[str, Any]:
    p = request.params
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
