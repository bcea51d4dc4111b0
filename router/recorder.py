"""Redis writes in order, off the path that reads the workers' streams.

Connected clients get their tokens from the router's memory, never from Redis, so Redis
costs them nothing: a slow Redis, one that is down, or one that refuses writes (out of
memory, a read-only replica after a failover) delays or loses durability, never a stream
and never a worker's liveness. One writer task runs the writes in the order they were
submitted:

- Redis unavailable (refused, timed out, loading), or refusing writes for a reason that
  passes (OOM, READONLY): the write stays at the head and is retried with backoff (0.1 s
  doubling to 2 s); what waits behind it is the backlog, bounded by MAX_BACKLOG (the
  oldest go first). The store drops a replayed entry it already has, so a write that
  half-landed is harmless.
- Any other error: that write is logged and dropped; the rest go on.
- Redis acknowledges a write before its append-only file has it when an fsync is slow
  (it defers the write up to 2 s), so a crash can lose writes it acknowledged. When Redis
  becomes unavailable, the writes acknowledged in the last REPLAY_WINDOW_S go back to the
  head of the backlog and are written again once it is back: the store skips what it
  already has, and a log never gets the hole a lost entry would leave.

submit() returns at once with a future that is done when the writes are recorded, or
are waiting in the backlog because Redis cannot take them now (they are recorded once it
can), or were dropped: a caller that awaits it never waits on an outage.

Writes that are StepOps (a list of StepWrites: a step's tokens, a RUNNING, a finish) and
wait next to each other go to Redis as one write_step: one script call, one round trip,
in the order they were submitted. At saturation the writer finds every write that came
while its last call was in flight, and sends them together. A call of several that Redis
refuses for good is tried again one op at a time, so only the op it refused is dropped.
"""

from __future__ import annotations

import asyncio
import collections
import itertools
import logging
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

from router.backoff import Backoff
from router.redis_errors import is_transient_refusal
from router.state import RequestStore, StepWrite, StoreUnavailable

log = logging.getLogger("kvserve.router")

StoreOp = Callable[[], Awaitable[None]]
MAX_BACKLOG = 200_000  # Redis writes kept while it cannot take them, beyond which the oldest go
REPLAY_WINDOW_S = 3.0  # acknowledged writes written again after an outage (Redis defers AOF writes up to 2 s)
MAX_WRITES_PER_CALL = 1024  # StepWrites sent in one script call: Redis runs a script without pausing


class StepOp:
    """A store op that is StepWrites. on_fenced gets the ids of its requests another
    router owns, whose writes Redis refused (RequestStore.write_step)."""

    __slots__ = ("store", "writes", "on_fenced")

    def __init__(self, store: RequestStore, writes: Sequence[StepWrite],
                 on_fenced: Callable[[list[str]], None] | None = None) -> None:
        self.store = store
        self.writes = writes
        self.on_fenced = on_fenced

    async def __call__(self) -> None:
        await write_together([self])


class Barrier:
    """An op that writes nothing: it waits for a write made outside the recorder (a create,
    made while its request is already being placed: Router.create(wait=False)), so that
    what is submitted after it lands after that write. Its outcome is not this op's: a
    create that failed leaves the writes after it no record to write to, and the store
    drops them."""

    __slots__ = ("write",)

    def __init__(self, write: asyncio.Future[Any]) -> None:
        self.write = write

    async def __call__(self) -> None:
        await asyncio.wait([self.write])


async def write_together(ops: Sequence[StepOp]) -> None:
    """The ops' writes in one write_step, in order (every op on one store)."""
    writes = [write for op in ops for write in op.writes]
    fenced = set(await ops[0].store.write_step(writes))
    if not fenced:
        return
    for op in ops:
        mine = [write.request_id for write in op.writes if write.request_id in fenced]
        if mine and op.on_fenced is not None:
            op.on_fenced(mine)


class OrderedRecorder:
    def __init__(self) -> None:
        self._queue: collections.deque[tuple[StoreOp, asyncio.Future[None] | None]] = collections.deque()
        self._writer: asyncio.Task[None] | None = None
        self._waiting = False  # Redis cannot take writes now: submit()'s futures are done at once
        self.num_dropped = 0  # writes lost: refused for good, or pushed out of a full backlog
        self._recent: collections.deque[tuple[float, StoreOp]] = collections.deque()  # acknowledged, newest last

    @property
    def num_pending(self) -> int:
        return len(self._queue)

    def submit(self, ops: Sequence[StoreOp]) -> asyncio.Future[None]:
        done: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        if not ops or self._waiting:
            done.set_result(None)
        for index, op in enumerate(ops):
            self._queue.append((op, done if index == len(ops) - 1 and not done.done() else None))
        self._trim()
        if self._queue and (self._writer is None or self._writer.done()):
            self._writer = asyncio.create_task(self._write(), name="redis-writer")
        return done

    async def record(self, ops: Sequence[StoreOp]) -> None:
        """submit(ops) and wait for its future (never for an outage)."""
        await self.submit(ops)

    async def flush(self) -> None:
        """Wait until what was submitted so far is written (or kept for Redis to take)."""
        written: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        written.set_result(None)
        await self.record([Barrier(written)])  # nothing to wait for but the ops ahead of it

    def _trim(self) -> None:
        dropped = 0
        while len(self._queue) > MAX_BACKLOG:
            _, done = self._queue.popleft()
            _resolve(done)
            dropped += 1
        if dropped:
            self.num_dropped += dropped
            log.error("Redis backlog over %d writes: dropped the %d oldest", MAX_BACKLOG, dropped)

    def _head(self, alone: bool) -> list[StoreOp]:
        """The ops at the head that go in one call: the first, and the StepOps that follow
        a StepOp on the same store, up to MAX_WRITES_PER_CALL writes. A Barrier whose
        write is done is nothing to wait for: it goes along (a burst of new requests puts
        one before each request's first write, and they would otherwise go one a call)."""
        first = self._queue[0][0]
        group = [first]
        if alone or not isinstance(first, StepOp):
            return group
        num_writes = len(first.writes)
        for op, _ in itertools.islice(self._queue, 1, None):
            if isinstance(op, Barrier) and op.write.done():
                group.append(op)
                continue
            if not isinstance(op, StepOp) or op.store is not first.store:
                break
            num_writes += len(op.writes)
            if num_writes > MAX_WRITES_PER_CALL:
                break
            group.append(op)
        return group

    async def _write(self) -> None:
        backoff = Backoff(0.1, 2.0)
        alone = 0  # a call of several ops was refused for good: that many go one at a time
        while self._queue:
            group = self._head(alone > 0)
            try:
                if len(group) == 1:
                    await group[0]()
                else:  # _head: StepOps, and Barriers with nothing left to wait for
                    await write_together([op for op in group if isinstance(op, StepOp)])
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # noqa: BLE001 - sorted below: retried, or dropped
                if isinstance(exc, StoreUnavailable) or is_transient_refusal(exc):
                    if not self._waiting:
                        log.warning("Redis cannot take writes; keeping them until it can: %s", exc)
                        self._waiting = True
                        for _, waiting in self._queue:
                            _resolve(waiting)
                    if isinstance(exc, StoreUnavailable) and self._recent:
                        # It may have crashed with acknowledged writes not yet in its AOF.
                        for _, recent in reversed(self._recent):
                            self._queue.appendleft((recent, None))
                        self._recent.clear()
                    await backoff.sleep()
                    continue
                if len(group) > 1:
                    alone = len(group)  # to find which op Redis refuses, and drop only that one
                    continue
                self.num_dropped += 1
                log.error("Redis refused a write, which is dropped: %s: %s", type(exc).__name__, exc)
            else:
                now = time.monotonic()
                self._recent.extend((now, op) for op in group)
                while self._recent and now - self._recent[0][0] > REPLAY_WINDOW_S:
                    self._recent.popleft()
            alone = max(0, alone - 1)
            for _ in group:
                _resolve(self._queue.popleft()[1])
            if self._waiting:
                log.info("Redis takes writes again: the ones kept are being recorded")
                self._waiting = False
                backoff.reset()

    def close(self) -> None:
        if self._writer is not None:
            self._writer.cancel()
        for _, done in self._queue:
            _resolve(done)


def _resolve(done: asyncio.Future[None] | None) -> None:
    if done is not None and not done.done():
        done.set_result(None)
