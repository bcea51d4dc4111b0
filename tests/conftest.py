"""Shared fixtures: real services on loopback, started once per test session."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from typing import TYPE_CHECKING

import pytest

from cluster.redis_server import EmbeddedRedis, RedisServerConfig
from router.state import StoreConfig

if TYPE_CHECKING:
    from tests.cluster_harness import ReferenceEngine


@pytest.fixture(scope="session")
def redis_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EmbeddedRedis]:
    """A real redis-server on a free loopback port, with its AOF in a temp dir."""
    server = EmbeddedRedis(RedisServerConfig(state_dir=tmp_path_factory.mktemp("redis")))
    server.start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
def store_config(redis_server: EmbeddedRedis) -> StoreConfig:
    """A store on the session's Redis with a prefix of its own, so tests never share keys."""
    return StoreConfig(url=redis_server.url, prefix=f"test-{uuid.uuid4().hex[:12]}")


@pytest.fixture(scope="session")
def ray_session() -> Iterator[None]:
    """One local Ray for the whole session (its start costs seconds). Logical CPUs are
    declared above the machine's 2 so that several small workers fit at once."""
    import ray

    ray.init(num_cpus=8, include_dashboard=False, log_to_driver=False, configure_logging=False)
    try:
        yield
    finally:
        ray.shutdown()


@pytest.fixture(scope="session")
def reference_engine() -> ReferenceEngine:
    """The in-process engine with the cluster tests' worker EngineArgs (loads the model once)."""
    from tests.cluster_harness import ReferenceEngine, tiny_engine

    return ReferenceEngine(tiny_engine())
