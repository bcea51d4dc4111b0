"""A worker is sent no more requests than its engine runs at once (max_num_seqs).

What cannot start now waits in the router's queue, where it can still go to whichever
worker frees first, instead of in one worker's waiting queue.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from dataclasses import replace

import pytest

from cluster.redis_server import EmbeddedRedis
from protos.kvserve.v1 import serving_pb2 as pb
from router.placement import POLICIES, WorkerView, make_policy
from tests.cluster_harness import (
    MiB,
    ClusterHarness,
    cluster_config,
    greedy_request,
    request_info,
    running_cluster,
    wait_for,
)
from workers.engine.stats import EngineStats
from workers.messages import WorkerInfo
from workers.model.tokenizer import TokenizerSpec

SLOTS = 4


def _view(max_num_seqs: int | None, running: int = 0, waiting: int = 0, count: bool = True) -> WorkerView:
    info = WorkerInfo("w", "node", "tiny", "cpu", "float32", 258, 2048, 16, 1024, 100, TokenizerSpec(None, None, ()),
                      max_num_seqs=max_num_seqs)
    view = WorkerView(info, count_seq_slots=count)
    view.apply_report(EngineStats.of_pool(100, 0, 1024, num_running=running, num_waiting=waiting), (), 0.0)
    return view


def test_free_slots_count_running_waiting_and_reservations() -> None:
    view = _view(SLOTS, running=2, waiting=1)
    assert view.free_seq_slots == 1
    view.place("a", 2)
    assert view.free_seq_slots == 0
    for name in ("kv", "prefix", "kv-least-loaded"):
        assert make_policy(name, 100).choose([view], 1) is None, name
    # The worker's report counts a (running now); the reservation goes with added_ids.
    view.apply_report(EngineStats.of_pool(100, 2, 1024, num_running=3, num_waiting=1), ("a",), 1.0)
    assert view.free_seq_slots == 0
    view.apply_report(EngineStats.of_pool(100, 2, 1024, num_running=2, num_waiting=0), (), 2.0)
    assert view.free_seq_slots == 2
    assert make_policy("kv", 100).choose([view], 1) is view


def test_no_limit_when_unknown_or_not_counted() -> None:
    for view in (_view(None, running=500), _view(SLOTS, running=SLOTS, count=False)):
        assert view.free_seq_slots > 1000
        assert make_policy("kv", 100).choose([view], 1) is view


def test_blind_policies_stay_blind_to_slots() -> None:
    # round-robin, random and least-requests are the comparisons: they place as a plain
    # balancer in front of engines would, queueing inside the worker.
    for name in set(POLICIES) - {"kv", "prefix", "kv-least-loaded"}:
        assert make_policy(name, 100).choose([_view(SLOTS, running=SLOTS)], 1) is not None, name


@pytest.fixture(scope="module")
def cluster(redis_server: EmbeddedRedis, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ClusterHarness]:
    config = cluster_config(redis_server.url, tmp_path_factory.mktemp("slots"), (8 * MiB, 8 * MiB))
    config = replace(config, engine=replace(config.engine, max_num_seqs=SLOTS))
    with running_cluster(config) as harness:
        yield harness


def test_a_burst_waits_in_the_router_not_in_a_worker(cluster: ClusterHarness) -> None:
    """40 requests onto 2 workers of 4 slots: at every poll no worker holds more than 4
    unfinished requests and none waits inside a worker; the rest wait in the router."""
    ids = [f"slots-{i}-{time.monotonic_ns()}" for i in range(40)]
    peaks = {"queued": 0, "unfinished": 0, "waiting": 0}
    done = threading.Event()

    def poll() -> None:
        while not done.is_set():
            status = cluster.stub.ClusterStatus(pb.ClusterStatusRequest(), timeout=10)
            peaks["queued"] = max(peaks["queued"], status.queued)
            for worker in status.workers:
                peaks["unfinished"] = max(peaks["unfinished"], worker.running + worker.waiting)
                peaks["waiting"] = max(peaks["waiting"], worker.waiting)
            time.sleep(0.005)

    poller = threading.Thread(target=poll)
    poller.start()
    try:
        for i, request_id in enumerate(ids):
            cluster.stub.Submit(greedy_request([1 + i % 7, 2, 3, 4, 5], 48, request_id), timeout=30)
        for request_id in ids:
            wait_for(lambda rid=request_id: request_info(cluster.stub, rid),
                     lambda info: info.status == pb.REQUEST_STATUS_FINISHED, timeout=120, what=request_id)
    finally:
        done.set()
        poller.join()
    assert peaks["unfinished"] <= SLOTS, peaks
    assert peaks["waiting"] == 0, peaks
    assert peaks["queued"] > 0, peaks
