"""The flow of tokens: a worker's token events to the requests' listeners and to Redis.

Listeners get each event at once, from memory. The same events become one store write
per step (all requests' log entries and fields in one pipeline), plus the finish of each
request that ended, handed to the recorder, which writes them in order off this path:
a slow or refusing Redis never holds up the worker's stream. A finished request is
forgotten here once its finish is recorded (or kept for Redis to take later), so a
Stream that comes after finds it in Redis.

A placement's token events come in offset order, each at the request's output length or
before it (a repeat). One past it means events were lost on their way here: nothing of
that placement is taken from then on, and on_lost moves the request, which resumes from
the output it has. A hole never reaches a client or the log.

Redis refuses a step's writes to a request another router has claimed (router/ownership.py):
on_fenced lets those requests go here.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import Callable, Sequence
from typing import Any

from router.placement import WorkerView
from router.recorder import OrderedRecorder, StepOp, StoreOp
from router.state import LogEntry, RequestStatus, RequestStore, StepWrite
from router.tracker import RequestTracker, split_engine_key
from workers.engine.plan import TokenEvent
from workers.engine.request import FinishReason

FINISH_STATUS = {
    FinishReason.LENGTH: RequestStatus.FINISHED,
    FinishReason.STOP: RequestStatus.FINISHED,
    FinishReason.EOS: RequestStatus.FINISHED,
    FinishReason.CANCELLED: RequestStatus.CANCELLED,
    FinishReason.ERROR: RequestStatus.FAILED,
}


class TokenFlow:
    """Applies token events to the live requests (trackers, owned by the Router)."""

    def __init__(
        self,
        store: RequestStore,
        recorder: OrderedRecorder,
        trackers: dict[str, RequestTracker],
        notify: Callable[[str, Any], None],
        on_lost: Callable[[WorkerView | None, RequestTracker, str], None],
        on_fenced: Callable[[list[str]], None] = lambda _ids: None,
    ) -> None:
        self.store = store
        self.recorder = recorder
        self.trackers = trackers
        self._notify = notify
        self._on_lost = on_lost
        self._on_fenced = on_fenced
        self._lost_keys: set[str] = set()  # placements that lost events: ignored from then on

    def apply(self, view: WorkerView | None, events: Sequence[TokenEvent]) -> asyncio.Future[None]:
        """Publish the events (view: the worker they came from, None for an end the router
        decided) and submit their Redis writes; the future is the recorder's."""
        writes: list[StepWrite] = []
        finished: list[tuple[RequestTracker, TokenEvent]] = []
        with_tokens: list[tuple[RequestTracker, TokenEvent]] = []
        for event in events:
            if view is not None and event.finish_reason is not None:
                view.release(event.request_id)
            request_id, attempt = split_engine_key(event.request_id)
            tracker = self.trackers.get(request_id)
            if tracker is None or tracker.num_migrations != attempt or tracker.finished:
                continue  # an earlier placement of a request that has moved on, or one gone
            if event.request_id in self._lost_keys:
                continue
            if event.token_ids and event.offset > tracker.num_output_tokens:
                self._lost_keys.add(event.request_id)
                self._on_lost(view, tracker, f"token at offset {event.offset} came after {tracker.num_output_tokens}")
                continue
            if event.finish_reason is FinishReason.CANCELLED and tracker.cancel_reason and not event.error:
                event = dataclasses.replace(event, error=tracker.cancel_reason)  # the router's, not a client's
            had_tokens = tracker.num_output_tokens > 0
            cached_before = tracker.num_cached_tokens
            tracker.publish(event)
            if event.token_ids:
                with_tokens.append((tracker, event))
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
                tracker.ended_on_worker = view is not None
                finished.append((tracker, event))
        # One "tokens" notice for the batch (per event, the observers' dispatch was a
        # cost of every token), before the ends, as when each event was told apart.
        if with_tokens:
            self._notify("tokens", with_tokens)
        for tracker, _ in finished:
            self._notify("finished", tracker)
        ops: list[StoreOp] = []
        if writes:
            ops.append(StepOp(self.store, writes, self._on_fenced))
        for tracker, event in finished:
            assert event.finish_reason is not None
            finish = self.store.finish_write(tracker.request_id, FINISH_STATUS[event.finish_reason],
                                             event.finish_reason.value, event.error or "", time.time())
            ops.append(StepOp(self.store, [finish]))
        recorded = self.recorder.submit(ops)
        if finished:
            done = [tracker for tracker, _ in finished]
            for tracker in done:
                tracker.end_recorded = recorded
            recorded.add_done_callback(lambda _: self._forget(done))
        return recorded

    def _forget(self, trackers: list[RequestTracker]) -> None:
        for tracker in trackers:
            if self.trackers.get(tracker.request_id) is tracker:
                del self.trackers[tracker.request_id]
        if self._lost_keys:
            gone = {t.request_id for t in trackers}
            self._lost_keys = {key for key in self._lost_keys if split_engine_key(key)[0] not in gone}


def _logprob_json(sampled: Any) -> dict[str, Any]:
    return {
        "id": sampled.token_id,
        "lp": sampled.logprob,
        "top": [[t.token_id, t.logprob] for t in sampled.top_logprobs],
    }
