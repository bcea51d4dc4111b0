"""The worker -> router stream has backpressure: a router that stops reading costs the
worker a bounded number of bytes on the way, and the steps made meanwhile arrive merged.

A real Ray actor runs requests while its reader (read as the router reads it, through
workers/events_wire.read_batches) sleeps until the steps pile up at the worker. Without
backpressure every step would wait on the way as a batch of its own; with it, at most a
few BUFFER_BYTES (the actor's transport, each socket buffer, the reader's buffer) wait,
and the first batch after them carries every step the actor merged while it was blocked.
"""

from __future__ import annotations

import asyncio
import pickle

from cluster.workers import spawn_worker
from workers.config import EngineArgs, WorkerConfig
from workers.engine.sampling import SamplingParams
from workers.events_wire import BUFFER_BYTES, read_batches
from workers.messages import AddRequest, StepBatch, WorkerInfo

MAX_TOKENS = 1500
PAUSE_LIMIT_S = 60.0
PILED_BATCHES = 120  # steps waiting at the worker, behind full buffers, before the reader reads again
NUM_REQUESTS = 4


def test_a_reader_that_stops_gets_the_steps_merged_behind_a_bounded_buffer(ray_session: None) -> None:
    handle = spawn_worker(WorkerConfig("bp", EngineArgs(num_threads=1, kv_cache_memory=32 * 2**20),
                                       report_interval_s=0.05, heartbeat_interval_s=0.05))

    async def scenario() -> list[StepBatch]:
        info: WorkerInfo = await handle.info.remote()
        after: list[StepBatch] = []  # read after the pause
        paused = False
        for index in range(NUM_REQUESTS):
            await handle.add_request.remote(AddRequest(
                f"r{index}", (1 + index, 2, 3, 4), SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)))
        num_before = 0
        async for batch in read_batches(info.events_address, info.events_token, ""):
            if paused:
                after.append(batch)
            else:
                num_before += 1
            if num_before == 3 and not paused:
                paused = True
                # The router is busy: it reads nothing until the steps pile up at the worker,
                # which takes longer on a slower machine (the buffers fill at its step rate).
                loop = asyncio.get_running_loop()
                deadline = loop.time() + PAUSE_LIMIT_S
                while await handle.pending_batches.remote("") < PILED_BATCHES:
                    assert loop.time() < deadline, f"no steps piled up at the worker in {PAUSE_LIMIT_S} s"
                    await asyncio.sleep(0.1)
            finished = {e.request_id for b in after for e in b.events if e.finished}
            if len(finished) == NUM_REQUESTS:
                break
        return after

    try:
        after = asyncio.run(asyncio.wait_for(scenario(), timeout=180))
    finally:
        import ray

        ray.kill(handle)
    tokens_in = [sum(len(e.token_ids) for e in b.events) for b in after]
    # What waited on the way for the sleeping reader is bounded in bytes; the batch after it
    # holds the steps the actor made while it could not hand any out: at least PILED_BATCHES
    # steps of one token per request. A batch of a few merged steps among the waiting ones is
    # an actor loop that lagged its engine on a busy machine, not the pile (a CI run took the
    # first batch of more than one step for it, and counted 67,134 bytes as all that waited).
    merged = next(i for i, n in enumerate(tokens_in) if n >= PILED_BATCHES * NUM_REQUESTS)
    waited = sum(len(pickle.dumps(b, protocol=pickle.HIGHEST_PROTOCOL)) for b in after[:merged])
    # The actor's transport (1 x BUFFER_BYTES, and the batch that crossed it), two socket
    # buffers the kernel doubles for its bookkeeping (4 x), and the reader's buffer, which
    # asyncio stops filling at 2 x its limit, passed by the read that crossed it, up to what
    # the kernel held (2 x): the steps piled up at the worker, so these are all full
    # (464,835 bytes, 7.1 x, in one run). A pause of any length waits no more than this.
    assert waited <= 9 * BUFFER_BYTES, (waited, merged, tokens_in[:40])
    assert waited >= 2 * BUFFER_BYTES, ("the buffers never filled: nothing exercised the bound", waited, merged, tokens_in[:40])
    assert max(tokens_in) >= NUM_REQUESTS * 100, f"no batch merged many steps: {tokens_in[:40]}"
    assert sum(tokens_in) <= NUM_REQUESTS * MAX_TOKENS
