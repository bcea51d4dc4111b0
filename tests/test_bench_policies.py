"""The policy benchmark's arithmetic: run summaries, targets, the simulator side, the report.

The cluster side (loadtest.bench_policies against real workers) is a benchmark, run by
hand; these check what it computes from what it measured, on hand-made measurements.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from loadtest.bench_policies import (
    BenchConfig,
    Plan,
    build_report,
    check_targets,
    plot_all,
    simulate_runs,
    step_overhead,
    write_markdown,
)
from loadtest.policy_rates import (
    JudgedAt,
    closed_loop_capacity,
    highest_sustained,
    judged_fractions,
    parse_fractions,
    rates_at,
)
from loadtest.policy_replay import (
    KVRecorder,
    KVSample,
    MeasuredRun,
    RequestResult,
    preemptions_between,
    step_times,
    summarize_run,
)
from loadtest.metrics import percentile
from loadtest.sim.workload import make_trace

CPU = {"router": 0.3, "clients": 0.2, "workers": 1.2, "redis": 0.05, "ray daemons": 0.05, "other processes": 0.1}


def _sample(at: float, worker_id: str, free: int, committed: int, preemptions: int, total: int = 100,
            steps: int = -1, running: int = 1) -> KVSample:
    return KVSample(at, worker_id, free, total, committed, preemptions, running, 0, steps, 1000.0 + at)


def test_preemptions_count_only_the_growth_inside_the_window() -> None:
    samples = [
        _sample(0.0, "w0", 100, 0, 3),  # before the window: the baseline
        _sample(1.5, "w0", 50, 80, 5),
        _sample(2.5, "w0", 40, 90, 9),
        _sample(9.0, "w0", 100, 0, 12),  # after the window
        _sample(1.2, "w1", 90, 10, 0),  # first seen inside the window: its own baseline
        _sample(2.0, "w1", 80, 20, 1),
    ]
    assert preemptions_between(samples, 1.0, 3.0) == {"w0": 6, "w1": 1}


def test_step_times_take_one_step_apart_reports_of_a_busy_worker() -> None:
    samples = [
        _sample(0.00, "w0", 90, 10, 0, steps=10, running=0),  # idle before: the next gap is a wait, not a step
        _sample(0.50, "w0", 90, 10, 0, steps=11),
        _sample(0.52, "w0", 90, 10, 0, steps=12),
        _sample(0.60, "w0", 90, 10, 0, steps=14),  # two steps in one merged batch: no single-step gap
        _sample(0.63, "w0", 90, 10, 0, steps=15),
        _sample(0.10, "w1", 90, 10, 0, steps=3),
        _sample(0.14, "w1", 90, 10, 0, steps=4),
        _sample(0.50, "w1", 90, 10, 0),  # from ClusterStatus: no step count, skipped
    ]
    times = step_times(samples)
    assert times.num_steps == 5 + 1
    assert times.busy_intervals == pytest.approx([0.02, 0.03, 0.04])


def _result(request_id: str, arrival: float, ttft: float, itl: float, n: int, worker: str, is_long: bool = False,
            outcome: str = "ok") -> RequestResult:
    times = [arrival + ttft + i * itl for i in range(n)] if outcome == "ok" else []
    return RequestResult(request_id, is_long, n, arrival, arrival, times, worker, outcome)


def test_a_run_summary_counts_outcomes_goodput_placement_and_over_commitment() -> None:
    results = [
        _result("a", 0.0, 0.5, 0.05, 11, "w0"),  # meets the SLO
        _result("b", 1.0, 3.0, 0.05, 11, "w1", is_long=True),  # first token too late
        _result("c", 2.0, 0.5, 0.5, 3, "w1"),  # too slow per token
        _result("d", 3.0, 0.0, 0.0, 4, "", outcome="RESOURCE_EXHAUSTED"),
        _result("e", 3.5, 0.0, 0.0, 4, "w0", outcome="incomplete"),
    ]
    samples = [_sample(0.5, "w0", 60, 150, 0), _sample(1.0, "w1", 80, 40, 2), _sample(4.0, "w1", 10, 90, 7)]
    placed_at = {"a": 0.2, "b": 2.5, "c": 2.1, "e": 3.6}  # d was refused: never placed
    shares = {"a": 0.5, "b": 0.125, "c": 1.0, "e": 0.25, "elsewhere": 0.01}  # another run's request: not counted
    run = summarize_run(MeasuredRun("round-robin", 2.0, results, (0.0, 4.5), samples, [(3.0, "queue_full")], CPU,
                                    placed_at=placed_at, committed_share=shares))
    assert run["committed_share"] == pytest.approx({"p50": percentile([0.5, 0.125, 1.0, 0.25], 50),
                                                    "min": 0.125, "max": 1.0, "n": 4})
    assert run["num_ok"] == 3 and run["num_rejected"] == 1 and run["num_incomplete"] == 1 and run["num_failed"] == 0
    assert run["rejections_by_reason"] == {"queue_full": 1}
    assert run["goodput_fraction"] == pytest.approx(1 / 5)
    assert run["summary"]["makespan"] == pytest.approx(4.5)  # first arrival to b's last token (1 + 3 + 10 x 0.05)
    assert run["goodput_rps"] == pytest.approx(1 / 4.5)
    assert run["ttfts"] == pytest.approx([0.5, 3.0, 0.5])
    # b, the long one, is the tail; a and c the short ones (the rejected and unfinished are not counted).
    # The router's part of each TTFT: b waited 1.5 s of its 3 s for a placement, a 0.2 s and c 0.1 s.
    assert run["ttft_by_kind"]["long"] == pytest.approx({"n": 1, "p50": 3.0, "p99": 3.0, "wait_p50": 1.5,
                                                         "wait_p99": 1.5})
    assert run["ttft_by_kind"]["short"] == pytest.approx({"n": 2, "p50": 0.5, "p99": 0.5, "wait_p50": 0.15,
                                                          "wait_p99": percentile([0.2, 0.1], 99)})
    # Without every placement known (a cluster in another process), no wait is claimed.
    partial = summarize_run(MeasuredRun("kv", 2.0, results, (0.0, 4.5), samples, [], CPU, placed_at={"a": 0.2}))
    assert all("wait_p50" not in kind for kind in partial["ttft_by_kind"].values())
    assert partial["committed_share"] is None
    assert run["num_preemptions"] == 5 and run["preemptions_per_worker"] == {"w0": 0, "w1": 5}
    assert run["peak_commit_ratio"] == {"w0": 1.5, "w1": 0.9}
    assert run["placed"] == {"w0": {"requests": 2, "long": 0}, "w1": {"requests": 2, "long": 1}}
    assert run["kv"]["w0"]["committed"] == [1.5] and run["kv"]["w0"]["used"] == [0.4]
    assert not run["sustained"]  # a rejection and an unfinished request: not sustained, whatever the rest


def test_the_recorder_keeps_each_request_s_first_placement_and_what_it_committed() -> None:
    from router.tracker import RequestTracker
    from workers.engine.sampling import SamplingParams

    recorder = KVRecorder()
    some = RequestTracker("some", (1, 2, 3), SamplingParams(max_tokens=400), 26, reserve_tokens=30)
    every = RequestTracker("every", (1, 2, 3), SamplingParams(max_tokens=400), 26, reserve_tokens=None)
    recorder("placed", (some, None))
    recorder("placed", (every, None))
    first = recorder.placed_at["some"]
    some.reserve_tokens = 200  # moved, after a worker died: the first placement is what counts
    recorder("placed", (some, None))
    assert recorder.committed_share == {"some": 30 / 400, "every": 1.0}
    assert recorder.placed_at["some"] == first


def test_a_run_whose_requests_failed_says_what_the_first_was_told(capsys: pytest.CaptureFixture[str]) -> None:
    from loadtest.bench_policies import _log_run

    bad_id = RequestResult("kv+backfill-1-0", False, 4, 0.0, 0.0, [], "", "INVALID_ARGUMENT",
                           "request_id: must match [A-Za-z0-9._:-]{1,128}")
    results = [_result("a", 0.0, 0.5, 0.05, 4, "w0"), bad_id,
               RequestResult("late", False, 4, 1.0, 1.0, [], "", "UNAVAILABLE", "router gone")]
    run = {**summarize_run(MeasuredRun("kv", 2.0, results, (0.0, 2.0), [], [], CPU)), "fraction": 1.0}
    assert run["num_failed"] == 2
    assert run["first_failure"] == "INVALID_ARGUMENT: request_id: must match [A-Za-z0-9._:-]{1,128}"
    _log_run(run, (0.0, 2.0))
    assert "2 failed, not sustained, 2 s; the first failure: INVALID_ARGUMENT: request_id" in capsys.readouterr().err
    clean = summarize_run(MeasuredRun("kv", 2.0, results[:1], (0.0, 2.0), [], [], CPU))
    assert clean["first_failure"] == ""


def test_a_run_is_sustained_when_every_request_finished_and_99_percent_met_the_slo() -> None:
    fast = [_result(f"r{i}", i * 0.1, 0.5, 0.05, 5, "w0") for i in range(99)]
    late = _result("late", 10.0, 2.5, 0.05, 5, "w1")  # TTFT over 2 s
    one_late = summarize_run(MeasuredRun("kv", 1.0, [*fast, late], (0.0, 13.0), [], [], CPU))
    assert one_late["sustained"]  # 99 of 100 met it
    two_late = [*fast[:98], late, _result("slow", 11.0, 0.5, 0.3, 5, "w1")]  # 98 of 100
    assert not summarize_run(MeasuredRun("kv", 1.0, two_late, (0.0, 13.0), [], [], CPU))["sustained"]


def test_capacity_counts_finishes_only_while_the_closed_loop_is_full() -> None:
    # 20 finishes, 4 in flight: the first cohort's 4 finishes come close together, and after
    # the 16th (index 16) fewer than 4 requests are left; one finish a second between them.
    finishes = [0.0, 0.1, 0.2, 0.3, *[float(t) for t in range(1, 13)], 12.5, 12.6, 12.7, 12.8]
    capacity = closed_loop_capacity(list(reversed(finishes)), concurrency=4)
    assert capacity is not None
    assert capacity.num_counted == 16 - 4 and capacity.window_s == pytest.approx(12.5 - 1.0)
    assert capacity.requests_per_s == pytest.approx(12 / 11.5)
    assert closed_loop_capacity([1.0, 2.0, 3.0, 4.0], concurrency=2) is None  # no finish while full
    with pytest.raises(ValueError, match="concurrency"):
        closed_loop_capacity(finishes, concurrency=0)


def test_rates_are_fractions_of_the_capacity_and_bad_fractions_are_named() -> None:
    assert rates_at(4.0, (1.2, 0.5, 1.0)) == {0.5: 2.0, 1.0: 4.0, 1.2: pytest.approx(4.8)}
    assert list(rates_at(4.0, (1.2, 0.5))) == [0.5, 1.2]
    assert parse_fractions("1, 0.5,0.85") == (0.5, 0.85, 1.0)
    with pytest.raises(ValueError, match="'x'"):
        parse_fractions("0.5,x")
    with pytest.raises(ValueError, match="repeat"):
        parse_fractions("0.5,0.5")
    with pytest.raises(ValueError, match="capacity_rps"):
        rates_at(0.0, (1.0,))
    with pytest.raises(ValueError, match="BenchConfig.fractions"):
        BenchConfig(policies=("kv",), fractions=(-1.0,), num_requests=5, worker_kv_cache_memory=(2**20,))
    with pytest.raises(ValueError, match="capacity_requests"):
        BenchConfig(policies=("kv",), fractions=(1.0,), num_requests=5, worker_kv_cache_memory=(2**20,),
                    capacity_requests=60, capacity_concurrency=32)


def test_the_highest_sustained_fraction_stops_at_the_first_miss() -> None:
    assert highest_sustained({0.5: True, 0.7: True, 0.85: False, 1.0: True}) == 0.7  # 1.0's pass is noise
    assert highest_sustained({1.0: True, 0.5: True}) == 1.0
    assert highest_sustained({0.5: False, 0.7: True}) is None


def test_targets_are_judged_where_both_sustain_and_at_capacity() -> None:
    fractions = (0.5, 0.7, 0.85, 1.0, 1.2)
    assert judged_fractions(1.0, 0.7, fractions) == [
        JudgedAt(0.7, "the highest fraction both sustain"), JudgedAt(1.0, "capacity")]
    both = judged_fractions(1.2, 1.0, fractions)
    assert [j.fraction for j in both] == [1.0] and "both sustain" in both[0].why and "capacity" in both[0].why
    none = judged_fractions(0.85, None, fractions)
    assert none[0] == JudgedAt(0.5, "the lowest fraction measured (round-robin sustained none)")
    assert judged_fractions(None, None, (0.5, 0.9, 1.2))[1] == JudgedAt(0.9, "the fraction nearest capacity")


def _row(policy: str, fraction: float, ttft_p99: float, preemptions: int, sustained: bool) -> dict[str, object]:
    summary = {"ttft_p50": ttft_p99 / 4, "ttft_p99": ttft_p99, "output_tokens_per_s": 100.0}
    return {"policy": policy, "fraction": fraction, "rate": 4.0 * fraction, "summary": summary,
            "num_preemptions": preemptions, "sustained": sustained}


def test_targets_compare_kv_with_round_robin_at_the_judged_fractions_and_sim_with_real() -> None:
    runs = [_row("kv", 0.5, 0.5, 0, True), _row("round-robin", 0.5, 0.9, 0, True),
            _row("kv", 1.0, 1.0, 0, True), _row("round-robin", 1.0, 2.5, 6, False),
            _row("kv", 1.5, 9.0, 3, False), _row("round-robin", 1.5, 5.0, 9, False)]  # 1.5x is not judged
    sim = [_row("kv", 1.0, 1.2, 0, True), _row("round-robin", 1.0, 5.0, 6, False)]
    targets = check_targets(runs, sim)
    assert targets["sustained"]["kv"]["fraction"] == 1.0 and targets["sustained"]["kv"]["rate"] == 4.0
    assert targets["sustained"]["round-robin"]["fraction"] == 0.5
    low, top = targets["judged"]
    assert (low["fraction"], top["fraction"]) == (0.5, 1.0)
    assert low["ttft_p99"]["ratio"] == pytest.approx(1.8) and not low["ttft_p99"]["met"]
    assert not low["preemptions"]["met"]  # neither preempts: not separated
    assert top["ttft_p99"]["ratio"] == pytest.approx(2.5) and top["ttft_p99"]["met"]
    assert top["preemptions"]["ratio"] == math.inf and top["preemptions"]["met"]
    kv, rr = targets["sim_agreement"]
    assert kv["ttft_p99"]["diff"] == pytest.approx(0.2) and kv["within_target"]
    assert rr["ttft_p99"]["diff"] == pytest.approx(1.0) and not rr["within_target"]


def test_the_simulator_side_replays_the_same_trace_on_the_same_pools() -> None:
    config = BenchConfig(policies=("kv", "round-robin"), fractions=(1.0,), num_requests=60,
                         worker_kv_cache_memory=(12 * 2**20, 36 * 2**20))
    traces = {8.0: make_trace("mixed", 60, 8.0, seed=7)}
    sim = {s["policy"]: s for s in simulate_runs(config, traces, [96, 288], ["kv", "round-robin"])}
    assert sim["kv"]["num_preemptions"] == 0 and sim["kv"]["peak_commit_ratio"] <= 1.0
    for s in sim.values():
        assert s["num_ok"] + s["num_rejected"] == 60
        assert s["summary"]["ttft_p99"] >= s["summary"]["ttft_p50"] > 0


def test_a_policy_entry_ending_in_backfill_runs_with_that_queue_order() -> None:
    from loadtest.bench_policies import _own_ratios, _router_config

    config = BenchConfig(policies=("kv", "kv+backfill", "kv@0.5-0.1+backfill"), fractions=(1.0,), num_requests=5,
                         worker_kv_cache_memory=(12 * 2**20, 36 * 2**20))
    routers = [_router_config(config, p) for p in config.policies]
    assert [(r.policy, r.queue_order, r.kv_reserve_floor) for r in routers] == [
        ("kv", "fifo", None), ("kv", "backfill", None), ("kv", "backfill", 0.1)]
    assert _own_ratios(config.policies) == [" (kv+backfill: --queue-order backfill)", " (kv@0.5-0.1+backfill: 0.5, "
                                            "down to 0.1)", " (kv@0.5-0.1+backfill: --queue-order backfill)"]
    with pytest.raises(ValueError, match="'kv\\+fifo'"):
        BenchConfig(policies=("kv+fifo",), fractions=(1.0,), num_requests=5, worker_kv_cache_memory=(12 * 2**20,))
    # The simulator backfills too: at twice what the pools serve, short requests pass a long
    # head in kv+backfill and never in kv, and every request still gets its tokens.
    traces = {20.0: make_trace("mixed", 60, 20.0, seed=7)}
    kv, backfill = simulate_runs(config, traces, [96, 288], ["kv", "kv+backfill"])
    assert kv["num_backfilled"] == 0 and backfill["num_backfilled"] > 0
    assert kv["num_ok"] == backfill["num_ok"] == 60


def test_a_policy_entry_may_carry_its_own_reserve_ratio() -> None:
    """--policies kv@1,kv@0.5: two ratios side by side in one run, each entry's routers
    (real and simulated) committing at its own ratio, the others at the bench's."""
    from loadtest.bench_policies import _router_config, id_prefix, split_policy
    from router.validation import validate_request_id

    config = BenchConfig(policies=("kv@1", "kv@0.5", "kv@0.5-0.1", "kv", "round-robin"), fractions=(1.0,),
                         num_requests=60, worker_kv_cache_memory=(12 * 2**20, 36 * 2**20), kv_reserve_ratio=0.9)
    assert split_policy("kv@0.5") == ("kv", 0.5, None) and split_policy("round-robin") == ("round-robin", None, None)
    assert split_policy("kv@0.5-0.1") == ("kv", 0.5, 0.1)
    assert [(c.policy, c.kv_reserve_ratio, c.kv_reserve_floor)
            for c in (_router_config(config, p) for p in config.policies)] \
        == [("kv", 1.0, None), ("kv", 0.5, None), ("kv", 0.5, 0.1), ("kv", 0.9, None), ("round-robin", 0.9, None)]
    for bad, named in (("kv@0", "'kv@0'"), ("kv@1.5", "'kv@1.5'"), ("kv@x", "'kv@x'"), ("nope@0.5", "nope@0.5"),
                       ("kv@0.5-0.7", "kv_reserve_floor"), ("kv@0.5-x", "'0.5-x'")):
        with pytest.raises(ValueError, match=named):
            BenchConfig(policies=(bad,), fractions=(1.0,), num_requests=5, worker_kv_cache_memory=(2**20,))
    with pytest.raises(ValueError, match="kv_reserve_ratio"):
        BenchConfig(policies=("kv",), fractions=(1.0,), num_requests=5, worker_kv_cache_memory=(2**20,),
                    kv_reserve_ratio=3.0)

    # Its runs' request ids are ids the router takes.
    assert validate_request_id(f"{id_prefix('kv@0.5', 0.85)}-17") == "kv:0.5-0.85-17"
    assert validate_request_id(f"{id_prefix('kv@0.5-0.1', 0.85)}-17") == "kv:0.5-0.1-0.85-17"
    assert validate_request_id(f"{id_prefix('kv@0.5-0.1+backfill', 1)}-17") == "kv:0.5-0.1.backfill-1-17"

    # Past the pools' capacity (20 req/s) kv@1 never commits a pool past its size at
    # max_tokens; kv@0.5 commits half of each request's output and so admits past it
    # (the simulator is deterministic: 1.00 against 1.02 on this trace).
    traces = {20.0: make_trace("mixed", 60, 20.0, seed=7)}
    sim = {s["policy"]: s for s in simulate_runs(config, traces, [96, 288], ["kv@1", "kv@0.5"])}
    assert set(sim) == {"kv@1", "kv@0.5"}
    assert sim["kv@1"]["num_preemptions"] == 0 and sim["kv@1"]["peak_commit_ratio"] <= 1.0
    assert sim["kv@0.5"]["peak_commit_ratio"] > 1.0
    assert sim["kv@0.5"]["num_ok"] == sim["kv@1"]["num_ok"] == 60


def test_the_report_renders_its_tables_and_plots(tmp_path: Path) -> None:
    config = BenchConfig(policies=("kv", "round-robin"), fractions=(1.0,), num_requests=5,
                         worker_kv_cache_memory=(12 * 2**20, 36 * 2**20))
    runs = []
    for policy, ttft in (("kv", 0.5), ("round-robin", 2.5)):  # round-robin misses the 2 s TTFT bound
        results = [_result(f"{policy}-{i}", i * 0.5, ttft, 0.05, 8, f"w{i % 2}") for i in range(5)]
        samples = [_sample(t * 0.01, f"w{t % 2}", 50, 40 + 10 * t, t, steps=t // 2) for t in range(8)]
        placed_at = {r.request_id: r.arrival_at + 0.1 for r in results}
        shares = {r.request_id: 0.5 if policy == "kv" else 1.0 for r in results}
        run = summarize_run(MeasuredRun(policy, 2.0, results, (0.0, 4.0), samples, [], CPU, replay_s=5.0,
                                        placed_at=placed_at, committed_share=shares))
        runs.append({**run, "fraction": 1.0})
    assert runs[0]["num_steps"] == 6 and runs[0]["step_ms_p50"] == pytest.approx(20.0)
    assert runs[0]["worker_cpu_ms_per_step"] == pytest.approx(1.2 * 5.0 / 6 * 1e3)
    traces = {2.0: make_trace("mixed", 5, 2.0, seed=7)}
    sim = simulate_runs(config, traces, [100, 100], ["kv", "round-robin"])
    overhead_s = step_overhead(runs, sim)
    expected = 20.0 - percentile([s["step_ms_p50"] for s in sim], 50)  # the median of the two runs' gaps
    assert overhead_s * 1e3 == pytest.approx(expected)
    scaled = simulate_runs(config, traces, [100, 100], ["kv", "round-robin"], step_overhead_s=overhead_s)
    assert scaled[0]["step_ms_p50"] > sim[0]["step_ms_p50"]
    plan = Plan({"requests_per_s": 2.0, "source": "given (--capacity)"}, {1.0: 2.0}, traces)
    report = build_report(config, plan, [100, 100], runs, sim, scaled, wall_s=1.0)
    markdown = write_markdown(report)
    assert "| kv | 1 | 2.00 | 5/5 |" in markdown and "| round-robin | 1 | 2.00 | 5/5 |" in markdown
    assert "| kv | 1x | 2.00 | yes |" in markdown and "| round-robin | none | - | no |" in markdown
    assert "| 1x | 2.00 | 0.50 / 12 | 2.50 / 12 |" in markdown
    assert "| 1x (2.00 req/s) | the highest fraction both sustain" not in markdown  # round-robin sustains none
    assert "the lowest fraction measured (round-robin sustained none), and capacity" in markdown
    assert "## Simulator vs real" in markdown
    # TTFT of long and short apart, with the router's wait in each
    assert "| kv | 1 | 2.00 | 0 | - / - | - / - | 5 | 0.50 / 0.50 | 0.10 / 0.10 |" in markdown
    # What each run's placements committed of max_tokens.
    assert "| kv | 1 | 2.00 | 5 | 0.500 | 0.500 | 0.500 |" in markdown
    assert "| round-robin | 1 | 2.00 | 5 | 1.000 | 1.000 | 1.000 |" in markdown
    # results.md can be written again from results.json: the same text after a JSON round trip.
    assert write_markdown(json.loads(json.dumps(report))) == markdown
    assert "With every simulated step charged" in markdown
    plot_all(report, tmp_path)
    assert all((tmp_path / name).stat().st_size > 0 for name in ("latency.png", "rates.png", "kv.png"))
