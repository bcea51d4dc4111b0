"""How long the router's placement takes, and how many placements one core can make.

    python -m loadtest.sim.placement_bench [--workers 16,64,256,1000]

Times router/placement.py's real policies over N WorkerViews in a realistic state: each
with a report, ~30 outstanding requests, and 0-3 in-flight reservations (a reservation
lives from a placement to the worker's next StepBatch, one engine step, so a worker
rarely has more). It reports:

* decision time: one policy.choose() call, p50 and p99 in microseconds;
* placements/s: choose + place + release (the router's per-request placement work)
  back to back on one core.

Token-event cost (Redis pipeline, listeners) is measured by the router benchmark
(loadtest/bench_router.py), not here.
"""

from __future__ import annotations

import argparse
import gc
import json
import random
import sys
import time
from collections import deque
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from loadtest.metrics import percentile
from loadtest.sim.proposals import SIM_POLICIES, make_sim_policy
from router.placement import WorkerView
from workers.messages import KVReport, WorkerInfo
from workers.model.tokenizer import TokenizerSpec

NEED_BLOCKS = 6  # a trace request: (64 prompt + 32 output) tokens in 16-token blocks
MAX_OUTSTANDING = 512


def make_views(num_workers: int, seed: int) -> list[WorkerView]:
    rng = random.Random(seed)
    views = []
    for i in range(num_workers):
        num_blocks = 256
        info = WorkerInfo(
            f"w{i}", "bench", "tiny", "cpu", "float32", 258, 2048, 16, 131072, num_blocks, TokenizerSpec(None, None, ())
        )
        committed = rng.randint(num_blocks // 4, num_blocks - 2 * NEED_BLOCKS)
        report = KVReport(f"w{i}", 1, 0.0, num_blocks, num_blocks - committed, committed, 131072, 30, 0, 0, 100)
        reservations = {f"q{i}-{j}": NEED_BLOCKS for j in range(rng.choice((0, 0, 1, 1, 2, 3)))}
        outstanding = {f"r{i}-{j}" for j in range(rng.randint(20, 40))} | set(reservations)
        view = WorkerView(info, report=report, last_report_at=0.0)
        for request_id, blocks in reservations.items():
            view.place(request_id, blocks)  # keeps whatever running totals the view maintains
        view.outstanding |= outstanding
        views.append(view)
    return views


def _time_calls(call: Callable[[], object], num_calls: int) -> list[float]:
    """Seconds per call, each timed on its own, with the collector off while timing."""
    for _ in range(min(200, num_calls)):
        call()
    times = []
    gc.disable()
    try:
        for _ in range(num_calls):
            start = time.perf_counter()
            call()
            times.append(time.perf_counter() - start)
    finally:
        gc.enable()
    return times


def decision_times(policy_name: str, num_workers: int, num_calls: int) -> dict[str, float]:
    """p50/p99 microseconds of one choose() over num_workers views."""
    views = make_views(num_workers, seed=num_workers)
    policy = make_sim_policy(policy_name, MAX_OUTSTANDING)
    times = _time_calls(lambda: policy.choose(views, NEED_BLOCKS), num_calls)
    return {"p50_us": percentile(times, 50) * 1e6, "p99_us": percentile(times, 99) * 1e6}


def placements_per_second(policy_name: str, num_workers: int, num_placements: int, block: int = 50) -> float:
    """choose + place + release back to back, in blocks of `block`; each release ends the
    oldest placement, so the views stay in their realistic state. The median block sets
    the rate, so a burst from another process on a shared machine does not."""
    views = make_views(num_workers, seed=num_workers)
    policy = make_sim_policy(policy_name, MAX_OUTSTANDING)
    live: deque[tuple[WorkerView, str]] = deque()
    block_times = []
    gc.disable()
    try:
        for first in range(0, max(num_placements, block), block):
            start = time.perf_counter()
            for i in range(first, first + block):
                view = policy.choose(views, NEED_BLOCKS)
                assert view is not None
                request_id = f"p{i}"
                view.place(request_id, NEED_BLOCKS)
                live.append((view, request_id))
                if len(live) > num_workers:
                    old_view, old_id = live.popleft()
                    old_view.release(old_id)
            block_times.append(time.perf_counter() - start)
    finally:
        gc.enable()
    return block / percentile(block_times, 50)


def run(worker_counts: Sequence[int], policies: Sequence[str], num_calls: int = 2000) -> dict[str, Any]:
    result: dict[str, Any] = {
        "conditions": {
            "need_blocks": NEED_BLOCKS,
            "view_state": "report with 25-95% of 256 blocks committed, 20-40 outstanding, 0-3 reservations",
            "calls_per_point": num_calls,
        },
        "decision_us": {},
        "placements_per_s": {},
    }
    for n in worker_counts:
        result["decision_us"][str(n)] = {p: decision_times(p, n, num_calls) for p in policies}
        result["placements_per_s"][str(n)] = {p: placements_per_second(p, n, num_calls) for p in policies}
    return result


def print_table(result: dict[str, Any]) -> None:
    decisions, rates = result["decision_us"], result["placements_per_s"]
    policies = list(next(iter(decisions.values())))
    print("\nPlacement on one core: choose() p50 / p99 us, and placements/s (choose + place + release)")
    head = f"{'workers':>8}" + "".join(f"{p:>30}" for p in policies)
    print(head)
    print("-" * len(head))
    for n, row in decisions.items():
        cells = "".join(
            f"{row[p]['p50_us']:>9.1f} /{row[p]['p99_us']:>7.1f} us {rates[n][p]:>8.0f}/s" for p in policies
        )
        print(f"{n:>8}{cells}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workers", default="16,64,256,1000")
    parser.add_argument("--policies", default=",".join(SIM_POLICIES))
    parser.add_argument("--calls", type=int, default=2000)
    parser.add_argument("--out", type=Path, default=Path("results/sim"))
    args = parser.parse_args(argv)
    result = run([int(n) for n in args.workers.split(",")], args.policies.split(","), args.calls)
    print_table(result)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "placement.json").write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
