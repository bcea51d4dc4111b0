"""--kv-reserve-ratio: what a kv-aware placement commits of a request's output, and
--kv-reserve-floor: a ratio that falls while no worker preempts.

A request commits its prompt's blocks and ceil(ratio x max_tokens) tokens' worth, not all
of max_tokens, so more requests run at once; one that outgrows its reservation holds what
it holds, and a worker that runs short preempts (recompute) as vLLM does. A request goes
only to a worker whose pool holds its longest: wherever the reservation finds room, the
request can finish.

The cluster: two tiny workers of 64 and 32 KV blocks (16 tokens each), the `kv` policy,
ratio 0.5.
"""

from __future__ import annotations

import dataclasses
import time
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
from router.placement import ReserveRatio, WorkerView
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
from workers.engine.request import FinishReason
from workers.engine.sampling import SamplingParams
from workers.engine.stats import EngineStats
from workers.messages import StepBatch, WorkerInfo
from workers.model.tokenizer import TokenizerSpec

RATIO = 0.5
BLOCK = 16


def _tracker(num_prompt: int, max_tokens: int, produced: int = 0) -> RequestTracker:
    tracker = RequestTracker("r", tuple(range(num_prompt)), SamplingParams(max_tokens=max_tokens),
                             blocks_for_tokens(num_prompt + max_tokens - 1, BLOCK))
    tracker.output_ids.extend(range(produced))
    return tracker


def _router(ratio: float, floor: float | None = None, decay_s: float = 20.0) -> Router:
    config = RouterConfig(kv_reserve_ratio=ratio, kv_reserve_floor=floor, kv_reserve_decay_s=decay_s)
    router = Router(config, RequestStore(StoreConfig(url="redis://127.0.0.1:1/0")))
    router.limits = ClusterLimits(vocab_size=100, max_model_len=4096, block_size=BLOCK, max_worker_blocks=64)
    return router


def test_a_placement_commits_the_prompt_and_the_ratio_of_max_tokens() -> None:
    half = _router(RATIO)
    # 8 + 400 tokens at its longest: 26 blocks; 8 + 200 - 1 reserved: 13.
    assert half._commitment(_tracker(8, 400)) == (13, 200)
    # An odd max_tokens rounds up: ceil(0.5 x 401) = 201 tokens, still 13 blocks.
    assert half._commitment(_tracker(8, 401)) == (13, 201)
    # A request that moved with 300 tokens made commits at least those and the next one.
    assert half._commitment(_tracker(8, 400, produced=300)) == (blocks_for_tokens(8 + 301 - 1, BLOCK), 301)
    # One token of output: the reservation is all of it, said as None.
    assert half._commitment(_tracker(8, 1)) == (1, None)
    # Ratio 1 is max_tokens, as before the flag.
    assert _router(1.0)._commitment(_tracker(8, 400)) == (26, None)
    # Wherever it is committed below its longest, its longest fits: the policy passes over
    # a pool smaller than 26 blocks (tests/test_placement.py, every policy), so whichever
    # worker it goes to can hold it to the end.
    for bad in (0.0, -0.5, 1.01, float("nan")):
        with pytest.raises(ValueError, match="kv_reserve_ratio must be in"):
            RouterConfig(kv_reserve_ratio=bad)


def test_an_adaptive_ratio_falls_to_what_answers_end_at_and_a_preemption_puts_it_back() -> None:
    r = ReserveRatio(0.5, 0.1, 20.0, now=100.0)
    assert r.at(500.0) == 0.5, "nothing has ended: no evidence, the ceiling"
    for _ in range(ReserveRatio.LEARN_MIN - 1):
        r.ended(100, 400)  # each answer a quarter of its max_tokens
    assert r.at(500.0) == 0.5, "one end short of LEARN_MIN"
    r.ended(100, 400)
    assert (r.target, r.at(500.0)) == (0.125, 0.125)  # the ceiling x a quarter
    # The 90th percentile: while at most a tenth run to max_tokens, they do not move it.
    for _ in range(3):
        r.ended(400, 400)
    assert r.target == 0.125  # 3 of 35
    r.ended(400, 400)
    assert r.target == 0.5  # 4 of 36: the ceiling
    # The window: LEARN_WINDOW more ends at a quarter forget the long ones.
    for _ in range(ReserveRatio.LEARN_WINDOW):
        r.ended(100, 400)
    assert r.target == 0.125
    # Never below the floor, nor above the ceiling (more tokens than max_tokens, as a
    # moved request's count can be, counts as max_tokens).
    for _ in range(ReserveRatio.LEARN_WINDOW):
        r.ended(1, 400)
    assert r.target == 0.1
    for _ in range(ReserveRatio.LEARN_WINDOW):
        r.ended(500, 400)
    assert r.target == 0.5
    for _ in range(ReserveRatio.LEARN_WINDOW):
        r.ended(100, 400)

    # From the ceiling (the start, or a preemption) it falls to the target over decay_s.
    assert [r.at(t) for t in (100.0, 110.0, 120.0, 500.0)] == pytest.approx([0.5, 0.3125, 0.125, 0.125])
    r.preempted(130.0)
    assert (r.since, r.at(130.0), r.at(140.0), r.at(150.0)) == pytest.approx((130.0, 0.5, 0.3125, 0.125))

    # Without a floor the ratio is fixed, whatever ends.
    fixed = ReserveRatio(0.5, None, 20.0, now=0.0)
    for _ in range(ReserveRatio.LEARN_MIN):
        fixed.ended(1, 400)
    assert fixed.at(1e6) == 0.5
    for bad in (0.0, 0.6, float("nan")):
        with pytest.raises(ValueError, match="kv_reserve_floor must be in"):
            RouterConfig(kv_reserve_ratio=0.5, kv_reserve_floor=bad)
    with pytest.raises(ValueError, match="kv_reserve_decay_s must be positive"):
        RouterConfig(kv_reserve_decay_s=0.0)

    # The router learns from each request that ran and ended without an error ("finished"),
    # commits at the ratio of the moment, and a report whose preemption counter rose (not
    # the first report, not one that only repeats it) puts it back to the ceiling.
    router = _router(0.5, floor=0.05, decay_s=0.2)
    time.sleep(0.25)

    def ended(made: int, placements: int = 1, reason: FinishReason = FinishReason.CANCELLED) -> None:
        tracker = _tracker(8, 400, produced=made)
        tracker.num_placements, tracker.finish_reason = placements, reason
        router.notify("finished", tracker)

    for _ in range(ReserveRatio.LEARN_MIN):
        ended(40, placements=0)  # cancelled while it waited: it never held KV
        ended(40, reason=FinishReason.ERROR)
    assert router._commitment(_tracker(8, 400)) == (13, 200), "nothing learned: still the ceiling"
    for reason in (FinishReason.EOS, FinishReason.STOP, FinishReason.CANCELLED):  # each counts
        for _ in range(ReserveRatio.LEARN_MIN // 3 + 1):
            ended(60, reason=reason)
    assert router.reserve.target == pytest.approx(0.5 * 60 / 400)
    assert router._commitment(_tracker(8, 400)) == (blocks_for_tokens(8 + 30 - 1, BLOCK), 30)
    view = WorkerView(WorkerInfo("w0", "node", "tiny", "cpu", "float32", 258, 2048, BLOCK, 1024, 64,
                                 TokenizerSpec(None, None, ())))
    report = EngineStats.of_pool(64, 0, 1024)
    for preemptions in (3, 3):  # the first report says what it had; the second, nothing new
        view.apply_report(dataclasses.replace(report, num_preemptions=preemptions), (), time.monotonic())
        _run(router._on_batch(view, StepBatch(view.report)))
    assert router.reserve.at(time.monotonic()) == pytest.approx(0.075)
    view.apply_report(dataclasses.replace(report, num_preemptions=4), (), time.monotonic())
    _run(router._on_batch(view, StepBatch(view.report)))
    assert router.reserve.at(time.monotonic()) > 0.4
    assert router._commitment(_tracker(8, 400))[1] > 160


def _run(coroutine: Any) -> Any:
    import asyncio

    return asyncio.run(coroutine)


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

    # The adaptive ratio's two flags, through the same three paths.
    assert cluster_config_from_args(parser.parse_args(["up"])).router.kv_reserve_floor is None
    up_args = parser.parse_args(["up", "--kv-reserve-floor", "0.1", "--kv-reserve-decay", "5", "--routers", "2"])
    assert (cluster_config_from_args(up_args).router.kv_reserve_floor,
            cluster_config_from_args(up_args).router.kv_reserve_decay_s) == (0.1, 5.0)
    flags = router_flags(router_only_parser(), up_args)
    assert flags[flags.index("--kv-reserve-floor") + 1] == "0.1" and flags[flags.index("--kv-reserve-decay") + 1] == "5.0"
    joining = parser.parse_args(["router", "--ray-address", "auto", "--redis-url", "redis://h:1/0",
                                 "--kv-reserve-floor", "0.2"])
    assert router_cluster_config_from_args(joining).router.kv_reserve_floor == 0.2
    with pytest.raises(ValueError, match=r"--kv-reserve-floor \(0.8\) must not be above --kv-reserve-ratio \(0.5\)"):
        cluster_config_from_args(parser.parse_args(["up", "--kv-reserve-floor", "0.8"]))
    for flag, bad in (("--kv-reserve-floor", "0"), ("--kv-reserve-decay", "-1")):
        with pytest.raises(SystemExit):
            parser.parse_args(["up", flag, bad])
        assert flag in capsys.readouterr().err


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
    """A long request (24 + 600 tokens: 39 blocks at its longest, more than w1's 32) goes
    to w0, the only pool that holds its longest, committing 24 + 300 tokens (21 blocks).
    Six mediums (8 + 400 tokens: 26 blocks at their longest, 13 reserved) follow while the
    engines are held, so the router decides from reservations alone: w0's 43 left take
    three, w1's 32 take two, and the sixth waits. At max_tokens the long one would fill 39
    of w0's blocks and the 25 left take no medium, w1 one. The two on w1 grow to 52 blocks
    of its 32: it preempts, and every medium still finishes with the same greedy tokens."""
    tag = uuid.uuid4().hex[:8]
    long_id = f"long-{tag}"
    medium_ids = [f"medium{i}-{tag}" for i in range(6)]
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
        wait_until(lambda: sum(r in placed for r in medium_ids) == 5 and
                   cluster.stub.ClusterStatus(pb.ClusterStatusRequest(), timeout=5).queued == 1,
                   what="five mediums placed and one waiting")
        on = {request_id: placed.get(request_id) for request_id in medium_ids}
        # The long one at half its output, on the only worker that holds its longest.
        assert placed[long_id] == ("w0", 300)
        # 64 - 21 = 43 left on w0: three mediums' 13; 32 on w1: two of them (26).
        assert sorted(p for p in on.values() if p is not None) == [("w0", 200)] * 3 + [("w1", 200)] * 2
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


def test_a_worker_s_preemption_puts_an_adaptive_ratio_back_to_its_ceiling(cluster: ClusterHarness) -> None:
    """The module's router, given an adaptive ratio (0.5, floor 0.1, decay 0.5 s) for this
    test. First LEARN_MIN streams, each asking for 400 tokens, end after their first (the
    client cancels, as it would on an EOS of its own): the router learns that answers end
    far short of max_tokens and the ratio falls to its floor. Then eight mediums (8 + 400
    tokens: 26 blocks at their longest) commit 40 output tokens (3 blocks) each, so all
    eight run at once where 0.5 would place three: they outgrow both pools (26 x 8 blocks
    against 64 + 32) and the workers preempt. The workers' reports say so, the router puts
    the ratio back to 0.5, and every medium finishes with the same greedy tokens."""
    tag = uuid.uuid4().hex[:8]
    ids = [f"adaptive{i}-{tag}" for i in range(8)]
    placed: dict[str, int | None] = {}

    def observe(name: str, payload: Any) -> None:
        if name == "placed":
            placed[payload[0].request_id] = payload[0].reserve_tokens

    fixed = cluster.router.reserve
    preempted_before = sum(worker_status(cluster.stub, w).preemptions for w in ("w0", "w1"))
    cluster.router.reserve = learning = ReserveRatio(RATIO, 0.1, 0.5)
    try:
        time.sleep(0.6)
        assert learning.at(time.monotonic()) == RATIO, "nothing ended yet: the ceiling"
        for i in range(ReserveRatio.LEARN_MIN):
            call = cluster.stub.Generate(greedy_request([1, 2, 3, i], 400, f"short{i}-{tag}"), timeout=30)
            assert next(call).WhichOneof("event") == "started"
            assert next(call).delta.token_ids
            call.cancel()
        wait_until(lambda: learning.target == 0.1, what="the router to learn from the ends")
        started = time.monotonic()
        with observing(cluster, observe):
            hold_engines(cluster, ("w0", "w1"), 4.0)  # all eight are placed before any grows (or preempts)
            for request_id in ids:
                cluster.stub.Submit(greedy_request([5, 6, 7, 8, 9, 10, 11, 12], 400, request_id), timeout=10)
            wait_until(lambda: len(placed) == 8, what="all eight placed")
            assert set(placed.values()) == {40}, placed
            infos = wait_for(
                lambda: [request_info(cluster.stub, r) for r in ids],
                lambda infos: all(i.status == pb.REQUEST_STATUS_FINISHED for i in infos),
                timeout=90, what="every medium to finish",
            )
        preempted = sum(worker_status(cluster.stub, w).preemptions for w in ("w0", "w1")) - preempted_before
        assert preempted > 0, "eight requests growing to 26 blocks each outgrow 64 + 32"
        assert cluster.router.reserve.since > started, "the router saw the preemption and went back up"
    finally:
        cluster.router.reserve = fixed
    outputs = {tuple(i.output_token_ids) for i in infos}
    assert len(outputs) == 1 and len(next(iter(outputs))) == 400, "the same greedy tokens, all 400, for each"
    status = wait_idle(cluster.stub)
    assert [(w.worker_id, w.uncommitted_blocks) for w in status.workers] == [("w0", 64), ("w1", 32)]


class _Started:
    """What the bench's replay tells its parent process (policy_replay.replay_main), kept."""

    def __init__(self) -> None:
        self.sent: list[Any] = []

    def send(self, message: Any) -> None:
        self.sent.append(message)


def test_the_policy_bench_ends_each_stream_at_its_output_length_as_eos_would(cluster: ClusterHarness) -> None:
    """`bench-policies --max-tokens-factor 4`: each request asks for 4x its output length and
    the client ends its stream at that length. Each gets exactly its output length, and
    each ending frees the request on its worker: the router records it cancelled, with at
    least its output length and below its max_tokens made, and every block is uncommitted
    after."""
    import asyncio

    from loadtest.policy_replay import _replay
    from loadtest.trace import TraceRequest

    tag = uuid.uuid4().hex[:8]
    trace = [TraceRequest(f"{i}", 0.05 * i, tuple(range(3 + i, 40 + i)), 20 + 7 * i) for i in range(6)]
    results = asyncio.run(_replay(_Started(), cluster.cluster.address, trace, f"eos-{tag}", 30.0, 4.0))
    assert [(r.outcome, len(r.token_times)) for r in results] == [("ok", t.output_len) for t in trace]
    for r, t in zip(results, trace):
        info = wait_for(lambda: request_info(cluster.stub, r.request_id), lambda i: i.status != pb.REQUEST_STATUS_RUNNING,
                        what=f"{r.request_id} to end")
        assert info.status == pb.REQUEST_STATUS_CANCELLED
        assert t.output_len <= len(info.output_token_ids) < 4 * t.output_len
    status = wait_idle(cluster.stub)
    assert [(w.worker_id, w.uncommitted_blocks) for w in status.workers] == [("w0", 64), ("w1", 32)]
