"""What a simulated run is fed: a timed trace of requests, and the workers' KV pool sizes.

Request shapes are the load tests' own (loadtest/trace.py for `trace`, the seed
chapter's trace; loadtest/workloads.py for the others), arriving as a Poisson process.
"""

from __future__ import annotations

import math
import random

from loadtest.trace import TraceRequest, poisson_trace
from loadtest.workloads import WORKLOADS, WorkloadConfig, make_workload

# KV pool of worker i under --unequal: the base size times these, in turn (mean 1).
UNEQUAL_FACTORS = (0.25, 0.5, 1.25, 2.0)


def make_trace(workload: str, num_requests: int, rate: float, seed: int = 7) -> list[TraceRequest]:
    """num_requests requests of `workload` arriving at `rate` per second on average.

    Shapes depend only on the seed, not the rate, so every rate replays the same
    requests, only closer together (as poisson_trace does).
    """
    if workload not in WORKLOADS:
        raise ValueError(f"workload must be one of {', '.join(WORKLOADS)}, got {workload!r}")
    if workload == "trace":
        return poisson_trace(num_requests, rate, seed=seed)
    if not rate > 0:
        raise ValueError(f"rate must be positive, got {rate}")
    source = make_workload(WorkloadConfig(name=workload, seed=seed))
    shapes = random.Random(seed)
    gaps = random.Random(seed + 1)
    clock = 0.0
    trace = []
    for index in range(num_requests):
        request = source.sample(shapes)
        trace.append(TraceRequest(f"{workload}-{index}", clock, request.prompt_ids, request.max_tokens))
        if math.isfinite(rate):
            clock += gaps.expovariate(1.0) / rate
    return trace


def worker_blocks(num_workers: int, base_blocks: int, unequal: bool) -> tuple[int, ...]:
    """Each worker's KV pool in blocks: all base_blocks, or base_blocks x UNEQUAL_FACTORS in turn."""
    if num_workers < 1 or base_blocks < 1:
        raise ValueError(f"need num_workers >= 1 and base_blocks >= 1, got {num_workers} and {base_blocks}")
    if not unequal:
        return (base_blocks,) * num_workers
    return tuple(max(1, round(base_blocks * UNEQUAL_FACTORS[i % len(UNEQUAL_FACTORS)])) for i in range(num_workers))
