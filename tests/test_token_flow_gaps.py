"""A placement whose events arrive with a hole never puts the hole in a client's stream or
in the Redis log: the flow stops taking that placement's events and hands the request on
(the router moves it, resuming from the output it has), and takes the next placement's.

Real Redis under the store; the events are built by hand, as a worker's stream that lost
a batch would deliver them.
"""

from __future__ import annotations

import asyncio

from router.recorder import OrderedRecorder
from router.state import RequestRecord, RequestStatus, RequestStore, StoreConfig
from router.token_flow import TokenFlow
from router.tracker import RequestTracker, engine_key
from workers.engine.plan import TokenEvent
from workers.engine.sampling import SamplingParams


def test_a_token_past_the_output_so_far_stops_its_placement_and_the_next_one_goes_on(store_config: StoreConfig) -> None:
    async def scenario() -> tuple[list[tuple[str, str]], list[int], list[int], list[tuple[int, tuple[int, ...]]]]:
        store = RequestStore(store_config)
        recorder = OrderedRecorder()
        trackers: dict[str, RequestTracker] = {}
        lost: list[tuple[str, str]] = []

        def on_lost(_view: object, tracker: RequestTracker, what: str) -> None:
            lost.append((tracker.engine_key, what))

        flow = TokenFlow(store, recorder, trackers, lambda *_: None, on_lost)
        params = SamplingParams(max_tokens=10, temperature=0.0)
        await store.create(RequestRecord("r", RequestStatus.RUNNING, prompt_ids=[1, 2], sampling={}, created_at=0.0))
        tracker = trackers["r"] = RequestTracker("r", (1, 2), params, need_blocks=1)
        listener = tracker.subscribe()

        def tokens(key: str, offset: int, *ids: int) -> TokenEvent:
            return TokenEvent(key, tuple(ids), "", offset)

        await flow.apply(None, [tokens("r", 0, 10), tokens("r", 1, 11)])
        # Offset 2 never came: 3 and 4 must not be taken, whatever follows them.
        await flow.apply(None, [tokens("r", 3, 13)])
        await flow.apply(None, [tokens("r", 4, 14), tokens("r", 2, 12)])
        after_gap = list(tracker.output_ids)
        # The router moved it (what on_lost leads to): the next placement resumes at 2.
        tracker.num_migrations += 1
        await flow.apply(None, [tokens(engine_key("r", 1), 2, 12), tokens(engine_key("r", 1), 3, 13)])
        streamed = []
        while listener.num_pending_tokens:
            event = await listener.get()
            streamed.extend(event.token_ids)
        entries = [(e.offset, e.token_ids) for e in await store.read_log("r", 0)]
        await store.close()
        return lost, after_gap, streamed, entries

    lost, after_gap, streamed, entries = asyncio.run(scenario())
    assert lost == [("r", "token at offset 3 came after 2")]  # once, for the placement that lost events
    assert after_gap == [10, 11]
    assert streamed == [10, 11, 12, 13]
    assert entries == [(0, (10,)), (1, (11,)), (2, (12,)), (3, (13,))]
