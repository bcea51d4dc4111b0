"""Simulate kvserve clusters of many workers and compare placement policies.

    python -m loadtest.sim.run [--workers 16,64,256,1000] [--policies kv,round-robin]
        [--rates 10,25] [--workload trace|mixed|shared-prefix] [--unequal]
        [--blocks 256] [--requests-per-worker 60] [--out results/sim]

Every point is one simulated run: `requests-per-worker` x workers requests of the
workload arriving as a Poisson process at `rate` requests/s per worker (so the cluster
gets rate x workers), placed by the router's real policy, served by real engines whose
steps take the fitted cost model's time. --unequal gives the workers KV pools of
0.25, 0.5, 1.25 and 2 times --blocks in turn (same compute each: one CPU core).

Prints one table (latencies, throughput, goodput under the SLO, preemptions,
rejections, the engines' prefix-cache hit rate, the peak KV any worker had committed
against its pool, and the share of one core the router's placement work would take) and
the placement benchmark at each worker count; writes results.json and sim.png into --out.

The `prefix` policy places by the workers' prefix caches (the router's PrefixIndex, fed
by the workers' KV events); compare it with `kv` on --workload shared-prefix.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

from loadtest.metrics import RequestTimeline, summarize
from loadtest.sim import placement_bench
from loadtest.sim.cost_model import DEFAULT_COST_MODEL, CostModel, load_cost_model
from loadtest.sim.report import plot, print_table
from loadtest.sim.simulator import ClusterConfig, SimResult, simulate
from loadtest.sim.workload import UNEQUAL_FACTORS, make_trace, worker_blocks
from loadtest.trace import TraceRequest
from router.core import QUEUE_ORDERS, RouterConfig
from loadtest.sim.proposals import SIM_POLICIES

TTFT_SLO_S = 1.0
MEAN_ITL_SLO_S = 0.1


def log(message: str) -> None:
    print(f"[sim] {message}", file=sys.stderr, flush=True)


def meets_slo(timeline: RequestTimeline) -> bool:
    """The per-request SLO goodput counts: first token within 1 s, then 100 ms per token on average."""
    times = timeline.token_times
    if not times or timeline.ttft >= TTFT_SLO_S:
        return False
    return len(times) < 2 or (times[-1] - times[0]) / (len(times) - 1) < MEAN_ITL_SLO_S


def summarize_run(
    result: SimResult, trace: list[TraceRequest], rate_per_worker: float, placement: dict[str, Any]
) -> dict[str, Any]:
    """One table row: latencies and throughput of the placed requests, and what went wrong."""
    wanted = {r.request_id: r.output_len for r in trace}
    done = [t for request_id, t in result.timelines.items() if len(t.token_times) == wanted[request_id]]
    num_incomplete = len(result.timelines) - len(done)
    summary = summarize(done) if done else None
    makespan = summary.makespan if summary is not None else float("nan")
    num_good = sum(1 for t in done if meets_slo(t))
    num_workers = len(result.worker_blocks)
    peak_commit = max(c / b for c, b in zip(result.peak_committed_blocks, result.worker_blocks))
    # What one core would spend placing: every placement, plus the full choose() the real
    # router runs for each batch that arrives while requests wait (see routing.py).
    n = str(num_workers)
    place_s = 1.0 / placement["placements_per_s"][n][result.policy]
    choose_s = placement["decision_us"][n][result.policy]["p50_us"] * 1e-6
    router_s = (len(done) + num_incomplete) * place_s + result.num_batches_while_queued * choose_s
    classes = sorted(set(result.worker_blocks))
    kv_by_class = {
        str(blocks): [
            sum(u for u, b in zip(sample, result.worker_blocks) if b == blocks)
            / (blocks * result.worker_blocks.count(blocks))
            for sample in result.kv_used_blocks
        ]
        for blocks in classes
    }
    return {
        "workers": num_workers,
        "policy": result.policy,
        "rate_per_worker": rate_per_worker,
        "cluster_rate": rate_per_worker * num_workers,
        "num_requests": result.num_requests,
        "num_completed": len(done),
        "num_incomplete": num_incomplete,
        "num_failed": result.num_failed,
        "summary": asdict(summary) if summary is not None else None,
        "goodput_rps": num_good / makespan if makespan > 0 else float("nan"),
        "goodput_fraction": num_good / result.num_requests,
        "num_preemptions": result.num_preemptions,
        "prefix_cache_hit_rate": result.prefix_cache_hit_rate,
        "num_rejected": result.num_rejected,
        "rejected": {
            "queue_full": result.num_rejected_queue_full,
            "queue_wait": result.num_rejected_wait,
            "too_large": result.num_rejected_too_large,
        },
        "max_queue_length": result.max_queue_length,
        "num_backfilled": result.num_backfilled,
        "peak_commit_ratio": peak_commit,
        "batches_per_s": result.num_batches / makespan if makespan > 0 else float("nan"),
        "batches_while_queued": result.num_batches_while_queued,
        "router_placement_core_share": router_s / makespan if makespan > 0 else float("nan"),
        "num_steps": result.num_steps,
        "num_events": result.num_events,
        "virtual_s": result.end_time,
        "wall_s": result.wall_s,
        "kv_sample_times": result.kv_sample_times,
        "kv_used_fraction_by_pool": kv_by_class,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workers", default="16,64,256,1000")
    parser.add_argument(
        "--policies",
        default=",".join(SIM_POLICIES),
        help=f"comma-separated, of {', '.join(SIM_POLICIES)} (the router's own policies)",
    )
    parser.add_argument("--rates", default="25", help="arrival rates, requests/s per worker")
    parser.add_argument("--workload", default="trace")
    parser.add_argument("--unequal", action="store_true", help=f"KV pools of {UNEQUAL_FACTORS} x --blocks in turn")
    parser.add_argument("--blocks", type=int, default=256, help="KV blocks per worker (16 tokens, 128 KiB each)")
    parser.add_argument("--requests-per-worker", type=int, default=60)
    parser.add_argument("--max-queue", type=int, default=RouterConfig.max_queue)
    parser.add_argument("--max-queue-wait", type=float, default=RouterConfig.max_queue_wait_s)
    parser.add_argument("--queue-order", default=RouterConfig.queue_order, choices=QUEUE_ORDERS,
                        help="the router's admission queue: fifo, or backfill around a head that fits nowhere")
    parser.add_argument("--latency-ms", type=float, default=1.0, help="router<->worker message latency")
    parser.add_argument("--seed", type=int, default=7)
    parser.add_argument("--cost-model", type=Path, default=DEFAULT_COST_MODEL)
    parser.add_argument("--out", type=Path, default=Path("results/sim"))
    args = parser.parse_args(argv)
    worker_counts = [int(n) for n in args.workers.split(",") if n]
    policies = [p for p in args.policies.split(",") if p]
    rates = [float(r) for r in args.rates.split(",") if r]
    cost = load_cost_model(args.cost_model)

    log(f"placement benchmark at {worker_counts} workers")
    placement = placement_bench.run(worker_counts, policies, num_calls=1000)
    runs = []
    for num_workers in worker_counts:
        blocks = worker_blocks(num_workers, args.blocks, args.unequal)
        for rate in rates:
            trace = make_trace(args.workload, num_workers * args.requests_per_worker, rate * num_workers, args.seed)
            for policy in policies:
                router = RouterConfig(max_queue=args.max_queue, max_queue_wait_s=args.max_queue_wait,
                                      queue_order=args.queue_order)
                latency = args.latency_ms / 1e3
                config = ClusterConfig(blocks, policy, router, report_latency_s=latency, dispatch_latency_s=latency)
                result = simulate(trace, config, cost)
                row = summarize_run(result, trace, rate, placement)
                runs.append(row)
                log(f"{num_workers:>5} workers {policy:>14} @ {rate:g}/s/worker: {result.wall_s:6.1f} s wall, "
                    f"{result.end_time:6.2f} s virtual, {row['num_preemptions']} preemptions")
                if row["num_incomplete"] or row["num_failed"]:
                    log(f"  WARNING: {row['num_incomplete']} incomplete, {row['num_failed']} failed requests")

    report = build_report(args, cost, placement, runs)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "results.json").write_text(json.dumps(report, indent=2))
    print_table(report)
    plot(report, args.out / "sim.png")
    log(f"wrote {args.out / 'results.json'} and {args.out / 'sim.png'}")
    return 0


def build_report(
    args: argparse.Namespace, cost: CostModel, placement: dict[str, Any], runs: list[dict[str, Any]]
) -> dict[str, Any]:
    pools = f"{', '.join(f'{f:g}' for f in UNEQUAL_FACTORS)} x {args.blocks} blocks in turn" if args.unequal else (
        f"{args.blocks} blocks each"
    )
    return {
        "conditions": {
            "workload": args.workload,
            "requests_per_worker": args.requests_per_worker,
            "kv_pools": pools,
            "block": f"{cost.facts.block_size} tokens, {cost.facts.block_bytes} B",
            "engine": f"max_num_seqs {cost.facts.max_num_seqs}, "
            f"max_num_batched_tokens {cost.facts.max_num_batched_tokens}",
            "router": f"max_queue {args.max_queue}, max_queue_wait {args.max_queue_wait:g} s, "
            f"queue order {args.queue_order}, "
            f"latency {args.latency_ms:g} ms each way",
            "reports": "after every step (the actor's rule), StepBatch reaches the router after the latency",
            "slo": f"per request: TTFT < {TTFT_SLO_S:g} s and mean ITL < {MEAN_ITL_SLO_S * 1e3:g} ms",
            "cost_model": cost.to_json(),
            "machine": platform.machine(),
            "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        },
        "placement": placement,
        "runs": runs,
    }


if __name__ == "__main__":
    sys.exit(main())
