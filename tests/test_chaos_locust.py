"""Locust at a steady open-loop rate while a worker is killed: the report shows no failure.

The cluster has two workers; a few seconds into the run one of them is SIGKILLed. Its
requests move to the other worker and finish there, so every request Locust sent ends
well, and the router's record agrees (E2E count == FINISHED in Redis, some moved).
"""

from __future__ import annotations

import os
import signal
import threading
import time
import uuid
from pathlib import Path

import ray

from cluster.local import ClusterConfig
from cluster.redis_server import EmbeddedRedis
from router.server import ServerConfig
from tests.cluster_harness import TEST_REDIS_TIMEOUT_S, ClusterHarness
from tests.test_locust_smoke import SmokeCluster, check_run, run_locust
from workers.config import EngineArgs


def test_locust_sees_no_failure_while_a_worker_is_killed(
    ray_session: None, redis_server: EmbeddedRedis, tmp_path: Path
) -> None:
    prefix = f"chaos-{uuid.uuid4().hex[:12]}"
    config = ClusterConfig(
        engine=EngineArgs(model="tiny", kv_cache_memory=16 * 2**20, num_threads=1),
        num_workers=2,
        worker_cpus=1,
        state_dir=tmp_path / "state",
        server=ServerConfig(port=0),
        report_interval_s=0.05,
        redis_url=redis_server.url,
        store_prefix=prefix,
        metrics_port=None,
        redis_timeout_s=TEST_REDIS_TIMEOUT_S,
    )
    harness = ClusterHarness(config)
    smoke = SmokeCluster(harness, redis_url=redis_server.url, prefix=prefix)
    try:
        pids: dict[str, int] = {
            worker_id: ray.get(handle.__ray_call__.remote(lambda actor: os.getpid()), timeout=30)
            for worker_id, handle in zip(("w0", "w1"), harness.cluster.handles)
        }
        killed: list[str] = []

        def kill_when_busy() -> None:
            # Once the load is steady, kill whichever worker has requests in flight to lose
            # (placement may keep a group's requests on one worker; a tiny model ends them
            # fast, so the views are looked at often). In flight on the worker: its report
            # counts them (outstanding less the reservations no report counts yet). A request
            # still on its way when its worker dies is placed elsewhere as if for the first
            # time, not moved: a fresh-clone suite once killed a worker whose two outstanding
            # requests were both on their way, and nothing had moved.
            deadline = time.monotonic() + 20
            while time.monotonic() < deadline:
                time.sleep(0.05)
                if time.monotonic() - started < 3.0:
                    continue
                for worker_id, pid in pids.items():
                    view = harness.router.workers[worker_id]
                    if len(view.outstanding) - len(view.reservations) >= 2:
                        os.kill(pid, signal.SIGKILL)
                        killed.append(worker_id)
                        return

        started = time.monotonic()
        killer = threading.Thread(target=kill_when_busy, daemon=True)
        killer.start()
        rows = run_locust(
            harness.cluster.address, tmp_path / "run", "--arrival-rate", "4", "-u", "2", "-r", "2", "-t", "10s",
            "--max-tokens-scale", "4",
            env={"KVSERVE_SHAPE": "poisson"},
        )  # fmt: skip
        killer.join(timeout=30)
        assert killed, "no worker ever had two requests in flight to lose"

        check_run(rows, smoke.num_finished())
        moved = [
            key for key in smoke.redis.scan_iter(match=f"{prefix}:req:*", count=1000)
            if int(smoke.redis.hget(key, "num_migrations") or 0) > 0
        ]  # fmt: skip
        # Two were in flight when it was killed; one of them may have ended in the moment
        # between the look and the kill, the other cannot have.
        assert len(moved) >= 1, "the killed worker's requests moved and finished elsewhere"
        assert not harness.router.workers[killed[0]].alive
    finally:
        smoke.redis.close()
        harness.stop()
