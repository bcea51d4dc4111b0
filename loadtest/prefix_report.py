"""bench-prefix's report: one row per configuration and offered load, the issue's targets
read off the rows, the printed table and the plot."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any, Callable

from loadtest.metrics import percentile
from loadtest.policy_rates import highest_sustained
from loadtest.report import Column, RequestLatency, Slo, Table, figure

# Caching on against off under one policy: (policy, its caching-on label, its caching-off label).
ON_OFF = (("kv", "kv", "kv-no-cache"), ("prefix", "prefix", "prefix-no-cache"))


# The table of a run with fixed rates, as the record of 2026-12-02 was printed.
TABLE = Table((
    Column("config", 18, align="<"),
    Column("rate", 6, "g"),
    Column("TTFT p50", 10, ".2f", unit="s"),
    Column("p90", 8, ".2f", unit="s"),
    Column("p99", 8, ".2f", unit="s"),
    Column("tok/s", 8, ".1f"),
    Column("goodput", 9, ".0%"),
    Column("hit rate", 10, ".0%"),
    Column("per worker", 0, align="<", gap=2),
), rule=False)


# A run at fractions of the caching-off capacity: the fraction, then its rate in req/s.
TABLE_AT_FRACTIONS = Table((
    TABLE.columns[0],
    Column("x cap", 6, "g", unit="x"),
    Column("req/s", 7, ".2f"),
    *TABLE.columns[2:],
), rule=False)


def describe_load(fraction: float | None, rate: float) -> str:
    """An offered load in words: "1.5x (0.92 req/s)", or "0.4 req/s" without a fraction."""
    return f"{rate:g} req/s" if fraction is None else f"{fraction:g}x ({rate:.2f} req/s)"


def latency(result: dict[str, Any]) -> RequestLatency:
    """One client row as the SLO judges it: its mean ITL from its first token to its end."""
    ttft, tokens = result.get("ttft", math.inf), result.get("output_tokens", 0)
    mean_itl = (result["e2e"] - ttft) / (tokens - 1) if tokens > 1 and "e2e" in result else None
    return RequestLatency(ttft, mean_itl, bool(result.get("ok")))


def summarize(label: str, rate: float, results: list[dict[str, Any]], slo: Slo, arrivals: list[float]) -> dict[str, Any]:
    ok = [r for r in results if r.get("ok")]
    latencies = [latency(r) for r in results]
    ttfts = [r.get("ttft", math.inf) for r in results]
    finite = [t for t in ttfts if math.isfinite(t)]
    prompt = sum(r.get("prompt_tokens", 0) for r in ok)
    span = max([r["sent"] + r.get("e2e", 0.0) for r in results] + [arrivals[-1]])
    return {
        "config": label, "rate": rate, "requests": len(results), "finished": len(ok),
        "ttft_p50": percentile(ttfts, 50) if finite else math.nan,
        "ttft_p90": percentile(ttfts, 90) if finite else math.nan,
        "ttft_p99": percentile(ttfts, 99) if finite else math.nan,
        "output_tokens_per_s": sum(r.get("output_tokens", 0) for r in ok) / span,
        "goodput": slo.attainment(latencies),
        "sustained": slo.sustained(latencies),
        "hit_rate": sum(r.get("cached_tokens", 0) for r in ok) / prompt if prompt else 0.0,
        "per_worker": {w: sum(1 for r in results if r.get("worker") == w) for w in {r.get("worker") for r in results}
                       if w},
    }  # fmt: skip


def targets(rows: list[dict[str, Any]], oracle_of: Callable[[int], float]) -> dict[str, Any]:
    """The issue's targets; oracle_of(n) is the oracle's hit rate on the workload's first n requests.

    Each is read at one offered load, named by its rate and, where the rows carry one, its
    fraction of the caching-off capacity (every configuration ran the same rates)."""
    by = {(r["config"], r["rate"]): r for r in rows}
    rates = sorted({r["rate"] for r in rows})
    fraction_of = {r["rate"]: r["fraction"] for r in rows if "fraction" in r}

    def at(rate: float) -> dict[str, Any]:
        return {"rate": rate, "fraction": fraction_of[rate]} if rate in fraction_of else {"rate": rate}

    def sustained_at(config: str) -> dict[float, bool]:
        return {r: bool(by[(config, r)]["sustained"]) for r in rates if (config, r) in by}

    out: dict[str, Any] = {}
    for policy, on_label, off_label in ON_OFF:
        # The rate where caching off saturates: its first unsustained one, else its last run.
        off_rates = sustained_at(off_label)
        off_saturates = next((r for r, ok in off_rates.items() if not ok), max(off_rates, default=0))
        off, on = by.get((off_label, off_saturates)), by.get((on_label, off_saturates))
        if off and on:
            out[f"caching on vs off ({policy}), p90 TTFT"] = {
                **at(off_saturates), "value": off["ttft_p90"] / on["ttft_p90"], "target": 3.0}
    # The highest rate both sustain, each with every lower rate sustained too; the lowest when one sustains none.
    kv_best, prefix_best = highest_sustained(sustained_at("kv")), highest_sustained(sustained_at("prefix"))
    top = min(kv_best, prefix_best) if kv_best is not None and prefix_best is not None else min(rates, default=0)
    kv, prefix = by.get(("kv", top)), by.get(("prefix", top))
    if kv and prefix:
        out["prefix vs kv, p90 TTFT"] = {**at(top), "value": kv["ttft_p90"] / prefix["ttft_p90"], "target": 3.0}
        out["prefix vs kv, goodput"] = {**at(top), "value": prefix["goodput"] / max(kv["goodput"], 1e-9),
                                        "target": 1.5}
    prefix_rows = [r for r in rows if r["config"] == "prefix"]
    if prefix_rows:
        # Over every request prefix ran, token-weighted, against the oracle on those same
        # requests in the same order (its first rates hold every group's cold start).
        ran = [q for r in prefix_rows for q in r["trace"] if q.get("ok")]
        hit = sum(q["cached_tokens"] for q in ran) / max(sum(q["prompt_tokens"] for q in ran), 1)
        oracle = oracle_of(sum(r["requests"] for r in prefix_rows))
        # An oracle of 0 (every request its group's first: a tiny run) leaves nothing to compare.
        out["prefix hit rate / oracle"] = {"rate": None, "value": hit / oracle if oracle else math.nan,
                                           "target": 0.9, "hit_rate": hit, "oracle": oracle}
    for t in out.values():
        t["met"] = bool(t["value"] >= t["target"])
    return out


def highest_loads(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """The highest load `kv` and `prefix` (caching on) each sustained, every lower one too:
    goodput as DistServe defines it, the most req/s served within the SLO. Reported beside
    the targets, not one of them (the issue's goodput is read at one load both sustain).
    Each configuration stops at its first unsustained load, so one that sustained its last
    has only a lower bound ("at_least"), and so has the ratio when prefix's is one."""
    out: dict[str, Any] = {}
    for config in ("kv", "prefix"):
        mine = {r["rate"]: r for r in rows if r["config"] == config}
        best = highest_sustained({rate: bool(r["sustained"]) for rate, r in mine.items()})
        if best is None:
            return {}
        out[config] = {"rate": best, "fraction": mine[best].get("fraction"), "at_least": best == max(mine)}
    out["ratio"] = out["prefix"]["rate"] / out["kv"]["rate"]
    out["ratio_at_least"] = out["prefix"]["at_least"] and not out["kv"]["at_least"]
    return out


def highest_loads_line(loads: dict[str, Any]) -> str:
    def load(config: str) -> str:
        mine = loads[config]
        return f"{config} {'>= ' if mine['at_least'] else ''}{describe_load(mine['fraction'], mine['rate'])}"

    return (f"Highest load sustained (goodput as the most req/s within the SLO; reported, not a target): "
            f"{load('kv')}, {load('prefix')}: prefix/kv {'>= ' if loads['ratio_at_least'] else ''}"
            f"{loads['ratio']:.2f}x")


def print_table(report: dict[str, Any]) -> None:
    """The calibration (when the run had one), a row per configuration and rate, the targets.
    A report whose rows carry no fraction (a run before calibration) prints as it did then."""
    rows = report["rows"]
    at_fractions = any("fraction" in r for r in rows)
    keys = ("config", *(("fraction",) if at_fractions else ()), "rate", "ttft_p50", "ttft_p90", "ttft_p99",
            "output_tokens_per_s", "goodput", "hit_rate", "per_worker")
    print()
    if "calibration" in report:
        print("\n".join(calibration_lines(report["calibration"])) + "\n")
    print("\n".join((TABLE_AT_FRACTIONS if at_fractions else TABLE).lines([[r.get(k) for k in keys] for r in rows])))
    print(f"oracle hit rate: {report['oracle_hit_rate']:.0%}")
    print("\nTargets:")
    width = max([28, *(len(name) + 1 for name in report["targets"])])
    ats = {name: f" at {describe_load(t.get('fraction'), t['rate'])}" if t["rate"] is not None else ""
           for name, t in report["targets"].items()}
    at_width = max([16, *(len(at) + 1 for at in ats.values())])
    for name, t in report["targets"].items():
        print(f"  {name:<{width}}{ats[name]:<{at_width}} {t['value']:.2f} (target {t['target']}) "
              f"{'MET' if t['met'] else 'MISSED'}")
    loads = highest_loads(rows)
    if loads:
        print(highest_loads_line(loads))


def calibration_lines(calibration: dict[str, Any]) -> list[str]:
    """The calibration in words: the cold TTFT, the SLO and where it came from, the capacity."""
    lines = []
    if calibration["cold_ttft_s"] is not None:
        each = ", ".join(f"{t:.2f}" for t in calibration["cold_ttfts_s"])
        lines.append(f"cold TTFT (kv, caching off, one request at a time): {calibration['cold_ttft_s']:.2f} s, "
                     f"the median of {each} s")
    lines.append(f"SLO: TTFT < {calibration['ttft_slo_s']:.2f} s ({calibration['slo_source']}), half of the requests")
    capacity = calibration["capacity"]
    if capacity is None:
        lines.append("capacity: not measured (--rates)")
    elif "num_counted" in capacity:
        lines.append(f"capacity with caching off: {capacity['requests_per_s']:.3f} req/s ({capacity['source']}; "
                     f"{capacity['num_counted']} finishes in {capacity['window_s']:.1f} s while full)")
    else:
        lines.append(f"capacity with caching off: {capacity['requests_per_s']:.3f} req/s ({capacity['source']})")
    return lines


def plot(report: dict[str, Any], path: Path) -> None:
    with figure(path, 1, 3, dpi=120, figsize=(15, 4.5)) as (_, axes):
        _draw(report, axes)


def _draw(report: dict[str, Any], axes: Any) -> None:
    # x: the fraction of the caching-off capacity when every row has one, else the rate.
    by_fraction = bool(report["rows"]) and all(r.get("fraction") is not None for r in report["rows"])
    x_key = "fraction" if by_fraction else "rate"
    for config in dict.fromkeys(r["config"] for r in report["rows"]):
        rows = [r for r in report["rows"] if r["config"] == config]
        xs = [r[x_key] for r in rows]
        axes[0].plot(xs, [r["ttft_p90"] for r in rows], "o-", label=config)
        axes[1].plot(xs, [r["goodput"] for r in rows], "o-", label=config)
        axes[2].plot(xs, [r["hit_rate"] for r in rows], "o-", label=config)
    oracle = axes[2].axhline(report["oracle_hit_rate"], color="gray", linestyle=":")
    axes[2].legend([oracle], ["oracle (one infinite cache)"], loc="lower right")
    capacity = (report.get("calibration") or {}).get("capacity")
    for ax, title in zip(axes, ("p90 TTFT (s)", "goodput (TTFT within SLO)", "prefix-cache hit rate"), strict=True):
        ax.set_title(title)
        if by_fraction and capacity:
            cap = capacity["requests_per_s"]
            ax.set_xlabel("offered load (x caching-off capacity)")
            ax.secondary_xaxis("top", functions=(lambda f, c=cap: f * c, lambda r, c=cap: r / c)).set_xlabel(
                "arrival rate (req/s)")
        else:
            ax.set_xlabel("arrival rate (req/s)")
    axes[0].set_yscale("log")
    axes[0].legend()
