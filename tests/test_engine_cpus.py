"""--engine-cpus: each engine process on CPUs of its own, kvserve's other processes off them
(workers/cpus.py)."""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path
from typing import Any

import psutil
import pytest

from cluster.cli import build_parser
from cluster.local import ClusterConfig
from cluster.redis_server import EmbeddedRedis
from cluster.up import cluster_config_from_args
from protos.kvserve.v1 import serving_pb2 as pb
from tests.cluster_harness import ReferenceEngine, cluster_config, greedy_request, parse_stream, running_cluster
from workers.cpus import engine_slice, parse_cpu_list


def test_cpu_lists_parse_like_taskset_and_split_between_workers() -> None:
    assert parse_cpu_list("1") == (1,)
    assert parse_cpu_list("4-6,0, 5") == (0, 4, 5, 6)
    for bad in ("", "a", "3-1", "-1", "1-"):
        with pytest.raises(ValueError, match="CPU numbers like 1 or 2-7"):
            parse_cpu_list(bad)
    assert [engine_slice((2, 3, 4, 5, 6, 7), i, 3) for i in range(3)] == [(2, 3), (4, 5), (6, 7)]
    assert [engine_slice((2, 3, 4), i, 2) for i in range(2)] == [(2,), (3, 4)]
    assert engine_slice((1,), 1, 2) == (1,), "fewer CPUs than workers: they share them"


def test_the_flag_reaches_the_cluster_config(capsys: pytest.CaptureFixture[str]) -> None:
    config = cluster_config_from_args(build_parser().parse_args(["up", "--engine-cpus", "1-2"]))
    assert config.engine_cpus == (1, 2)
    assert cluster_config_from_args(build_parser().parse_args(["up"])).engine_cpus == ()
    with pytest.raises(SystemExit):
        build_parser().parse_args(["up", "--engine-cpus", "two"])
    assert "--engine-cpus: expected CPU numbers like 1 or 2-7" in capsys.readouterr().err
    with pytest.raises(ValueError, match="engine_cpus is for a cluster that starts its workers"):
        ClusterConfig(engine_cpus=(1,), join_workers=True, ray_address="auto", redis_url="redis://x")


def _thread_cpus(pid: int) -> set[frozenset[int]]:
    """The CPU sets of the process's live threads (one that ends after the listing is left out)."""
    found = set()
    for thread in psutil.Process(pid).threads():
        try:
            found.add(frozenset(os.sched_getaffinity(thread.id)))
        except ProcessLookupError:
            continue
    return found


def _pids(handle: Any) -> tuple[int, int]:
    import ray

    return ray.get(handle.__ray_call__.remote(lambda actor: (os.getpid(), actor._engine.pid)), timeout=30)


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs 2 CPUs: one for the engine, one for the rest")
def test_the_engine_runs_on_its_cpus_and_the_rest_keeps_off_them(
    ray_session: None, redis_server: EmbeddedRedis, tmp_path: Path, reference_engine: ReferenceEngine
) -> None:
    mine = os.sched_getaffinity(0)
    engine_cpu = max(mine)
    config = dataclasses.replace(cluster_config(redis_server.url, tmp_path, (16 * 2**20,)), engine_cpus=(engine_cpu,))
    prompt = list(range(30, 44))
    expected = reference_engine.greedy([(prompt, 12)])[0].output_ids
    with running_cluster(config) as cluster:
        actor_pid, engine_pid = _pids(cluster.cluster.handles[0])
        assert _thread_cpus(engine_pid) == {frozenset({engine_cpu})}
        for cpus in _thread_cpus(actor_pid) | _thread_cpus(os.getpid()):
            assert engine_cpu not in cpus and cpus, cpus
        result = parse_stream(cluster.stub.Generate(greedy_request(prompt, 12), timeout=120))
        assert result.token_ids == expected and result.finished.finish_reason == pb.FINISH_REASON_LENGTH
    assert _thread_cpus(os.getpid()) == {frozenset(mine)}, "the process that ran the cluster gets its CPUs back"
