"""The benchmarks' shared tail (loadtest.report): tables, the SLO, and what is written to --out.

The benchmarks themselves run by hand; these check the pieces every one of them uses,
and that the documented outputs in docs/benchmarks/ still come out of the new tables.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest

from loadtest.metrics import RequestTimeline
from loadtest.report import Column, RequestLatency, Slo, Table, figure, printed_to, pyplot, write_json, write_results

DOCS = Path(__file__).resolve().parent.parent / "docs" / "benchmarks"
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


# -- tables ---------------------------------------------------------------------------------------


def test_a_table_aligns_scales_and_marks_what_was_not_measured() -> None:
    table = Table((
        Column("name", 8, align="<"),
        Column("TTFT ms", 9, ".1f", scale=1e3),
        Column("p90", 7, ".2f", unit="s"),
        Column("good", 6, ".0%"),
        Column("note", 0, align="<", gap=2),
    ))
    assert table.header() == "name      TTFT ms    p90  good  note"
    lines = table.lines([("kv", 0.01234, 1.5, 0.75, "ok"), ("rr", None, math.nan, 1.0, "")])
    assert lines == [
        "name      TTFT ms    p90  good  note",
        "-" * 36,
        "kv           12.3  1.50s   75%  ok",
        "rr              -      -  100%",  # None and NaN read "-"; trailing blanks are cut
    ]


def test_a_row_may_stop_early_but_not_run_past_its_columns() -> None:
    table = Table((Column("a", 4), Column("b", 4, "+.1f"), Column("c", 4)), rule=False)
    assert table.lines([(1, -0.25)]) == ["   a   b   c", "   1-0.2"]
    assert table.row(("toolong", 2.0)) == "toolong+2.0"  # a value wider than its column is written whole
    with pytest.raises(ValueError, match="3 columns"):
        table.row((1, 2, 3, 4))


def test_the_same_columns_render_as_markdown() -> None:
    table = Table((Column("policy", 0), Column("req/s", 0, "g"), Column("ITL p50 ms", 0, ".1f", scale=1e3)))
    assert table.markdown([("kv", 2.0, 0.05), ("random", 4.5, None)]) == [
        "| policy | req/s | ITL p50 ms |",
        "|---|---|---|",
        "| kv | 2 | 50.0 |",
        "| random | 4.5 | - |",
    ]
    with pytest.raises(ValueError, match="2 values for 3 columns"):
        table.markdown([("kv", 2.0)])


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [({"width": -1}, "width"), ({"align": "^"}, "align"), ({"spec": ".2q"}, "spec"), ({"scale": 0.0}, "scale"),
     ({"gap": -2}, "gap")],
)
def test_a_bad_column_names_its_field(kwargs: dict[str, Any], field: str) -> None:
    with pytest.raises(ValueError, match=f"Column.{field}"):
        Column("x", **{"width": 4, **kwargs})


def test_a_table_without_columns_is_refused() -> None:
    with pytest.raises(ValueError, match="Table.columns"):
        Table(())


def test_the_prefix_benchmark_table_still_prints_its_documented_lines(tmp_path: Path) -> None:
    """docs/benchmarks/bench_prefix/output.txt (a calibrated run) is what print_table prints
    from the results.json beside it."""
    from loadtest.prefix_report import print_table

    report = json.loads((DOCS / "bench_prefix" / "results.json").read_text())
    documented = (DOCS / "bench_prefix" / "output.txt").read_text().splitlines()
    path = tmp_path / "output.txt"
    with printed_to(path):
        print_table(report)
    printed = path.read_text().splitlines()
    assert printed[1].startswith("cold TTFT (kv, caching off, one request at a time):")
    assert any(line.startswith("config             x cap  req/s  TTFT p50     p90") for line in printed)
    assert [line.rstrip() for line in printed] == [line.rstrip() for line in documented]


def test_a_run_at_fixed_rates_prints_the_table_without_fractions(capsys: pytest.CaptureFixture[str]) -> None:
    """A report from before the calibration (rows without a fraction, no calibration) keeps
    its old layout: no calibration lines, no fraction column."""
    from loadtest.prefix_report import print_table, targets

    rows = [{k: v for k, v in row.items() if k != "fraction"} for row in _fraction_rows()]
    print_table({"oracle_hit_rate": 0.95, "rows": rows, "targets": targets(rows, lambda n: 0.95)})
    lines = capsys.readouterr().out.splitlines()
    assert lines[1].startswith("config              rate  TTFT p50     p90     p99   tok/s  goodput  hit rate")
    assert lines[2].startswith("kv-no-cache          0.3     2.00s   4.00s")
    assert "  prefix vs kv, p90 TTFT" in "\n".join(lines) and " at 0.9 req/s" in "\n".join(lines)


def test_the_engine_table_keeps_the_readme_columns() -> None:
    from loadtest.bench_engine import TABLE

    row = TABLE.row(("batched", 0.0156, 0.0276, 0.00573, 0.0166, 257.0, 1288.4, 32.0))
    assert TABLE.header() == "engine          TTFT p50  TTFT p99  ITL p50  ITL p99   tok/s  sat tok/s  max rate"
    assert row == "batched             15.6      27.6     5.73    16.60     257       1288        32"


# -- the SLO --------------------------------------------------------------------------------------


def _timeline(ttft: float, itl: float, num_tokens: int, arrival: float = 10.0) -> RequestTimeline:
    return RequestTimeline(arrival, [arrival + ttft + i * itl for i in range(num_tokens)])


def test_a_request_meets_the_slo_strictly_under_each_bound() -> None:
    slo = Slo(ttft_s=2.0, mean_itl_s=0.2)
    assert slo.meets(RequestLatency(1.99, 0.19, True))
    assert not slo.meets(RequestLatency(2.0, 0.1, True))  # at the bound is not under it
    assert not slo.meets(RequestLatency(0.5, 0.2, True))
    assert not slo.meets(RequestLatency(0.5, 0.1, False))  # unfinished never meets
    assert slo.meets(RequestLatency(0.5, None, True))  # one token: no gap to judge
    assert Slo(ttft_s=2.0).meets(RequestLatency(0.5, 9.0, True))  # no ITL bound: ITL is not judged


def test_request_latency_from_a_timeline() -> None:
    assert RequestLatency.of(_timeline(0.5, 0.1, 5)) == pytest.approx((0.5, 0.1, True))
    one = RequestLatency.of(_timeline(0.5, 0.1, 1))
    assert one.ttft_s == pytest.approx(0.5) and one.mean_itl_s is None and one.finished
    assert RequestLatency.of(RequestTimeline(3.0, [])) == (math.inf, None, False)
    assert RequestLatency.of(_timeline(0.5, 0.1, 5), finished=False).finished is False


def test_the_policies_slo_judges_every_timeline_as_policy_replay_does() -> None:
    """bench_policies judges its simulated runs with SLO.meets and policy_replay its real runs
    with meets_slo: goodput on both sides of its table must mean the same."""
    from loadtest.bench_policies import SLO
    from loadtest.policy_replay import MEAN_ITL_SLO_S, TTFT_SLO_S, meets_slo

    assert (SLO.ttft_s, SLO.mean_itl_s) == (TTFT_SLO_S, MEAN_ITL_SLO_S)
    cases = [_timeline(ttft, itl, n) for ttft in (0.0, 1.0, 1.999, 2.0, 2.5) for itl in (0.0, 0.1, 0.2, 0.3)
             for n in (1, 2, 10)] + [RequestTimeline(1.0, [])]
    verdicts = [(SLO.meets(RequestLatency.of(t)), meets_slo(t)) for t in cases]
    assert all(a == b for a, b in verdicts)
    assert {a for a, _ in verdicts} == {True, False}


def test_sustained_needs_every_request_finished_and_the_percentile_met() -> None:
    p99 = Slo(ttft_s=1.0, percentile=99)
    good, late = RequestLatency(0.5, None, True), RequestLatency(1.5, None, True)
    assert p99.sustained([good] * 99 + [late])  # 99 of 100 under the bound
    assert not p99.sustained([good] * 98 + [late] * 2)
    assert not p99.sustained([good] * 63 + [late])  # 63 of 64 is 98.4%
    assert not p99.sustained([good] * 100 + [RequestLatency(0.5, None, False)])  # one lost
    assert not p99.sustained([])
    half, slow = Slo(ttft_s=5.0, percentile=50), RequestLatency(6.0, None, True)
    assert half.sustained([good, slow]) and half.sustained([late, slow]) and not half.sustained([good, slow, slow])
    assert half.attainment([good, slow, slow, RequestLatency(math.inf, None, False)]) == 0.25
    assert math.isnan(half.attainment([]))


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [({"ttft_s": 0.0}, "ttft_s"), ({"ttft_s": math.nan}, "ttft_s"), ({"ttft_s": math.inf}, "ttft_s"),
     ({"mean_itl_s": -0.1}, "mean_itl_s"), ({"percentile": 0.0}, "percentile"), ({"percentile": 101}, "percentile")],
)
def test_a_bad_slo_names_its_field(kwargs: dict[str, Any], field: str) -> None:
    with pytest.raises(ValueError, match=f"Slo.{field}"):
        Slo(**{"ttft_s": 1.0, **kwargs})


def test_the_slo_in_words() -> None:
    assert Slo(ttft_s=2.0, mean_itl_s=0.2).describe() == "TTFT < 2 s and mean ITL < 200 ms"
    assert Slo(ttft_s=1.0).describe_sustained() == "p99 TTFT < 1 s"  # the README's "max rate" column


def test_the_engine_sweep_stops_at_the_first_rate_it_does_not_sustain() -> None:
    from argparse import Namespace

    from loadtest import bench_engine

    class SweepOnly:
        """Bench's timelines(): every request of a rate at one TTFT, growing with the rate."""

        args = Namespace(num_requests=4)

        def timelines(self, engine: str, rate: float, num_requests: int) -> list[RequestTimeline]:
            return [_timeline(rate / 8, 0.01, 3, arrival=float(i)) for i in range(num_requests)]

    at_rate: dict[float, Any] = {}
    best = bench_engine.max_sustained_rate(SweepOnly(), "batched", at_rate)  # type: ignore[arg-type]
    assert best == 4.0  # 8 req/s gives TTFT 1 s: not under the bound
    assert sorted(at_rate) == [0.25, 0.5, 1.0, 2.0, 4.0, 8.0]
    assert at_rate[8.0].num_requests == 80  # max(4, 8 req/s x 10 s)


def test_the_prefix_benchmark_counts_goodput_and_saturation_by_its_slo() -> None:
    from loadtest.prefix_report import summarize

    slo = Slo(ttft_s=5.0, percentile=50)
    results = [
        {"group": 0, "sent": 0.0, "ok": True, "ttft": 1.0, "e2e": 1.7, "output_tokens": 8, "prompt_tokens": 100,
         "cached_tokens": 50, "worker": "w0"},
        {"group": 1, "sent": 1.0, "ok": True, "ttft": 6.0, "e2e": 6.7, "output_tokens": 8, "prompt_tokens": 100,
         "cached_tokens": 0, "worker": "w1"},
    ]
    row = summarize("kv", 0.5, results, slo, [0.0, 1.0])
    assert row["goodput"] == 0.5 and row["sustained"] and row["hit_rate"] == 0.25
    lost = results + [{"group": 0, "sent": 2.0, "ok": False, "error": "DEADLINE_EXCEEDED"}]
    row = summarize("kv", 0.5, lost, slo, [0.0, 1.0, 2.0])
    assert row["goodput"] == pytest.approx(1 / 3) and not row["sustained"]


def test_the_prefix_hit_target_pools_every_request_prefix_ran_against_the_oracle_on_the_same_ones() -> None:
    from loadtest.prefix_report import targets

    def row(config: str, rate: float, trace: list[tuple[int, int]], sustained: bool = True) -> dict:
        return {"config": config, "rate": rate, "requests": len(trace), "sustained": sustained, "goodput": 1.0,
                "ttft_p90": 1.0, "hit_rate": 0.0,
                "trace": [{"ok": True, "cached_tokens": c, "prompt_tokens": p} for c, p in trace]}

    rows = [row("prefix", 0.4, [(0, 100), (0, 100), (90, 100)]),  # two cold starts, one hit
            row("prefix", 0.8, [(90, 100)] * 5 + [(0, 100)]),  # an eviction
            row("kv", 0.4, [(0, 100)] * 9)]
    asked: list[int] = []

    def oracle_of(n: int) -> float:
        asked.append(n)
        return 0.8

    target = targets(rows, oracle_of)["prefix hit rate / oracle"]
    assert asked == [9]  # prefix's nine requests, not kv's
    assert target["hit_rate"] == pytest.approx(540 / 900) and target["value"] == pytest.approx(0.6 / 0.8)
    assert not target["met"]


def test_caching_on_against_off_is_judged_per_policy_where_its_own_off_run_saturates() -> None:
    from loadtest.prefix_report import targets

    def row(config: str, rate: float, p90: float, sustained: bool = True) -> dict:
        return {"config": config, "rate": rate, "requests": 1, "sustained": sustained, "goodput": 1.0,
                "ttft_p90": p90, "hit_rate": 0.0, "trace": []}

    rows = [row("kv-no-cache", 0.4, 4.0), row("kv-no-cache", 0.6, 8.0, sustained=False),
            row("kv", 0.4, 3.0), row("kv", 0.6, 4.0),
            row("prefix-no-cache", 0.4, 9.0, sustained=False),  # off saturates earlier here
            row("prefix", 0.4, 0.3), row("prefix", 0.6, 0.2)]
    out = targets(rows, lambda n: 0.9)
    kv, prefix = out["caching on vs off (kv), p90 TTFT"], out["caching on vs off (prefix), p90 TTFT"]
    assert (kv["rate"], kv["value"], kv["met"]) == (0.6, 2.0, False)
    assert (prefix["rate"], prefix["value"], prefix["met"]) == (0.4, pytest.approx(30.0), True)


def test_the_prefix_slo_is_a_multiple_of_the_cold_ttft_unless_one_is_given() -> None:
    from loadtest.bench_prefix import slo_for

    slo = slo_for(None, 1.5, 4.0)
    assert slo.ttft_s == 6.0 and slo.percentile == 50
    assert slo.meets(RequestLatency(4.3, None, True))  # a miss that did not queue
    assert not slo.meets(RequestLatency(8.1, None, True))  # a miss behind another miss
    assert slo.meets(RequestLatency(0.3, None, True))  # a hit
    assert slo_for(None, 1.5, 4.7007618).ttft_s == 7.05  # to 10 ms
    assert slo_for(5.0, 1.5, 4.0).ttft_s == 5.0  # --ttft-slo wins over the measurement
    assert slo_for(5.0, 1.5, None).ttft_s == 5.0  # and needs none
    with pytest.raises(ValueError, match="no cold TTFT"):
        slo_for(None, 1.5, None)
    with pytest.raises(ValueError, match="--slo-factor"):
        slo_for(None, 0.0, 4.0)
    with pytest.raises(ValueError, match="Slo.ttft_s"):
        slo_for(-1.0, 1.5, 4.0)


def test_the_cold_ttft_is_the_median_of_the_cold_requests_that_finished() -> None:
    from loadtest.bench_prefix import cold_ttft

    rows = [{"ok": True, "ttft": 9.0}, {"ok": True, "ttft": 4.0}, {"ok": True, "ttft": 4.2},
            {"ok": False, "ttft": 0.1, "error": "CANCELLED"}]
    assert cold_ttft(rows) == 4.2  # the slow first one does not move it; the lost one is not counted
    with pytest.raises(RuntimeError, match="no cold request finished"):
        cold_ttft([{"ok": False, "error": "DEADLINE_EXCEEDED"}])


def test_the_cold_requests_are_each_the_first_of_its_group() -> None:
    from loadtest.prefix_workload import PrefixRequest, first_of_groups

    workload = [PrefixRequest(g, i, (("user", str(i)),)) for i, g in enumerate([1, 1, 0, 2, 0, 3])]
    assert [(r.group, r.user) for r in first_of_groups(workload, 3)] == [(1, 0), (0, 2), (2, 3)]
    assert len(first_of_groups(workload, 10)) == 4  # no more than there are groups


def test_the_caching_off_capacity_is_read_from_the_closed_loop_while_full() -> None:
    from loadtest.bench_prefix import capacity_of

    # Finishes at 1..8 s (sent + e2e), 2 in flight: counted from the 2nd to the 6th, 4 in 4 s.
    rows = [{"ok": True, "sent": t - 3.0, "e2e": 3.0} for t in range(1, 9)] + [{"ok": False, "sent": 0.0}]
    capacity = capacity_of(rows, 2)
    assert capacity is not None
    assert capacity["requests_per_s"] == pytest.approx(1.0) and capacity["num_counted"] == 4
    assert (capacity["num_requests"], capacity["num_ok"]) == (9, 8)
    assert capacity_of(rows[:4], 2) is None  # never full for a counted finish


def test_the_prefix_rates_are_fractions_of_the_caching_off_capacity_unless_given() -> None:
    from loadtest.bench_prefix import DEFAULT_FRACTIONS, RatePoint, plan_rates

    points = plan_rates(DEFAULT_FRACTIONS, None, 0.6)
    assert [p.fraction for p in points] == [0.5, 1.0, 1.5, 2.0, 2.5, 3.0, 4.0]
    assert [p.rate for p in points] == pytest.approx([0.3, 0.6, 0.9, 1.2, 1.5, 1.8, 2.4])
    assert plan_rates((4.0, 0.5), None, 1.0) == [RatePoint(0.5, 0.5), RatePoint(4.0, 4.0)]  # ascending
    assert plan_rates(DEFAULT_FRACTIONS, [1.5, 0.25], 0.5) == [RatePoint(0.5, 0.25), RatePoint(3.0, 1.5)]
    assert plan_rates(DEFAULT_FRACTIONS, [0.4], None) == [RatePoint(None, 0.4)]  # --rates and no capacity
    with pytest.raises(ValueError, match="neither --rates nor a capacity"):
        plan_rates(DEFAULT_FRACTIONS, None, None)
    with pytest.raises(ValueError, match="--rates must be positive"):
        plan_rates(DEFAULT_FRACTIONS, [0.4, -1.0], None)


def _fraction_rows() -> list[dict[str, Any]]:
    """A run at fractions of a 0.6 req/s capacity: kv-no-cache saturates at 1x, kv misses 2x
    (and passes 3x above the miss), prefix sustains everything."""

    def row(config: str, fraction: float, p90: float, sustained: bool = True, goodput: float = 1.0) -> dict:
        return {"config": config, "fraction": fraction, "rate": 0.6 * fraction, "requests": 4,
                "sustained": sustained, "goodput": goodput, "ttft_p50": p90 / 2, "ttft_p90": p90, "ttft_p99": p90,
                "output_tokens_per_s": 3.0, "hit_rate": 0.5, "per_worker": {"w0": 2, "w1": 2},
                "trace": [{"ok": True, "cached_tokens": 90, "prompt_tokens": 100}] * 4}

    return [row("kv-no-cache", 0.5, 4.0), row("kv-no-cache", 1.0, 9.0, sustained=False),
            row("kv", 0.5, 3.0), row("kv", 1.0, 3.0), row("kv", 1.5, 4.0, goodput=0.8),
            row("kv", 2.0, 9.0, sustained=False, goodput=0.4), row("kv", 3.0, 4.0),
            row("prefix", 0.5, 0.3), row("prefix", 1.0, 0.3), row("prefix", 1.5, 0.4), row("prefix", 2.0, 0.3),
            row("prefix", 3.0, 0.3)]


def test_the_prefix_targets_are_read_at_fractions_of_the_caching_off_capacity() -> None:
    from loadtest.prefix_report import targets

    out = targets(_fraction_rows(), lambda n: 0.95)
    on_off = out["caching on vs off (kv), p90 TTFT"]  # where kv-no-cache saturates: 1x
    assert (on_off["fraction"], on_off["rate"], on_off["value"], on_off["met"]) == (1.0, 0.6, 3.0, True)
    assert "caching on vs off (prefix), p90 TTFT" not in out  # prefix-no-cache did not run
    ttft, goodput = out["prefix vs kv, p90 TTFT"], out["prefix vs kv, goodput"]
    # The highest fraction both sustain is 1.5x: kv's pass at 3x above its miss at 2x does not count.
    assert ttft["fraction"] == goodput["fraction"] == 1.5 and ttft["rate"] == pytest.approx(0.9)
    assert ttft["value"] == pytest.approx(10.0) and ttft["met"]
    assert goodput["value"] == pytest.approx(1.25) and not goodput["met"]
    hit = out["prefix hit rate / oracle"]
    assert hit["value"] == pytest.approx(0.9 / 0.95) and hit["met"]


def test_the_highest_load_each_policy_sustains_counts_only_below_its_first_miss() -> None:
    from loadtest.prefix_report import highest_loads

    rows = _fraction_rows()
    loads = highest_loads(rows)
    # kv's pass at 3x above its miss at 2x does not count; prefix sustained its last load.
    assert loads["kv"] == {"rate": pytest.approx(0.9), "fraction": 1.5, "at_least": False}
    assert loads["prefix"] == {"rate": pytest.approx(1.8), "fraction": 3.0, "at_least": True}
    assert loads["ratio"] == pytest.approx(2.0) and loads["ratio_at_least"]
    # Where prefix misses its 2x, the ratio is exact; where kv sustains none, there is none.
    missed = [dict(r, sustained=False) if (r["config"], r["fraction"]) == ("prefix", 2.0) else r for r in rows]
    assert highest_loads(missed)["ratio"] == pytest.approx(1.0) and not highest_loads(missed)["ratio_at_least"]
    assert highest_loads([dict(r, sustained=False) if r["config"] == "kv" else r for r in rows]) == {}


def test_a_run_at_fractions_prints_its_calibration_and_both_the_fraction_and_the_rate(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from loadtest.prefix_report import plot, print_table, targets

    rows = _fraction_rows()
    capacity = {"requests_per_s": 0.6, "source": "closed loop, kv, caching off, 4 in flight", "num_counted": 8,
                "window_s": 13.3}
    report = {"calibration": {"cold_ttfts_s": [5.1, 4.0, 4.2], "cold_ttft_s": 4.2, "slo_factor": 1.5,
                              "ttft_slo_s": 6.3, "slo_source": "1.5 x the cold TTFT", "capacity": capacity},
              "oracle_hit_rate": 0.95, "rows": rows, "targets": targets(rows, lambda n: 0.95)}
    print_table(report)
    lines = capsys.readouterr().out.splitlines()
    assert lines[1] == "cold TTFT (kv, caching off, one request at a time): 4.20 s, the median of 5.10, 4.00, 4.20 s"
    assert lines[2] == "SLO: TTFT < 6.30 s (1.5 x the cold TTFT), half of the requests"
    assert lines[3].startswith("capacity with caching off: 0.600 req/s (closed loop, kv, caching off, 4 in flight;")
    header = lines.index(next(line for line in lines if line.startswith("config")))
    assert lines[header].startswith("config             x cap  req/s  TTFT p50     p90")
    assert lines[header + 5].startswith("kv                  1.5x   0.90     2.00s   4.00s")
    assert "  prefix vs kv, p90 TTFT            at 1.5x (0.90 req/s)  10.00 (target 3.0) MET" in lines
    assert lines[-1] == ("Highest load sustained (goodput as the most req/s within the SLO; reported, not a target): "
                         "kv 1.5x (0.90 req/s), prefix >= 3x (1.80 req/s): prefix/kv >= 2.00x")
    plot(report, tmp_path / "bench_prefix.png")
    assert (tmp_path / "bench_prefix.png").read_bytes()[:8] == PNG_MAGIC


# -- what is written ------------------------------------------------------------------------------


def test_write_results_writes_json_the_printed_table_and_each_figure(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "bench"
    report = {"rate": 2.0, "out": tmp_path, "rows": [{"ttft": 0.5}], "missing": math.nan}

    def draw(path: Path) -> None:
        with figure(path, 1, 2, title="two panels", figsize=(6, 3)) as (_, axes):
            axes[0].plot([1, 2], [3, 4])
            axes[1].bar(["a"], [1])

    written = write_results(out, report, lambda: print("table line 1\ntable line 2"), {"a.png": draw})
    assert written == [out / "results.json", out / "output.txt", out / "a.png"]
    assert capsys.readouterr().out == "table line 1\ntable line 2\n"  # still printed
    assert (out / "output.txt").read_text() == "table line 1\ntable line 2\n"
    back = json.loads((out / "results.json").read_text())
    assert back["out"] == str(tmp_path) and back["rows"] == [{"ttft": 0.5}] and math.isnan(back["missing"])
    assert (out / "a.png").read_bytes()[:8] == PNG_MAGIC
    assert pyplot().get_fignums() == []  # every figure closed


def test_a_figure_that_fails_saves_nothing_and_is_closed(tmp_path: Path) -> None:
    with pytest.raises(RuntimeError, match="drawing failed"):
        with figure(tmp_path / "broken.png"):
            raise RuntimeError("drawing failed")
    assert not (tmp_path / "broken.png").exists()
    assert pyplot().get_fignums() == []


def test_results_json_refuses_what_it_cannot_hold(tmp_path: Path) -> None:
    with pytest.raises(TypeError, match="cannot hold a set"):
        write_json(tmp_path / "results.json", {"workers": {"w0", "w1"}})


def test_the_policies_benchmark_writes_its_markdown_as_results_md(tmp_path: Path) -> None:
    """bench_policies passes text_name: the Markdown it prints is its results.md."""
    written = write_results(tmp_path, {"runs": []}, lambda: print("# title\n\n| a |", end=""), {}, "results.md")
    assert [p.name for p in written] == ["results.json", "results.md"]
    assert (tmp_path / "results.md").read_text() == "# title\n\n| a |"


def test_percentiles_are_numpys_and_an_unfinished_request_makes_them_infinite() -> None:
    from loadtest.metrics import percentile

    assert percentile([4.0, 1.0, 3.0, 2.0], 50) == 2.5 and percentile([1.0, 2.0], 90) == pytest.approx(1.9)
    assert percentile([0.5, math.inf], 99) == math.inf and percentile([math.inf], 50) == math.inf
    assert percentile([0.5, 0.7, math.inf], 50) == 0.7
    assert math.isnan(percentile([], 50))


def test_the_grpc_floor_streams_every_message_and_prices_it_in_cpu() -> None:
    """bench-router's floor line: a bare grpc.aio server's CPU per message, positive and
    finite (floor_us raises unless its client, in another process, read every message)."""
    from loadtest.grpc_floor import floor_us

    us = floor_us(num_streams=4, num_steps=30, step_s=0.001)
    assert 0.0 < us < float("inf")


def test_the_token_path_probe_streams_every_token_and_prices_both_halves() -> None:
    """bench-router's own-Python line: the token flow's and the streams' microseconds per
    token, positive and finite (token_path_cost_us raises unless every stream yielded every
    token and the flow built every step's Redis write)."""
    from loadtest.router_probes import token_path_cost_us

    flow_us, stream_us = token_path_cost_us(num_streams=4, num_steps=20)
    assert 0.0 < flow_us < float("inf") and 0.0 < stream_us < float("inf")


@pytest.mark.parametrize("record", ["bench_router", "bench_router/2026-12-04-tiny", "bench_router/2026-12-04-smollm2",
                                    "bench_router/2026-12-05-tiny", "bench_router/2026-12-06-tiny",
                                    "bench_router/2026-12-07-tiny", "bench_router/2026-12-07-smollm2",
                                    "bench_router/2026-12-07-tiny-b"])
def test_the_router_benchmark_records_still_print_their_documented_lines(record: str, tmp_path: Path) -> None:
    """Each bench-router record in docs/benchmarks/ is what print_table prints from the
    results.json beside it (the real model's has no tokens/s target: its baseline is tiny's)."""
    from loadtest.bench_router import print_table

    report = json.loads((DOCS / record / "results.json").read_text())
    path = tmp_path / "output.txt"
    with printed_to(path):
        print_table(report)
    printed = [line.rstrip() for line in path.read_text().splitlines()]
    assert [line.rstrip() for line in (DOCS / record / "output.txt").read_text().splitlines()] == printed
    assert any(line.startswith("  router_us_per_token") for line in printed)
    assert any(line.startswith("  tokens_per_s_x_baseline") for line in printed) == ("tiny" in printed[1])


@pytest.mark.parametrize("record", ["bench_policies/2026-12-02", "bench_policies/2026-12-05",
                                    "bench_policies/2026-12-05-300", "bench_policies/2026-12-05-refit",
                                    "bench_policies/2026-12-06-reserve", "bench_policies/2026-12-06-reserve1",
                                    "bench_policies/2026-12-06-ratios", "bench_policies/2026-12-06-r05",
                                    "bench_policies/2026-12-06-r05b", "bench_policies/2026-12-06-wait",
                                    "bench_policies/2026-12-06-adaptive", "bench_policies/2026-12-06-adaptive-eos4",
                                    "bench_policies/2026-12-06-adaptive-eos4b", "bench_policies/2026-12-06-fit-eos4",
                                    "bench_policies/2026-12-07-learn", "bench_policies/2026-12-07-learn-eos4",
                                    "bench_policies/2026-12-07-learn-b", "bench_policies/2026-12-07-backfill",
                                    "bench_policies/2026-12-07-backfill-eos4", "bench_policies/2026-12-07-backfill-held",
                                    "bench_policies/2026-12-07-backfill-held-eos4", "bench_policies/2026-12-07-sim-eos4"])
def test_the_policy_benchmark_records_are_what_their_runs_give(record: str) -> None:
    """Each bench-policies record in docs/benchmarks/: its targets are what check_targets
    judges from the runs beside them, and its results.md is what write_markdown writes from
    its results.json, so a change to where or how the targets are judged shows here."""
    from loadtest.bench_policies import check_targets, write_markdown

    report = json.loads((DOCS / record / "results.json").read_text())
    assert json.loads(json.dumps(check_targets(report["runs"], report["sim"]))) == report["targets"]
    assert write_markdown(report) == (DOCS / record / "results.md").read_text()


@pytest.mark.parametrize("model", ["tiny", "smollm2-135m-instruct"])
def test_the_tokens_per_s_target_is_judged_on_tiny_only(model: str) -> None:
    """bench-router --model: the 3x tokens/s target's baseline (971/s, 2026-12-01) was
    measured on tiny, so another model's run reports its tokens/s and judges the rest."""
    import argparse

    from loadtest.bench_router import build_report
    from loadtest.grpc_load import Timeline
    from loadtest.router_probes import HopClock
    from workers.config import EngineArgs

    args = argparse.Namespace(num_requests=1, output_len=2, concurrency=4, saturation_output_len=8,
                              window_s=1.0, warmup_s=1.0)
    # Three requests whose TTFTs differ by 3, 1 and 5 ms: the medians differ by 1 ms, the
    # median of the differences is 3 ms.
    in_process = [Timeline(ttft=t, itls=[0.002, 0.002], token_ids=[1, 2, 3]) for t in (0.010, 0.020, 0.100)]
    through_router = [Timeline(ttft=0.013, itls=[0.002, 0.002], token_ids=[1, 2, 3], sent_wall=100.0,
                               first_token_wall=100.013)]
    through_router += [Timeline(ttft=t, itls=[0.002, 0.002], token_ids=[1, 2, 3]) for t in (0.021, 0.105)]
    hops = HopClock()
    hops.placed_at["serial-0"], hops.actor_handed["serial-0"] = 100.002, 100.0115
    hops.worker_sent["serial-0"] = [100.011, 100.013, 100.015]
    hops.router_got["serial-0"] = [100.012, 100.014, 100.016]
    hops.engine_step["serial-0"] = [0.008, 0.0019, 0.0019]
    saturation = {"tokens_per_s": 3000.0, "router_cpu_us_per_token": 40.0}
    report = build_report(args, EngineArgs(model=model, kv_cache_memory=2**26), in_process, through_router, hops, saturation, None, None)
    targets = report["targets"]
    assert targets["ttft_p50_added_ms"]["value"] == pytest.approx(1.0)
    assert report["concurrency_1"]["ttft_added_paired_p50_ms"] == pytest.approx(3.0)
    assert targets["ttft_p50_added_ms"]["met"] and targets["router_us_per_token"]["met"]
    assert targets["actor_step_x_in_process"]["value"] == pytest.approx(1.0)
    if model == "tiny":
        assert targets["tokens_per_s_x_baseline"]["value"] == pytest.approx(3000.0 / 971.0)
        assert targets["tokens_per_s_x_baseline"]["met"]
        assert report["conditions"]["model"] == "tiny preset (random weights)"
    else:
        assert "tokens_per_s_x_baseline" not in targets
        assert report["conditions"]["model"] == model


@pytest.mark.parametrize("record", ["bench_policies/2026-12-07-rounds", "bench_policies/2026-12-07-rounds-seeds",
                                    "bench_policies/2026-12-07-rounds-backfill"])
def test_the_policy_benchmark_records_in_rounds_are_what_their_runs_give(record: str) -> None:
    """A bench-policies record of `--repeats N`: each round's targets and results.md are what
    the code judges and writes from that round's runs, and the pooled targets and results.md
    are what judge_pooled and pooled_markdown give from the pooled runs."""
    from loadtest.bench_policies import (
        TARGET_PREEMPTION_RATIO,
        TARGET_TTFT_RATIO,
        check_targets,
        pooled_markdown,
        write_markdown,
    )
    from loadtest.policy_rounds import judge_pooled

    result = json.loads((DOCS / record / "results.json").read_text())
    assert len(result["rounds"]) == len(result["conditions"]["seeds"]) > 1
    runs = []
    for entry in result["rounds"]:
        report = json.loads((DOCS / record / entry["dir"] / "results.json").read_text())
        targets = json.loads(json.dumps(check_targets(report["runs"], report["sim"])))
        assert targets == report["targets"] == entry["targets"]
        assert write_markdown(report) == (DOCS / record / entry["dir"] / "results.md").read_text()
        runs.append({(r["policy"], r["fraction"]): r for r in report["runs"]})
    for row in result["pooled"]:  # each round's figures, as its own report has them
        mine = [by[(row["policy"], row["fraction"])] for by in runs]
        assert row["ttft_p99s"] == [r["summary"]["ttft_p99"] for r in mine]
        assert row["preemptions"] == [r["num_preemptions"] for r in mine]
        assert row["num_preemptions"] == sum(row["preemptions"])
        assert row["sustained_rounds"] == [r["sustained"] for r in mine]
        assert row["num_requests"] == sum(r["num_requests"] for r in mine)
    judged = judge_pooled(result["pooled"], TARGET_TTFT_RATIO, TARGET_PREEMPTION_RATIO)
    assert json.loads(json.dumps(judged)) == result["targets"]
    assert pooled_markdown(result) == (DOCS / record / "results.md").read_text()
