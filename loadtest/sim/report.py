"""The simulator's table and figure, from the report dict loadtest.sim.run builds."""

from __future__ import annotations

from pathlib import Path
from typing import Any

_NAN = float("nan")


def _ms(summary: dict[str, Any] | None, key: str) -> float:
    return summary[key] * 1e3 if summary is not None else _NAN


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
    head = (
        f"{'workers':>7} {'policy':<14}{'req/s/w':>8}{'TTFT p50':>9}{'p99':>8}{'ITL p50':>8}{'p99':>7}"
        f"{'tok/s':>9}{'goodput':>9}{'good %':>7}{'preempt':>8}{'reject':>7}{'hit %':>6}{'peak KV':>8}{'router %':>9}"
        f"{'wall s':>7}"
    )
    print("times in ms")
    print(head)
    print("-" * len(head))
    for r in report["runs"]:
        s = r["summary"]
        print(
            f"{r['workers']:>7} {r['policy']:<14}{r['rate_per_worker']:>8g}{_ms(s, 'ttft_p50'):>9.0f}"
            f"{_ms(s, 'ttft_p99'):>8.0f}{_ms(s, 'itl_p50'):>8.1f}{_ms(s, 'itl_p99'):>7.0f}"
            f"{(s['output_tokens_per_s'] if s else _NAN):>9.0f}{r['goodput_rps']:>9.0f}"
            f"{r['goodput_fraction'] * 100:>7.1f}{r['num_preemptions']:>8}{r['num_rejected']:>7}"
            f"{r.get('prefix_cache_hit_rate', _NAN) * 100:>6.1f}"
            f"{r['peak_commit_ratio']:>8.2f}{r['router_placement_core_share'] * 100:>9.1f}{r['wall_s']:>7.1f}"
        )
    placement = report["placement"]
    policies = list(next(iter(placement["decision_us"].values())))
    print("\nPlacement on one core (the real policies over N WorkerViews): choose() p50 / p99 us; "
          "placements/s of choose + place + release")
    head = f"{'workers':>7}" + "".join(f"{p:>30}" for p in policies)
    print(head)
    print("-" * len(head))
    for n, row in placement["decision_us"].items():
        rates = placement["placements_per_s"][n]
        print(f"{n:>7}" + "".join(
            f"{row[p]['p50_us']:>9.1f} /{row[p]['p99_us']:>7.1f} us {rates[p]:>8.0f}/s" for p in policies
        ))
    print("\nRouter event load at the table's rates (token events are priced by loadtest/bench_router.py):")
    for r in report["runs"]:
        s = r["summary"]
        print(f"  {r['workers']:>5} workers {r['policy']:<14} @ {r['rate_per_worker']:g}/s/w: "
              f"{r['cluster_rate']:>8.0f} placements/s, {r['batches_per_s']:>8.0f} StepBatches/s, "
              f"{(s['output_tokens_per_s'] if s else _NAN):>8.0f} token events/s")


def plot(report: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = report["runs"]
    policies = list(dict.fromkeys(r["policy"] for r in runs))
    worker_counts = sorted({r["workers"] for r in runs})
    colors = {p: f"C{i}" for i, p in enumerate(policies)}
    markers = dict(zip(worker_counts, "osD^v<>p"))
    fig, axes = plt.subplots(2, 2, figsize=(13, 10))
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
        ax.grid(True, which="both", alpha=0.3)
    axes[0][0].axhline(1.0, color="gray", linestyle="--", label="1 s")
    axes[0][0].set_title("p99 TTFT against arrival rate")
    axes[0][1].set_title("throughput against arrival rate")
    axes[1][0].set_title(f"goodput ({report['conditions']['slo']})")
    axes[1][0].set_ylim(-0.02, 1.02)
    axes[0][0].legend(fontsize=7, ncol=2)
    _plot_kv(axes[1][1], runs, colors)
    c = report["conditions"]
    fig.suptitle(f"kvserve simulator: {c['workload']} workload, KV pools {c['kv_pools']}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


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
    ax.grid(True, alpha=0.3)
