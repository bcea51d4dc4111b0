"""Prefix caching across a real cluster: what a worker's cache holds reaches the router's
index, the `prefix` policy sends a request where its prompt already is, usage says how
much of the prompt came from the cache, and a dead or restarted worker's entries vanish."""

from __future__ import annotations

import dataclasses
import os
import signal
import urllib.request
import uuid
from collections import Counter
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import ray
import redis

from cluster.redis_server import EmbeddedRedis
from protos.kvserve.v1 import serving_pb2 as pb
from router.core import RouterConfig
from tests.cluster_harness import (
    MiB,
    ClusterHarness,
    ReferenceEngine,
    cluster_config,
    greedy_request,
    hold_engines,
    parse_stream,
    read_deltas,
    read_rest,
    request_info,
    running_cluster,
    wait_until,
    worker_pid,
    worker_status,
)

BLOCK = 16
SALT = "tenant-a"
SHARED = [(7 * i + 3) % 250 for i in range(5 * BLOCK + 5)]  # 5 full blocks and 5 tokens shared


def _prompt(tail: int) -> list[int]:
    return SHARED + [100 + tail, 101 + tail, 102 + tail]


def _generate(
    cluster: ClusterHarness, prompt: list[int], max_tokens: int = 8, cache_salt: str | None = None
) -> tuple[str, list[int], pb.Finished, str]:
    request_id = f"p-{uuid.uuid4().hex[:10]}"
    result = parse_stream(cluster.stub.Generate(_request(prompt, max_tokens, request_id, cache_salt), timeout=120))
    return result.started.worker_id, result.token_ids, result.finished, request_id


def _request(prompt: list[int], max_tokens: int, request_id: str = "", cache_salt: str | None = None) -> pb.GenerateRequest:
    request = greedy_request(prompt, max_tokens, request_id)
    if cache_salt is not None:
        request.cache_salt = cache_salt
    return request


@pytest.fixture
def prefix_cluster(ray_session: None, redis_server: EmbeddedRedis, tmp_path: Path) -> Iterator[ClusterHarness]:
    config = cluster_config(redis_server.url, tmp_path, (16 * MiB, 16 * MiB), router=RouterConfig(policy="prefix"))
    with running_cluster(dataclasses.replace(config, metrics_port=0)) as cluster:
        yield cluster


def test_a_shared_prefix_is_reused_counted_and_indexed(
    prefix_cluster: ClusterHarness, reference_engine: ReferenceEngine, redis_server: EmbeddedRedis
) -> None:
    cluster = prefix_cluster
    first_worker, first_out, first, _ = _generate(cluster, _prompt(0))
    assert first.usage.cached_prompt_tokens == 0 and first.usage.prompt_tokens == len(_prompt(0))
    # The worker's events reach the router's index: its five shared blocks, and the tail's.
    wait_until(lambda: worker_status(cluster.stub, first_worker).indexed_blocks >= 5, what="the index to fill")

    for tail in (1, 2, 3):
        worker, out, finished, request_id = _generate(cluster, _prompt(tail))
        assert worker == first_worker  # where the prefix is, though the other worker is as empty
        assert finished.usage.cached_prompt_tokens == 5 * BLOCK
        assert out == reference_engine.greedy([(_prompt(tail), 8)])[0].output_ids  # cached equals computed
        info = request_info(cluster.stub, request_id)
        assert info.cached_prompt_tokens == 5 * BLOCK
        stored = redis.Redis.from_url(redis_server.url, decode_responses=True).hget(
            f"{cluster.cluster.config.store_prefix}:req:{request_id}", "cached_prompt_tokens"
        )
        assert stored == str(5 * BLOCK)
    status = worker_status(cluster.stub, first_worker)
    assert status.prefix_cache_hit_tokens == 3 * 5 * BLOCK
    assert status.prefix_cache_hit_rate == pytest.approx(
        status.prefix_cache_hit_tokens / status.prefix_cache_queried_tokens
    )
    assert status.evictable_blocks >= 5  # nobody holds them now; they wait in LRU order
    assert status.free_blocks == status.total_blocks  # evictable blocks are free to take
    assert first_out == reference_engine.greedy([(_prompt(0), 8)])[0].output_ids

    metrics = cluster.cluster.metrics
    assert metrics is not None and metrics.port is not None
    text = urllib.request.urlopen(f"http://127.0.0.1:{metrics.port}/metrics", timeout=10).read().decode()
    line = next(x for x in text.splitlines() if x.startswith(f'kvserve_worker_prefix_cache_hit_rate{{worker="{first_worker}"}}'))
    assert float(line.split()[-1]) == pytest.approx(status.prefix_cache_hit_rate)


def test_a_burst_with_a_new_prefix_lands_together_before_any_event(prefix_cluster: ClusterHarness) -> None:
    """Four requests sharing a prefix nobody has cached, sent at once: the placement of the
    first predicts its blocks on its worker, so the others follow it there."""
    with ThreadPoolExecutor(4) as pool:
        results = list(pool.map(lambda tail: _generate(prefix_cluster, _prompt(10 + tail), 4), range(4)))
    assert len({worker for worker, _, _, _ in results}) == 1, results


def test_a_cache_salt_shares_cached_kv_only_within_its_salt(
    prefix_cluster: ClusterHarness, reference_engine: ReferenceEngine, redis_server: EmbeddedRedis
) -> None:
    """Tenants with their own salts send one prompt: each computes it, and each finds it
    cached, where it was cached, only once it sent it itself; the salt changes no output."""
    cluster = prefix_cluster
    expected = reference_engine.greedy([(_prompt(0), 8)])[0].output_ids
    first_worker, out, finished, request_id = _generate(cluster, _prompt(0), cache_salt="tenant-a")
    assert finished.usage.cached_prompt_tokens == 0 and out == expected
    stored = redis.Redis.from_url(redis_server.url, decode_responses=True).hget(
        f"{cluster.cluster.config.store_prefix}:req:{request_id}", "cache_salt"
    )
    assert stored == "tenant-a"  # for a move or an adoption
    wait_until(lambda: worker_status(cluster.stub, first_worker).indexed_blocks >= 5, what="the index to fill")
    for salt in ("tenant-b", None):
        _, out, finished, _ = _generate(cluster, _prompt(0), cache_salt=salt)
        assert finished.usage.cached_prompt_tokens == 0 and out == expected, salt
    # Same salt: the router's index (salted hashes, as the worker's) sends it where its blocks are.
    worker, out, finished, _ = _generate(cluster, _prompt(1), cache_salt="tenant-a")
    assert worker == first_worker and finished.usage.cached_prompt_tokens == 5 * BLOCK
    assert out == reference_engine.greedy([(_prompt(1), 8)])[0].output_ids


def test_without_caching_nothing_is_cached_the_output_is_the_same_and_a_burst_is_spread_as_kv_spreads_it(
    ray_session: None, redis_server: EmbeddedRedis, tmp_path: Path, reference_engine: ReferenceEngine
) -> None:
    """`--no-prefix-caching` under the default policy, `prefix`: with nothing cached anywhere
    it is `kv` (README), so a burst of requests that share a prompt prefix spreads over
    both idle workers. (The router predicted each placed prompt's blocks on its worker,
    caching or not, and read its predictions as hits: all 8 piled on w0 while w1 idled, an
    outside check found.)"""
    config = cluster_config(redis_server.url, tmp_path, (64 * MiB, 64 * MiB), router=RouterConfig(policy="prefix"))
    config = dataclasses.replace(config, engine=dataclasses.replace(config.engine, enable_prefix_caching=False))
    with running_cluster(config) as cluster:
        for tail in (0, 1):
            _, out, finished, _ = _generate(cluster, _prompt(tail))
            assert finished.usage.cached_prompt_tokens == 0
            assert out == reference_engine.greedy([(_prompt(tail), 8)])[0].output_ids
        shared = [(11 * i + 5) % 250 for i in range(12 * BLOCK)]
        with ThreadPoolExecutor(8) as pool:
            placed = list(pool.map(lambda tail: _generate(cluster, shared + [100 + tail, 7], 200), range(8)))
        assert all(finished.usage.cached_prompt_tokens == 0 for _, _, finished, _ in placed)
        by_worker = Counter(worker for worker, _, _, _ in placed)
        assert set(by_worker) == {"w0", "w1"}, f"a burst with nothing cached piled on one worker: {by_worker}"
        for worker in ("w0", "w1"):
            status = worker_status(cluster.stub, worker)
            assert status.indexed_blocks == 0 and status.evictable_blocks == 0 and status.prefix_cache_hit_tokens == 0


def test_a_dead_worker_leaves_the_index_and_a_restarted_one_comes_back_empty(
    ray_session: None, redis_server: EmbeddedRedis, tmp_path: Path
) -> None:
    config = cluster_config(redis_server.url, tmp_path, (16 * MiB, 16 * MiB), router=RouterConfig(policy="prefix"))
    with running_cluster(dataclasses.replace(config, worker_max_restarts=1)) as cluster:
        worker, _, _, _ = _generate(cluster, _prompt(0))
        wait_until(lambda: worker_status(cluster.stub, worker).indexed_blocks >= 5, what="the index to fill")
        handle = cluster.cluster.handles[int(worker[1:])]
        pid = worker_pid(handle)
        os.kill(pid, signal.SIGKILL)
        wait_until(lambda: not worker_status(cluster.stub, worker).alive, timeout=10, what="the worker dead")
        assert worker_status(cluster.stub, worker).indexed_blocks == 0  # at once, not at its rejoin
        wait_until(lambda: worker_status(cluster.stub, worker).alive, timeout=90, what="the worker back")
        assert worker_pid(handle) != pid
        assert worker_status(cluster.stub, worker).indexed_blocks == 0  # its snapshot: an empty cache
        other, _, finished, _ = _generate(cluster, _prompt(1))
        # The other worker never held the prefix either: nothing cached, and placed by kv.
        assert finished.usage.cached_prompt_tokens == 0


def test_a_moved_request_resumes_on_a_worker_that_holds_its_prefix(
    ray_session: None, redis_server: EmbeddedRedis, tmp_path: Path, reference_engine: ReferenceEngine
) -> None:
    """Both workers have the prompt's prefix cached, under one tenant's salt; a long request of
    that tenant's worker is killed and it resumes on the other, reusing the cached blocks
    (its move keeps its salt), with the output of an uninterrupted run."""
    config = cluster_config(redis_server.url, tmp_path, (16 * MiB, 16 * MiB), router=RouterConfig(policy="kv"))
    with running_cluster(config) as cluster:
        expected = reference_engine.greedy([(_prompt(5), 200)])[0].output_ids
        # kv counts its own reservations: two requests at once go to the two workers.
        with ThreadPoolExecutor(2) as pool:
            warmed = {w for w, _, _, _ in pool.map(lambda tail: _generate(cluster, _prompt(tail), cache_salt=SALT),
                                                   (4, 6))}
        assert warmed == {"w0", "w1"}
        for worker in warmed:
            wait_until(lambda: worker_status(cluster.stub, worker).indexed_blocks >= 5, what="the index to fill")
        call = cluster.stub.Generate(_request(_prompt(5), 200, cache_salt=SALT), timeout=120)
        started, head = read_deltas(call, 3)
        hold_engines(cluster, (started.worker_id,), 5.0)  # still running when the kill lands
        ray.kill(cluster.cluster.handles[int(started.worker_id[1:])], no_restart=True)
        result = read_rest(started, head, call)
        assert result.token_ids == expected
        assert result.finished.usage.cached_prompt_tokens >= 5 * BLOCK  # the other worker's cached prefix
        info = request_info(cluster.stub, started.request_id)
        assert info.worker_id != started.worker_id and info.num_migrations == 1
