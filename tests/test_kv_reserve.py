"""--kv-reserve-ratio: what a kv-aware placement commits of a request's output.

A request commits its prompt's blocks and ceil(ratio x max_tokens) tokens' worth, not all
of max_tokens, so more requests run at once; one that outgrows its reservation holds what
it holds, and a worker that runs short preempts (recompute) as vLLM does. Only a request
whose longest fits every live worker is reserved below its longest: wherever the
reservation finds room, the request can finish.

The cluster: two tiny workers of 64 and 32 KV blocks (16 tokens each), the `kv` policy,
ratio 0.5.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from typing import Any

import pytest

from cluster.cli import build_parser
from cluster.redis_server import EmbeddedRedis
from cluster.routers import router_flags
from cluster.up import cluster_config_from_args, router_cluster_config_from_args, router_only_parser
from protos.kvserve.v1 import serving_pb2 as pb
from router.core import Router, RouterConfig
from router.state import RequestStore, StoreConfig
from router.tracker import RequestTracker
from router.validation import ClusterLimits
from tests.cluster_harness import (
    MiB,
    ClusterHarness,
    cluster_config,
    greedy_request,
    hold_engines,
    observing,
    request_info,
    running_cluster,
    wait_for,
    wait_idle,
    wait_until,
    worker_status,
)
from workers.engine.config import blocks_for_tokens
from workers.engine.sampling import SamplingParams

RATIO = 0.5
BLOCK = 16


def _tracker(num_prompt: int, max_tokens: int, produced: int = 0) -> RequestTracker:
    tracker = RequestTracker("r", tuple(range(num_prompt)), SamplingParams(max_tokens=max_tokens),
                             blocks_for_tokens(num_prompt + max_tokens - 1, BLOCK))
    tracker.output_ids.extend(range(produced))
    return tracker


def _router(ratio: float) -> Router:
    router = Router(RouterConfig(kv_reserve_ratio=ratio), RequestStore(StoreConfig(url="redis://127.0.0.1:1/0")))
    router.limits = ClusterLimits(vocab_size=100, max_model_len=4096, block_size=BLOCK, max_worker_blocks=64)
    return router


def test_a_placement_commits_the_prompt_and_the_ratio_of_max_tokens() -> None:
    half = _router(RATIO)
    # 8 + 400 tokens at its longest: 26 blocks; 8 + 200 - 1 reserved: 13.
    assert half._commitment(_tracker(8, 400), min_total_blocks=32) == (13, 200)
    # An odd max_tokens rounds up: ceil(0.5 x 401) = 201 tokens, still 13 blocks.
    assert half._commitment(_tracker(8, 401), min_total_blocks=32) == (13, 201)
    # Its longest (26) does not fit the smallest worker (20): all of it, so that whichever
    # worker has room for it can hold it to the end.
    assert half._commitment(_tracker(8, 400), min_total_blocks=20) == (26, None)
    # A request that moved with 300 tokens made commits at least those and the next one.
    assert half._commitment(_tracker(8, 400, produced=300), min_total_blocks=32) == (
        blocks_for_tokens(8 + 301 - 1, BLOCK), 301)
    # One token of output: the reservation is all of it, said as None.
    assert half._commitment(_tracker(8, 1), min_total_blocks=32) == (1, None)
    # Ratio 1 is max_tokens, as before the flag.
    assert _router(1.0)._commitment(_tracker(8, 400), min_total_blocks=32) == (26, None)
    for bad in (0.0, -0.5, 1.01, float("nan")):
        with pytest.raises(ValueError, match="kv_reserve_ratio must be in"):
            RouterConfig(kv_reserve_ratio=bad)


def test_the_ratio_is_a_flag_of_up_its_routers_and_a_joining_router(capsys: pytest.CaptureFixture[str]) -> None:
    parser = build_parser()
    assert cluster_config_from_args(parser.parse_args(["up"])).router.kv_reserve_ratio == RouterConfig.kv_reserve_ratio
    up_args = parser.parse_args(["up", "--kv-reserve-ratio", "0.6", "--routers", "2"])
    assert cluster_config_from_args(up_args).router.kv_reserve_ratio == 0.6
    flags = router_flags(router_only_parser(), up_args)
    assert flags[flags.index("--kv-reserve-ratio") + 1] == "0.6"
    joining = parser.parse_args(["router", "--ray-address", "auto", "--redis-url", "redis://h:1/0",
                                 "--kv-reserve-ratio", "1"])
    assert router_cluster_config_from_args(joining).router.kv_reserve_ratio == 1.0
    for bad in ("0", "-1", "1.5", "half", "nan"):
        with pytest.raises(SystemExit):
            parser.parse_args(["up", "--kv-reserve-ratio", bad])
        assert "--kv-reserve-ratio: expected a fraction in (0, 1]" in capsys.readouterr().err


@pytest.fixture(scope="module")
def cluster(
    ray_session: None, redis_server: EmbeddedRedis, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[ClusterHarness]:
    config = cluster_config(
        redis_server.url,
        tmp_path_factory.mktemp("reserve"),
        worker_kv_cache_memory=(8 * MiB, 4 * MiB),  # 64 and 32 blocks of the tiny model
        router=RouterConfig(policy="kv", kv_reserve_ratio=RATIO),
    )
    with running_cluster(config) as harness:
        yield harness


def test_twice_as_many_run_and_those_that_outgrow_their_reservation_are_preempted_and_finish_exactly(
    cluster: ClusterHarness,
) -> None:
    """A long request (24 + 600 tokens: 39 blocks, more than w1's 32) commits all of it, on
    w0. Four mediums (8 + 400 tokens: 26 blocks at their longest, 13 reserved) follow while
    the engines are held, so the router decides from reservations alone: w0's 25 left take
    one, w1's 32 take two, and the fourth waits. At max_tokens w0 would take none and w1
    one. The two on w1 grow to 52 blocks of its 32: it preempts, and every medium still
    finishes with the same greedy tokens."""
    tag = uuid.uuid4().hex[:8]
    long_id = f"long-{tag}"
    medium_ids = [f"medium{i}-{tag}" for i in range(4)]
    placed: dict[str, tuple[str, int | None]] = {}

    def observe(name: str, payload: Any) -> None:
        if name == "placed":
            tracker, view = payload
            placed[tracker.request_id] = (view.worker_id, tracker.reserve_tokens)

    preempted_before = worker_status(cluster.stub, "w1").preemptions
    with observing(cluster, observe):
        hold_engines(cluster, ("w0", "w1"), 5.0)  # nothing runs: placement sees reservations only
        cluster.stub.Submit(greedy_request(list(range(24)), 600, long_id), timeout=10)
        wait_until(lambda: long_id in placed, what="the long request to be placed")
        for request_id in medium_ids:
            cluster.stub.Submit(greedy_request([5, 6, 7, 8, 9, 10, 11, 12], 400, request_id), timeout=10)
        wait_until(lambda: sum(r in placed for r in medium_ids) == 3 and
                   cluster.stub.ClusterStatus(pb.ClusterStatusRequest(), timeout=5).queued == 1,
                   what="three mediums placed and one waiting")
        on = {request_id: placed.get(request_id) for request_id in medium_ids}
        # All of the long one (None) on the only worker that holds its longest.
        assert placed[long_id] == ("w0", None)
        # 64 - 39 = 25 left on w0: one medium's 13; 32 on w1: two of them (26). At max_tokens
        # (26 each) w0 would take none and w1 one.
        assert sorted(p for p in on.values() if p is not None) == [("w0", 200), ("w1", 200), ("w1", 200)]
        waiting = next(r for r, p in on.items() if p is None)
        info = request_info(cluster.stub, waiting)
        assert (info.status, info.worker_id) == (pb.REQUEST_STATUS_QUEUED, "")
        cluster.stub.Cancel(pb.CancelRequest(request_id=long_id), timeout=10)

        infos = wait_for(
            lambda: [request_info(cluster.stub, r) for r in medium_ids],
            lambda infos: all(i.status == pb.REQUEST_STATUS_FINISHED for i in infos),
            timeout=60, what="every medium to finish",
        )
    outputs = {tuple(i.output_token_ids) for i in infos}
    assert len(outputs) == 1 and len(next(iter(outputs))) == 400, "the same greedy tokens, all 400, for each"
    assert worker_status(cluster.stub, "w1").preemptions > preempted_before, "w1's two outgrew its 32 blocks"
    status = wait_idle(cluster.stub)
    assert [(w.worker_id, w.uncommitted_blocks) for w in status.workers] == [("w0", 64), ("w1", 32)]
