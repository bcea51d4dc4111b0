"""Latency metrics from per-request token timestamps: TTFT, ITL, throughput."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np


@dataclass
class RequestTimeline:
    arrival_time: float
    token_times: list[float] = field(default_factory=list)

    @property
    def ttft(self) -> float:
        return self.token_times[0] - self.arrival_time

    @property
    def itls(self) -> list[float]:
        t = self.token_times
        return [b - a for a, b in zip(t, t[1:])]


def percentile(values: Sequence[float], q: float) -> float:
    """Linear-interpolated percentile (numpy's default method), q in [0, 100]; NaN for no values.

    An unfinished request's latency is +inf, and a percentile that interpolates towards it
    is +inf; one that lands exactly on a finite value is that value. numpy's interpolation
    gives NaN in both cases (inf - inf, inf x 0), which is resolved here."""
    if not len(values):
        return float("nan")
    with np.errstate(invalid="ignore"):
        result = float(np.percentile(values, q))
    if math.isnan(result) and not any(math.isnan(v) for v in values):
        position = (len(values) - 1) * q / 100
        return float(np.percentile(values, q, method="lower")) if position == int(position) else math.inf
    return result


@dataclass(frozen=True)
class Summary:
    ttft_p50: float
    ttft_p99: float
    itl_p50: float
    itl_p99: float
    output_tokens_per_s: float
    num_requests: int
    num_output_tokens: int
    makespan: float


def summarize(timelines: list[RequestTimeline]) -> Summary:
    ttfts = [t.ttft for t in timelines]
    itls = [gap for t in timelines for gap in t.itls]
    num_tokens = sum(len(t.token_times) for t in timelines)
    start = min(t.arrival_time for t in timelines)
    end = max(t.token_times[-1] for t in timelines)
    makespan = end - start
    return Summary(
        ttft_p50=percentile(ttfts, 50),
        ttft_p99=percentile(ttfts, 99),
        itl_p50=percentile(itls, 50),
        itl_p99=percentile(itls, 99),
        output_tokens_per_s=num_tokens / makespan if makespan > 0 else float("nan"),
        num_requests=len(timelines),
        num_output_tokens=num_tokens,
        makespan=makespan,
    )
