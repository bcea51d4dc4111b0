"""The cluster simulator: real engines and real placement in virtual time (loadtest/sim)."""

from __future__ import annotations

from collections.abc import Mapping

import pytest

from loadtest.sim.cost_model import FEATURES, StepShape, fit_least_squares, load_cost_model, shape_of
from loadtest.sim.routing import Placement, SimRouter, Waiting
from loadtest.sim.simulator import ClusterConfig, SimResult, _Simulation, simulate
from loadtest.sim.worker import PricedRunner, SimWorker
from loadtest.sim.workload import make_trace, worker_blocks
from loadtest.trace import TraceRequest, poisson_trace
from router.core import RouterConfig
from workers.engine.config import SchedulerConfig
from workers.engine.plan import SampledToken, StepPlan
from workers.engine.sampling import SamplingParams
from workers.messages import AddRequest, StepBatch

COST = load_cost_model()


def test_cost_model_loads_and_prices_steps() -> None:
    assert len(COST.coefficients) == len(FEATURES)
    assert all(c >= 0 for c in COST.coefficients)
    assert COST.r2 > 0.9
    assert COST.facts.block_size == 16 and COST.facts.num_threads == 1
    decode_1 = COST.step_seconds(StepShape(0, 0, 0, 1, 64))
    decode_32 = COST.step_seconds(StepShape(0, 0, 0, 32, 32 * 64))
    prefill = COST.step_seconds(StepShape(512, 1, 512 * 512, 0, 0))
    assert 0 < decode_1 < decode_32 < prefill


def test_fit_recovers_known_coefficients() -> None:
    truth = (2e-3, 1e-4, 5e-4, 1e-7, 2e-4, 1e-9)
    shapes = [
        StepShape(p, c, p * (p + 7), d, d * (40 + d))
        for p, c in ((0, 0), (16, 1), (64, 1), (256, 2), (1024, 1))
        for d in (0, 1, 4, 16, 64)
        if p or d
    ]
    seconds = [sum(t * f for t, f in zip(truth, s.features())) for s in shapes]
    fit = fit_least_squares(shapes, seconds)
    assert fit.r2 > 0.999999
    for got, want in zip(fit.coefficients, truth):
        assert got == pytest.approx(want, rel=1e-6)


def _run(trace: list[TraceRequest], blocks: tuple[int, ...], policy: str) -> SimResult:
    return simulate(trace, ClusterConfig(blocks, policy), COST)


def test_every_request_gets_exactly_its_tokens() -> None:
    trace = poisson_trace(40, rate=60.0, seed=3)
    result = _run(trace, (256, 256, 256), "kv")
    assert result.num_rejected == 0 and result.num_failed == 0
    assert set(result.timelines) == {r.request_id for r in trace}
    for request in trace:
        times = result.timelines[request.request_id].token_times
        assert len(times) == request.output_len
        assert times == sorted(times)
        assert times[0] > request.arrival_time


def _unequal_mixed() -> tuple[list[TraceRequest], tuple[int, ...]]:
    # 64-, 128-, 320- and 512-block pools; a fifth of the requests hold up to 80 blocks.
    return make_trace("mixed", 120, rate=24.0, seed=7), worker_blocks(4, 256, unequal=True)


def test_kv_never_overcommits_and_never_preempts_where_round_robin_does() -> None:
    trace, blocks = _unequal_mixed()
    kv = _run(trace, blocks, "kv")
    round_robin = _run(trace, blocks, "round-robin")
    assert round_robin.num_preemptions > 0
    assert max(c / b for c, b in zip(round_robin.peak_committed_blocks, blocks)) > 1
    assert kv.num_preemptions == 0
    for peak, total in zip(kv.peak_committed_blocks, blocks):
        assert peak <= total  # committed only grows when a request is added, where the peak is taken
    for sample in kv.kv_committed_blocks:
        assert all(c <= b for c, b in zip(sample, blocks))
    for result in (kv, round_robin):
        done = {r.request_id: len(result.timelines[r.request_id].token_times) for r in trace}
        assert done == {r.request_id: r.output_len for r in trace}


def test_deterministic_given_a_seed() -> None:
    trace, blocks = _unequal_mixed()
    for policy in ("random", "kv", "prefix"):
        first, second = _run(trace, blocks, policy), _run(trace, blocks, policy)
        assert {k: t.token_times for k, t in first.timelines.items()} == {
            k: t.token_times for k, t in second.timelines.items()
        }
        assert first.preemptions_per_worker == second.preemptions_per_worker
        assert first.kv_used_blocks == second.kv_used_blocks


def test_queue_retry_shortcut_is_exact() -> None:
    """Retrying the queue only when the reporting worker could take the head gives the same
    run as the real router's full choose() after every batch."""
    # A rate past what the fitted steps serve, for every policy (checked below): at 60 req/s,
    # with the cost model of 2026-12-05, least-requests never queued.
    trace = make_trace("mixed", 120, rate=100.0, seed=5)
    blocks = worker_blocks(4, 128, unequal=True)
    for policy in ("kv", "least-requests", "round-robin", "prefix"):
        router = RouterConfig(max_queue=16, max_queue_wait_s=0.5, max_outstanding_per_worker=6)
        config = ClusterConfig(blocks, policy, router)
        fast = _Simulation(trace, config, COST)
        full = _Simulation(trace, config, COST)
        full.router._could_take = lambda view, need_blocks, longest_blocks=0: True  # type: ignore[method-assign]
        a, b = fast.run(), full.run()
        assert a.num_batches_while_queued > 0 and a.num_rejected > 0  # the queue was exercised
        assert {k: t.token_times for k, t in a.timelines.items()} == {k: t.token_times for k, t in b.timelines.items()}
        assert (a.num_rejected_queue_full, a.num_rejected_wait) == (b.num_rejected_queue_full, b.num_rejected_wait)


def test_router_queue_is_fifo_bounded_and_expires() -> None:
    scheduler = SchedulerConfig(max_model_len=2048)
    worker = SimWorker("w0", 10, COST, scheduler, report_interval_s=0.1, seed=0)
    router = SimRouter(RouterConfig(max_queue=2, max_queue_wait_s=1.0), [worker.info], "kv")
    assert router.arrive(0.0, "a", 8) == Placement("a", 0)
    assert router.arrive(0.0, "too-large", 11) is None and router.num_rejected_too_large == 1
    assert router.arrive(0.0, "b", 4) == Waiting("b", 4, 1.0)  # 2 blocks left: b waits
    assert router.arrive(0.1, "c", 1) == Waiting("c", 1, 1.1)  # c would fit, but b is ahead
    assert router.arrive(0.2, "d", 1) is None and router.num_rejected_queue_full == 1
    # The worker takes "a" (8 blocks at max_tokens): room for c but not for b, and b is first.
    worker.engine.add_request("a", [1] * 8, SamplingParams(max_tokens=113))
    assert router.on_batch(0.2, 0, StepBatch(worker.report(), (), ("a",))) == []
    assert router.expire("b") and not router.expire("b")
    # "a" ends: the next batch places c, now at the head.
    finished = worker.engine.abort("a")
    assert finished is not None
    assert router.on_batch(0.3, 0, StepBatch(worker.report(), (finished,), ())) == [Placement("c", 0)]
    assert router.num_waiting == 0 and router.views[0].outstanding == {"c"}
    assert (router.num_rejected_wait, router.num_placed) == (1, 2)


class _RecordingRunner:
    def __init__(self, runner: PricedRunner) -> None:
        self.runner = runner
        self.plans: list[StepPlan] = []

    def execute(self, plan: StepPlan) -> Mapping[str, SampledToken]:
        self.plans.append(plan)
        return self.runner.execute(plan)


def test_a_cache_hit_is_priced_for_the_tokens_it_computes_only() -> None:
    scheduler = SchedulerConfig(max_model_len=2048)
    worker = SimWorker("w0", 64, COST, scheduler, report_interval_s=0.1, seed=0)
    prompt = tuple(range(1, 81))  # 5 blocks of 16
    params = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)
    recording = _RecordingRunner(worker.runner)
    worker.engine.runner = recording  # still prices every step through the worker's own runner
    for request_id, extra in (("a", ()), ("b", (7, 8, 9))):
        worker.inbox.append(AddRequest(request_id, prompt + extra, params))
        while (step := worker.start_iteration(0.0)) is not None:
            worker.finish_iteration(0.0, step)
    first_b = next(p for p in recording.plans if p.chunks and p.chunks[0].request_id == "b")
    chunk = first_b.chunks[0]
    assert (chunk.start_position, chunk.num_tokens) == (80, 3)  # 5 cached blocks, 3 tokens computed
    assert shape_of(first_b) == StepShape(3, 1, 3 * 83, 0, 0)
    assert worker.engine.stats().prefix_cache_hit_tokens == 80


def test_prefix_follows_the_shared_prompts_and_its_index_follows_the_caches() -> None:
    # Enough load that prefix spreads the groups over all four workers (checked below): at
    # 20 req/s, with the cost model of 2026-12-05, one worker was never used.
    trace = make_trace("shared-prefix", 160, rate=60.0, seed=7)
    blocks = (256,) * 4
    kv = _run(trace, blocks, "kv")
    config = ClusterConfig(blocks, "prefix")
    simulation = _Simulation(trace, config, COST)
    prefix = simulation.run()
    for result in (kv, prefix):
        assert result.num_rejected == 0 and result.num_failed == 0
        done = {r.request_id: len(result.timelines[r.request_id].token_times) for r in trace}
        assert done == {r.request_id: r.output_len for r in trace}
    assert prefix.prefix_cache_hit_rate > kv.prefix_cache_hit_rate > 0
    assert prefix.num_predicted_hit_blocks > 0 and kv.num_predicted_hit_blocks == 0
    # Every batch has arrived: the router's index is exactly what each engine caches.
    index = simulation.router.prefix_index
    assert index is not None
    for worker in simulation.workers:
        cached = worker.engine.cached_block_hashes()
        assert index.num_blocks(worker.info.worker_id) == len(cached) > 0
        for block_hash in cached:
            assert worker.info.worker_id in index.hits([block_hash], now=1e9)  # stored, not predicted
    index.check_invariants()


def _backfill_run(order: str) -> dict[str, object]:
    """router/core.py's backfill scenario (tests/test_queue_backfill.py) in virtual time: w0
    (64 blocks) has 14 uncommitted, w1 (32) has 12; a long request (30 blocks) fits on neither,
    and w0 is the closer; three shorts (5 blocks each) come behind it. Then w1's request ends
    (the long one still fits nowhere: w1 has room for 22 or 32), then w0's."""
    scheduler = SchedulerConfig(max_model_len=2048)
    workers = [SimWorker(w, blocks, COST, scheduler, report_interval_s=0.1, seed=0)
               for w, blocks in (("w0", 64), ("w1", 32))]
    router = SimRouter(RouterConfig(kv_reserve_ratio=1.0, max_queue=8, max_queue_wait_s=10.0, queue_order=order),
                       [w.info for w in workers], "kv")
    for i, (worker, max_tokens) in enumerate(zip(workers, (785, 305))):  # 16 + max_tokens - 1 tokens: 50, 20 blocks
        worker.engine.add_request(f"big{i}", [1] * 16, SamplingParams(max_tokens=max_tokens))
        assert router.on_batch(0.0, i, StepBatch(worker.report(), (), (f"big{i}",))) == []
    assert [v.headroom_blocks for v in router.views] == [14, 12]
    out: dict[str, object] = {"long": router.arrive(0.1, "long", 30)}
    for name in ("s1", "s2", "s3"):
        out[name] = router.arrive(0.2, name, 5)
    placed = []
    for i, worker in ((1, workers[1]), (0, workers[0])):
        finished = worker.engine.abort(f"big{i}")
        assert finished is not None
        placed.append(router.on_batch(0.3, i, StepBatch(worker.report(), (finished,), ())))
    out["after w1 ends"], out["after w0 ends"] = placed
    out["backfilled"] = router.num_backfilled
    return out


def test_the_simulated_queue_backfills_as_the_router_does() -> None:
    fifo = _backfill_run("fifo")
    assert [fifo[k] for k in ("long", "s1", "s2", "s3")] == [
        Waiting("long", 30, 10.1), Waiting("s1", 5, 10.2), Waiting("s2", 5, 10.2), Waiting("s3", 5, 10.2)]
    # w1 empty holds the long one; the shorts follow it, two of them on w0's 14.
    assert fifo["after w1 ends"] == [Placement("long", 1), Placement("s1", 0), Placement("s2", 0)]
    assert fifo["after w0 ends"] == [Placement("s3", 0)] and fifo["backfilled"] == 0
    backfill = _backfill_run("backfill")
    # w0 is held for the long one: s1 and s2 go to w1 at once, s3 finds no room but w0's and waits.
    assert [backfill[k] for k in ("long", "s1", "s2", "s3")] == [
        Waiting("long", 30, 10.1), Placement("s1", 1), Placement("s2", 1), Waiting("s3", 5, 10.2)]
    # w1's end leaves it 22 (its 10 reserved for s1 and s2): too few for the long one, which keeps
    # w0; s3 is backfilled onto w1 by the drain. Then w0 is the long one's.
    assert backfill["after w1 ends"] == [Placement("s3", 1)]
    assert backfill["after w0 ends"] == [Placement("long", 0)] and backfill["backfilled"] == 3


def test_the_backfill_scan_s_skip_is_exact() -> None:
    """Not trying a request as large as one refused in the same scan gives the same run as
    trying every one (the policy made to look cache-aware, which turns the skip off)."""
    trace = make_trace("mixed", 120, rate=100.0, seed=5)
    blocks = worker_blocks(4, 128, unequal=True)
    for policy in ("kv", "kv-least-loaded", "least-requests", "round-robin"):
        router = RouterConfig(max_queue=64, max_queue_wait_s=0.5, max_outstanding_per_worker=6,
                              queue_order="backfill")
        config = ClusterConfig(blocks, policy, router)
        fast = _Simulation(trace, config, COST)
        full = _Simulation(trace, config, COST)
        full.router.policy.reads_hits = True  # type: ignore[misc]
        calls = {"fast": 0, "full": 0}
        for name, sim in (("fast", fast), ("full", full)):
            def counting(*args: object, _choose=sim.router.policy.choose, _name=name) -> object:  # type: ignore[no-untyped-def]
                calls[_name] += 1
                return _choose(*args)
            sim.router.policy.choose = counting  # type: ignore[method-assign]
        a, b = fast.run(), full.run()
        assert a.num_backfilled > 0 and calls["fast"] < calls["full"], (policy, calls)
        assert {k: t.token_times for k, t in a.timelines.items()} == {k: t.token_times for k, t in b.timelines.items()}
        assert (a.num_backfilled, a.num_rejected) == (b.num_backfilled, b.num_rejected)


def test_a_waiting_request_commits_at_the_ratio_of_the_moment_it_is_tried() -> None:
    """An adaptive ratio (ceiling 0.5, floor 0.1, 10 s decay) that has learned short answers:
    a request of 16 + 800 tokens that arrives at 0 s commits 400 of them (26 blocks) and waits
    on a worker with 20 blocks of headroom. At 2 s the ratio is 0.42 (22 blocks): it still
    waits; at 5 s it is 0.3 (16 blocks), and the batch then places it, committing 16, as the
    router, which takes the ratio at each try, would. At its arrival's ratio it would wait on."""
    scheduler = SchedulerConfig(max_model_len=2048)
    worker = SimWorker("w0", 64, COST, scheduler, report_interval_s=0.1, seed=0)
    config = RouterConfig(kv_reserve_ratio=0.5, kv_reserve_floor=0.1, kv_reserve_decay_s=10.0, max_queue_wait_s=60.0)
    router = SimRouter(config, [worker.info], "kv")
    for _ in range(40):
        router.reserve.ended(1, 10)  # answers end at a tenth of max_tokens: the target is the floor
    worker.engine.add_request("big", [1] * 16, SamplingParams(max_tokens=689))  # 704 tokens: 44 blocks
    assert router.on_batch(0.0, 0, StepBatch(worker.report(), (), ("big",))) == []
    assert router.views[0].headroom_blocks == 20
    waiting = router.arrive(0.0, "late", 26, [1] * 16, longest_blocks=51, max_tokens=800)
    assert waiting == Waiting("late", 26, 60.0, 51, 16, 800)
    assert [router.need_at(waiting, t) for t in (0.0, 2.0, 5.0, 10.0)] == [26, 22, 16, 6]
    assert router.on_batch(2.0, 0, StepBatch(worker.report(), (), ())) == []
    assert router.on_batch(5.0, 0, StepBatch(worker.report(), (), ())) == [Placement("late", 0)]
    assert router.views[0].reservations == {"late": 16}


def test_answers_that_end_before_max_tokens_are_aborted_at_their_length_and_teach_the_ratio() -> None:
    """--max-tokens-factor 4 in the simulator: each request asks for 4x its output_len and its
    client ends it at output_len, as bench-policies' client does. Every client gets exactly
    output_len tokens, the worker stops soon after (an abort, not max_tokens), and an adaptive
    ratio learns from those ends that answers use about a quarter of max_tokens. Without the
    factor, they use all of it and the ratio stays at its ceiling."""
    trace = poisson_trace(40, rate=20.0, seed=3)
    router = RouterConfig(kv_reserve_ratio=1.0, kv_reserve_floor=0.1, kv_reserve_decay_s=1.0)
    runs = {}
    for factor in (1.0, 4.0):
        simulation = _Simulation(trace, ClusterConfig((256, 256, 256), "kv", router, max_tokens_factor=factor), COST)
        result = simulation.run()
        runs[factor] = (result, simulation.router.reserve.at(result.end_time + 60.0), simulation)
    for factor, (result, _, simulation) in runs.items():
        assert result.num_rejected == 0 and result.num_failed == 0, factor
        assert {r.request_id: len(result.timelines[r.request_id].token_times) for r in trace} == {
            r.request_id: r.output_len for r in trace}
        assert not any(w.engine.has_unfinished for w in simulation.workers)
    (plain, plain_ratio, _), (early, early_ratio, _) = runs[1.0], runs[4.0]
    assert plain_ratio == 1.0
    assert 0.25 <= early_ratio < 0.4, early_ratio  # a few tokens past output_len land before the abort
    # Aborted at output_len: a step or two per request more than running to it, not 4x.
    assert plain.num_steps <= early.num_steps < 1.5 * plain.num_steps, (plain.num_steps, early.num_steps)


def test_max_tokens_factor_below_one_is_refused() -> None:
    with pytest.raises(ValueError, match="max_tokens_factor"):
        ClusterConfig((64,), max_tokens_factor=0.5)
