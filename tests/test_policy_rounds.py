"""The policy benchmark in rounds (`--repeats`): pooling, judging and the report, on
hand-made runs; and the bench's loop over rounds with its measurement replaced (the
cluster side is a benchmark, run by hand)."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import loadtest.bench_policies as bench
from loadtest.policy_replay import SLO, KVSample, MeasuredRun, RequestResult, summarize_run
from loadtest.policy_rounds import judge_pooled, pool_rounds, rounds_markdown
from loadtest.report import Slo

CPU = {"router": 0.3, "clients": 0.2, "workers": 1.2, "redis": 0.05, "ray daemons": 0.05, "other processes": 0.1}


def _run(policy: str, fraction: float, ttfts: list[float], preemptions: int = 0, num_long: int = 0) -> dict[str, Any]:
    """One summarized run: a request per TTFT (the last num_long of them long), 8 tokens 50 ms
    apart; preemptions counted on w0."""
    results = [RequestResult(f"{policy}-{fraction}-{i}", i >= len(ttfts) - num_long, 8, i * 0.5, i * 0.5,
                             [i * 0.5 + ttft + k * 0.05 for k in range(8)], "w0", "ok") for i, ttft in enumerate(ttfts)]
    samples = [KVSample(0.0, "w0", 50, 100, 0, 0, 1, 0, -1, 0.0),
               KVSample(1.0, "w0", 50, 100, 0, preemptions, 1, 0, -1, 1.0)]
    run = summarize_run(MeasuredRun(policy, 10.0 * fraction, results, (0.0, 20.0), samples, [], CPU))
    return {**run, "fraction": fraction}


def test_rounds_pool_their_requests_and_sum_their_preemptions() -> None:
    round1 = [_run("kv", 1.0, [0.1, 0.2, 0.3, 0.4, 3.0], 1, num_long=1),
              _run("round-robin", 1.0, [0.5, 0.6, 4.0, 5.0, 6.0], 4)]
    round2 = [_run("kv", 1.0, [0.1, 0.1, 0.2, 0.2, 0.3], 0, num_long=2),
              _run("round-robin", 1.0, [0.5, 0.5, 0.6, 0.7, 0.8], 2),
              _run("kv", 0.5, [0.1], 0)]  # measured in one round only: not pooled
    pooled = pool_rounds([round1, round2], SLO)
    assert [(r["policy"], r["fraction"]) for r in pooled] == [("kv", 1.0), ("round-robin", 1.0)]
    kv, rr = pooled
    both = [0.1, 0.2, 0.3, 0.4, 3.0, 0.1, 0.1, 0.2, 0.2, 0.3]
    assert kv["ttft_p99"] == pytest.approx(float(np.percentile(both, 99)))
    assert kv["ttft_p50"] == pytest.approx(float(np.percentile(both, 50)))
    assert kv["num_requests"] == 10 and kv["num_ok"] == 10 and kv["num_rounds"] == 2
    # The long ones (round 1's last, round 2's last two) and the short ones, pooled apart.
    assert kv["ttft_p99_by_kind"]["long"] == pytest.approx(float(np.percentile([3.0, 0.2, 0.3], 99)))
    assert kv["ttft_p99_by_kind"]["short"] == pytest.approx(float(np.percentile([0.1, 0.2, 0.3, 0.4, 0.1, 0.1, 0.2], 99)))
    assert math.isnan(rr["ttft_p99_by_kind"]["long"])  # none was long
    assert kv["num_preemptions"] == 1 and kv["preemptions"] == [1, 0]
    assert rr["num_preemptions"] == 6 and rr["preemptions"] == [4, 2]
    # Each round's own p99, as its report gives it.
    assert kv["ttft_p99s"] == [round1[0]["summary"]["ttft_p99"], round2[0]["summary"]["ttft_p99"]]
    assert kv["sustained_rounds"] == [False, True]  # round 1's 3 s TTFT misses the 2 s bound
    assert not kv["sustained"]  # 9 of 10 pooled is under 99%


def test_a_pooled_run_is_judged_by_the_slo_over_every_round_s_requests() -> None:
    # At 80%: round 1 has 3 of 5 in time (not sustained), round 2 all 5: pooled, 8 of 10 is 80%.
    slo = Slo(ttft_s=2.0, mean_itl_s=0.2, percentile=80.0)
    rounds = [[_run("kv", 1.0, [0.1, 0.1, 0.1, 3.0, 3.0])], [_run("kv", 1.0, [0.1] * 5)]]
    (pooled,) = pool_rounds(rounds, slo)
    assert pooled["sustained"]
    (missed,) = pool_rounds([rounds[0], [_run("kv", 1.0, [0.1] * 4 + [3.0])]], slo)  # 7 of 10
    assert not missed["sustained"]


def test_the_targets_are_judged_on_the_pooled_runs_with_each_round_s_ratio_beside() -> None:
    rounds = []
    for kv_tail, rr_tail, kv_pre, rr_pre in ((0.5, 1.5, 0, 3), (0.4, 1.2, 1, 4), (0.5, 0.6, 0, 0)):
        rounds.append([
            _run("kv", 0.7, [0.1] * 4, 0), _run("round-robin", 0.7, [0.2] * 4, 1),
            _run("kv", 1.0, [0.2, 0.2, 0.3, kv_tail], kv_pre),
            _run("round-robin", 1.0, [0.2, 0.3, 0.3, rr_tail], rr_pre),
        ])
    pooled = pool_rounds(rounds, SLO)
    judged = judge_pooled(pooled, 2.0, 5.0)
    assert judged["sustained"] == {"kv": 1.0, "round-robin": 1.0}
    (at,) = judged["judged"]  # both sustain 1.0x, which is also capacity: one entry
    assert at["fraction"] == 1.0 and "both sustain" in at["why"] and "capacity" in at["why"]
    kv_p99 = float(np.percentile([0.2, 0.2, 0.3, 0.5, 0.2, 0.2, 0.3, 0.4, 0.2, 0.2, 0.3, 0.5], 99))
    rr_p99 = float(np.percentile([0.2, 0.3, 0.3, 1.5, 0.2, 0.3, 0.3, 1.2, 0.2, 0.3, 0.3, 0.6], 99))
    t, p = at["ttft_p99"], at["preemptions"]
    assert t["kv"] == pytest.approx(kv_p99) and t["round-robin"] == pytest.approx(rr_p99)
    assert t["ratio"] == pytest.approx(rr_p99 / kv_p99) and t["met"] == (rr_p99 / kv_p99 >= 2.0)
    each = [r["ttft_p99s"] for r in pooled if r["fraction"] == 1.0]
    assert t["rounds"] == pytest.approx([b / a for a, b in zip(*each)])
    assert t["rounds_met"] == sum(r >= 2.0 for r in t["rounds"]) and t["round_median"] == pytest.approx(
        float(np.median(t["rounds"])))
    # Preemptions: 1 against 7 pooled (7x, met); per round inf (0 vs 3), 4x (missed), and 0 vs 0 (not met:
    # round-robin must preempt at all), so 1 of 3 rounds.
    assert (p["kv"], p["round-robin"], p["ratio"], p["met"]) == (1, 7, 7.0, True)
    assert p["rounds"][:2] == [math.inf, 4.0] and math.isnan(p["rounds"][2]) and p["rounds_met"] == 1
    lines = "\n".join(rounds_markdown(pooled, judged, {"requests_per_s": 10.0}, [7, 8, 9], lambda k: f"round-{k}"))
    assert "seeds 7, 8, 9" in lines and "`round-3/results.md`" in lines
    assert "| 1x (10.00 req/s) | the highest fraction both sustain, and capacity | preemptions | 1 | 7 | 7.0x " \
           "| >= 5x | MET | 1/3 | inf, 4.0x, - |" in lines
    assert "- kv: 1x (0.7x 3/3, 1x 3/3)" in lines
    assert "The short requests' pooled p99 TTFT" in lines and "| 1x | 10.00 | 0.50 / - | 1.47 / - |" in lines


def test_judging_without_round_robin_checks_nothing() -> None:
    pooled = pool_rounds([[_run("kv", 1.0, [0.1])], [_run("kv", 1.0, [0.2])]], SLO)
    judged = judge_pooled(pooled, 2.0, 5.0)
    assert judged["judged"] == [] and judged["sustained"] == {"kv": 1.0}
    assert "not both measured" in "\n".join(rounds_markdown(pooled, judged, {"requests_per_s": 1.0}, [1, 2], str))


@pytest.mark.parametrize("argv, message", [
    (["--repeats", "0"], "--repeats must be >= 1, got 0"),
    (["--repeats", "2", "--address", "localhost:1"], "--repeats starts local clusters"),
])
def test_a_bad_repeats_is_refused_before_anything_starts(argv: list[str], message: str,
                                                         capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        bench.main(argv)
    assert exc.value.code == 2 and message in capsys.readouterr().err


@pytest.mark.parametrize("vary_seed", [False, True])
def test_each_round_replays_the_trace_at_round_one_s_capacity(vary_seed: bool, tmp_path: Path,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """The loop over rounds with the cluster side replaced: every round gets the capacity
    round 1 measured, and the same seed (--vary-seed: seed + k - 1); each round's report and
    the pooled one are written."""
    seen: list[tuple[int, Any]] = []

    def measure(config: bench.BenchConfig, client: object, capacity: dict[str, Any] | None = None) -> bench.Measurements:
        seen.append((config.seed, capacity))
        capacity = capacity or {"requests_per_s": 4.0 + config.seed, "source": "closed loop"}
        plan = bench.plan_runs(config, capacity)
        tail = 0.5 if len(seen) == 1 else 3.0  # round 2's kv misses the SLO at 1.0x
        runs = [_run("kv", 1.0, [0.1, 0.2, tail], 0), _run("round-robin", 1.0, [0.2, 0.4, 2.5], 3)]
        return bench.Measurements([{**r, "rate": plan.rates[1.0]} for r in runs], [96, 288], plan)

    class NoClient:
        def close(self) -> None:
            pass

    monkeypatch.setattr(bench, "measure_local", measure)
    monkeypatch.setattr(bench, "ClientProcess", NoClient)
    assert bench.main(["--policies", "kv,round-robin", "--fractions", "1", "--num-requests", "3",
                       "--repeats", "2", "--out", str(tmp_path)] + ["--vary-seed"] * vary_seed) == 0
    seeds = [7, 8] if vary_seed else [7, 7]
    assert [s for s, _ in seen] == seeds
    assert seen[0][1] is None and seen[1][1]["requests_per_s"] == 11.0  # round 1's (with seed 8 it would be 12)
    assert seen[1][1]["source"] == "round 1: closed loop"
    for k in (1, 2):
        assert (tmp_path / f"round-{k}" / "results.md").read_text().startswith("# Placement policies")
        assert (tmp_path / f"round-{k}" / "rates.png").stat().st_size > 0
    result = json.loads((tmp_path / "results.json").read_text())
    assert result["conditions"]["seeds"] == seeds
    kv = next(r for r in result["pooled"] if r["policy"] == "kv")
    assert kv["num_requests"] == 6 and kv["sustained_rounds"] == [True, False] and not kv["sustained"]
    assert [r["dir"] for r in result["rounds"]] == ["round-1", "round-2"]
    markdown = (tmp_path / "results.md").read_text()
    assert "## 2 rounds pooled" in markdown and "11.00 req/s" in markdown
    assert ("seeds 7, 8" if vary_seed else "Every round replays the same trace (seed 7)") in markdown
    assert bench.pooled_markdown(result) == markdown  # results.md can be written again from results.json
    assert (tmp_path / "rounds.png").stat().st_size > 0
