"""A router that starts while another router's stream is still open on a worker (a
restarted router finding the named workers of the one before) gets every event of the
requests it sends, from their first token.

The actor hands its batches to its newest stream only. Once WorkerRegistry.add() has
returned, the starting router's stream is that one: a request it sends at once must not
have its first step go to the stream it superseded. Before the fix add() returned as soon
as it had the worker's info, the stream call left later, and the first step of a request
sent at once went to the old reader: the token log got a hole where the request resumed.
The racy moment (a send right after add()) is hit on every round, over several rounds,
with the previous router still reading.
"""

from __future__ import annotations

import asyncio
from collections import defaultdict

import ray

from cluster.workers import spawn_worker
from router.placement import WorkerView
from router.prefix_index import PrefixIndex
from router.registry import WorkerRegistry
from workers.config import EngineArgs, WorkerConfig
from workers.engine.plan import TokenEvent
from workers.engine.sampling import SamplingParams
from workers.messages import AddRequest, StepBatch

ROUNDS = 8
MAX_TOKENS = 4


class _Reader:
    """One router's registry, keeping every token event it is handed."""

    def __init__(self) -> None:
        self.events: dict[str, list[TokenEvent]] = defaultdict(list)
        self.registry = WorkerRegistry(
            worker_timeout_s=60.0, progress_timeout_s=60.0, prefix_index=PrefixIndex(), count_seq_slots=True,
            on_join=lambda _info: None, on_batch=self._on_batch, on_dead=self._on_dead,
        )

    async def _on_batch(self, _view: WorkerView, batch: StepBatch) -> None:
        for event in batch.events:
            self.events[event.request_id].append(event)

    async def _on_dead(self, view: WorkerView, why: str) -> None:
        raise AssertionError(f"{view.worker_id} declared dead: {why}")

    async def close(self) -> None:
        tasks = self.registry.tasks()
        for task in tasks:
            task.cancel()
        await asyncio.wait(tasks, timeout=10)


def test_a_request_sent_right_after_add_reaches_the_new_router_from_its_first_token(ray_session: None) -> None:
    handle = spawn_worker(WorkerConfig("handover", EngineArgs(num_threads=1), report_interval_s=0.05,
                                       heartbeat_interval_s=0.05))
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)

    async def scenario() -> list[tuple[str, list[int], list[int]]]:
        misses = []
        previous = _Reader()
        await previous.registry.add(handle)
        readers = [previous]
        try:
            for index in range(ROUNDS):
                reader = _Reader()  # the restarted router, beside the one still reading
                readers.append(reader)
                await reader.registry.add(handle)
                request_id = f"round-{index}"
                await handle.add_request.remote(AddRequest(request_id, (5 + index, 6, 7), params))
                loop = asyncio.get_running_loop()
                deadline = loop.time() + 60
                while not any(e.finished for e in reader.events[request_id]) and loop.time() < deadline:
                    if any(e.finished for r in readers for e in r.events[request_id]):
                        break  # ended elsewhere: this reader will never see its end
                    await asyncio.sleep(0.02)
                await asyncio.sleep(0.1)
                offsets = [e.offset for e in reader.events[request_id] if e.token_ids]
                elsewhere = [e.offset for r in readers if r is not reader for e in r.events[request_id] if e.token_ids]
                if offsets != list(range(MAX_TOKENS)):
                    misses.append((request_id, offsets, elsewhere))
        finally:
            for reader in readers:
                await reader.close()
        return misses

    try:
        misses = asyncio.run(asyncio.wait_for(scenario(), timeout=300))
    finally:
        ray.kill(handle)
    assert misses == [], f"token offsets seen by the new router, and by the old ones: {misses}"
