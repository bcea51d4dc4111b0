"""Retry delays that double up to a cap: the one backoff every retry loop of the router uses."""

from __future__ import annotations

import asyncio


class Backoff:
    """first_s, 2 x first_s, ... up to max_s; reset() after a success starts over."""

    def __init__(self, first_s: float, max_s: float) -> None:
        if not 0 < first_s <= max_s:
            raise ValueError(f"Backoff needs 0 < first_s <= max_s, got first_s={first_s}, max_s={max_s}")
        self.first_s = first_s
        self.max_s = max_s
        self._next_s = first_s

    def next_delay(self) -> float:
        """The delay to wait now; the one after it is twice as long (at most max_s)."""
        delay = self._next_s
        self._next_s = min(2 * delay, self.max_s)
        return delay

    async def sleep(self) -> None:
        await asyncio.sleep(self.next_delay())

    def reset(self) -> None:
        self._next_s = self.first_s
