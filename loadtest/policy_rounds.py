"""The policy benchmark repeated in rounds, and its runs pooled across them.

One round of loadtest.bench_policies replays 100-300 requests per policy and fraction of
capacity, so a p99 TTFT is one of its slowest three requests, and three replays of one
trace at one rate gave kv 1.30, 3.84 and 2.27 s (1.0x, 2026-12-07). `--repeats N` runs
the whole comparison N times, every round at the capacity measured in the first and on the same trace, so each
fraction is one offered load throughout and the rounds differ only by the machine's
timing; with `--vary-seed`, round k replays the workload drawn with seed + k - 1 instead
(another sample of the same shapes, which also varies the load: seed 7's 300 mixed
requests hold 64 long ones, seeds 8 and 9 hold 50). This module reads the rounds together:

    pooled run   per policy and fraction: every round's finished requests in one list,
                 p50/p99 TTFT of that list (and p99 of its short and of its long requests
                 apart), preemptions summed, the SLO judged on all of them (sustained: every
                 request finished and 99% met it)
    judged       as in one round (policy_rates.judged_fractions), on the pooled runs:
                 round-robin's pooled p99 TTFT over kv's, and the preemption sums
    per round    each round's own ratio at the same fractions, and how many rounds met it

Everything is a pure function of the rounds' runs (summarize_run's rows with their raw
"ttfts" and "latencies"), so tests check it by hand.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from loadtest.policy_rates import fmt as _f
from loadtest.policy_rates import fmt_ratio as _ratio
from loadtest.policy_rates import highest_sustained, judged_fractions, markdown_by_fraction
from loadtest.report import RequestLatency, Slo, figure

Run = dict[str, Any]


def pool_rounds(rounds: Sequence[Sequence[Run]], slo: Slo) -> list[Run]:
    """One pooled run per (policy, fraction) measured in every round, in the first round's order.

    Each row: policy, fraction, rate, num_rounds, num_requests, num_ok, ttft_p50, ttft_p99
    (over every round's finished requests; NaN when none finished), num_preemptions (the sum),
    sustained (slo over every round's requests), and per round: ttft_p99s, preemptions,
    sustained_rounds."""
    if not rounds:
        raise ValueError("pool_rounds needs at least one round")
    keyed = [{(r["policy"], r["fraction"]): r for r in runs} for runs in rounds]
    pooled = []
    for key in keyed[0]:
        if not all(key in k for k in keyed[1:]):
            continue
        mine = [k[key] for k in keyed]
        ttfts = [t for r in mine for t in r["ttfts"]]
        latencies: list[RequestLatency] = [lat for r in mine for lat in r["latencies"]]
        pooled.append({
            "policy": key[0],
            "fraction": key[1],
            "rate": mine[0]["rate"],
            "num_rounds": len(mine),
            "num_requests": sum(r["num_requests"] for r in mine),
            "num_ok": sum(r["num_ok"] for r in mine),
            "ttft_p50": _percentile(ttfts, 50),
            "ttft_p99": _percentile(ttfts, 99),
            # The short requests' and the long ones' apart: whose tail it is.
            "ttft_p99_by_kind": {kind: _percentile([t for r in mine for t in r["kind_ttfts"][kind]], 99)
                                 for kind in ("short", "long")},
            "num_preemptions": sum(r["num_preemptions"] for r in mine),
            "sustained": slo.sustained(latencies),
            "ttft_p99s": [(r["summary"] or {}).get("ttft_p99", math.nan) for r in mine],
            "preemptions": [r["num_preemptions"] for r in mine],
            "sustained_rounds": [r["sustained"] for r in mine],
        })
    return pooled


def _percentile(values: Sequence[float], q: float) -> float:
    # Linear interpolation, as loadtest.metrics.percentile gives each round's own p99.
    return float(np.percentile(values, q)) if values else math.nan


def judge_pooled(pooled: Sequence[Run], ttft_target: float, preemption_target: float) -> dict[str, Any]:
    """kv against round-robin on the pooled runs, at the fractions one round would judge
    (the highest both sustain, pooled; the one nearest capacity), with each round's own
    ratios beside the pooled ones."""
    sustained: dict[str, float | None] = {}
    for policy in dict.fromkeys(r["policy"] for r in pooled):
        sustained[policy] = highest_sustained({r["fraction"]: r["sustained"] for r in pooled if r["policy"] == policy})
    out: dict[str, Any] = {"sustained": sustained, "judged": []}
    by = {(r["policy"], r["fraction"]): r for r in pooled}
    fractions = sorted({f for p, f in by if p == "kv"} & {f for p, f in by if p == "round-robin"})
    if not fractions:
        return out
    for at in judged_fractions(sustained.get("kv"), sustained.get("round-robin"), fractions):
        kv, rr = by[("kv", at.fraction)], by[("round-robin", at.fraction)]
        ttft_ratio = rr["ttft_p99"] / kv["ttft_p99"] if kv["ttft_p99"] > 0 else math.inf
        round_ttft = [b / a if a > 0 else math.inf for a, b in zip(kv["ttft_p99s"], rr["ttft_p99s"])]
        round_pre = [_preemption_ratio(a, b) for a, b in zip(kv["preemptions"], rr["preemptions"])]
        out["judged"].append({
            "fraction": at.fraction,
            "why": at.why,
            "rate": kv["rate"],
            "ttft_p99": {"kv": kv["ttft_p99"], "round-robin": rr["ttft_p99"], "ratio": ttft_ratio,
                         "target": ttft_target, "met": ttft_ratio >= ttft_target,
                         "rounds": round_ttft, "rounds_met": sum(r >= ttft_target for r in round_ttft),
                         "round_median": float(np.median(round_ttft))},
            "preemptions": {"kv": kv["num_preemptions"], "round-robin": rr["num_preemptions"],
                            "ratio": _preemption_ratio(kv["num_preemptions"], rr["num_preemptions"]),
                            "target": preemption_target,
                            "met": _preemptions_met(kv["num_preemptions"], rr["num_preemptions"], preemption_target),
                            "rounds": round_pre,
                            "rounds_met": sum(_preemptions_met(a, b, preemption_target)
                                              for a, b in zip(kv["preemptions"], rr["preemptions"]))},
        })
    return out


def _preemption_ratio(kv: int, rr: int) -> float:
    return rr / kv if kv else (math.inf if rr else math.nan)


def _preemptions_met(kv: int, rr: int, target: float) -> bool:
    # As in one round: round-robin must preempt at all, and at least target x as often.
    return rr > 0 and rr >= target * kv


def rounds_markdown(pooled: Sequence[Run], judged: dict[str, Any], capacity: dict[str, Any],
                    seeds: Sequence[int], rounds_dir: Callable[[int], str]) -> list[str]:
    """The pooled tables: p99 TTFT and preemptions per policy and fraction (pooled, then
    round by round), the highest fraction each sustains, and the judged targets."""
    n = len(seeds)
    policies = list(dict.fromkeys(r["policy"] for r in pooled))
    fractions = sorted({r["fraction"] for r in pooled})
    by = {(r["policy"], r["fraction"]): r for r in pooled}
    same = len(set(seeds)) == 1
    lines = [
        f"## {n} rounds pooled",
        "",
        (f"Every round replays the same trace (seed {seeds[0]})" if same else
         f"Round k replays the workload drawn with seed {seeds[0]} + k - 1 (seeds {', '.join(map(str, seeds))})")
        + "; every round offers the same rates, fractions of the capacity measured in round 1 "
        f"({capacity['requests_per_s']:.2f} req/s). Each round's full report: "
        + ", ".join(f"`{rounds_dir(k)}/results.md`" for k in range(1, n + 1)) + ".",
        "",
        "Each cell: pooled p99 TTFT in s (every round's finished requests) / preemptions summed; below it, "
        "each round's p99 and preemptions. A `*` marks a pooled run with requests unfinished.",
        "",
    ]

    def cell(r: Mapping[str, Any]) -> str:
        each = ", ".join(f"{_f(p)}/{k}" for p, k in zip(r["ttft_p99s"], r["preemptions"]))
        return f"**{_f(r['ttft_p99'])} / {r['num_preemptions']}** ({each})"

    lines += markdown_by_fraction(by, policies, fractions, cell)
    if all("ttft_p99_by_kind" in r for r in pooled):  # (not in the records of before it was)
        lines += ["", "The short requests' pooled p99 TTFT / the long ones' (s):", ""]
        lines += markdown_by_fraction(by, policies, fractions, lambda r: " / ".join(
            _f(r["ttft_p99_by_kind"][kind]) for kind in ("short", "long")))
    lines += ["", "Highest fraction sustained, pooled (the SLO over every round's requests; every lower "
              "fraction sustained too), and the rounds that sustained each fraction:", ""]
    for policy in policies:
        best = judged["sustained"][policy]
        marks = ", ".join(f"{f:g}x {sum(by[(policy, f)]['sustained_rounds'])}/{n}"
                          for f in fractions if (policy, f) in by)
        lines.append(f"- {policy}: {'none' if best is None else f'{best:g}x'} ({marks})")
    lines += ["", "### Targets on the pooled runs: kv against round-robin", ""]
    if not judged["judged"]:
        return lines + ["kv and round-robin were not both measured, so the targets were not checked."]
    lines += [
        "| judged at | why there | | kv | round-robin | round-robin / kv | target | pooled | rounds met | each round |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for j in judged["judged"]:
        where = f"{j['fraction']:g}x ({j['rate']:.2f} req/s)"
        t, p = j["ttft_p99"], j["preemptions"]
        lines.append(f"| {where} | {j['why']} | p99 TTFT (s) | {_f(t['kv'])} | {_f(t['round-robin'])} "
                     f"| {_ratio(t['ratio'])} | >= {t['target']:g}x | {'MET' if t['met'] else 'MISSED'} "
                     f"| {t['rounds_met']}/{n} | {', '.join(_ratio(r) for r in t['rounds'])} "
                     f"(median {_ratio(t['round_median'])}) |")
        lines.append(f"| {where} | {j['why']} | preemptions | {p['kv']} | {p['round-robin']} "
                     f"| {_ratio(p['ratio'])} | >= {p['target']:g}x | {'MET' if p['met'] else 'MISSED'} "
                     f"| {p['rounds_met']}/{n} | {', '.join(_ratio(r) for r in p['rounds'])} |")
    return lines


def plot_rounds(pooled: Sequence[Run], path: Path, capacity_rps: float) -> None:
    """p99 TTFT and preemptions against the fraction of capacity: each round thin, pooled thick."""
    policies = list(dict.fromkeys(r["policy"] for r in pooled))
    colors = {p: f"C{i}" for i, p in enumerate(policies)}
    with figure(path, 1, 2, dpi=100, figsize=(13, 4.5)) as (_, axes):
        for policy in policies:
            mine = sorted((r for r in pooled if r["policy"] == policy), key=lambda r: r["fraction"])
            xs = [r["fraction"] for r in mine]
            for k in range(mine[0]["num_rounds"] if mine else 0):
                axes[0].plot(xs, [r["ttft_p99s"][k] for r in mine], "-", color=colors[policy], alpha=0.3, linewidth=1)
                axes[1].plot(xs, [r["preemptions"][k] for r in mine], "-", color=colors[policy], alpha=0.3,
                             linewidth=1)
            axes[0].plot(xs, [r["ttft_p99"] for r in mine], "-o", color=colors[policy], linewidth=2.5,
                         label=f"{policy} (pooled; thin: each round)")
            axes[1].plot(xs, [r["num_preemptions"] / max(1, r["num_rounds"]) for r in mine], "-o",
                         color=colors[policy], linewidth=2.5, label=f"{policy} (mean per round)")
        for ax, label, log_y in ((axes[0], "p99 TTFT (s, log)", True), (axes[1], "preemptions per round", False)):
            ax.set(xlabel=f"arrival rate, x capacity ({capacity_rps:.2f} req/s)", ylabel=label,
                   yscale="log" if log_y else "linear")
            ax.legend(fontsize=8)
        axes[0].set_title("p99 TTFT, pooled over the rounds")
        axes[1].set_title("preemptions")
