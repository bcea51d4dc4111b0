"""--queue-order backfill: while the request at the head of the admission queue fits on no
worker, the requests behind it may go to any worker but the one it waits for.

The router here is a real Router with real WorkerViews fed reports by hand (no Ray, no
Redis: placement and the queue never touch either).
"""

from __future__ import annotations

import asyncio
import dataclasses
from typing import Any

import pytest

from router.admission import BACKFILL_SCAN
from router.core import Router, RouterConfig
from router.placement import WorkerView
from router.state import RequestStore, StoreConfig
from router.tracker import RequestTracker
from router.validation import ClusterLimits
from workers.engine.config import blocks_for_tokens
from workers.engine.sampling import SamplingParams
from workers.engine.stats import EngineStats
from workers.messages import WorkerInfo
from workers.model.tokenizer import TokenizerSpec

BLOCK = 16


def _router(order: str, pools: tuple[int, int] = (64, 32)) -> Router:
    config = RouterConfig(policy="kv", kv_reserve_ratio=1.0, queue_order=order)
    router = Router(config, RequestStore(StoreConfig(url="redis://127.0.0.1:1/0")))
    router.limits = ClusterLimits(vocab_size=100, max_model_len=4096, block_size=BLOCK, max_worker_blocks=64)
    for worker_id, blocks in zip(("w0", "w1"), pools):
        info = WorkerInfo(worker_id, "node", "tiny", "cpu", "float32", vocab_size=258, max_model_len=2048,
                          block_size=BLOCK, block_bytes=1024, num_blocks=blocks, tokenizer=TokenizerSpec(None, None, ()))
        router.registry.views[worker_id] = WorkerView(info)
    router.registry._set_alive(router.registry.views["w0"], True)  # the alive list is built anew
    return router


def _report(router: Router, worker_id: str, committed: int) -> None:
    view = router.registry.views[worker_id]
    view.apply_report(EngineStats.of_pool(view.num_blocks, committed, 1024), (), 0.0)


def _tracker(request_id: str, blocks: int) -> RequestTracker:
    """A request whose prompt and max_tokens need `blocks` blocks at their longest."""
    max_tokens = 16
    prompt = tuple(range(blocks * BLOCK - max_tokens + 1))
    assert blocks_for_tokens(len(prompt) + max_tokens - 1, BLOCK) == blocks
    return RequestTracker(request_id, prompt, SamplingParams(max_tokens=max_tokens), blocks)


async def _scenario(order: str) -> dict[str, Any]:
    """w0 (64 blocks) has 14 uncommitted, w1 (32) has 12. A long request (30 blocks) fits
    on neither and waits, w0 being the closer; three shorts (5 blocks each) come behind it.
    Then w0's requests finish. Returns where each went, and None for one still waiting
    before w0 freed."""
    router = _router(order)
    told: list[int] = []
    router.observers.append(lambda name, payload: told.append(payload) if name == "backfilled" else None)
    _report(router, "w0", 50)
    _report(router, "w1", 20)
    placed: dict[str, Any] = {}
    tasks: dict[str, asyncio.Task[WorkerView]] = {}
    for tracker in (_tracker("long", 30), *(_tracker(f"short{i}", 5) for i in range(3))):
        tasks[tracker.request_id] = asyncio.create_task(router._place(tracker, None, resumed=False))
        await asyncio.sleep(0)
    await asyncio.sleep(0.01)
    for request_id, task in tasks.items():
        placed[request_id] = task.result().worker_id if task.done() else None
    assert router.queue.head is not None and router.queue.head.request_id == "long"
    # Nothing went where the long one waits, whatever the order.
    assert router.registry.views["w0"].reserved_blocks == 0
    _report(router, "w0", 20)  # w0's requests finished: 44 uncommitted
    router.queue.drain()
    await asyncio.sleep(0.01)
    for request_id, task in tasks.items():
        placed.setdefault(request_id, None)
        placed[f"{request_id} after"] = task.result().worker_id
    assert sum(told) == router.queue.num_backfilled
    placed["backfilled"] = router.queue.num_backfilled
    return placed


def test_fifo_holds_short_requests_behind_a_long_head_and_backfill_places_them_elsewhere() -> None:
    fifo = asyncio.run(_scenario("fifo"))
    assert fifo["backfilled"] == 0
    assert [fifo[r] for r in ("long", "short0", "short1", "short2")] == [None] * 4
    # Once w0 frees, the long one goes there first, and the shorts after it.
    assert fifo["long after"] == "w0"

    backfill = asyncio.run(_scenario("backfill"))
    assert backfill["backfilled"] == 2  # counted, and told to the metrics ("backfilled")
    # The shorts go to w1 (12 uncommitted: room for two of 5 blocks), not to w0, which is
    # held for the long one; the third waits behind the long one.
    assert [backfill[r] for r in ("long", "short0", "short1", "short2")] == [None, "w1", "w1", None]
    assert backfill["long after"] == "w0" and backfill["short2 after"] == "w0"


def test_backfill_from_the_queue_at_each_drain_and_a_long_head_is_never_passed_on_its_own_worker() -> None:
    """Requests already waiting when room opens elsewhere are backfilled by the drain, in
    order, up to BACKFILL_SCAN behind the head; the held worker stays untouched however
    much room it has short of the head's need."""

    async def scenario() -> None:
        router = _router("backfill")
        _report(router, "w0", 40)  # 24 uncommitted: the long one (40) does not fit
        _report(router, "w1", 32)  # full, and its pool (32) could never hold the long one
        tasks = [asyncio.create_task(router._place(_tracker("long", 40), None, resumed=False))]
        await asyncio.sleep(0)
        shorts = [_tracker(f"short{i}", 1) for i in range(BACKFILL_SCAN + 5)]
        for tracker in shorts:
            tasks.append(asyncio.create_task(router._place(tracker, None, resumed=False)))
        await asyncio.sleep(0.01)
        assert not any(t.done() for t in tasks), "w1 is full and w0 is held: all wait"
        _report(router, "w1", 0)  # w1 frees: 32 uncommitted
        router.queue.drain()
        await asyncio.sleep(0.01)
        done = [t for t in tasks if t.done()]
        assert len(done) == BACKFILL_SCAN, "one drain backfills up to BACKFILL_SCAN"
        assert {t.result().worker_id for t in done} == {"w1"}
        assert [t.done() for t in tasks[1:BACKFILL_SCAN + 1]] == [True] * BACKFILL_SCAN, "in order"
        assert router.queue.num_backfilled == BACKFILL_SCAN
        assert router.registry.views["w0"].reserved_blocks == 0
        for task in tasks:
            task.cancel()

    asyncio.run(scenario())


def test_a_backfill_scan_does_not_try_a_request_as_large_as_one_no_worker_took() -> None:
    """The long head waits for w0 (14 uncommitted); w1 (32) is full, so everything queues:
    ten requests of 5 blocks, then one of 2 and one of 3. Then w1 has 3 uncommitted, and one
    drain asks the policy for the head (30), the first 5 (refused: the nine other 5s are as
    large and are not tried), the 2 (placed on w1) and the 3 (smaller than the refused 5:
    tried, and refused with 1 left)."""

    async def scenario() -> tuple[list[int], list[str | None]]:
        router = _router("backfill")
        calls: list[int] = []
        choose = router.policy.choose

        def counting(workers: Any, need_blocks: int, hits: Any = None, longest_blocks: int = 0) -> Any:
            calls.append(need_blocks)
            return choose(workers, need_blocks, hits, longest_blocks)

        router.policy.choose = counting  # type: ignore[method-assign]
        _report(router, "w0", 50)
        _report(router, "w1", 32)
        trackers = [_tracker("long", 30), *(_tracker(f"five{i}", 5) for i in range(10)), _tracker("two", 2),
                    _tracker("three", 3)]
        tasks = []
        for tracker in trackers:
            tasks.append(asyncio.create_task(router._place(tracker, None, resumed=False)))
            await asyncio.sleep(0)
        await asyncio.sleep(0.01)
        assert not any(t.done() for t in tasks), "w1 is full and w0 is held: all wait"
        _report(router, "w1", 29)
        calls.clear()
        router.queue.drain()
        await asyncio.sleep(0.01)
        where = [t.result().worker_id if t.done() else None for t in tasks]
        for task in tasks:
            task.cancel()
        return calls, where

    calls, where = asyncio.run(scenario())
    assert calls == [30, 5, 2, 3]
    assert where == [None] * 11 + ["w1", None]


def test_the_worker_held_for_a_head_stays_held_until_the_head_is_placed() -> None:
    """Two pools of 64. The long head (30 blocks) waits for w0 (24 uncommitted against
    w1's 14). Then w1 frees to 26: more than w0, still short of 30. The hold stays on w0,
    so a short that comes now goes to w1; had the hold moved to the leader of the moment,
    the short would take the room w0 kept for the head."""

    async def scenario() -> None:
        router = _router("backfill", pools=(64, 64))
        _report(router, "w0", 40)
        _report(router, "w1", 50)
        long = asyncio.create_task(router._place(_tracker("long", 30), None, resumed=False))
        await asyncio.sleep(0.01)
        assert router._held_for(router.queue.head).worker_id == "w0"  # type: ignore[arg-type, union-attr]
        _report(router, "w1", 38)
        router.queue.drain()
        short = await router._place(_tracker("short", 5), None, resumed=False)
        assert short.worker_id == "w1" and router.registry.views["w0"].reserved_blocks == 0
        _report(router, "w0", 30)  # 34 uncommitted: the head goes to the worker held for it
        router.queue.drain()
        assert (await long).worker_id == "w0"

    asyncio.run(scenario())


def test_the_queue_order_is_a_flag_and_an_unknown_one_is_refused(capsys: pytest.CaptureFixture[str]) -> None:
    from cluster.cli import build_parser
    from cluster.routers import router_flags
    from cluster.up import cluster_config_from_args, router_cluster_config_from_args, router_only_parser

    parser = build_parser()
    assert cluster_config_from_args(parser.parse_args(["up"])).router.queue_order == "fifo"
    up_args = parser.parse_args(["up", "--queue-order", "backfill", "--routers", "2"])
    assert cluster_config_from_args(up_args).router.queue_order == "backfill"
    assert router_flags(router_only_parser(), up_args)[-2:] == ["--queue-order", "backfill"]
    joining = parser.parse_args(["router", "--ray-address", "auto", "--redis-url", "redis://h:1/0",
                                 "--queue-order", "backfill"])
    assert router_cluster_config_from_args(joining).router.queue_order == "backfill"
    with pytest.raises(SystemExit):
        parser.parse_args(["up", "--queue-order", "lifo"])
    assert "--queue-order: invalid choice: 'lifo'" in capsys.readouterr().err
    with pytest.raises(ValueError, match="queue_order must be one of fifo, backfill"):
        dataclasses.replace(RouterConfig(), queue_order="lifo")
