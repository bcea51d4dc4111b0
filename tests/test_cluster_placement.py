"""Placement through a real cluster whose workers have unequal KV budgets (2:1).

What each worker was asked to hold is read from the worker side: every StepBatch carries
the engine's own count of committed blocks (the blocks its admitted requests may grow
to), which must never pass its pool when the router commits each request at its longest.
"""

from __future__ import annotations

import asyncio
import threading
from collections import Counter
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import grpc
import pytest

from cluster.redis_server import EmbeddedRedis
from protos.kvserve.v1 import serving_pb2 as pb
from protos.kvserve.v1 import serving_pb2_grpc as pb_grpc
from router.core import RouterConfig
from tests.cluster_harness import (
    MiB,
    ClusterHarness,
    StreamResult,
    cluster_config,
    greedy_request,
    observing,
    parse_stream,
    running_cluster,
    wait_idle,
)

BLOCKS = {"w0": 128, "w1": 64}  # 16 MiB and 8 MiB of 128 KiB blocks


@pytest.fixture(scope="module")
def cluster(
    ray_session: None, redis_server: EmbeddedRedis, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[ClusterHarness]:
    # Every request committed at its longest (--kv-reserve-ratio 1), the setting under which
    # no worker is ever promised more than its pool; below 1 a worker may be, by design
    # (tests/test_kv_reserve.py).
    config = cluster_config(redis_server.url, tmp_path_factory.mktemp("placement"), (16 * MiB, 8 * MiB),
                            RouterConfig(kv_reserve_ratio=1.0))
    with running_cluster(config) as harness:
        yield harness


class KVWatch:
    """A router observer: the most KV each worker ever reported committed, and the placements in order."""

    def __init__(self) -> None:
        self.max_committed: Counter[str] = Counter()
        self.total: dict[str, int] = {}
        self.placed: list[str] = []

    def __call__(self, name: str, payload: Any) -> None:
        if name == "report":
            view, batch = payload
            report = batch.report
            worker_id = view.worker_id
            self.max_committed[worker_id] = max(self.max_committed[worker_id], report.num_committed_blocks)
            self.total[worker_id] = report.num_total_blocks
        elif name == "placed":
            _, view = payload
            self.placed.append(view.worker_id)

    def assert_never_over_committed(self) -> None:
        assert self.total == BLOCKS
        for worker_id, total in self.total.items():
            promised = self.max_committed[worker_id]
            assert promised <= total, f"{worker_id} was promised {promised} of its {total} blocks"


def test_long_requests_split_in_proportion_to_kv_budgets(cluster: ClusterHarness) -> None:
    # 8 + 248 tokens need 16 blocks each for their whole life (a second or more of decoding):
    # exactly 8 fit on w0 and 4 on w1, so a burst of 12 fills both pools and nothing waits.
    prompt, max_tokens, burst = list(range(8)), 248, 12
    watch = KVWatch()
    start = threading.Barrier(burst)

    def run(_: int) -> StreamResult:
        start.wait()
        return parse_stream(cluster.stub.Generate(greedy_request(prompt, max_tokens), timeout=120))

    with observing(cluster, watch):
        with ThreadPoolExecutor(burst) as pool:
            results = list(pool.map(run, range(burst)))
        wait_idle(cluster.stub)

    counts = Counter(r.started.worker_id for r in results)
    assert counts["w1"] > 0 and abs(counts["w0"] / counts["w1"] - 2.0) <= 0.5, counts
    assert Counter(watch.placed) == counts
    assert all(len(r.token_ids) == max_tokens for r in results)
    watch.assert_never_over_committed()
    assert watch.max_committed == BLOCKS, "the burst filled both pools to the block"


def test_a_burst_between_two_reports_spreads_by_reservations(cluster: ClusterHarness) -> None:
    # 50 requests of 4 blocks leave the client in one loop turn, far faster than the workers
    # report (every 50 ms and each step). Without the router counting its own placements
    # since the last report, all of them would land on w0, the emptiest-looking worker.
    prompt, max_tokens, burst = list(range(30, 38)), 56, 50

    async def send_all() -> list[StreamResult]:
        async with grpc.aio.insecure_channel(cluster.cluster.address) as channel:
            stub = pb_grpc.KVServeStub(channel)
            await stub.ClusterStatus(pb.ClusterStatusRequest(), timeout=5)  # connected before the burst
            calls = [stub.Generate(greedy_request(prompt, max_tokens), timeout=120) for _ in range(burst)]

            async def read(call: Any) -> StreamResult:
                return parse_stream([message async for message in call])

            return await asyncio.gather(*(read(call) for call in calls))

    watch = KVWatch()
    with observing(cluster, watch):
        results = asyncio.run(send_all())
        wait_idle(cluster.stub)

    counts = Counter(r.started.worker_id for r in results)
    shares = {worker_id: counts[worker_id] / burst for worker_id in BLOCKS}
    # 48 fit at once, 32 and 16: each worker's share is near its share of the cluster's KV.
    assert abs(shares["w0"] - 2 / 3) <= 0.12 and abs(shares["w1"] - 1 / 3) <= 0.12, counts
    assert all(len(r.token_ids) == max_tokens for r in results)
    watch.assert_never_over_committed()
