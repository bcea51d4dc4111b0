"""The worker actor shared by several routers, in process (no Ray): the tiny preset on CPU.

- Each router's stream carries every KV report and prefix-cache event, and the token
  events of the requests that router placed, and no others; a request sent before its
  router's stream has started still reaches that stream.
- A must_fit request that does not fit beside what is committed is refused (AddRefused
  with the worker's count), costs nothing, and a request without must_fit is taken.
  The check counts requests taken but not yet in a report, so many sends at once never
  commit past the pool.
"""

from __future__ import annotations

import asyncio
from collections import defaultdict

import pytest

from router.validation import prompt_block_hashes
from workers.actor import WorkerActor, _node_ip
from workers.config import EngineArgs, WorkerConfig
from workers.engine.sampling import SamplingParams
from workers.events_wire import EventsConnection, read_batches
from workers.messages import AddRefused, AddRequest, StepBatch

BLOCK_SIZE = 16
NUM_BLOCKS = 24


def _actor(num_blocks: int = NUM_BLOCKS) -> WorkerActor:
    engine = EngineArgs(num_threads=1, kv_cache_memory=num_blocks * 131072, block_size=BLOCK_SIZE, seed=0)
    return WorkerActor(WorkerConfig("w0", engine, report_interval_s=0.05, heartbeat_interval_s=0.05))


def _prompt(index: int) -> tuple[int, ...]:
    return tuple((11 * index + i) % 200 + 1 for i in range(2 * BLOCK_SIZE))


async def _read(actor: WorkerActor, router_id: str, into: list[StepBatch], stop: asyncio.Event) -> None:
    """router_id's stream as a router reads it: over the actor's events connection."""
    info = await actor.info()
    async for batch in read_batches(info.events_address, info.events_token, router_id):
        into.append(batch)
        if stop.is_set():
            return


def test_the_events_connection_serves_only_a_router_that_has_the_token() -> None:
    async def scenario() -> None:
        actor = _actor()
        info = await actor.info()
        # Where routers reach this node: loopback outside Ray, Ray's address for the node in it
        # (this test's process may have joined the session's Ray for an earlier test).
        assert info.events_address.rsplit(":", 1)[0] == _node_ip() and len(info.events_token) == 32
        assert info.events_token not in repr(info)
        with pytest.raises(asyncio.IncompleteReadError):
            async for _ in read_batches(info.events_address, "not-the-token", "a"):
                raise AssertionError("a batch for a hello without the token")
        async for batch in read_batches(info.events_address, info.events_token, "a"):
            assert batch.report.num_total_blocks == NUM_BLOCKS  # a heartbeat, while idle
            break
        await actor.stop()

    asyncio.run(asyncio.wait_for(scenario(), timeout=60))


def test_each_router_gets_every_report_and_only_its_own_tokens() -> None:
    async def scenario() -> None:
        actor = _actor()
        params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
        seen: dict[str, list[StepBatch]] = defaultdict(list)
        stop = asyncio.Event()
        readers = [asyncio.create_task(_read(actor, rid, seen[rid], stop)) for rid in ("a", "b")]
        # Router c sends before its stream starts: its events wait in its outlet.
        for index, router_id in enumerate(("a", "b", "a", "c", "b")):
            answer = await actor.add_request(AddRequest(f"{router_id}-{index}", _prompt(index), params,
                                                        router_id=router_id))
            assert answer is None
        await asyncio.sleep(0.3)
        readers.append(asyncio.create_task(_read(actor, "c", seen["c"], stop)))
        for _ in range(200):
            finished = {e.request_id for batches in seen.values() for b in batches for e in b.events if e.finished}
            if len(finished) == 5:
                break
            await asyncio.sleep(0.05)
        stop.set()
        await asyncio.sleep(0.2)
        for task in readers:
            task.cancel()
        await actor.stop()
        for router_id in ("a", "b", "c"):
            batches = seen[router_id]
            owners = {e.request_id.split("-")[0] for b in batches for e in b.events}
            assert owners == {router_id}, (router_id, owners)
            mine = {e.request_id for b in batches for e in b.events if e.finished}
            assert mine == {f"{router_id}-{i}" for i, r in enumerate(("a", "b", "a", "c", "b")) if r == router_id}
            tokens = defaultdict(list)
            for b in batches:
                for e in b.events:
                    assert e.offset == len(tokens[e.request_id]), "a hole or a repeat in a router's stream"
                    tokens[e.request_id].extend(e.token_ids)
            assert all(len(t) == 6 for t in tokens.values())
            added = {i for b in batches for i in b.added_ids}
            assert added == mine, "a router is told of what it placed being taken in, and only that"
        # Every router saw the reports of every step, whoever's requests ran in it.
        steps = {router_id: max(b.report.num_steps for b in seen[router_id]) for router_id in seen}
        assert min(steps.values()) == max(steps.values()) > 0, steps
        stored = {router_id: {h for b in seen[router_id] if b.kv_events for s, h in b.kv_events.events if s}
                  for router_id in seen}
        assert stored["a"] == stored["b"] == stored["c"] and stored["a"], "every router hears every cache event"

    asyncio.run(scenario())


def test_a_must_fit_request_that_does_not_fit_is_refused_and_many_at_once_never_over_commit() -> None:
    async def scenario() -> None:
        actor = _actor()
        stop = asyncio.Event()
        batches: list[StepBatch] = []
        reader = asyncio.create_task(_read(actor, "a", batches, stop))
        # Each needs 8 of the 24 blocks at its longest (32 prompt + 97 new - 1 = 128 tokens).
        params = SamplingParams(max_tokens=97, temperature=0.0, ignore_eos=True)
        answers = await asyncio.gather(*(
            actor.add_request(AddRequest(f"r{i}", _prompt(i), params, router_id="a" if i % 2 else "b",
                                         must_fit=True))
            for i in range(7)
        ))
        taken = [a for a in answers if a is None]
        refused = [a for a in answers if isinstance(a, AddRefused)]
        assert len(taken) == 3 and len(refused) == 4, answers
        for answer in refused:
            assert answer.num_committed_blocks == 24 and answer.num_total_blocks == NUM_BLOCKS
            assert answer.need_blocks == 8
        # Without must_fit the worker takes it (a blind policy over-commits by design).
        assert await actor.add_request(AddRequest("blind", _prompt(9), params, router_id="a")) is None
        for _ in range(400):
            if any(e.request_id == "blind" and e.finished for b in batches for e in b.events):
                break
            await asyncio.sleep(0.05)
        else:
            raise AssertionError("the blind request never finished")
        # Once they ended, the room is back: a must_fit request fits again.
        for _ in range(200):
            report = actor._last_report
            if report is not None and report.num_running + report.num_waiting == 0:
                break
            await asyncio.sleep(0.05)
        assert await actor.add_request(AddRequest("later", _prompt(8), params, router_id="a", must_fit=True)) is None
        stop.set()
        await asyncio.sleep(0.1)
        reader.cancel()
        await actor.stop()

    asyncio.run(scenario())


def test_must_fit_requests_sharing_a_prompt_are_charged_its_blocks_once() -> None:
    """Seven requests with one 5-block prompt prefix, 9 blocks each at their longest, on 48
    blocks: counted whole, five would fit; charged the shared blocks once (whichever
    router sent them), all seven are taken at 9 + 6 x 4 = 33, the engine's own count
    agrees whenever a report lands in between, and a request sharing nothing is charged
    in full."""

    async def scenario() -> None:
        actor = _actor(num_blocks=48)
        stop = asyncio.Event()
        batches: list[StepBatch] = []
        reader = asyncio.create_task(_read(actor, "a", batches, stop))
        shared = tuple(range(1, 5 * BLOCK_SIZE + 1))
        params = SamplingParams(max_tokens=64, temperature=0.0, ignore_eos=True)  # 81 + 64 - 1 = 144: 9 blocks
        prompts = [shared + (100 + i,) for i in range(7)]
        hashes = prompt_block_hashes(prompts[0], BLOCK_SIZE)
        assert len(hashes) == 5 and all(prompt_block_hashes(p, BLOCK_SIZE) == hashes for p in prompts)
        answers = await asyncio.gather(*(
            actor.add_request(AddRequest(f"s{i}", prompt, params, router_id="a" if i % 2 else "b", must_fit=True,
                                         block_hashes=hashes))
            for i, prompt in enumerate(prompts)
        ))
        assert answers == [None] * 7
        assert actor._reported_committed + actor._unreported_blocks == 9 + 6 * 4
        # Prompts sharing nothing: the first fits (42), the second would pass 48.
        alone = [tuple(range(200 + 100 * i, 281 + 100 * i)) for i in range(2)]
        answers = [await actor.add_request(AddRequest(f"alone{i}", p, params, router_id="a", must_fit=True,
                                                      block_hashes=prompt_block_hashes(p, BLOCK_SIZE)))
                   for i, p in enumerate(alone)]
        assert answers[0] is None and isinstance(answers[1], AddRefused), answers
        assert (answers[1].num_committed_blocks, answers[1].need_blocks) == (42, 9)
        for _ in range(600):  # every router's stream carries every report
            if batches and batches[-1].report.num_running + batches[-1].report.num_waiting == 0:
                break
            await asyncio.sleep(0.05)
        else:
            raise AssertionError("the requests never finished")
        assert sum(1 for b in batches for e in b.events if e.finished) == 4  # a's: s1 s3 s5 alone0
        reports = [b.report for b in batches]
        # The engine never counts past what the ledger took (a lagging reader sees some
        # reports merged, so the peak itself may be out of sight).
        assert 33 <= max(r.num_committed_blocks for r in reports) <= 42
        assert reports[-1].num_preemptions == 0
        stop.set()
        await asyncio.sleep(0.1)
        reader.cancel()
        await actor.stop()

    asyncio.run(asyncio.wait_for(scenario(), timeout=120))


def test_requests_sent_over_the_events_connection_are_answered_there() -> None:
    """What the router's dispatch does: AddRequest frames on the events connection, each
    answered between the batches (None: taken, AddRefused: not), the request's tokens
    after; answers still owed when the connection ends fail, so the router can move on."""

    async def scenario() -> None:
        actor = _actor()
        info = await actor.info()
        connection = EventsConnection(info.events_address, info.events_token, "a")
        batches: list[StepBatch] = []

        async def read() -> None:
            async for batch in connection.batches():
                batches.append(batch)

        reader = asyncio.create_task(read())
        for _ in range(100):
            if connection.open:
                break
            await asyncio.sleep(0.01)
        params = SamplingParams(max_tokens=97, temperature=0.0, ignore_eos=True)  # 8 of the 24 blocks each
        answers = await asyncio.gather(*(
            connection.add_request(AddRequest(f"w{i}", _prompt(i), params, router_id="a", must_fit=True))
            for i in range(4)
        ))
        assert answers[:3] == [None, None, None] and isinstance(answers[3], AddRefused), answers
        for _ in range(400):
            if {e.request_id for b in batches for e in b.events if e.finished} == {"w0", "w1", "w2"}:
                break
            await asyncio.sleep(0.05)
        else:
            raise AssertionError("the requests sent over the connection did not finish on it")
        owed = connection.add_request(AddRequest("owed", _prompt(5), params, router_id="a"))
        connection.close()  # before its answer can come
        with pytest.raises(ConnectionError, match="ended"):
            await owed
        with pytest.raises(ConnectionError, match="no events connection"):
            await connection.add_request(AddRequest("late", _prompt(6), params, router_id="a"))
        reader.cancel()
        await actor.stop()

    asyncio.run(asyncio.wait_for(scenario(), timeout=120))


def test_an_idle_engine_sends_no_report_it_already_sent_and_the_actor_keeps_beating() -> None:
    """Every router reads every worker's stream, so an idle worker's frames cost each of
    them: once its request has ended, the engine sends nothing new and the stream carries
    the actor's heartbeats alone (the engine used to re-send its unchanged report every
    report_interval_s)."""
    async def scenario() -> tuple[int, int, int]:
        actor = _actor()
        batches: list[tuple[float, StepBatch]] = []
        info = await actor.info()

        async def read() -> None:
            async for batch in read_batches(info.events_address, info.events_token, "a"):
                batches.append((asyncio.get_running_loop().time(), batch))

        reader = asyncio.create_task(read())
        params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
        assert await actor.add_request(AddRequest("r", _prompt(0), params, router_id="a")) is None
        for _ in range(400):
            if any(e.finished for _, b in batches for e in b.events):
                break
            await asyncio.sleep(0.05)
        else:
            raise AssertionError("the request did not finish")
        await asyncio.sleep(0.5)  # whatever the end changed has been reported
        since = asyncio.get_running_loop().time()
        await asyncio.sleep(1.5)  # 30 report intervals and 30 heartbeat intervals
        window = [b for at, b in batches if at >= since]
        reader.cancel()
        await actor.stop()
        steps = {b.report.num_steps for b in window}
        return sum(not b.heartbeat for b in window), sum(b.heartbeat for b in window), len(steps)

    reports, heartbeats, num_step_counts = asyncio.run(asyncio.wait_for(scenario(), timeout=120))
    assert reports == 0, reports
    assert heartbeats >= 5, heartbeats  # ~30 on an idle machine; a loaded one may stretch them
    assert num_step_counts == 1
