"""Cancel answers what became of the request, even when it races the request's last token.

Found by a Node.js client: Cancel sent at the 11th of 12 tokens answered CANCELLED for
requests that then finished with LENGTH and were recorded FINISHED (10 of 10). The proto
says the status is the one after the call. Each attempt here streams a 12-token request
and sends Cancel on the delta at one offset near the end; the answer must equal the
status Redis records once the request has ended, and match how the stream ended.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Iterator
from typing import Any
from pathlib import Path

import pytest

from cluster.redis_server import EmbeddedRedis
from protos.kvserve.v1 import serving_pb2 as pb
from router.ownership import Ownership
from router.state import RequestRecord, RequestStatus
from tests.cluster_harness import (
    ClusterHarness,
    cluster_config,
    greedy_request,
    observing,
    request_info,
    running_cluster,
    wait_for,
)

MAX_TOKENS = 12
ATTEMPTS = 12  # per offset
ENDED = (pb.REQUEST_STATUS_FINISHED, pb.REQUEST_STATUS_CANCELLED, pb.REQUEST_STATUS_FAILED)
STATUS_OF_FINISH = {
    pb.FINISH_REASON_LENGTH: pb.REQUEST_STATUS_FINISHED,
    pb.FINISH_REASON_CANCELLED: pb.REQUEST_STATUS_CANCELLED,
}


@pytest.fixture(scope="module")
def cluster(redis_server: EmbeddedRedis, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ClusterHarness]:
    with running_cluster(cluster_config(redis_server.url, tmp_path_factory.mktemp("cancel"))) as harness:
        yield harness


@pytest.mark.parametrize("at_offset", [9, 10, 11], ids=lambda o: f"at-token-{o + 1}")
def test_cancel_answers_the_status_the_request_ends_with(cluster: ClusterHarness, at_offset: int, tmp_path: Path) -> None:
    outcomes: dict[int, int] = {}
    for attempt in range(ATTEMPTS):
        request_id = f"race-{at_offset}-{attempt}-{uuid.uuid4().hex[:6]}"
        call = cluster.stub.Generate(greedy_request([3, 1, 4, 1, 5, 9, 2, 6], MAX_TOKENS, request_id), timeout=60)
        answer = None
        finish = None
        for message in call:
            kind = message.WhichOneof("event")
            if kind == "delta" and answer is None and message.delta.offset + len(message.delta.token_ids) > at_offset:
                answer = cluster.stub.Cancel(pb.CancelRequest(request_id=request_id), timeout=30).status
            elif kind == "finished":
                finish = message.finished.finish_reason
        assert answer is not None and finish is not None
        info = wait_for(lambda: request_info(cluster.stub, request_id), lambda i: i.status in ENDED,
                        timeout=20, what=f"{request_id} recorded as ended")
        assert answer == info.status, (
            f"attempt {attempt}: Cancel answered {pb.RequestStatus.Name(answer)}, the request is recorded "
            f"{pb.RequestStatus.Name(info.status)} (finish {pb.FinishReason.Name(finish)})"
        )
        assert STATUS_OF_FINISH[finish] == info.status
        outcomes[info.status] = outcomes.get(info.status, 0) + 1
    print(f"cancel at token {at_offset + 1} of {MAX_TOKENS}:",
          {pb.RequestStatus.Name(s): n for s, n in outcomes.items()})


def test_cancel_of_an_ended_request_answers_its_end(cluster: ClusterHarness) -> None:
    request_id = f"ended-{uuid.uuid4().hex[:6]}"
    list(cluster.stub.Generate(greedy_request([2, 7, 1, 8], 3, request_id), timeout=60))
    answer = cluster.stub.Cancel(pb.CancelRequest(request_id=request_id), timeout=30).status
    assert answer == pb.REQUEST_STATUS_FINISHED


def _queued_record(name: str, owner: str) -> RequestRecord:
    """A queued request of 8 greedy tokens, owned by `owner` (a router id)."""
    return RequestRecord(request_id=f"{name}-{uuid.uuid4().hex[:6]}", status=RequestStatus.QUEUED,
                         prompt_ids=[3, 1, 4, 1, 5], sampling={"max_tokens": 8, "temperature": 0.0},
                         created_at=time.time(), router_id=owner)


def test_cancel_of_a_request_whose_owner_is_gone_but_still_holds_its_lease_answers_cancelled(
    cluster: ClusterHarness,
) -> None:
    """A router that died (or hangs) keeps its lease until the lease's TTL runs out, and
    nothing ends its requests meanwhile. A Cancel through a live router answered RUNNING
    or QUEUED after its 5 s wait, and whoever adopted the request later ended it CANCELLED
    (9 of 24 such cancels in an outside check's kill rounds). Now the cancelling router
    claims it from the silent owner and ends it: the answer is what Redis records."""
    store = cluster.cluster.store
    assert store is not None
    ghost = Ownership(store, "ghost-router:1", 120.0)  # a dead router's lease, far from lapsing
    record = _queued_record("orphaned", ghost.router_id)
    request_id = record.request_id

    async def ghost_owns_it() -> None:
        await ghost.renew()
        await store.create(record)

    cluster.call(ghost_owns_it())
    notices: list[str] = []
    try:
        with observing(cluster, lambda name, _payload: notices.append(name)):
            answer = cluster.stub.Cancel(pb.CancelRequest(request_id=request_id), timeout=60).status
        info = request_info(cluster.stub, request_id)
        assert (answer, info.status) == (pb.REQUEST_STATUS_CANCELLED, pb.REQUEST_STATUS_CANCELLED)
        assert list(info.output_token_ids) == []
        # The owner it was taken from, were it alive after all, is fenced off it.
        owners = cluster.call(cluster.cluster.router.ownership.owners([request_id]))
        assert owners == {request_id: cluster.cluster.router.router_id}
        # Ended, not adopted: kvserve_adoptions_total counts requests that go on elsewhere.
        assert "adopted" not in notices and notices.count("finished") == 1, notices
    finally:
        cluster.call(ghost.release())


def test_cancel_never_takes_a_request_from_an_owner_that_renews_its_lease(cluster: ClusterHarness) -> None:
    """An owner that renews its lease is alive, only slow to end the request: its end may be
    told to its client already, its write still on its way to Redis. Taking the request
    from it recorded CANCELLED, with an empty log, for a request whose client got all its
    tokens and LENGTH (a review's test, with the owner's writes held). The answer is the
    status as it is, and the owner keeps the request."""
    store = cluster.cluster.store
    assert store is not None
    slow = Ownership(store, "slow-router:1", 2.0)
    record = _queued_record("slow-owner", slow.router_id)
    request_id = record.request_id

    async def scenario() -> RequestStatus:
        await slow.renew()
        await store.create(record)

        async def keep_lease() -> None:
            while True:
                await asyncio.sleep(0.5)
                await slow.renew()

        renewing = asyncio.ensure_future(keep_lease())
        try:
            return await cluster.cluster.router.cancel(request_id)  # what the Cancel call runs
        finally:
            renewing.cancel()
            await slow.release()
            await store.finish(request_id, RequestStatus.CANCELLED, "cancelled", "")  # as its owner would

    answer = cluster.call(scenario())
    assert answer is RequestStatus.QUEUED
    owners = cluster.call(cluster.cluster.router.ownership.owners([request_id]))
    assert owners == {request_id: "slow-router:1"}


def test_a_cancel_asked_while_a_router_takes_the_request_over_is_not_lost(cluster: ClusterHarness) -> None:
    """A router adopting a request claims it, reads its log, and only then tracks it. A cancel
    asked in between reached it, found no tracker and was dropped: the adopted request ran
    to its end. The log's read is held here (2 s) to hit that moment every time."""
    router = cluster.cluster.router
    store = router.store
    record = _queued_record("adopting", "gone-router:1")  # a router that holds no lease: its requests are orphans
    request_id = record.request_id

    async def scenario() -> tuple[RequestStatus, int]:
        read_log = store.read_log
        reading = asyncio.Event()

        async def held_read(rid: str, offset: int) -> Any:
            if rid == request_id:
                reading.set()
                await asyncio.sleep(2.0)  # the ask's Pub/Sub message comes within it, even on a loaded machine
            return await read_log(rid, offset)

        store.read_log = held_read  # type: ignore[method-assign]
        try:
            await store.create(record)
            adopting = asyncio.ensure_future(router.adopt())
            await asyncio.wait_for(reading.wait(), 30)
            answer = await router.cancel(request_id)  # what the Cancel call runs
            return answer, await adopting
        finally:
            store.read_log = read_log  # type: ignore[method-assign]

    answer, adopted = cluster.call(scenario())
    assert adopted >= 1
    info = request_info(cluster.stub, request_id)
    assert (answer, info.status) == (RequestStatus.CANCELLED, pb.REQUEST_STATUS_CANCELLED), info
    assert list(info.output_token_ids) == []
