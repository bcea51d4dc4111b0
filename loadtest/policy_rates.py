"""Rates relative to a measured capacity, and what the policy benchmark reads off them.

A fixed arrival rate compares two policies only on the machine it was chosen on: on a
slower one both queues are full and the comparison is of two backlogs. So each run of
loadtest.bench_policies first measures the cluster's capacity, then offers fractions of it:

    capacity  closed loop, `concurrency` requests always in flight, the workload's own
              shapes on the cluster under test: completions per second while the loop is
              full (after the first cohort's `concurrency` finishes, up to the finish that
              leaves fewer than `concurrency` requests to run), so neither start nor tail counts
    rates     capacity x each fraction (0.5, 0.7, 0.85, 1.0, 1.2 by default)
    sustained a policy's highest fraction whose run, and every run below it, the SLO
              sustains (report.Slo.sustained); a pass above a miss is not counted
    judged    the kv-vs-round-robin targets are read at the highest fraction both
              sustain, and at the fraction nearest 1.0x capacity

Everything here is a pure function of what was measured, so tests check it by hand.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any, NamedTuple

DEFAULT_FRACTIONS = (0.5, 0.7, 0.85, 1.0, 1.2)


class Capacity(NamedTuple):
    """What a closed-loop run measured: completions per second while the loop was full."""

    requests_per_s: float
    num_counted: int  # finishes between the two ends of the window
    window_s: float


def closed_loop_capacity(finish_times: Sequence[float], concurrency: int) -> Capacity | None:
    """Completions per second of a closed loop while it kept `concurrency` requests in flight.

    finish_times: when each request finished (any order; one per finished request). The
    first `concurrency` requests start together, so the first `concurrency` finishes are
    that cohort turning over (short ones first); after the (n - concurrency)-th finish
    fewer requests remain than the loop keeps in flight. Between the two the loop is full,
    and in its steady state completions come at the cluster's rate whatever their shapes.
    None when that stretch holds no finish or no time.

        finishes (sorted)  f0 ... f[lo] ............ f[hi] ... f[n-1]
                           cohort |<----- full ----->| draining
        lo = concurrency   hi = n - concurrency
        capacity = (hi - lo) / (f[hi] - f[lo])
    """
    if concurrency < 1:
        raise ValueError(f"concurrency must be >= 1, got {concurrency}")
    times = sorted(finish_times)
    lo, hi = concurrency, len(times) - concurrency
    if hi - lo < 1 or not times[hi] > times[lo]:
        return None
    window = times[hi] - times[lo]
    return Capacity((hi - lo) / window, hi - lo, window)


def rates_at(capacity_rps: float, fractions: Sequence[float]) -> dict[float, float]:
    """Each fraction's arrival rate (req/s), in ascending order of fraction."""
    if not (capacity_rps > 0 and math.isfinite(capacity_rps)):
        raise ValueError(f"capacity_rps must be positive and finite, got {capacity_rps}")
    check_fractions(fractions)
    return {f: capacity_rps * f for f in sorted(fractions)}


def check_fractions(fractions: Sequence[float]) -> None:
    if not fractions or not all(f > 0 and math.isfinite(f) for f in fractions):
        raise ValueError(f"fractions must be positive and finite, got {tuple(fractions)}")
    if len(set(fractions)) != len(fractions):
        raise ValueError(f"fractions must not repeat, got {tuple(fractions)}")


def parse_fractions(text: str) -> tuple[float, ...]:
    """"0.5,0.7,1" -> (0.5, 0.7, 1.0), sorted; a bad entry is named in the error."""
    out = []
    for item in (t.strip() for t in text.split(",")):
        if not item:
            continue
        try:
            out.append(float(item))
        except ValueError:
            raise ValueError(f"--fractions: {item!r} is not a number (in {text!r})") from None
    check_fractions(out)
    return tuple(sorted(out))


def highest_sustained(sustained_at: dict[float, bool]) -> float | None:
    """The highest fraction sustained with every lower fraction sustained too; None when the
    lowest is missed. A pass above a miss is noise in a short run, not capacity."""
    best = None
    for fraction in sorted(sustained_at):
        if not sustained_at[fraction]:
            break
        best = fraction
    return best


class JudgedAt(NamedTuple):
    """A fraction of capacity at which kv is compared with round-robin, and why there."""

    fraction: float
    why: str


def judged_fractions(kv_best: float | None, rr_best: float | None, fractions: Sequence[float]) -> list[JudgedAt]:
    """Where the kv-vs-round-robin targets are read: the highest fraction both sustain (when
    one of them sustains none, the lowest fraction measured, said so), and the measured
    fraction nearest 1.0x capacity; one entry when the two are the same fraction."""
    check_fractions(fractions)
    ordered = sorted(fractions)
    if kv_best is not None and rr_best is not None:
        first = JudgedAt(min(kv_best, rr_best), "the highest fraction both sustain")
    else:
        missed = " and ".join(p for p, best in (("kv", kv_best), ("round-robin", rr_best)) if best is None)
        first = JudgedAt(ordered[0], f"the lowest fraction measured ({missed} sustained none)")
    nearest = min(ordered, key=lambda f: (abs(f - 1.0), f))
    at_capacity = JudgedAt(nearest, "capacity" if nearest == 1.0 else f"the fraction nearest capacity")
    if at_capacity.fraction == first.fraction:
        return [JudgedAt(first.fraction, f"{first.why}, and {at_capacity.why}")]
    return sorted([first, at_capacity])


# -- the report's pieces --------------------------------------------------------------------------


def fmt(value: float | None, digits: int = 2) -> str:
    """A number for the report; "-" for one not measured (None or NaN)."""
    return "-" if value is None or value != value else f"{value:.{digits}f}"


def fmt_ratio(value: float) -> str:
    """A ratio for the report: "2.1x", "inf" (against 0), "-" (0 against 0)."""
    return "inf" if value == math.inf else ("-" if value != value else f"{value:.1f}x")


def markdown_by_fraction(runs: Mapping[tuple[str, float], Mapping[str, Any]], policies: Sequence[str],
                         fractions: Sequence[float], cell: Callable[[Mapping[str, Any]], str]) -> list[str]:
    """A Markdown table with a row per fraction of capacity (its rate beside it) and a column
    per policy: cell(run) of each (policy, fraction) run, "*" after it when some of its
    requests did not finish, "-" where there is none."""
    rate_of = {fraction: run["rate"] for (_, fraction), run in runs.items()}
    lines = ["| x capacity | req/s | " + " | ".join(policies) + " |", "|" + "---|" * (2 + len(policies))]
    for f in fractions:
        cells = []
        for policy in policies:
            run = runs.get((policy, f))
            cells.append("-" if run is None else cell(run) + ("*" if run["num_ok"] < run["num_requests"] else ""))
        lines.append(f"| {f:g}x | {rate_of[f]:.2f} | " + " | ".join(cells) + " |")
    return lines
