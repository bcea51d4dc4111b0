"""The admission queue: requests no worker can hold now wait here, in FIFO order.

Bounded twice: by length (max_queue; one more is refused at once) and by time
(max_queue_wait_s, or the client's deadline if sooner). A request that moved off a dead
worker goes to the front: it was admitted long ago. Placement itself (which worker, and
the reservation there) is the router's: the queue is handed a `place` function.

With a `backfill` function (RouterConfig.queue_order "backfill"), a head that fits nowhere
does not hold up the rest: the worker it waits for is kept for it, and the requests
behind it, in order, may go to any other worker with room for them (the router's
backfill(head, behind) places them and says where), as a
batch scheduler backfills around the job at its head. Nothing is placed on the held
worker but the head, so the head waits no longer than it would in FIFO order (for KV;
the backfilled requests do share the other workers' compute), while a short request
behind a long one runs where there is room for it instead of waiting for the long one.
The other long requests behind the head may wait longer: the backfilled ones hold KV on
the other workers that FIFO order would have kept for them (README, "Routing policies,
measured").
"""

from __future__ import annotations

import asyncio
import collections
import itertools
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from router.errors import Cancelled, DeadlineExceeded, ResourceExhausted, Unavailable
from router.placement import WorkerView
from router.tracker import RequestTracker

Place = Callable[[RequestTracker], "WorkerView | None"]  # place and reserve, or None: no room now
# Place and reserve each of the requests behind a head that fits nowhere, in order, on any
# worker but the one held for the head: where each went, or None.
Backfill = Callable[[RequestTracker, Sequence[RequestTracker]], "list[WorkerView | None]"]

# How many requests behind the head one drain tries to backfill: each try is a placement
# decision, and a drain runs at every worker report.
BACKFILL_SCAN = 32
# What a request whose client's deadline passed while it waited is recorded FAILED with.
DEADLINE_PASSED = "the deadline passed while waiting for KV room"


@dataclass
class _Waiter:
    tracker: RequestTracker
    placed: asyncio.Future[WorkerView]


class AdmissionQueue:
    def __init__(self, max_queue: int, max_wait_s: float, place: Place, notify: Callable[[str, Any], None],
                 backfill: Backfill | None = None) -> None:
        self.max_queue = max_queue
        self.max_wait_s = max_wait_s
        self._place = place
        self._notify = notify
        self._backfill_place = backfill
        self.num_backfilled = 0  # placed ahead of a head that fit nowhere
        self._waiters: collections.deque[_Waiter] = collections.deque()

    def __len__(self) -> int:
        return len(self._waiters)

    @property
    def head(self) -> RequestTracker | None:
        """The request that waits longest (the next to be placed), if any."""
        return self._waiters[0].tracker if self._waiters else None

    @property
    def full(self) -> bool:
        return len(self._waiters) >= self.max_queue

    def refuse_if_full(self, tracker: RequestTracker) -> None:
        """Raise ResourceExhausted (and count the refusal) if no one more may wait."""
        if self.full:
            self._notify("rejected", (tracker, "queue_full"))
            raise ResourceExhausted(
                f"no worker has KV room for this request now and the admission queue is full "
                f"({len(self._waiters)} waiting, max_queue={self.max_queue})"
            )

    async def wait(self, tracker: RequestTracker, deadline: float | None, first: bool = False) -> WorkerView:
        """Wait to be placed; returns the worker it is reserved on.

        Raises ResourceExhausted after max_wait_s, DeadlineExceeded at the client's
        deadline, and Cancelled when remove() took it out (a Cancel call)."""
        waiter = _Waiter(tracker, asyncio.get_running_loop().create_future())
        if first:
            self._waiters.appendleft(waiter)
        else:
            self._waiters.append(waiter)
        self._notify("queued", len(self._waiters))
        wait = self.max_wait_s
        client_limited = deadline is not None and deadline - time.monotonic() < wait
        if deadline is not None:
            wait = min(wait, max(0.0, deadline - time.monotonic()))
        try:
            return await asyncio.wait_for(asyncio.shield(waiter.placed), wait)
        except TimeoutError:
            if waiter.placed.done() and not waiter.placed.cancelled():
                return waiter.placed.result()  # placed in the same instant
            self._drop(waiter)
            # A moved request a worker took once was admitted: its end counts as an error, not
            # a refusal. One no worker ever took (adopted from a router that died while it
            # waited) is refused here as a new one would be.
            if not first or not tracker.accepted_at:
                self._notify("rejected", (tracker, "deadline" if client_limited else "queue_timeout"))
            if client_limited:
                raise DeadlineExceeded(DEADLINE_PASSED) from None
            raise ResourceExhausted(f"waited {self.max_wait_s:g} s (max_queue_wait_s) and no worker had KV room") from None
        except asyncio.CancelledError:
            self._drop(waiter)
            if waiter.placed.done() and not waiter.placed.cancelled():
                waiter.placed.result().release(tracker.engine_key)
            task = asyncio.current_task()
            if tracker.handed_over and task is not None and not task.cancelling():
                raise Unavailable(f"request {tracker.request_id!r} left this router while it waited for KV room; "
                                  f"it goes on: re-attach with Stream(request_id={tracker.request_id!r}, "
                                  f"from_offset=0)") from None
            if tracker.cancel_requested and task is not None and not task.cancelling():
                # remove() took it out of the queue: an answer for its client, not a vanished task.
                raise Cancelled(f"request {tracker.request_id!r} was cancelled while it waited for KV room") from None
            raise

    def remove(self, tracker: RequestTracker) -> bool:
        """Take a waiting request out (its wait() raises); False if it was not waiting."""
        for waiter in self._waiters:
            if waiter.tracker is tracker:
                self._drop(waiter)
                return True
        return False

    def drain(self) -> None:
        """Place waiting requests in order while the head one fits somewhere; then, with
        backfill, those behind it that fit elsewhere than where the head waits."""
        while self._waiters:
            waiter = self._waiters[0]
            if waiter.placed.done():
                self._waiters.popleft()
                continue
            view = self._place(waiter.tracker)
            if view is None:
                break
            self._waiters.popleft()
            waiter.placed.set_result(view)
        if self._backfill_place is not None and len(self._waiters) > 1:
            self._backfill(self._backfill_place)
        self._notify("queued", len(self._waiters))

    def _backfill(self, backfill: Backfill) -> None:
        behind = [w for w in itertools.islice(self._waiters, 1, 1 + BACKFILL_SCAN) if not w.placed.done()]
        placed: list[_Waiter] = []
        for waiter, view in zip(behind, backfill(self._waiters[0].tracker, [w.tracker for w in behind])):
            if view is not None:
                waiter.placed.set_result(view)
                placed.append(waiter)
        for waiter in placed:
            self._waiters.remove(waiter)
        if placed:
            self.backfilled(len(placed))

    def backfilled(self, num_requests: int) -> None:
        """Count requests placed ahead of the head (here, or on arrival by the router)."""
        self.num_backfilled += num_requests
        self._notify("backfilled", num_requests)

    def _drop(self, waiter: _Waiter) -> None:
        if waiter in self._waiters:
            self._waiters.remove(waiter)
        if not waiter.placed.done():
            waiter.placed.cancel()
        self._notify("queued", len(self._waiters))
