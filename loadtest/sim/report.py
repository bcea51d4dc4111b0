"""The simulator's table and figure, from the report dict loadtest.sim.run builds."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from loadtest.report import Column, Table, figure
from loadtest.sim.placement_bench import placement_lines

_NAN = float("nan")
RUNS = Table((
    Column("workers", 7),
    Column("policy", 14, align="<", gap=1),
    Column("req/s/w", 8, "g"),
    Column("TTFT p50", 9, ".0f", scale=1e3),
    Column("p99", 8, ".0f", scale=1e3),
    Column("ITL p50", 8, ".1f", scale=1e3),
    Column("p99", 7, ".0f", scale=1e3),
    Column("tok/s", 9, ".0f"),
    Column("goodput", 9, ".0f"),
    Column("good %", 7, ".1f", scale=100),
    Column("preempt", 8),
    Column("reject", 7),
    Column("hit %", 6, ".1f", scale=100),
    Column("peak KV", 8, ".2f"),
    Column("router %", 9, ".1f", scale=100),
    Column("wall s", 7, ".1f"),
))


def _row(run: dict[str, Any]) -> tuple[Any, ...]:
    s = run["summary"] or {}
    return (
        run["workers"], run["policy"], run["rate_per_worker"], s.get("ttft_p50"), s.get("ttft_p99"),
        s.get("itl_p50"), s.get("itl_p99"), s.get("output_tokens_per_s"), run["goodput_rps"],
        run["goodput_fraction"], run["num_preemptions"], run["num_rejected"], run.get("prefix_cache_hit_rate"),
        run["peak_commit_ratio"], run["router_placement_core_share"], run["wall_s"],
    )


def print_table(report: dict[str, Any]) -> None:
    c = report["conditions"]
    m = c["cost_model"]
    print(f"\nSimulated cluster — workload {c['workload']}, {c['requests_per_worker']} requests per worker, "
          f"KV pools {c['kv_pools']}")
    print(f"engine: {c['engine']}; router: {c['router']}; step cost fitted on the real engine "
          f"({m['facts']['model']}, {m['facts']['device']}, {m['facts']['num_threads']} thread, R^2 {m['r2']:.3f})")
    print(f"goodput: requests/s meeting the SLO ({c['slo']}); hit % = prompt tokens the engines' prefix caches "
          f"served; peak KV = most blocks any worker had committed / its pool; router % = one core's share spent "
          f"on placement alone\n")
    print("times in ms")
    print("\n".join(RUNS.lines([_row(r) for r in report["runs"]])))
    print("\nPlacement on one core (the real policies over N WorkerViews): choose() p50 / p99 us; "
          "placements/s of choose + place + release")
    print("\n".join(placement_lines(report["placement"])))
    print("\nRouter event load at the table's rates (token events are priced by loadtest/bench_router.py):")
    for r in report["runs"]:
        s = r["summary"]
        print(f"  {r['workers']:>5} workers {r['policy']:<14} @ {r['rate_per_worker']:g}/s/w: "
              f"{r['cluster_rate']:>8.0f} placements/s, {r['batches_per_s']:>8.0f} StepBatches/s, "
              f"{(s['output_tokens_per_s'] if s else _NAN):>8.0f} token events/s")


def plot(report: dict[str, Any], path: Path) -> None:
    c = report["conditions"]
    title = f"kvserve simulator: {c['workload']} workload, KV pools {c['kv_pools']}"
    with figure(path, 2, 2, title=title, figsize=(13, 10)) as (_, axes):
        _draw(report, axes)


def _draw(report: dict[str, Any], axes: Any) -> None:
    runs = report["runs"]
    policies = list(dict.fromkeys(r["policy"] for r in runs))
    worker_counts = sorted({r["workers"] for r in runs})
    colors = {p: f"C{i}" for i, p in enumerate(policies)}
    markers = dict(zip(worker_counts, "osD^v<>p"))
    panels = (
        (axes[0][0], "ttft_p99", "p99 TTFT (s)", True),
        (axes[0][1], "output_tokens_per_s", "output tokens/s", True),
        (axes[1][0], "goodput_fraction", "fraction of requests meeting the SLO", False),
    )
    for ax, key, label, log_y in panels:
        for policy in policies:
            for n in worker_counts:
                points = sorted(
                    (r["cluster_rate"], _value(r, key)) for r in runs if r["policy"] == policy and r["workers"] == n
                )
                if points:
                    ax.plot(*zip(*points), color=colors[policy], marker=markers[n], label=f"{policy}, {n} workers")
        ax.set_xscale("log")
        if log_y:
            ax.set_yscale("log")
        ax.set_xlabel("cluster arrival rate (requests/s, log)")
        ax.set_ylabel(label)
    axes[0][0].axhline(1.0, color="gray", linestyle="--", label="1 s")
    axes[0][0].set_title("p99 TTFT against arrival rate")
    axes[0][1].set_title("throughput against arrival rate")
    axes[1][0].set_title(f"goodput ({report['conditions']['slo']})")
    axes[1][0].set_ylim(-0.02, 1.02)
    axes[0][0].legend(fontsize=7, ncol=2)
    _plot_kv(axes[1][1], runs, colors)


def _value(run: dict[str, Any], key: str) -> float:
    if key in run:
        return float(run[key])
    return float(run["summary"][key]) if run["summary"] is not None else _NAN


def _plot_kv(ax: Any, runs: list[dict[str, Any]], colors: dict[str, str]) -> None:
    """KV in use over time, per pool size, at the largest cluster's highest rate: for kv and
    round-robin when both ran (else the first two policies), to keep the panel readable."""
    largest = max(r["workers"] for r in runs)
    top_rate = max(r["rate_per_worker"] for r in runs if r["workers"] == largest)
    chosen = [r for r in runs if r["workers"] == largest and r["rate_per_worker"] == top_rate]
    shown = {"kv", "round-robin"} if {"kv", "round-robin"} <= {r["policy"] for r in chosen} else {
        r["policy"] for r in chosen[:2]
    }
    chosen = [r for r in chosen if r["policy"] in shown]
    styles = ["-", "--", ":", "-."]
    for r in chosen:
        pools = sorted(r["kv_used_fraction_by_pool"].items(), key=lambda item: int(item[0]))
        for i, (blocks, fractions) in enumerate(pools):
            ax.plot(r["kv_sample_times"], fractions, color=colors[r["policy"]], linestyle=styles[i % len(styles)],
                    label=f"{r['policy']}, {blocks}-block pools")
    ax.set_xlabel("virtual time (s)")
    ax.set_ylabel("KV blocks in use / pool")
    ax.set_ylim(0, 1.05)
    ax.set_title(f"KV in use, {largest} workers at {top_rate:g} req/s per worker")
    ax.legend(fontsize=7)
