"""Step writes that wait next to each other reach Redis in one write_step, in order.

At saturation the recorder's writer finds every write that came while its last call was
in flight (a step's tokens from each worker, RUNNING records, finishes) and sends them
as one script call. Real Redis under the store: what lands must be what the ops would
have written one by one. The store is a RequestStore that counts its write_step calls.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

import redis

from router.recorder import MAX_WRITES_PER_CALL, Barrier, OrderedRecorder, StepOp
from router.state import LogEntry, RequestRecord, RequestStatus, RequestStore, StepWrite, StoreConfig


class CountingStore(RequestStore):
    def __init__(self, config: StoreConfig) -> None:
        super().__init__(config)
        self.calls: list[list[str]] = []  # each write_step call: its writes' request ids

    async def write_step(self, writes: Sequence[StepWrite]) -> list[str]:
        self.calls.append([write.request_id for write in writes])
        return await super().write_step(writes)


def record(request_id: str) -> RequestRecord:
    return RequestRecord(request_id, RequestStatus.RUNNING, prompt_ids=[1, 2], sampling={}, created_at=0.0)


def token(request_id: str, offset: int) -> StepWrite:
    return StepWrite(request_id, LogEntry(offset=offset, token_ids=(100 + offset,), text=""), {"num_output_tokens": offset + 1})


def test_waiting_step_writes_go_in_one_call_and_land_as_they_would_one_by_one(store_config: StoreConfig) -> None:
    async def scenario() -> tuple[list[list[str]], dict[str, list[int]], dict[str, str], list[str]]:
        store = CountingStore(store_config)
        for request_id in ("a", "b"):
            await store.create(record(request_id))
        recorder = OrderedRecorder()
        order: list[str] = []

        async def plain() -> None:  # not a StepOp: the writes on either side of it go apart
            order.append("plain")

        recorder.submit([StepOp(store, [token("a", 0), token("b", 0)])])
        while not store.calls:  # in flight while the rest come
            await asyncio.sleep(0)
        for offset in range(1, 6):
            recorder.submit([StepOp(store, [token("a", offset), token("b", offset)])])
        recorder.submit([StepOp(store, [store.finish_write("a", RequestStatus.FINISHED, "length")])])
        recorder.submit([StepOp(store, [token("a", 6), token("b", 6)])])  # a has ended: dropped for a
        recorder.submit([plain])
        await recorder.submit([StepOp(store, [token("b", 7)])])
        logs = {r: [e.offset for e in await store.read_log(r)] for r in ("a", "b")}
        a = await store.get("a")
        assert a is not None
        return store.calls, logs, {"status": a.status.value, "reason": a.finish_reason}, order

    calls, logs, a, order = asyncio.run(scenario())
    # The first call alone; everything that came while it was in flight in one call; the
    # plain op; then the last write.
    assert calls == [["a", "b"], ["a", "b"] * 5 + ["a"] + ["a", "b"], ["b"]], calls
    assert order == ["plain"]
    assert logs == {"a": list(range(6)), "b": list(range(8))}, logs
    assert a == {"status": "FINISHED", "reason": "length"}


def test_a_call_redis_refuses_is_tried_op_by_op_and_only_the_refused_op_is_dropped(store_config: StoreConfig) -> None:
    async def scenario() -> tuple[dict[str, list[int]], int, list[list[str]]]:
        store = CountingStore(store_config)
        for request_id in ("a", "b"):
            await store.create(record(request_id))
        with redis.Redis.from_url(store_config.url) as client:
            client.set(f"{store_config.prefix}:req:bad", "not a hash")  # HGET on it: WRONGTYPE, for good
        recorder = OrderedRecorder()
        recorder.submit([StepOp(store, [token("a", 0)])])
        while not store.calls:
            await asyncio.sleep(0)
        recorder.submit([StepOp(store, [token("a", 1)])])
        recorder.submit([StepOp(store, [token("bad", 0)])])
        await recorder.submit([StepOp(store, [token("b", 0), token("a", 2)])])
        logs = {r: [e.offset for e in await store.read_log(r)] for r in ("a", "b")}
        return logs, recorder.num_dropped, store.calls

    logs, dropped, calls = asyncio.run(scenario())
    # The group of three failed on "bad" after "a" 1 had landed: op by op, "a" 1 is not
    # logged twice, "bad" alone is dropped, and the op after it goes.
    assert calls == [["a"], ["a", "bad", "b", "a"], ["a"], ["bad"], ["b", "a"]], calls
    assert dropped == 1
    assert logs == {"a": [0, 1, 2], "b": [0]}, logs


def test_each_op_hears_of_its_own_fenced_requests(store_config: StoreConfig) -> None:
    async def scenario() -> tuple[list[list[str]], list[list[str]], int]:
        store = CountingStore(store_config)
        store.set_owner("router-1")
        for request_id in ("mine", "theirs"):
            await store.create(record(request_id))
        with redis.Redis.from_url(store_config.url) as client:
            client.hset(f"{store_config.prefix}:req:mine", "router_id", "router-1")
            client.hset(f"{store_config.prefix}:req:theirs", "router_id", "router-2")
        recorder = OrderedRecorder()
        first: list[list[str]] = []
        second: list[list[str]] = []
        recorder.submit([StepOp(store, [token("mine", 0)])])
        while not store.calls:
            await asyncio.sleep(0)
        recorder.submit([StepOp(store, [token("mine", 1)], first.append)])
        await recorder.submit([StepOp(store, [token("theirs", 0), token("mine", 2)], second.append)])
        return first, second, len(store.calls)

    first, second, num_calls = asyncio.run(scenario())
    assert num_calls == 2
    assert first == [] and second == [["theirs"]]


def test_a_call_carries_at_most_max_writes_per_call(store_config: StoreConfig) -> None:
    async def scenario() -> list[int]:
        store = CountingStore(store_config)
        await store.create(record("a"))
        recorder = OrderedRecorder()
        futures = [recorder.submit([StepOp(store, [StepWrite("a", None, {"n": i}) for i in range(300)])])]
        while not store.calls:
            await asyncio.sleep(0)
        futures += [recorder.submit([StepOp(store, [StepWrite("a", None, {"n": i}) for i in range(300)])])
                    for _ in range(7)]
        await asyncio.gather(*futures)
        return [len(call) for call in store.calls]

    sizes = asyncio.run(scenario())
    # The first alone, then three ops of 300 a call (a fourth would pass 1,024), then the last.
    assert MAX_WRITES_PER_CALL == 1024
    assert sizes == [300, 900, 900, 300], sizes


def test_a_burst_of_new_requests_writes_go_in_one_call_past_their_barriers(store_config: StoreConfig) -> None:
    """Each Generate the router places while its record is created puts a Barrier before its
    first write (Router.create(wait=False)). One whose create has landed is nothing to wait
    for: it must not cut the writes around it into calls of one (a review found 9 calls for
    a burst of 8, not 2)."""

    async def scenario() -> list[list[str]]:
        store = CountingStore(store_config)
        ids = [f"r{i}" for i in range(8)]
        for request_id in ["busy", *ids]:
            await store.create(record(request_id))
        recorder = OrderedRecorder()
        recorder.submit([StepOp(store, [token("busy", 0)])])
        while not store.calls:  # a call in flight while the burst comes
            await asyncio.sleep(0)
        last = None
        for request_id in ids:
            created: asyncio.Future[None] = asyncio.get_running_loop().create_future()
            created.set_result(None)
            recorder.submit([Barrier(created)])
            last = recorder.submit([StepOp(store, [StepWrite(request_id, None, {
                "status": RequestStatus.RUNNING.value, "worker_id": "w0"})])])
        assert last is not None
        await last
        landed = [(await store.get(request_id)) for request_id in ids]
        assert all(r is not None and r.status is RequestStatus.RUNNING for r in landed)
        await store.close()
        return store.calls

    assert asyncio.run(scenario()) == [["busy"], [f"r{i}" for i in range(8)]]
