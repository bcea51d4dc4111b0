"""New requests' records that come while a create is in flight go to Redis together.

The router creates each request's record through a GroupCommit over
RequestStore.create_many (router/core.py). Real Redis under the store: what lands must
be what creating the records one by one would have left, and a batch must fail no
further than its causes.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

import pytest
import redis
import redis.exceptions

from router.core import MAX_CREATES_PER_CALL, Router, RouterConfig
from router.group_commit import GroupCommit
from router.placement import WorkerView
from router.state import RequestRecord, RequestStatus, RequestStore, StoreConfig, StoreUnavailable
from router.validation import ValidRequest
from workers.engine.request import FinishReason
from workers.engine.sampling import SamplingParams
from workers.messages import WorkerInfo
from workers.model.tokenizer import TokenizerSpec


class CountingStore(RequestStore):
    def __init__(self, config: StoreConfig) -> None:
        super().__init__(config)
        self.calls: list[list[str]] = []  # each create_many call: its records' ids

    async def create_many(self, records: Sequence[RequestRecord]) -> list[RequestRecord | None]:
        self.calls.append([record.request_id for record in records])
        return await super().create_many(records)


def creates_of(store: RequestStore) -> GroupCommit[RequestRecord, RequestRecord | None]:
    """The router's wiring (Router.__init__)."""
    return GroupCommit(store.create_many, MAX_CREATES_PER_CALL)


def record(request_id: str, status: RequestStatus = RequestStatus.QUEUED, prompt: int = 1) -> RequestRecord:
    return RequestRecord(request_id, status, prompt_ids=[prompt, 2, 3], sampling={"temperature": 0.0},
                         created_at=1.5, prompt_text=f"prompt {request_id}", router_id="r1")


def test_creates_that_come_while_one_is_in_flight_go_in_one_call_and_land_as_one_by_one(
    store_config: StoreConfig,
) -> None:
    async def scenario() -> None:
        store = CountingStore(store_config)
        creates = creates_of(store)
        await store.create(record("old", prompt=9))  # an id that exists: its create finds it
        first = asyncio.ensure_future(creates.submit(record("r0")))
        while not store.calls[1:]:  # r0's call is in flight while the rest come
            await asyncio.sleep(0)
        rest = [record(f"r{i}") for i in range(1, 40)] + [record("old"), record("r5", prompt=7),
                                                         record("done", RequestStatus.CANCELLED)]
        results = await asyncio.gather(first, *(creates.submit(r) for r in rest))
        # The lone create went at once; everything that came while it was in flight, in one call.
        assert store.calls[1:] == [["r0"], [r.request_id for r in rest]]
        assert (creates.num_calls, creates.num_items) == (2, 1 + len(rest))
        assert results[:40] == [None] * 40  # created
        old, r5_again, done = results[40:]
        assert old is not None and old.prompt_ids == [9, 2, 3]  # the existing record, untouched
        assert r5_again is not None and r5_again.prompt_ids == [1, 2, 3]  # the first r5 of the same call
        assert done is None
        for i in range(40):
            got = await store.get(f"r{i}")
            assert got is not None
            assert (got.status, got.prompt_ids, got.prompt_text, got.router_id, got.created_at) == (
                RequestStatus.QUEUED, [1, 2, 3], f"prompt r{i}", "r1", 1.5)
        client = redis.Redis.from_url(store_config.url, decode_responses=True)
        try:
            active = client.smembers(f"{store_config.prefix}:active")
            assert active == {f"r{i}" for i in range(40)} | {"old"}  # an ended record is not active
            assert 0 < client.ttl(store.hash_key("done")) <= store_config.ttl_seconds  # and expires
            assert client.ttl(store.hash_key("r1")) == -1
        finally:
            client.close()
        await store.close()

    asyncio.run(scenario())


def test_a_record_redis_refuses_fails_alone_and_the_others_in_its_call_are_created(store_config: StoreConfig) -> None:
    async def scenario() -> None:
        store = CountingStore(store_config)
        creates = creates_of(store)
        client = redis.Redis.from_url(store_config.url, decode_responses=True)
        client.set(store.hash_key("bad"), "a string, not a hash")  # HGETALL on it: WRONGTYPE
        client.close()
        first = asyncio.ensure_future(creates.submit(record("a")))
        while not store.calls:
            await asyncio.sleep(0)
        results = await asyncio.gather(
            first, *(creates.submit(record(r)) for r in ("b", "bad", "c")), return_exceptions=True
        )
        assert store.calls == [["a"], ["b", "bad", "c"]]
        assert results[0] is None and results[1] is None and results[3] is None
        assert isinstance(results[2], redis.exceptions.ResponseError)
        assert "WRONGTYPE" in str(results[2])
        for request_id in ("a", "b", "c"):
            got = await store.get(request_id)
            assert got is not None and got.status is RequestStatus.QUEUED
        with pytest.raises(redis.exceptions.ResponseError, match="WRONGTYPE"):
            await store.create(record("bad"))  # one alone raises it
        await store.close()

    asyncio.run(scenario())


def test_when_redis_is_unavailable_a_batch_fails_at_once_not_one_call_each(store_config: StoreConfig) -> None:
    async def scenario() -> None:
        gone = StoreConfig(url="redis://127.0.0.1:1/0", prefix=store_config.prefix, socket_timeout=0.5)
        store = CountingStore(gone)
        creates = creates_of(store)
        results = await asyncio.gather(*(creates.submit(record(f"r{i}")) for i in range(10)), return_exceptions=True)
        assert all(isinstance(result, StoreUnavailable) for result in results), results
        assert [len(call) for call in store.calls] == [1, 9]
        await store.close()

    asyncio.run(scenario())


def test_group_commit_hands_each_caller_its_own_result_in_order_and_caps_a_call() -> None:
    async def scenario() -> None:
        calls: list[list[int]] = []
        gate = asyncio.Event()

        async def send(items: Sequence[int]) -> list[int]:
            calls.append(list(items))
            if len(calls) == 1:
                await gate.wait()
            return [item * 10 for item in items]

        group: GroupCommit[int, int] = GroupCommit(send, 4)
        first = asyncio.ensure_future(group.submit(0))
        await asyncio.sleep(0)
        rest = [asyncio.ensure_future(group.submit(i)) for i in range(1, 11)]
        await asyncio.sleep(0)
        gate.set()
        assert await asyncio.gather(first, *rest) == [i * 10 for i in range(11)]
        assert calls == [[0], [1, 2, 3, 4], [5, 6, 7, 8], [9, 10]]

    asyncio.run(scenario())


def test_group_commit_refuses_a_batch_cap_below_one() -> None:
    async def send(items: Sequence[int]) -> list[int]:
        return list(items)

    with pytest.raises(ValueError, match="max_items"):
        GroupCommit(send, 0)


def test_an_item_answered_with_an_error_raises_to_its_caller_alone_and_a_failed_call_fails_its_items_only() -> None:
    async def scenario() -> None:
        calls: list[list[int]] = []
        gate = asyncio.Event()

        async def send(items: Sequence[int]) -> list[int | BaseException]:
            calls.append(list(items))
            if len(calls) == 1:
                await gate.wait()
            if 5 in items:
                raise ConnectionError("the store went away")
            return [ValueError(f"item {item}") if item == 2 else item for item in items]

        group: GroupCommit[int, int] = GroupCommit(send, 3)
        futures = [asyncio.ensure_future(group.submit(i)) for i in range(8)]
        await asyncio.sleep(0)
        gate.set()
        answers = await asyncio.gather(*futures, return_exceptions=True)
        assert calls == [[0], [1, 2, 3], [4, 5, 6], [7]]
        assert answers[:2] == [0, 1] and answers[3] == 3 and answers[7] == 7
        assert isinstance(answers[2], ValueError) and str(answers[2]) == "item 2"
        assert all(isinstance(answers[i], ConnectionError) for i in (4, 5, 6))
        later = await group.submit(9)  # nothing is left in flight: it goes alone, at once
        assert (later, calls[-1]) == (9, [9])

    asyncio.run(scenario())


def test_a_caller_that_leaves_while_its_create_waits_in_a_group_leaves_no_live_record(
    store_config: StoreConfig,
) -> None:
    """Router.create shields the create from its caller: a create the caller left is still
    made (it may be in a call already), and then ended CANCELLED, so no record stays QUEUED
    and active with no expiry. Here the caller leaves while its create waits behind one in
    flight, and while its own call is in flight. Each is told as finished, as every request
    that ends is (kvserve_requests_finished_total counts it once)."""
    class GatedStore(CountingStore):
        def __init__(self, config: StoreConfig) -> None:
            super().__init__(config)
            self.gate = asyncio.Event()

        async def create_many(self, records: Sequence[RequestRecord]) -> list[RequestRecord | None]:
            self.calls.append([record.request_id for record in records])
            await self.gate.wait()
            return await RequestStore.create_many(self, records)

    async def scenario() -> None:
        store = GatedStore(store_config)
        router = Router(RouterConfig(), store)
        info = WorkerInfo("w0", "node", "tiny", "cpu", "float32", vocab_size=258, max_model_len=2048,
                          block_size=16, block_bytes=1024, num_blocks=64, tokenizer=TokenizerSpec(None, None, ()))
        view = WorkerView(info)
        router.registry.views["w0"] = view
        router.registry._set_alive(view, True)
        await router.ownership.renew()
        finished: list[tuple[str, FinishReason | None]] = []
        router.observers.append(
            lambda name, payload: finished.append((payload.request_id, payload.finish_reason)) if name == "finished" else None
        )

        def valid(request_id: str) -> ValidRequest:
            return ValidRequest(request_id, (1, 2, 3), SamplingParams(max_tokens=4), 1)

        in_flight = asyncio.ensure_future(router.create(valid("first")))
        while not store.calls:
            await asyncio.sleep(0)
        waiting = asyncio.ensure_future(router.create(valid("left-waiting")))
        await asyncio.sleep(0.05)
        in_flight.cancel()  # its call is in flight
        waiting.cancel()  # its create waits in the next group
        await asyncio.sleep(0.05)
        store.gate.set()
        for task in (in_flight, waiting):
            with pytest.raises(asyncio.CancelledError):
                await task
        await asyncio.sleep(0.2)  # the shielded creates and their ends land
        assert store.calls == [["first"], ["left-waiting"]]
        client = redis.Redis.from_url(store_config.url, decode_responses=True)
        try:
            assert client.smembers(f"{store_config.prefix}:active") == set()
            for request_id in ("first", "left-waiting"):
                got = await store.get(request_id)
                assert got is not None and got.status is RequestStatus.CANCELLED, (request_id, got)
                assert 0 < client.ttl(store.hash_key(request_id)) <= store_config.ttl_seconds
        finally:
            client.close()
        assert not router.trackers
        assert sorted(finished) == [("first", FinishReason.CANCELLED), ("left-waiting", FinishReason.CANCELLED)]
        await store.close()

    asyncio.run(scenario())


def test_a_batch_whose_call_is_cancelled_answers_its_waiters_and_later_submits_are_sent() -> None:
    """The batch's task cancelled mid-call (by whatever cancels it: the loop closing, or a
    future caller of the task) answered its waiters but left the group busy, so every
    later submit waited for ever: every new request's create would hang (found by review)."""

    async def scenario() -> None:
        first_gate, stuck = asyncio.Event(), asyncio.Event()
        calls: list[list[int]] = []

        async def send(items: Sequence[int]) -> list[int]:
            calls.append(list(items))
            if len(calls) == 1:
                await first_gate.wait()
            elif len(calls) == 2:
                await stuck.wait()  # the batch's call hangs until it is cancelled
            return list(items)

        group: GroupCommit[int, int] = GroupCommit(send, 8)
        first = asyncio.ensure_future(group.submit(0))
        await asyncio.sleep(0)
        second = asyncio.ensure_future(group.submit(1))  # waits behind the lone call
        await asyncio.sleep(0)
        first_gate.set()
        assert await first == 0
        while len(calls) < 2:  # the batch [1] is in flight
            await asyncio.sleep(0)
        assert group._sender is not None
        group._sender.cancel()
        with pytest.raises(asyncio.CancelledError):
            await second
        assert await asyncio.wait_for(group.submit(9), 10) == 9
        assert calls[-1] == [9]

    asyncio.run(scenario())
