"""A client's deadline that passes while its request waits for KV room has one outcome.

Two timers fire at that deadline: the admission queue's own wait, and gRPC's, which
cancels the call. Whichever came first decided the record: FAILED ("the deadline passed
while waiting for KV room", counted as rejected for "deadline") or CANCELLED (counted
nowhere); a Node.js client saw 8 of 20 queued requests recorded one way, 12 the other.
Here a real Router and Redis, a worker whose KV is full, and admit() cancelled the way
gRPC cancels a call: at instants around the deadline, many times, and well before it.
Every one of those requests ended, so each counts once in kvserve_requests_finished_total
(requests cancelled while queued were missing there).
"""

from __future__ import annotations

import asyncio
import random
import time
from types import SimpleNamespace
from typing import Any

from router.admission import DEADLINE_PASSED
from router.core import DEADLINE_SLACK_S, Router, RouterConfig
from router.errors import DeadlineExceeded, Unavailable
from router.metrics import RouterMetrics
from router.placement import WorkerView
from router.state import RequestRecord, RequestStatus, RequestStore, StoreConfig
from router.tracker import RequestTracker
from workers.engine.sampling import SamplingParams
from workers.engine.stats import EngineStats
from workers.messages import WorkerInfo
from workers.model.tokenizer import TokenizerSpec

BLOCK = 16


def _full_router(store: RequestStore, max_queue_wait_s: float = RouterConfig.max_queue_wait_s) -> Router:
    router = Router(RouterConfig(policy="kv", kv_reserve_ratio=1.0, max_queue_wait_s=max_queue_wait_s), store)
    info = WorkerInfo("w0", "node", "tiny", "cpu", "float32", vocab_size=258, max_model_len=2048,
                      block_size=BLOCK, block_bytes=1024, num_blocks=64, tokenizer=TokenizerSpec(None, None, ()))
    view = WorkerView(info)
    router.registry.views["w0"] = view
    router.registry._set_alive(view, True)
    view.apply_report(EngineStats.of_pool(64, 64, 1024), (), 0.0)  # every block committed: requests wait
    return router


async def _queued(router: Router, request_id: str) -> RequestTracker:
    record = RequestRecord(request_id, RequestStatus.QUEUED, prompt_ids=[1, 2, 3], sampling={}, created_at=time.time())
    assert await router.store.create(record) is None
    tracker = RequestTracker(request_id, (1, 2, 3), SamplingParams(max_tokens=8), 1)
    router.trackers[request_id] = tracker
    return tracker


async def _waiting(router: Router, request_id: str) -> tuple[RequestTracker, asyncio.Future[None]]:
    """A queued request whose admit() waits for room (the router is full); the admit's task."""
    tracker = await _queued(router, request_id)
    admitting = asyncio.ensure_future(router.admit(tracker, None))
    await asyncio.sleep(0.1)
    return tracker, admitting


async def _admit_cancelled_at(router: Router, tracker: RequestTracker, deadline: float, cancel_at: float | None) -> str:
    """admit() with a deadline; cancelled at cancel_at as gRPC cancels a call (None: never).
    What the caller saw."""
    task = asyncio.ensure_future(router.admit(tracker, deadline))
    if cancel_at is not None:
        await asyncio.sleep(max(0.0, cancel_at - time.monotonic()))
        task.cancel()
    try:
        await task
    except asyncio.CancelledError:
        return "cancelled"
    except DeadlineExceeded:
        return "deadline"
    return "placed"


def test_a_deadline_passing_in_the_queue_is_recorded_failed_whichever_timer_fires_first(
    store_config: StoreConfig,
) -> None:
    async def scenario() -> tuple[dict[str, tuple[str, Any, str]], list[str], dict[str, float]]:
        store = RequestStore(store_config)
        router = _full_router(store)
        metrics = RouterMetrics(router)
        rejected: list[str] = []
        router.observers.append(lambda name, payload: rejected.append(payload[0].request_id)
                                if name == "rejected" and payload[1] == "deadline" else None)
        rng = random.Random(7)
        outcomes: dict[str, tuple[str, Any, str]] = {}
        try:
            cases: list[tuple[str, float, float | None]] = [("early-cancel", 0.4, 0.1), ("queue-first", 0.1, None)]
            # gRPC's cancel in the instants around the deadline, from just inside the slack
            # before it to after it: 40 times.
            cases += [(f"at-deadline-{i}", 0.1, 0.1 + rng.uniform(-0.8 * DEADLINE_SLACK_S, 0.01)) for i in range(40)]
            for request_id, deadline_in, cancel_in in cases:
                tracker = await _queued(router, request_id)
                now = time.monotonic()
                seen = await _admit_cancelled_at(router, tracker, now + deadline_in,
                                                 None if cancel_in is None else now + cancel_in)
                record = await store.get(request_id)
                assert record is not None
                outcomes[request_id] = (seen, record.status, record.error)
                assert request_id not in router.trackers
            assert router.registry.views["w0"].reserved_blocks == 0
        finally:
            await store.close()
        counters = {f"{m.name}{{reason={s.labels['reason']}}}": s.value for m in metrics.registry.collect()
                    for s in m.samples if m.name.startswith("kvserve_requests_") and s.name.endswith("_total")}
        return outcomes, rejected, counters

    outcomes, rejected, counters = asyncio.run(scenario())
    assert outcomes.pop("early-cancel") == ("cancelled", RequestStatus.CANCELLED, "")
    assert outcomes.pop("queue-first") == ("deadline", RequestStatus.FAILED, DEADLINE_PASSED)
    for request_id, (_, status, error) in outcomes.items():
        assert (status, error) == (RequestStatus.FAILED, DEADLINE_PASSED), request_id
    # Each deadline counted once, as rejected for "deadline"; the early cancel not at all.
    assert sorted(rejected) == sorted(["queue-first", *outcomes])
    # And every one of them ended: counted once among the finished, by its recorded reason.
    assert counters == {
        "kvserve_requests_finished{reason=cancelled}": 1.0,
        "kvserve_requests_finished{reason=error}": float(len(rejected)),
        "kvserve_requests_rejected{reason=deadline}": float(len(rejected)),
    }
    seen = {seen for seen, _, _ in outcomes.values()}
    assert "cancelled" in seen, "gRPC's timer never came first: the racy order was not hit"


class _SilentWorker:
    """A worker handle whose add_request is never answered: the request stays on its way."""

    class _Method:
        def __init__(self, answer: bool) -> None:
            self.answer = answer

        def remote(self, *args: Any) -> asyncio.Future[None]:
            future: asyncio.Future[None] = asyncio.get_running_loop().create_future()
            if self.answer:
                future.set_result(None)
            return future

    def __init__(self) -> None:
        self.add_request = self._Method(answer=False)
        self.abort = self._Method(answer=True)


def test_a_deadline_that_passes_once_the_request_is_placed_is_not_a_wait_for_room(store_config: StoreConfig) -> None:
    """The deadline rule is for a request still waiting in the queue. One that found room
    and is on its way to its worker when gRPC cancels the call at its deadline did not wait
    for room: it ends CANCELLED, not counted as rejected (found by review)."""

    async def scenario() -> tuple[RequestRecord | None, list[str], int]:
        store = RequestStore(store_config)
        router = _full_router(store)
        view = router.registry.views["w0"]
        view.apply_report(EngineStats.of_pool(64, 0, 1024), (), 0.0)  # room now
        router.registry._handles["w0"] = _SilentWorker()
        rejected: list[str] = []
        router.observers.append(lambda name, payload: rejected.append(payload[0].request_id)
                                if name == "rejected" else None)
        try:
            tracker = await _queued(router, "placed")
            now = time.monotonic()
            seen = await _admit_cancelled_at(router, tracker, now + 0.2, now + 0.2 - DEADLINE_SLACK_S / 2)
            assert seen == "cancelled" and tracker.num_placements == 1
            return await store.get("placed"), rejected, view.reserved_blocks
        finally:
            await store.close()

    record, rejected, reserved = asyncio.run(scenario())
    assert record is not None and (record.status, record.error) == (RequestStatus.CANCELLED, "")
    assert rejected == [] and reserved == 0


def test_a_second_ctrl_c_ends_the_drain_and_cancels_what_still_waits(store_config: StoreConfig) -> None:
    """Ctrl-C drains for --drain-grace; a second Ctrl-C was ignored, so a user who wanted
    out waited the whole grace (found by a walkthrough). end_drain(), which kvserve up calls
    on the second signal, ends it now, and a drain that has not begun yet, too."""

    async def scenario() -> tuple[float, RequestRecord | None, float]:
        store = RequestStore(store_config)
        router = _full_router(store)
        try:
            tracker, admitting = await _waiting(router, "waiting")
            began = time.monotonic()
            draining = asyncio.ensure_future(router.drain(600.0))
            await asyncio.sleep(0.3)
            assert not draining.done()  # it waits for the request
            router.end_drain()
            await asyncio.wait_for(draining, 30)
            took = time.monotonic() - began
            await asyncio.gather(admitting, return_exceptions=True)
            record = await store.get("waiting")
            # Cut before it began: the next drain does not wait either.
            again, admitting = await _waiting(router, "again")
            began = time.monotonic()
            await asyncio.wait_for(router.drain(600.0), 30)
            await asyncio.gather(admitting, return_exceptions=True)
            return took, record, time.monotonic() - began
        finally:
            await store.close()

    took, record, second = asyncio.run(scenario())
    assert took < 30 and second < 30  # not the 600 s grace
    assert record is not None and record.status is RequestStatus.CANCELLED
    assert record.error == "the router stopped: a second stop signal cut its drain short"  # not a client's cancel


def test_a_waiting_request_another_router_took_is_let_go_with_where_to_re_attach(store_config: StoreConfig) -> None:
    """Redis fenced this router's writes to a request (a peer claimed it while this router
    was stalled), or the router handed it to a peer as it stopped: while it waits in the
    admission queue, its client is told to re-attach (UNAVAILABLE naming the Stream), not
    that it was cancelled, and this router writes no end to it: the peer's now."""

    async def scenario() -> tuple[BaseException | None, RequestRecord | None, bool]:
        store = RequestStore(store_config)
        router = _full_router(store)
        try:
            tracker, admitting = await _waiting(router, "taken")
            router._on_fenced(["taken"])
            raised = (await asyncio.gather(admitting, return_exceptions=True))[0]
            await asyncio.sleep(0.2)  # an end, if one were written, lands
            return raised, await store.get("taken"), "taken" in router.trackers
        finally:
            await store.close()

    raised, record, tracked = asyncio.run(scenario())
    assert isinstance(raised, Unavailable), raised
    assert "re-attach with Stream(request_id='taken', from_offset=0)" in str(raised)
    assert record is not None and record.status is RequestStatus.QUEUED and not tracked


def test_a_drain_goes_on_when_redis_refuses_its_draining_mark(store_config: StoreConfig) -> None:
    """The mark that tells peers a router drains is a write: Redis may refuse it (OOM under
    maxmemory). The drain does not stop there: what still waits is cancelled, as before."""
    import redis.exceptions

    async def scenario() -> RequestRecord | None:
        store = RequestStore(store_config)
        router = _full_router(store)

        async def refused(for_s: float) -> None:
            raise redis.exceptions.ResponseError("OOM command not allowed when used memory > 'maxmemory'.")

        router.ownership.mark_draining = refused  # type: ignore[method-assign]
        try:
            tracker, admitting = await _waiting(router, "oom")
            await asyncio.wait_for(router.drain(0.2, hand_over=True), 30)
            await asyncio.gather(admitting, return_exceptions=True)
            return await store.get("oom")
        finally:
            await store.close()

    record = asyncio.run(scenario())
    assert record is not None and record.status is RequestStatus.CANCELLED
    assert record.error == "the router stopped: it ran past the drain grace (0.2 s)"


def test_a_request_let_go_while_on_its_way_to_a_worker_is_stopped_there(store_config: StoreConfig) -> None:
    """A stopping router hands a request over (or Redis fences it) while its AddRequest is
    in flight: the router does not know its worker yet, so the hand-over cannot stop it. Once
    the worker takes it, the router must: abort it there and free its reservation, or the old
    placement would decode to max_tokens beside the adopter's (found by a review)."""

    async def scenario() -> tuple[list[str], int, str, str]:
        store = RequestStore(store_config)
        router = _full_router(store)
        view = router.workers["w0"]
        view.apply_report(EngineStats.of_pool(64, 0, 1024), (), 0.0)  # room: it is placed at once
        on_its_way: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        aborted: list[str] = []

        async def abort(key: str) -> None:
            aborted.append(key)

        router.registry._handles["w0"] = SimpleNamespace(abort=SimpleNamespace(remote=abort))
        router.registry.send_add = lambda worker_id, add: on_its_way  # type: ignore[method-assign, assignment]
        try:
            tracker = await _queued(router, "on-its-way")
            admitting = asyncio.ensure_future(router.admit(tracker, None))
            while not tracker.num_placements:
                await asyncio.sleep(0.01)
            router._let_go(tracker, "router r1 stopped; r2 takes it over")
            on_its_way.set_result(None)  # the worker took it
            await asyncio.wait_for(admitting, 30)
            return aborted, view.reserved_blocks, tracker.worker_id, tracker.engine_key
        finally:
            await store.close()

    aborted, reserved, worker_id, key = asyncio.run(scenario())
    assert aborted == [key] and reserved == 0 and worker_id == ""


def test_a_request_let_go_from_the_queue_whose_record_redis_did_not_make_gets_the_create_s_error(
    store_config: StoreConfig,
) -> None:
    """A Generate whose id the router made waits in the queue while Redis creates its record;
    its router stops and leaves it to a peer. Its client was told to re-attach there with
    Stream(request_id, from_offset=0), but the create failed: no record, and the re-attach
    got NOT_FOUND. The create's error is the answer now (UNAVAILABLE naming Redis, so the
    client sends it again); one whose create landed is still sent to re-attach."""
    from router.errors import Unavailable
    from router.state import StoreUnavailable
    from router.validation import ValidRequest

    async def scenario(fail: bool) -> BaseException:
        store = RequestStore(store_config)
        router = _full_router(store)
        send = router.creates._send
        created = asyncio.Event()

        async def held(records: Any) -> Any:
            await created.wait()  # until the request has been let go
            if fail:
                raise StoreUnavailable("Redis is unavailable (the test's)")
            return await send(records)

        router.creates._send = held  # type: ignore[method-assign]
        try:
            await router.ownership.renew()
            request = ValidRequest(f"req-let-go-{fail}", (1, 2, 3), SamplingParams(max_tokens=8), 1)
            tracker = await router.create(request, wait=False)
            admitting = asyncio.ensure_future(router.admit(tracker, None))
            await asyncio.sleep(0.1)  # waiting for room: the router is full
            assert not admitting.done()
            router._let_go(tracker, "router r1 stopped; r2 takes it over")
            created.set()
            try:
                await asyncio.wait_for(admitting, 10)
            except BaseException as exc:  # noqa: BLE001 - what its Generate would answer
                return exc
            raise AssertionError("admit() returned for a request let go")
        finally:
            await store.close()

    failed = asyncio.run(scenario(fail=True))
    assert isinstance(failed, StoreUnavailable), repr(failed)
    landed = asyncio.run(scenario(fail=False))
    assert isinstance(landed, Unavailable) and "re-attach with Stream(request_id=" in str(landed), repr(landed)


def test_an_adopted_request_no_worker_took_that_times_out_in_the_queue_is_refused_as_a_new_one(
    store_config: StoreConfig,
) -> None:
    """A request its router adopted (a move, so it waits at the queue's head) that no worker
    ever took (accepted_at 0: its first router died while it waited) and that waits past
    max_queue_wait_s again is refused as a new request is: kvserve_requests_rejected{queue_timeout}
    and the queue's own error. It was counted only as finished{error}, told that "its worker
    died" (an outside check of the metrics). A moved request a worker had taken keeps both:
    it was admitted once."""
    async def scenario() -> tuple[dict[str, str], dict[str, float]]:
        store = RequestStore(store_config)
        router = _full_router(store, max_queue_wait_s=0.3)
        metrics = RouterMetrics(router)
        errors: dict[str, str] = {}
        try:
            never_taken = await _queued(router, "adopted-never-taken")
            taken = await _queued(router, "moved-after-a-worker-took-it")
            taken.accepted_at = time.time() - 1.0
            for tracker in (never_taken, taken):
                await router.moves.move(tracker, "adopted by a restarted router")
            for request_id in ("adopted-never-taken", "moved-after-a-worker-took-it"):
                deadline = time.monotonic() + 10.0
                while (record := await store.get(request_id)) is None or not record.is_finished:
                    assert time.monotonic() < deadline, f"{request_id} did not end"
                    await asyncio.sleep(0.05)
                errors[request_id] = record.error
        finally:
            await store.close()
        counters = {f"{m.name}{{reason={s.labels['reason']}}}": s.value for m in metrics.registry.collect()
                    for s in m.samples if m.name.startswith("kvserve_requests_") and s.name.endswith("_total")}
        return errors, counters

    errors, counters = asyncio.run(scenario())
    assert errors["adopted-never-taken"] == "waited 0.3 s (max_queue_wait_s) and no worker had KV room"
    assert errors["moved-after-a-worker-took-it"].startswith("its worker died and no live worker took it over")
    assert counters == {
        "kvserve_requests_finished{reason=error}": 2.0,
        "kvserve_requests_rejected{reason=queue_timeout}": 1.0,
    }
