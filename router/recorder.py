"""Redis writes in order, kept while Redis is down and replayed once it is back.

Connected clients get their tokens from the router's memory, never from Redis, so an
outage costs them nothing; what it costs is durability, bounded by MAX_BACKLOG.
"""

from __future__ import annotations

import asyncio
import collections
import logging
from collections.abc import Awaitable, Callable, Sequence

from router.state import StoreUnavailable

log = logging.getLogger("kvserve.router")

StoreOp = Callable[[], Awaitable[None]]
MAX_BACKLOG = 200_000  # Redis writes kept while it is down, beyond which the oldest go


class OrderedRecorder:
    """Runs store writes in order. While Redis is down, writes wait in a bounded backlog
    and a flusher retries them with backoff (0.1 s doubling to 2 s); the store drops a
    replayed entry it already has, so a write that half-landed is harmless."""

    def __init__(self) -> None:
        self._backlog: collections.deque[StoreOp] = collections.deque()
        self._flusher: asyncio.Task[None] | None = None

    @property
    def backlog_length(self) -> int:
        return len(self._backlog)

    async def record(self, ops: Sequence[StoreOp]) -> None:
        if self._backlog:
            self._backlog.extend(ops)
            self._trim()
            return
        for index, op in enumerate(ops):
            try:
                await op()
            except StoreUnavailable as exc:
                log.warning("Redis is unavailable; keeping writes until it returns: %s", exc)
                self._backlog.extend(ops[index:])
                if self._flusher is None or self._flusher.done():
                    self._flusher = asyncio.create_task(self._flush(), name="redis-backlog")
                return

    def _trim(self) -> None:
        dropped = 0
        while len(self._backlog) > MAX_BACKLOG:
            self._backlog.popleft()
            dropped += 1
        if dropped:
            log.error("Redis backlog over %d writes: dropped the %d oldest", MAX_BACKLOG, dropped)

    async def _flush(self) -> None:
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

    def close(self) -> None:
        if self._flusher is not None:
            self._flusher.cancel()
