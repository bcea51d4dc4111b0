"""Following a request that another process writes, as a router follows a request that
another router runs: the log is a Redis Stream, read from an offset with XRANGE and
followed with XREAD BLOCK, ending at the marker the finish writes. Redis's own command
counts (INFO commandstats, on a redis-server of this test's own) show that the follower
neither polls the hash nor reads the log whole, once or per step.
"""

from __future__ import annotations

import asyncio
import subprocess
import sys
import textwrap
from pathlib import Path

import redis

from cluster.redis_server import EmbeddedRedis, RedisServerConfig
from router.state import LogEnd, LogEntry, RequestStatus, RequestStore, StoreConfig
from tests.cluster_harness import redis_command_calls

NUM_STEPS = 200
TOKENS_PER_STEP = 2  # every fifth step gives two tokens at once, the others one

WRITER = textwrap.dedent(
    """
    import asyncio, sys, time
    from router.state import LogEntry, RequestRecord, RequestStatus, RequestStore, StepWrite, StoreConfig

    async def main(url, prefix, num_steps):
        store = RequestStore(StoreConfig(url=url, prefix=prefix))
        record = RequestRecord("r", RequestStatus.QUEUED, [1, 2, 3], {"max_tokens": 999}, created_at=time.time())
        assert await store.create(record) is None
        offset = 0
        for step in range(num_steps):
            ids = tuple(range(offset, offset + (2 if step % 5 == 0 else 1)))
            entry = LogEntry(offset, ids, "".join(chr(97 + i % 26) for i in ids))
            writes = [StepWrite("r", entry, {"status": "RUNNING", "num_output_tokens": offset + len(ids)})]
            await store.write_step(writes)
            if step % 50 == 0:
                await store.write_step(writes)  # a resent pipeline: the store skips it
            offset += len(ids)
            await asyncio.sleep(0.005)
        await store.write_step([StepWrite("r", LogEntry(offset, (), "."), {})])  # text released at the end
        await store.finish("r", RequestStatus.FINISHED, finish_reason="length")
        await store.close()

    asyncio.run(main(sys.argv[1], sys.argv[2], int(sys.argv[3])))
    """
)


def _expected() -> tuple[list[int], str]:
    ids: list[int] = []
    for step in range(NUM_STEPS):
        ids += range(len(ids), len(ids) + (TOKENS_PER_STEP if step % 5 == 0 else 1))
    return ids, "".join(chr(97 + i % 26) for i in ids) + "."


def test_a_request_written_by_another_process_is_followed_live_exactly_once(tmp_path: Path) -> None:
    with EmbeddedRedis(RedisServerConfig(state_dir=tmp_path / "redis")) as server:
        config = StoreConfig(url=server.url, prefix="cross")
        with redis.Redis.from_url(server.url, decode_responses=True) as client:
            client.config_resetstat()

            async def follow() -> list[LogEntry | LogEnd]:
                store = RequestStore(config)
                try:
                    # Attached before the request exists: it waits for the log to begin.
                    following = store.follow("r", 0)
                    first = asyncio.ensure_future(following.__anext__())
                    await asyncio.sleep(0.3)
                    assert store.num_followers == 1 and not first.done()
                    writer = await asyncio.create_subprocess_exec(
                        sys.executable, "-c", WRITER, server.url, config.prefix, str(NUM_STEPS),
                        cwd=str(Path(__file__).resolve().parent.parent),
                    )
                    items = [await asyncio.wait_for(first, 60)]
                    async for item in following:
                        items.append(item)
                    assert await asyncio.wait_for(writer.wait(), 60) == 0
                    assert store.num_followers == 0
                    return items
                finally:
                    await store.close()

            items = asyncio.run(follow())
            calls = redis_command_calls(client)

    end = items[-1]
    entries = items[:-1]
    assert isinstance(end, LogEnd) and end == LogEnd(RequestStatus.FINISHED, "length", "", len(_expected()[0]))
    assert all(isinstance(entry, LogEntry) for entry in entries)
    ids = [t for entry in entries if isinstance(entry, LogEntry) for t in entry.token_ids]
    text = "".join(entry.text for entry in entries if isinstance(entry, LogEntry))
    assert (ids, text) == _expected(), "every token exactly once, in order, with the late text"
    offsets = [entry.offset for entry in entries if isinstance(entry, LogEntry)]
    assert offsets == sorted(offsets) and len(entries) == NUM_STEPS + 1
    # The follower read what was there once (nothing: one XRANGE), then waited in XREAD
    # BLOCK: no whole-log read per step, no list reads, no hash polling.
    assert calls.get("xrange", 0) <= 2, calls
    assert 1 <= calls.get("xread", 0) <= NUM_STEPS + 3, calls
    assert "lrange" not in calls, calls
    assert calls.get("hgetall", 0) <= 1, calls
    print(f"followed {len(ids)} tokens in {len(entries)} entries with {calls.get('xread', 0)} XREADs, "
          f"{calls.get('xrange', 0)} XRANGE, {calls.get('hgetall', 0)} HGETALL")
