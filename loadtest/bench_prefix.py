"""Prefix caching and prefix-aware placement on the real model, through a real cluster.

    python -m loadtest.bench_prefix [--groups 6] [--users 5] [--fractions 0.5,1,1.5,2,2.5,3,4] [--duration 40]
        [--slo-factor 1.5 | --ttft-slo S] [--capacity REQ_PER_S | --rates 0.4,0.8] [--out results/bench_prefix]
    make bench-prefix

A workload shaped like llm-d's prefix benchmark: G groups, each with a long shared system
prompt (about --system-tokens tokens of real English text: the standard library's own
documentation, through the model's chat template), several users per group asking short
questions, short answers (--max-tokens, greedy, EOS ignored so every answer has the same
length). The workers' KV is sized so that the groups' prefixes together are larger than
one worker's KV and smaller than the cluster's.

Rates and the SLO are measured, not fixed: what one cache miss costs depends on the hour
(a worker thread prefilled the ~1,050-token system prompt in ~3.5 s on one day and in
4.8-5.3 s on another, and a fixed 5 s SLO failed every miss). So the run starts with a
calibration on one fresh cluster of the same workers, policy `kv`, caching off:

    cold TTFT  after a warm-up request per worker (torch's first calls are slow), --cold-requests
               single requests one at a time, each its group's first: their median TTFT is
               what one miss costs on this machine now
    SLO        TTFT < --slo-factor (1.5) x the cold TTFT, half of the requests: a miss that does
               not queue meets it, one that waits behind another miss does not, a hit meets it
               with room to spare; --ttft-slo S sets it instead
    capacity   a closed loop (loadtest.policy_rates) keeping --capacity-concurrency (2 per
               worker) requests of the same workload (another seed) in flight: completions per
               second while the loop is full; --capacity REQ_PER_S sets it instead
    rates      each of --fractions (0.5,1,1.5,2,2.5,3,4) x that caching-off capacity: caching off
               should saturate near 1x, caching on much further (the steps of 0.5 up to 3 place the
               highest rate both placements sustain to half the capacity); --rates (req/s) sets them instead

Requests then arrive open loop as a Poisson process at each rate in turn (the same seeded
sequence of groups and users at every rate); a configuration past saturation at one rate
(a request unfinished, or under half within the TTFT SLO) is not run at the higher ones.

Five configurations run side by side in one run, each on a fresh cluster of the same
workers: `round-robin` (caching on), `kv` with caching off (`--no-prefix-caching`), `kv`
with caching on, `prefix`, and `prefix` with caching off (the default policy with the
cache off: it still places a group's requests together on its predictions, but every
request computes its whole prompt). Reported per configuration and rate (as a fraction of
the caching-off capacity and in req/s): TTFT p50/p90/p99, output tokens/s, goodput (the
share of requests whose TTFT met the SLO), and the prefix-cache hit rate (cached prompt
tokens over prompt tokens, from each response's usage) against the oracle's: the hit rate
of one infinite cache, where every request but its group's first finds its group's whole
system prompt cached.

Targets on this machine: caching on vs off, same policy, p90 TTFT at least 3x lower at
the fraction where caching off saturates (judged for `kv` and for `prefix`: `kv` spreads each
group over every worker, so with the groups' prefixes larger than one worker's KV its hit
rate is bounded well below the oracle's whatever the cache does); prefix vs kv (both
caching on) p90 TTFT at least 3x lower and goodput at least 1.5x at the highest fraction
both sustain; prefix's hit rate at least 90% of the oracle's. Writes
results/bench_prefix/{results.json,output.txt,bench_prefix.png}, with the calibration
(cold TTFTs, factor, SLO, capacity) in results.json and above the table.

This file is the run (calibration, the clusters, one configuration at each load); the
workload is loadtest/prefix_workload.py, the client process loadtest/prefix_client.py,
and the rows, targets, table and plot loadtest/prefix_report.py.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import math
import multiprocessing
import random
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any, NamedTuple

from loadtest.policy_rates import closed_loop_capacity, parse_fractions, rates_at
from loadtest.prefix_client import client_main, closed_loop, replay
from loadtest.prefix_report import describe_load, plot, print_table, summarize, targets
from loadtest.prefix_workload import PrefixRequest, first_of_groups, make_workload, oracle_hit_rate, system_prompts
from loadtest.report import Slo, log, write_results
from router.placement import PrefixWeights

MiB = 2**20
CONFIGS = (  # (label, policy, prefix caching)
    ("round-robin", "round-robin", True),
    ("kv-no-cache", "kv", False),
    ("kv", "kv", True),
    ("prefix", "prefix", True),
    ("prefix-no-cache", "prefix", False),
)
DEFAULT_FRACTIONS = (0.5, 1.0, 1.5, 2.0, 2.5, 3.0, 4.0)  # of the caching-off capacity


def slo_for(ttft_slo_s: float | None, slo_factor: float, cold_ttft_s: float | None) -> Slo:
    """TTFT within ttft_slo_s when it is given, else within slo_factor x the cold TTFT measured
    at the start; a rate is sustained while every request finishes and half meet it."""
    if not (slo_factor > 0 and math.isfinite(slo_factor)):
        raise ValueError(f"--slo-factor must be positive and finite, got {slo_factor}")
    if ttft_slo_s is None:
        if cold_ttft_s is None:
            raise ValueError("no --ttft-slo and no cold TTFT measured to derive the SLO from")
        ttft_slo_s = round(slo_factor * cold_ttft_s, 2)  # to 10 ms: finer is noise, and it reads plainly
    return Slo(ttft_s=ttft_slo_s, percentile=50)


class RatePoint(NamedTuple):
    """One offered load: its fraction of the caching-off capacity, and its arrival rate."""

    fraction: float | None  # None: --rates gave req/s and no capacity is known to divide by
    rate: float  # req/s


def plan_rates(
    fractions: Sequence[float], rates: Sequence[float] | None, capacity_rps: float | None
) -> list[RatePoint]:
    """The loads to offer, ascending: --rates when given (as fractions of capacity_rps when it
    is known), else each fraction of capacity_rps (policy_rates.rates_at)."""
    if rates:
        if not all(r > 0 and math.isfinite(r) for r in rates):
            raise ValueError(f"--rates must be positive and finite, got {tuple(rates)}")
        return [RatePoint(r / capacity_rps if capacity_rps else None, r) for r in sorted(rates)]
    if capacity_rps is None:
        raise ValueError("neither --rates nor a capacity to take --fractions of")
    return [RatePoint(f, r) for f, r in rates_at(capacity_rps, fractions).items()]


# -- the clusters -----------------------------------------------------------------------------


@contextlib.contextmanager
def fresh_cluster(args: argparse.Namespace, policy: str, caching: bool, worker_kv: int) -> Iterator[str]:
    """A cluster of --workers workers of the real model with `policy`, prefix caching on or
    off, started fresh; yields its address, and stops it and removes its state on leaving."""
    from cluster.local import ClusterConfig
    from loadtest.bench_policies import LocalCluster
    from router.core import RouterConfig
    from router.server import ServerConfig
    from workers.config import EngineArgs

    state = Path(tempfile.mkdtemp(prefix="bench-prefix-"))
    engine = EngineArgs(model=args.model, kv_cache_memory=worker_kv, num_threads=1,
                        enable_prefix_caching=caching, max_num_batched_tokens=args.max_num_batched_tokens)
    config = ClusterConfig(engine=engine, num_workers=args.workers, worker_cpus=1, state_dir=state,
                           router=RouterConfig(policy=policy, max_queue=1024, max_queue_wait_s=600,
                                               prefix_weights=PrefixWeights(evict_weight=args.evict_weight)),
                           server=ServerConfig(port=0), metrics_port=None)  # fmt: skip
    cluster = LocalCluster(config)
    try:
        yield cluster.start()
    finally:
        cluster.stop()
        shutil.rmtree(state, ignore_errors=True)


class Calibration(NamedTuple):
    """What one miss costs and how fast caching off serves, measured at the start of the run."""

    cold_ttfts_s: list[float]  # each cold request's TTFT, in the order they ran
    cold_ttft_s: float  # their median
    capacity: dict[str, Any] | None  # the closed loop's numbers; None when it was not run


def cold_ttft(rows: Sequence[dict[str, Any]]) -> float:
    """The median TTFT of the cold requests that finished; one slow outlier does not move it."""
    ttfts: list[float] = [r["ttft"] for r in rows if r.get("ok") and "ttft" in r]
    if not ttfts:
        raise RuntimeError(f"no cold request finished ({[r.get('error', 'unfinished') for r in rows]})")
    return statistics.median(ttfts)


def capacity_of(rows: Sequence[dict[str, Any]], concurrency: int) -> dict[str, Any] | None:
    """A closed loop's completions per second while it was full (policy_rates.closed_loop_capacity),
    from each finished request's end; None when too few finished to measure one."""
    finishes = [r["sent"] + r["e2e"] for r in rows if r.get("ok")]
    measured = closed_loop_capacity(finishes, concurrency)
    if measured is None:
        return None
    return {"requests_per_s": measured.requests_per_s, "num_requests": len(rows), "num_ok": len(finishes),
            "concurrency": concurrency, "num_counted": measured.num_counted, "window_s": measured.window_s}


def calibrate(args: argparse.Namespace, workload: list[PrefixRequest], worker_kv: int, conn: Any,
              measure_capacity: bool) -> Calibration:
    """On a fresh cluster of the same workers, policy kv, caching off: the cold TTFT, then
    (when measure_capacity) the capacity of a closed loop over the workload."""
    concurrency = args.capacity_concurrency or 2 * args.workers
    warm_up, rest = workload[: args.workers], workload[args.workers :]
    cold = first_of_groups(rest, args.cold_requests)
    # The loop's requests follow the last cold one (caching is off: none would hit anyway).
    loop = rest[rest.index(cold[-1]) + 1 :][: args.capacity_requests or 2 * concurrency + 12]
    log(f"calibration: kv, caching off, {args.workers} workers: starting a cluster")
    with fresh_cluster(args, "kv", False, worker_kv) as address:
        # A request per worker at once: torch's first calls in each worker are not a miss's cost.
        rows = closed_loop(conn, address, warm_up, len(warm_up), args)
        log(f"calibration: warm-up on {sorted({r.get('worker', '?') for r in rows})}")
        rows = closed_loop(conn, address, cold, 1, args)  # one at a time on the idle cluster
        ttfts = [r.get("ttft", math.inf) if r.get("ok") else math.inf for r in rows]
        median = cold_ttft(rows)
        log(f"calibration: cold TTFT {median:.2f} s, the median of {', '.join(f'{t:.2f}' for t in ttfts)} s")
        capacity = None
        if measure_capacity:
            log(f"calibration: closed loop of {len(loop)} requests, {concurrency} in flight")
            began = time.monotonic()
            rows = closed_loop(conn, address, loop, concurrency, args)
            capacity = capacity_of(rows, concurrency)
            if capacity is None:
                raise RuntimeError(f"the closed loop finished {sum(1 for r in rows if r.get('ok'))} of {len(rows)} "
                                   f"requests: too few to measure a capacity with {concurrency} in flight")
            capacity.update(seconds=time.monotonic() - began,
                            source=f"closed loop, kv, caching off, {concurrency} in flight")
            log(f"calibration: capacity with caching off {capacity['requests_per_s']:.3f} req/s "
                f"({capacity['num_counted']} finishes in {capacity['window_s']:.0f} s while full)")
    return Calibration(ttfts, median, capacity)


# -- one configuration --------------------------------------------------------------------


class RunSetup(NamedTuple):
    """What every configuration's run shares: the flags, the workload, the loads to offer,
    the SLO, each worker's KV bytes, and the pipe to the client process."""

    args: argparse.Namespace
    workload: list[PrefixRequest]
    points: list[RatePoint]
    slo: Slo
    worker_kv: int
    conn: Any


def run_config(setup: RunSetup, label: str, policy: str, caching: bool) -> list[dict[str, Any]]:
    """One configuration on a fresh cluster: each load in turn, up to the first it does not sustain."""
    args, rows = setup.args, []
    with fresh_cluster(args, policy, caching, setup.worker_kv) as address:
        offset = 0
        for point in setup.points:
            count = max(args.min_requests, int(point.rate * args.duration))
            batch = setup.workload[offset : offset + count]
            offset += count
            # Seeded by the fraction: at one fraction the arrivals have one shape whatever the capacity.
            rng = random.Random(args.seed + round((point.fraction or point.rate) * 1000))
            arrivals, t = [], 0.0
            for _ in batch:
                t += rng.expovariate(point.rate)
                arrivals.append(t)
            log(f"{label}: {count} requests at {describe_load(point.fraction, point.rate)}")
            results = replay(setup.conn, address, batch, arrivals, args)
            row = {**summarize(label, point.rate, results, setup.slo, arrivals), "fraction": point.fraction}
            row["trace"] = results  # per request: group, worker, sent, TTFT, cached and prompt tokens
            log(f"  TTFT p50 {row['ttft_p50']:.2f} s p90 {row['ttft_p90']:.2f} s, goodput {row['goodput']:.0%}, "
                f"hit rate {row['hit_rate']:.0%}, {row['output_tokens_per_s']:.1f} tok/s")
            rows.append(row)
            if not row["sustained"]:
                log(f"  {label} is past saturation at {describe_load(point.fraction, point.rate)}: "
                    "its higher rates are not run")
                break
    return rows


def main(argv: list[str] | None = None) -> int:
    from workers.model.named_models import DEFAULT_MODEL

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=DEFAULT_MODEL)
    parser.add_argument("--groups", type=int, default=6)
    parser.add_argument("--users", type=int, default=5)
    parser.add_argument("--system-tokens", type=int, default=1000)
    parser.add_argument("--max-tokens", type=int, default=8)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--worker-kv", type=int, default=None,
                        help="bytes per worker (default: 3.6 groups' prefixes, so all of them fit in two workers, not one)")
    parser.add_argument("--fractions", default=",".join(f"{f:g}" for f in DEFAULT_FRACTIONS),
                        help="arrival rates as fractions of the caching-off capacity measured at the start")
    parser.add_argument("--rates", default=None, help="arrival rates in req/s instead of --fractions")
    parser.add_argument("--capacity", type=float, default=None,
                        help="req/s to take as the caching-off capacity instead of measuring it")
    parser.add_argument("--capacity-concurrency", type=int, default=None,
                        help="requests the closed loop keeps in flight (default: 2 per worker)")
    parser.add_argument("--capacity-requests", type=int, default=None,
                        help="requests in the closed loop (default: 2 x its concurrency + 12)")
    parser.add_argument("--cold-requests", type=int, default=3, help="single requests timed for the cold TTFT")
    parser.add_argument("--duration", type=float, default=40.0, help="seconds of arrivals per rate")
    parser.add_argument("--min-requests", type=int, default=12)
    parser.add_argument("--drain", type=float, default=120.0)
    parser.add_argument("--ttft-slo", type=float, default=None,
                        help="seconds; goodput counts requests within it (default: --slo-factor x the cold TTFT)")
    parser.add_argument("--slo-factor", type=float, default=1.5,
                        help="the SLO in cold TTFTs: a miss that does not queue meets 1.5, one behind another does not")
    parser.add_argument("--max-num-batched-tokens", type=int, default=512)
    parser.add_argument("--configs", default=",".join(c[0] for c in CONFIGS))
    parser.add_argument("--evict-weight", type=float, default=PrefixWeights.evict_weight,
                        help="the prefix policy's --evict-weight (0: evictions cost nothing, as before 2026-12-03)")
    parser.add_argument("--seed", type=int, default=7)
    parser.add_argument("--out", type=Path, default=Path("results/bench_prefix"))
    args = parser.parse_args(argv)
    # Bad flags fail here, before any cluster starts.
    try:
        fractions = parse_fractions(args.fractions)
        rates = [float(r) for r in args.rates.split(",") if r.strip()] if args.rates else None
        plan_rates(fractions, rates, args.capacity or 1.0)
        slo_for(args.ttft_slo, args.slo_factor, 1.0)
    except ValueError as exc:
        parser.error(str(exc))
    if args.capacity is not None and not (args.capacity > 0 and math.isfinite(args.capacity)):
        parser.error(f"--capacity must be positive and finite, got {args.capacity}")
    concurrency = args.capacity_concurrency or 2 * args.workers
    if concurrency < 1 or args.cold_requests < 1:
        parser.error(f"--capacity-concurrency and --cold-requests must be >= 1, got {concurrency}, "
                     f"{args.cold_requests}")
    if args.capacity_requests is not None and args.capacity_requests < 2 * concurrency + 4:
        parser.error(f"--capacity-requests must be >= 2 x --capacity-concurrency + 4 ({2 * concurrency + 4}), "
                     f"got {args.capacity_requests}: the closed loop counts only while it is full")
    wanted = [c.strip() for c in args.configs.split(",")]
    configs = [c for c in CONFIGS if c[0] in wanted]
    args.out.mkdir(parents=True, exist_ok=True)

    import torch

    from router.chat import ChatMessage, ChatTemplate
    from workers.model.loader import load_model

    log(f"building the workload on {args.model}'s tokenizer and chat template")
    tokenizer = load_model(args.model, torch.device("cpu"), torch.float32).tokenizer
    template = ChatTemplate.of(tokenizer)
    system = system_prompts(args.groups, args.system_tokens, tokenizer.encode)

    assert template is not None, f"{args.model} has no chat template"

    def ids(messages: list[ChatMessage]) -> tuple[int, ...]:
        return template.encode(messages, "messages").prompt_ids

    def rendered_len(request: PrefixRequest) -> int:
        return len(ids([ChatMessage(r, c) for r, c in request.messages]))

    def common(a: tuple[int, ...], b: tuple[int, ...]) -> int:
        return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))

    # What every request of a group shares: its rendered system turn (two questions' common prefix).
    shared = {g: common(ids([ChatMessage("system", system[g]), ChatMessage("user", "a?")]),
                        ids([ChatMessage("system", system[g]), ChatMessage("user", "b!")]))
              for g in range(args.groups)}
    block_size = 16
    kv_per_token = 2 * 30 * 3 * 64 * 4  # SmolLM2: layers x kv heads x head dim x fp32, K and V
    prefix_bytes = sum(shared.values()) / args.groups * kv_per_token
    worker_kv = args.worker_kv if args.worker_kv is not None else int(3.6 * prefix_bytes)
    log(f"{args.groups} groups x ~{sum(shared.values()) // args.groups} shared tokens "
        f"({prefix_bytes / MiB:.0f} MiB of KV each); {args.workers} workers x {worker_kv / MiB:.0f} MiB")

    import ray

    context = multiprocessing.get_context("spawn")
    conn, child = context.Pipe()
    client = context.Process(target=client_main, args=(child,), daemon=True)
    client.start()
    rows: list[dict[str, Any]] = []
    # One Ray for every configuration, started here as bench_policies does: a Cluster that
    # starts Ray itself stops the processes under this one when it stops, the client too.
    ray.init(num_cpus=8, include_dashboard=False, logging_level=logging.WARNING)
    try:
        need_capacity = rates is None and args.capacity is None
        calibration = None
        if need_capacity or args.ttft_slo is None:
            # Another seed: the same shapes, other groups and users in another order.
            calibration = calibrate(args, make_workload(args.groups, args.users, system, args.seed + 1000),
                                    worker_kv, conn, need_capacity)
        slo = slo_for(args.ttft_slo, args.slo_factor, calibration.cold_ttft_s if calibration else None)
        capacity = calibration.capacity if calibration and calibration.capacity else None
        if args.capacity is not None:
            capacity = {"requests_per_s": args.capacity, "source": "given (--capacity)"}
        points = plan_rates(fractions, rates, capacity["requests_per_s"] if capacity else None)
        log(f"SLO {slo.describe()} ({_slo_source(args, calibration)}); "
            f"rates {', '.join(describe_load(p.fraction, p.rate) for p in points)}")
        count = sum(max(args.min_requests, int(p.rate * args.duration)) for p in points)
        workload = make_workload(args.groups, args.users, system, args.seed, count)
        setup = RunSetup(args, workload, points, slo, worker_kv, conn)
        for label, policy, caching in configs:
            rows.extend(run_config(setup, label, policy, caching))
    finally:
        ray.shutdown()
        conn.send(("stop", ()))
        client.join(timeout=30)

    def oracle_of(n: int) -> float:
        return oracle_hit_rate(workload[:n], shared, block_size, rendered_len)

    report = {"conditions": {**vars(args), "worker_kv": worker_kv, "slo": slo.describe(),
                             "sustained": f"every request finished and {slo.describe_sustained()}",
                             "date": time.strftime("%Y-%m-%d")},
              "calibration": {"cold_ttfts_s": calibration.cold_ttfts_s if calibration else None,
                              "cold_ttft_s": calibration.cold_ttft_s if calibration else None,
                              "slo_factor": args.slo_factor, "ttft_slo_s": slo.ttft_s,
                              "slo_source": _slo_source(args, calibration), "capacity": capacity},
              "oracle_hit_rate": oracle_of(count), "rows": rows, "targets": targets(rows, oracle_of)}  # fmt: skip
    write_results(args.out, report, lambda: print_table(report), {"bench_prefix.png": lambda p: plot(report, p)})
    return 0


def _slo_source(args: argparse.Namespace, calibration: Calibration | None) -> str:
    if args.ttft_slo is not None or calibration is None:
        return "given (--ttft-slo)"
    return f"{args.slo_factor:g} x the cold TTFT"


if __name__ == "__main__":
    sys.exit(main())
