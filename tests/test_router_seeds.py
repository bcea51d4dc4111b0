"""The seeds the router picks survive a JavaScript client: below 2^53, exact as doubles."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from cluster.redis_server import EmbeddedRedis
from protos.kvserve.v1 import serving_pb2 as pb
from router.core import ROUTER_SEED_BOUND
from tests.cluster_harness import ClusterHarness, cluster_config, request_info, running_cluster

NUM_REQUESTS = 64  # a seed drawn from [0, 2^63) is >= 2^53 with probability 1 - 2^-10 each


@pytest.fixture(scope="module")
def cluster(redis_server: EmbeddedRedis, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ClusterHarness]:
    with running_cluster(cluster_config(redis_server.url, tmp_path_factory.mktemp("seeds"))) as harness:
        yield harness


def test_router_seeds_are_exact_as_doubles(cluster: ClusterHarness) -> None:
    assert ROUTER_SEED_BOUND == 2**53
    seeds = []
    for _ in range(NUM_REQUESTS):
        request = pb.GenerateRequest(token_ids=pb.TokenIds(ids=[1, 2, 3]),
                                     sampling=pb.SamplingParams(max_tokens=1, temperature=0.8))
        started = next(iter(cluster.stub.Generate(request, timeout=60))).started
        seed = request_info(cluster.stub, started.request_id).sampling.seed
        assert 0 <= seed < 2**53 and float(seed) == seed
        seeds.append(seed)
    assert len(set(seeds)) == NUM_REQUESTS, "seeds repeat"
