"""Group commit: calls that come while one is in flight go together in the next.

A lone call goes out at once, from its caller, so one request at a time pays nothing for
the grouping. Calls that come while a call is in flight wait, and when it returns they go
out together, as one call of the batched form (one round trip for all of them). Under
load that is one round trip per round trip's worth of arrivals, whatever their number;
the first waiter waits at most the call in flight.

    time ->        call 1 [a]        call 2 [b c d]       call 3 [e]
    submit   a ----|=========|
    submit      b c d ......... -----|==============|
    submit                          e .............. -----|======|

The batched form answers each item in its place, with a result or an exception (that
item's own failure, raised to its caller alone); a call that fails as a whole (the store
is unavailable) fails every item in it. A caller that stops waiting does not take its
item back: it may still be sent.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Sequence
from typing import Generic, TypeVar

__all__ = ["GroupCommit"]

_Item = TypeVar("_Item")
_Result = TypeVar("_Result")


class GroupCommit(Generic[_Item, _Result]):
    """submit(item) returns send([..., item, ...])'s answer for item (see the module docstring).

    send takes the items in submission order and answers each, in order: its result, or
    an exception that submit raises.
    """

    def __init__(self, send: Callable[[Sequence[_Item]], Awaitable[Sequence[_Result | BaseException]]],
                 max_items: int) -> None:
        if max_items < 1:
            raise ValueError(f"max_items must be >= 1, got {max_items}")
        self._send = send
        self._max_items = max_items
        self._busy = False  # a call is in flight
        self._waiting: list[tuple[_Item, asyncio.Future[_Result]]] = []
        self._sender: asyncio.Task[None] | None = None
        self.num_calls = 0  # calls sent, for tests and benchmarks
        self.num_items = 0

    @property
    def busy(self) -> bool:
        """A call is in flight: a submit now waits for it, and goes in the next."""
        return self._busy

    async def submit(self, item: _Item) -> _Result:
        if self._busy:
            future: asyncio.Future[_Result] = asyncio.get_running_loop().create_future()
            self._waiting.append((item, future))
            return await future
        self._busy = True
        try:
            answer = (await self._call([item]))[0]
        finally:
            self._busy = False
            self._send_waiting()
        if isinstance(answer, BaseException):
            raise answer
        return answer

    async def _call(self, items: Sequence[_Item]) -> Sequence[_Result | BaseException]:
        self.num_calls += 1
        self.num_items += len(items)
        answers = await self._send(items)
        if len(answers) != len(items):
            raise RuntimeError(f"send answered {len(answers)} of {len(items)} items")
        return answers

    def _send_waiting(self) -> None:
        if self._busy or not self._waiting:
            return
        batch = self._waiting[: self._max_items]
        del self._waiting[: self._max_items]
        self._busy = True
        self._sender = asyncio.create_task(self._send_batch(batch), name="group-commit")

    async def _send_batch(self, batch: list[tuple[_Item, asyncio.Future[_Result]]]) -> None:
        try:
            answers = await self._call([item for item, _ in batch])
        except Exception as exc:  # noqa: BLE001 - the whole call failed: so did each item
            answers = [exc] * len(batch)
        except BaseException as exc:  # cancelled (the loop is closing): no waiter is left hanging
            batch, self._waiting = batch + self._waiting, []
            self._busy = False  # and a later submit is sent, not parked behind a call that is gone
            for _, future in batch:
                _answer(future, exc)
            raise
        self._busy = False
        for (_, future), answer in zip(batch, answers):
            _answer(future, answer)
        self._send_waiting()


def _answer(future: asyncio.Future[_Result], answer: _Result | BaseException) -> None:
    if future.done():  # its caller stopped waiting
        return
    if isinstance(answer, asyncio.CancelledError):
        future.cancel()
    elif isinstance(answer, BaseException):
        future.set_exception(answer)
    else:
        future.set_result(answer)
