"""A model a worker cannot load fails `kvserve up` in one line that says why.

`kvserve up --model` naming a file that is not there (the first thing a user mistypes)
ended in two tracebacks, the worker actor's and `kvserve up`'s own, with "[kvserve]
stopped" printed before them and, as the last line, "its engine process exited (1) while
loading the model; its log has why": the missing file was named only inside the
actor's traceback, and Ray started the actor again to fail the same way.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from cluster.redis_server import EmbeddedRedis
from cluster.workers import spawn_worker
from router.placement import WorkerView
from router.prefix_index import PrefixIndex
from router.registry import WorkerRegistry
from tests.cluster_harness import ClusterHarness, cluster_config, tiny_engine, wait_until
from workers.config import EngineArgs, WorkerConfig
from workers.messages import WorkerInfo, WorkerLoadError
from workers.model.tokenizer import ByteTokenizer, TokenizerSpec


def _kvserve_up(redis_server: EmbeddedRedis, state_dir: Path, *flags: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "cluster.cli", "up", "--redis-url", redis_server.url, "--workers", "1",
         "--port", "0", "--metrics-port", "off", "--state-dir", str(state_dir), *flags],
        capture_output=True, text=True, timeout=180, env={**os.environ, "RAY_DEDUP_LOGS": "0"},
    )


def test_a_missing_model_file_is_named_in_one_line_and_kvserve_up_exits_1(
    redis_server: EmbeddedRedis, tmp_path: Path
) -> None:
    missing = tmp_path / "models" / "SmolLM2-135M-Instruct.Q4_1.gguf"
    done = _kvserve_up(redis_server, tmp_path / "state", "--model", str(missing))
    assert done.returncode == 1, done.stderr[-3000:]
    said = [line for line in done.stderr.splitlines() if line.startswith("[kvserve]")]
    assert said[-2:] == [f"[kvserve] error: worker w0 could not load the model: GGUF file {missing} not found",
                         "[kvserve] stopped"], done.stderr[-3000:]
    assert "Traceback" not in done.stderr, done.stderr[-3000:]


def test_a_worker_whose_model_does_not_load_says_why_and_a_router_does_not_wait_for_it(
    ray_session: None, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The actor lives on to answer info() with the reason (a router's first call); a router
    whose worker Ray restarted into this state takes it for gone, as it took an actor whose
    restart died, rather than asking again every few seconds for ever."""
    import ray

    # A setting the engine refuses is told the same way, in its own words.
    small = spawn_worker(WorkerConfig(worker_id="w8", engine=EngineArgs(model="tiny", kv_cache_memory=1024)))
    try:
        with pytest.raises(WorkerLoadError) as refused:
            ray.get(small.info.remote(), timeout=120)
        assert str(getattr(refused.value, "cause", None)) == ("worker w8 could not load the model: kv_cache_memory 1024 bytes is "
                                            "smaller than one KV block (131072 bytes)")
    finally:
        ray.kill(small)

    missing = tmp_path / "gone.gguf"
    handle = spawn_worker(WorkerConfig(worker_id="w7", engine=EngineArgs(model=str(missing))))
    try:
        with pytest.raises(WorkerLoadError, match=re.escape(f"worker w7 could not load the model: GGUF file "
                                                            f"{missing} not found")):
            ray.get(handle.info.remote(), timeout=120)

        async def rejoin() -> None:
            registry = WorkerRegistry(2.0, 10.0, PrefixIndex(), False, lambda _info: None, _nothing, _nothing)
            info = WorkerInfo("w7", "", "tiny", "cpu", "float32", 256, 64, 16, 1024, 8,
                              TokenizerSpec.of(ByteTokenizer()))
            view = WorkerView(info, alive=False)
            await asyncio.wait_for(registry._rejoin(view, handle), timeout=30)  # returns: gone for good

        with caplog.at_level(logging.WARNING, logger="kvserve.router"):
            asyncio.run(rejoin())
        assert any("worker w7 is gone for good: worker w7 could not load the model" in r.getMessage()
                   for r in caplog.records), [r.getMessage() for r in caplog.records]
        # And ended, as an actor whose restart died is: it held a Ray CPU (or a GPU). ray.kill
        # takes effect a moment later (a CI run's call right after it was still answered).
        def ended() -> bool:
            try:
                ray.get(handle.info.remote(), timeout=60)
            except ray.exceptions.RayActorError:
                return True
            except WorkerLoadError:
                return False
            return False

        wait_until(ended, timeout=30, what="the actor the router gave up on to end")
    finally:
        ray.kill(handle)


def test_a_joining_router_joins_the_workers_that_serve_beside_one_whose_model_did_not_load(
    ray_session: None, redis_server: EmbeddedRedis, tmp_path: Path
) -> None:
    """A worker Ray restarted into a model that does not load lives on under its name until
    a router gives up on it. A router joining meanwhile (`kvserve router`, or `kvserve up
    --routers N` starting one again) failed its start on it (a review's test)."""
    import ray

    config = cluster_config(redis_server.url, tmp_path)
    prefix = config.store_prefix
    serving = spawn_worker(WorkerConfig(worker_id="w1", engine=tiny_engine(), report_interval_s=0.05),
                           name=f"kvserve-{prefix}-w1")
    failed = spawn_worker(WorkerConfig(worker_id="w0", engine=EngineArgs(model=str(tmp_path / "gone.gguf"))),
                          name=f"kvserve-{prefix}-w0")
    harness = None
    try:
        ray.get(serving.info.remote(), timeout=120)
        joining = dataclasses.replace(config, join_workers=True, num_workers=None, worker_kv_cache_memory=None,
                                      ray_address=ray.get_runtime_context().gcs_address)
        harness = ClusterHarness(joining, idle=False)
        assert sorted(harness.router.workers) == ["w1"]
    finally:
        if harness is not None:
            harness.stop()
        for handle in (serving, failed):
            ray.kill(handle)


async def _nothing(*_args: object) -> None:
    return None
