"""The Locust load test against a real cluster, run headless the way users run it.

Two CPU workers, the session's redis-server, gRPC on loopback, and Locust as a
subprocess. Each run's CSV must show TTFT, ITL and E2E with no failures, and the E2E
count must equal the requests the router recorded as finished in Redis.
"""

from __future__ import annotations

import csv
import os
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

from cluster.local import ClusterConfig
from cluster.redis_server import EmbeddedRedis
from router.core import RouterConfig
from router.server import ServerConfig
from tests.cluster_harness import TEST_REDIS_TIMEOUT_S, ClusterHarness
from workers.config import EngineArgs

REPO = Path(__file__).resolve().parents[1]
LOCUSTFILE = REPO / "loadtest" / "locustfile.py"


class SmokeCluster:
    def __init__(self, harness: ClusterHarness, redis_url: str, prefix: str) -> None:
        self.harness = harness
        self.redis = redis.Redis.from_url(redis_url, decode_responses=True)
        self.prefix = prefix

    def num_finished(self) -> int:
        """Requests whose hash in Redis says FINISHED (ran to max_tokens)."""
        keys = list(self.redis.scan_iter(match=f"{self.prefix}:req:*", count=1000))
        return sum(1 for key in keys if self.redis.hget(key, "status") == "FINISHED")


@pytest.fixture(scope="module")
def cluster(ray_session: None, redis_server: EmbeddedRedis, tmp_path_factory: pytest.TempPathFactory) -> Iterator[SmokeCluster]:
    prefix = f"locust-{uuid.uuid4().hex[:12]}"
    config = ClusterConfig(
        engine=EngineArgs(model="tiny", kv_cache_memory=16 * 2**20, num_threads=1),
        num_workers=2,
        worker_cpus=1,
        state_dir=tmp_path_factory.mktemp("locust-cluster"),
        server=ServerConfig(port=0),
        # On a busy shared machine a step of several 512-token prefills can keep a worker
        # silent for seconds; this test is about the load tester, not about liveness.
        router=RouterConfig(worker_timeout_s=30.0),
        report_interval_s=0.05,
        redis_url=redis_server.url,
        store_prefix=prefix,
        metrics_port=None,  # not 9400, the README's: another pytest-xdist process may be running its commands
        redis_timeout_s=TEST_REDIS_TIMEOUT_S,
    )
    harness = ClusterHarness(config)
    smoke = SmokeCluster(harness, redis_url=redis_server.url, prefix=prefix)
    try:
        yield smoke
    finally:
        smoke.redis.close()
        harness.stop()


def run_locust(
    address: str, csv_prefix: Path, *args: str, env: dict[str, str] | None = None, expect_success: bool = True
) -> dict[str, dict[str, str]]:
    """Run the locustfile headless against a router; return run_stats.csv's rows by name.
    Locust exits 1 when a request failed: expect_success=False allows that."""
    command = [
        sys.executable, "-m", "locust", "-f", str(LOCUSTFILE),
        "--host", address,
        "--headless", "--only-summary", "--csv", str(csv_prefix),
        "--stop-timeout", "15",  # let running requests finish, so every one is counted
        *args,
    ]  # fmt: skip
    environ = {k: v for k, v in os.environ.items() if not k.startswith("KVSERVE_")} | (env or {})
    result = subprocess.run(command, cwd=REPO, env=environ, capture_output=True, text=True, timeout=90)
    assert result.returncode in ((0,) if expect_success else (0, 1)), (
        f"locust exited {result.returncode}\n{result.stdout}\n{result.stderr[-4000:]}"
    )
    with open(f"{csv_prefix}_stats.csv", newline="") as f:
        return {row["Name"]: row for row in csv.DictReader(f)}


def check_run(rows: dict[str, dict[str, str]], num_finished: int) -> None:
    assert int(rows["Aggregated"]["Failure Count"]) == 0, rows["Aggregated"]
    assert int(rows["Aggregated"]["Request Count"]) > 0
    for name in ("TTFT", "ITL", "E2E"):
        assert rows[name]["Type"] == "grpc"
        assert int(rows[name]["Request Count"]) > 0, name
        assert int(rows[name]["Failure Count"]) == 0, name
    # Every request that got a first token ran to its end, and the router agrees.
    assert int(rows["E2E"]["Request Count"]) == int(rows["TTFT"]["Request Count"]) == num_finished
    assert float(rows["E2E"]["Average Content Size"]) >= 1.0  # output tokens per request


def test_closed_loop_users(cluster: SmokeCluster, tmp_path: Path) -> None:
    before = cluster.num_finished()
    rows = run_locust(cluster.harness.cluster.address, tmp_path / "run", "-u", "2", "-r", "2", "-t", "8s", "--max-tokens-scale", "0.5")
    check_run(rows, cluster.num_finished() - before)


def test_open_loop_poisson_arrivals_chosen_by_environment(cluster: SmokeCluster, tmp_path: Path) -> None:
    before = cluster.num_finished()
    rows = run_locust(
        cluster.harness.cluster.address, tmp_path / "run", "--arrival-rate", "4", "-u", "2", "-r", "2", "-t", "4s", "--max-tokens-scale", "0.5",
        env={"KVSERVE_SHAPE": "poisson", "KVSERVE_WORKLOAD": "shared-prefix"},
    )  # fmt: skip
    check_run(rows, cluster.num_finished() - before)
