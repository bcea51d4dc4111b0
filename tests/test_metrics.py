"""The router's /metrics on a real cluster: two tiny CPU workers, Redis, gRPC, HTTP scrapes."""

from __future__ import annotations

import time
import urllib.request
import uuid
from collections.abc import Callable, Iterator

import grpc
import pytest

from cluster.local import ClusterConfig
from cluster.redis_server import EmbeddedRedis
from protos.kvserve.v1 import serving_pb2 as pb
from router.core import RouterConfig
from router.placement import reservation
from router.server import ServerConfig
from tests.cluster_harness import TEST_REDIS_TIMEOUT_S, ClusterHarness, generate, greedy_request, output_ids
from workers.config import EngineArgs

KV_BYTES = 16 * 2**20


@pytest.fixture(scope="module")
def cluster(ray_session: None, redis_server: EmbeddedRedis) -> Iterator[ClusterHarness]:
    config = ClusterConfig(
        engine=EngineArgs(model="tiny", kv_cache_memory=KV_BYTES, num_threads=1),
        num_workers=2,
        redis_url=redis_server.url,
        store_prefix=f"test-metrics-{uuid.uuid4().hex[:8]}",
        server=ServerConfig(port=0),
        router=RouterConfig(max_queue=0),  # no room now -> rejected at once, as queue_full
        metrics_port=0,
        report_interval_s=0.05,
        redis_timeout_s=TEST_REDIS_TIMEOUT_S,
    )
    harness = ClusterHarness(config)
    try:
        yield harness
    finally:
        harness.stop()


def scrape(harness: ClusterHarness) -> dict[str, float]:
    """The /metrics page as {'name{labels}': value}; labels as Prometheus writes them."""
    assert harness.cluster.metrics is not None, "metrics are off: is prometheus-client installed?"
    url = f"http://127.0.0.1:{harness.cluster.metrics.port}/metrics"
    with urllib.request.urlopen(url, timeout=5) as response:
        assert response.status == 200
        text = response.read().decode()
    samples = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            key, value = line.rsplit(" ", 1)
            samples[key] = float(value)
    return samples


def wait_for(
    harness: ClusterHarness, check: str, predicate: Callable[[dict[str, float]], bool], timeout: float = 10.0
) -> dict[str, float]:
    deadline = time.monotonic() + timeout
    while True:
        samples = scrape(harness)
        if predicate(samples):
            return samples
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {check}: {samples}")
        time.sleep(0.05)


def test_latency_counters_and_worker_kv(cluster: ClusterHarness) -> None:
    prompts = [[1, 2, 3, 4, 5], list(range(10, 50)), [7] * 17, list(range(100, 120))]
    max_tokens = [8, 5, 12, 1]
    num_tokens = 0
    for prompt, n in zip(prompts, max_tokens):
        messages = generate(cluster.stub, greedy_request(prompt, n))
        assert len(output_ids(messages)) == n
        num_tokens += n
    num_requests = len(prompts)

    def settled(s: dict[str, float]) -> bool:
        return all(s.get(f'kvserve_worker_free_kv_bytes{{worker="w{i}"}}') == KV_BYTES for i in range(2))

    s = wait_for(cluster, "every worker's KV to be free again", settled)
    assert s["kvserve_time_to_first_token_seconds_count"] == num_requests
    assert s["kvserve_inter_token_latency_seconds_count"] == num_tokens - num_requests
    assert s["kvserve_e2e_request_latency_seconds_count"] == num_requests
    assert s['kvserve_requests_finished_total{reason="length"}'] == num_requests
    assert s["kvserve_output_tokens_total"] == num_tokens
    assert s['kvserve_time_to_first_token_seconds_bucket{le="+Inf"}'] == num_requests
    assert 0 < s["kvserve_time_to_first_token_seconds_sum"] < 60
    # Each placed once, at once (no queue here), and before its first token.
    assert s["kvserve_request_queue_time_seconds_count"] == num_requests
    assert 0 < s["kvserve_request_queue_time_seconds_sum"] < s["kvserve_time_to_first_token_seconds_sum"]
    assert sum(s.get(f'kvserve_placements_total{{worker="w{i}"}}', 0) for i in range(2)) == num_requests
    assert s["kvserve_admission_queue_length"] == 0
    assert s["kvserve_admission_backfilled_total"] == 0  # the default order is FIFO
    for i in range(2):
        w = f'{{worker="w{i}"}}'
        assert s[f"kvserve_worker_total_kv_bytes{w}"] == KV_BYTES
        assert s[f"kvserve_worker_kv_usage_ratio{w}"] == 0
        assert s[f"kvserve_worker_uncommitted_blocks{w}"] == KV_BYTES // (16 * 8192)  # 16-token blocks of 8 KiB/token
        assert s[f"kvserve_worker_running_requests{w}"] == 0
        assert s[f"kvserve_worker_waiting_requests{w}"] == 0
        assert s[f"kvserve_worker_preemptions{w}"] == 0
        assert s[f"kvserve_worker_alive{w}"] == 1
        assert 0 <= s[f"kvserve_worker_report_age_seconds{w}"] < 5


def test_rejection_and_cancellation_by_reason(cluster: ClusterHarness) -> None:
    # Each long request (8 + 2040 tokens: all of a 128-block worker at its longest) commits
    # more than half of a worker's 128 blocks (65: its prompt and 1020 tokens at the default
    # kv_reserve_ratio, 0.5), so after one on each worker a third has no room anywhere, and
    # with max_queue=0 it is refused.
    committed, _ = reservation(8, 2040, 0, 128, RouterConfig.kv_reserve_ratio, 16)
    assert 64 < committed < 128
    placed_before = scrape(cluster)["kvserve_request_queue_time_seconds_count"]
    ids = []
    for _ in range(2):
        submitted = cluster.stub.Submit(greedy_request([1, 2, 3, 4, 5, 6, 7, 8], 2040), timeout=30)
        ids.append(submitted.request_id)

    def running(request_id: str) -> bool:
        info = cluster.stub.GetRequest(pb.GetRequestRequest(request_id=request_id))
        return bool(info.status == pb.REQUEST_STATUS_RUNNING)

    deadline = time.monotonic() + 10
    while not all(running(i) for i in ids):
        assert time.monotonic() < deadline, "the long requests never started"
        time.sleep(0.02)
    with pytest.raises(grpc.RpcError) as refused:
        generate(cluster.stub, greedy_request([1, 2, 3, 4, 5, 6, 7, 8], 2040))
    assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    s = scrape(cluster)
    assert s['kvserve_requests_rejected_total{reason="queue_full"}'] == 1
    assert s['kvserve_requests_finished_total{reason="error"}'] == 1, "a refused request ended too (FAILED)"
    assert s["kvserve_request_queue_time_seconds_count"] == placed_before + 2, "a refused request is never placed"
    for i in range(2):
        assert s[f'kvserve_worker_uncommitted_blocks{{worker="w{i}"}}'] == 128 - committed

    for request_id in ids:
        cluster.stub.Cancel(pb.CancelRequest(request_id=request_id))
    wait_for(
        cluster, "two cancelled requests", lambda s: s.get('kvserve_requests_finished_total{reason="cancelled"}') == 2
    )
    assert not cluster.call(_pending_token_clocks(cluster)), "per-request token clocks must be dropped at the end"


async def _pending_token_clocks(cluster: ClusterHarness) -> int:
    assert cluster.cluster.metrics is not None
    return len(cluster.cluster.metrics._last_token_at)
