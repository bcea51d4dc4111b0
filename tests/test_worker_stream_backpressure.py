"""The worker -> router stream has backpressure: a router that stops reading costs the
worker a bounded number of batches in flight, and the steps made meanwhile arrive merged.

A real Ray actor runs requests while its reader (read as the router reads it, with
registry.STREAM_BACKPRESSURE) sleeps. Without backpressure Ray would buffer one item per
step for the sleeping reader; with it, at most STREAM_BACKPRESSURE items wait, and the
first item after them carries every step the actor merged while it was blocked.
"""

from __future__ import annotations

import asyncio

from cluster.workers import spawn_worker
from router.registry import STREAM_BACKPRESSURE
from workers.config import EngineArgs, WorkerConfig
from workers.engine.sampling import SamplingParams
from workers.messages import AddRequest, StepBatch

MAX_TOKENS = 120
PAUSE_S = 3.0


def test_a_reader_that_stops_gets_the_steps_merged_behind_a_bounded_buffer(ray_session: None) -> None:
    handle = spawn_worker(WorkerConfig("bp", EngineArgs(num_threads=1), report_interval_s=0.05,
                                       heartbeat_interval_s=0.05))

    async def scenario() -> tuple[list[StepBatch], list[StepBatch]]:
        await handle.info.remote()
        stream = handle.events.options(_generator_backpressure_num_objects=STREAM_BACKPRESSURE).remote()
        before: list[StepBatch] = []  # read before the pause
        after: list[StepBatch] = []  # read after it
        paused = False
        for index in range(4):
            await handle.add_request.remote(AddRequest(
                f"r{index}", (1 + index, 2, 3, 4), SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)))
        async for ref in stream:
            batch = await ref
            (after if paused else before).append(batch)
            if len(before) == 3 and not paused:
                paused = True
                await asyncio.sleep(PAUSE_S)  # the router is busy: it reads nothing
            finished = {e.request_id for b in after for e in b.events if e.finished}
            if len(finished) == 4:
                break
        return before, after

    try:
        _, after = asyncio.run(asyncio.wait_for(scenario(), timeout=120))
    finally:
        import ray

        ray.kill(handle)
    tokens_in = [sum(len(e.token_ids) for e in b.events) for b in after]
    # The items buffered for the sleeping reader are at most the backpressure bound; the one
    # after them holds the steps the actor made while it could not hand any out.
    merged = next(i for i, n in enumerate(tokens_in) if n > 4 * 4)
    assert merged <= STREAM_BACKPRESSURE + 1, (merged, tokens_in[:30])
    assert max(tokens_in) >= 4 * 10, f"no batch merged many steps: {tokens_in[:30]}"
    assert sum(tokens_in) <= 4 * MAX_TOKENS
