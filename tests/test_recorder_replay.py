"""The recorder writes again what Redis acknowledged just before it became unavailable.

A Redis whose fsync is slow acknowledges writes it has not yet put in its AOF (it defers
them up to 2 s), so a crash loses them; the router's later writes then leave a hole in a
request's log (test_chaos_redis.py failed that way: one 3-token entry missing mid-log).
The ops here are plain coroutines that record each call: the recorder's ordering is what
is under test, and the store's script skips what it already has (test_redis_store.py).
"""

from __future__ import annotations

import asyncio

from router.recorder import REPLAY_WINDOW_S, OrderedRecorder
from router.state import StoreUnavailable


def test_writes_acknowledged_just_before_an_outage_are_written_again_in_order() -> None:
    async def scenario() -> list[str]:
        calls: list[str] = []
        failures = {"f": 2}  # "f" meets an outage twice, then Redis is back

        def op(name: str):  # noqa: ANN202 - a StoreOp
            async def run() -> None:
                calls.append(name)
                if failures.get(name, 0) > 0:
                    failures[name] -= 1
                    raise StoreUnavailable("Redis is unavailable (test)")
            return run

        recorder = OrderedRecorder()
        await recorder.submit([op("old")])
        for _ in range(100):
            if calls:
                break
            await asyncio.sleep(0.01)
        await asyncio.sleep(REPLAY_WINDOW_S + 0.2)  # "old" is out of the window by now
        await recorder.submit([op("a"), op("b"), op("c")])
        recorder.submit([op("f"), op("g")])
        for _ in range(500):
            if calls[-1:] == ["g"]:
                break
            await asyncio.sleep(0.02)
        recorder.close()
        return calls

    calls = asyncio.run(scenario())
    # a, b, c landed; f met an outage: a, b, c go again before f, in order. They land, and f
    # meets a second outage: they were acknowledged just before it, so they go again too.
    # "old" was acknowledged longer ago than the window: never again.
    assert calls == ["old", "a", "b", "c", "f", "a", "b", "c", "f", "a", "b", "c", "f", "g"], calls
