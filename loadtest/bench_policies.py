"""Placement policies on a real cluster: the same open-loop trace through each policy, at
the same fractions of the cluster's capacity, measured at the start of the run.

    python -m loadtest.bench_policies [--policies kv,kv-least-loaded,least-requests,round-robin,random]
        [--fractions 0.5,0.7,0.85,1,1.2] [--num-requests 100] [--capacity REQ_PER_S]
        [--worker-kv-cache-memory 12MiB,36MiB] [--out results/bench_policies]
    python -m loadtest.bench_policies --policies kv@1,kv@0.5,round-robin   # kv at two --kv-reserve-ratio
    python -m loadtest.bench_policies --policies kv,kv@0.5-0.1 --max-tokens-factor 4
        # a fixed ratio against one that learns how long answers are (never below
        # --kv-reserve-floor 0.1), on answers that end at a quarter of max_tokens (the client
        # ends each stream there, as EOS would)
    python -m loadtest.bench_policies --policies kv,kv+backfill,round-robin   # --queue-order backfill too
    python -m loadtest.bench_policies --address HOST:PORT --policy-label kv   # a running cluster
    python -m loadtest.bench_policies --policies kv,round-robin --num-requests 300 --repeats 3
        # three rounds of the same trace at round 1's capacity, judged on every round's
        # requests pooled (loadtest.policy_rounds); each round's own report in OUT/round-K

A local cluster (Ray, embedded redis-server, the router in this process, CPU workers of
unequal KV budgets) is started fresh for each policy under one ray.init. The `mixed`
workload (80% short chats, 20% 512-1024-token documents with 128-256 output tokens) is
generated once with a seed, and the same requests are replayed at each arrival rate as
a Poisson process, open loop, by streaming Generate calls from a client process of its
own. After the real runs, the simulator (loadtest.sim) replays the same trace on the same
worker pools at the same rates, so both sides are read off one table.

Rates are fractions of a capacity measured in this run (loadtest.policy_rates): on the
first policy's cluster (kv by default), right after its warm-up, a closed loop keeps
--capacity-concurrency requests of the same workload in flight, and the completions per
second while the loop is full are the capacity. Measured, not priced: the cost model
prices the engine's steps, not the actor around them nor what else the machine runs (on
2026-12-01 a worker step took 18.6 ms against the 5.2 ms it prices), while the closed
loop costs ~30 s and sees the cluster exactly as the timed runs will. One capacity is the
yardstick for every policy, so equal fractions are equal offered loads. --capacity sets
it instead (to compare runs at the same absolute rates).

The default pools, 12 and 36 MiB (96 and 288 blocks of 16 tokens), make KV the scarce
resource: a long request holds up to 80 blocks at its longest (prompt + max_tokens), so
the small worker has room for one and the large one for three or four; the router commits
it less (its prompt and half its output at the default --kv-reserve-ratio, 38-72 blocks),
so the small worker may take two of the shorter ones.

Reported: per policy the highest fraction (and rate) it sustains within the SLO (every
request finished, 99% of them TTFT < 2 s and mean ITL < 200 ms; a pass above a miss does
not count), p99 TTFT and preemptions at each fraction, and the targets, `kv` with at least
2x lower p99 TTFT than `round-robin` and 5x fewer preemptions, judged at the highest
fraction both sustain and at 1.0x capacity; the simulator's TTFT p50/p99 and tokens/s
within 25% of the real ones.

With --address the benchmark drives a cluster someone else started: its policy cannot be
switched from here, so only the running policy is measured (name it with --policy-label),
and KV comes from polling ClusterStatus instead of every worker report.

Writes results.md (the tables), results.json, latency.png (TTFT and ITL CDFs), rates.png
(throughput, goodput, p99 TTFT, preemptions and rejections against the fraction of
capacity) and kv.png (KV per worker over time) into --out; progress goes to stderr.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import math
import os
import platform
import shutil
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Coroutine
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple, TypeVar

from loadtest.metrics import percentile, summarize
from loadtest.policy_rates import (
    DEFAULT_FRACTIONS,
    Capacity,
    JudgedAt,
    check_fractions,
    closed_loop_capacity,
    highest_sustained,
    judged_fractions,
    markdown_by_fraction,
    parse_fractions,
    rates_at,
)
from loadtest.policy_rates import fmt as _f
from loadtest.policy_rates import fmt_ratio as _ratio
from loadtest.policy_rounds import judge_pooled, plot_rounds, pool_rounds, rounds_markdown
from loadtest.policy_replay import (
    LONG_PROMPT_TOKENS,
    SLO,
    ClientProcess,
    KVRecorder,
    KVSample,
    MeasuredRun,
    StatusPoller,
    replay_once,
    summarize_run,
    wait_idle,
)
from loadtest.report import Column, RequestLatency, Slo, Table, figure, log, write_results
from loadtest.sim.cost_model import CostModel, StepShape
from loadtest.sim.workload import make_trace
from loadtest.trace import TraceRequest

if TYPE_CHECKING:
    from cluster.local import ClusterConfig

T = TypeVar("T")
MiB = 2**20
TARGET_TTFT_RATIO = 2.0  # round-robin p99 TTFT / kv p99 TTFT, at each judged fraction of capacity
TARGET_PREEMPTION_RATIO = 5.0  # round-robin preemptions / kv preemptions, there too
TARGET_SIM_AGREEMENT = 0.25  # |sim - real| / real
# SLO (from policy_replay, which judges the real runs with it) judges the simulated ones too.
CPU_TABLE = Table((
    Column("policy", 0), Column("req/s", 0, ".2f"), Column("workers", 0, ".2f"),
    Column("router (this process)", 0, ".2f"), Column("client", 0, ".2f"), Column("redis", 0, ".2f"),
    Column("Ray daemons", 0, ".2f"), Column("other processes", 0, ".2f"), Column("client lag max s", 0, ".3f"),
))
CPU_ROLES = ("workers", "router", "clients", "redis", "ray daemons", "other processes")


def runs_table(workers: list[str]) -> Table:
    """The real cluster's table; its peak commit and placed columns name each worker."""
    return Table((
        Column("policy", 0), Column("x capacity", 0, "g"), Column("req/s", 0, ".2f"), Column("ok", 0), Column("TTFT p50 s", 0, ".2f"),
        Column("TTFT p99 s", 0, ".2f"), Column("ITL p50 ms", 0, ".1f", scale=1e3),
        Column("ITL p99 ms", 0, ".0f", scale=1e3), Column("tok/s", 0, ".0f"), Column("goodput req/s", 0, ".2f"),
        Column("good %", 0, ".0f", scale=100), Column("sustained", 0), Column("preempt", 0), Column("rejected", 0), Column("incomplete", 0),
        Column("peak commit " + "/".join(workers), 0), Column("placed " + "/".join(workers), 0),
        Column("worker CPU", 0, ".2f"),
    ))


@dataclass(frozen=True)
class BenchConfig:
    """What one benchmark run replays, and against which cluster."""

    policies: tuple[str, ...]
    fractions: tuple[float, ...]  # of the measured capacity, one timed run each per policy
    num_requests: int
    worker_kv_cache_memory: tuple[int, ...]
    capacity_rps: float | None = None  # None: measured by a closed loop at the start of the run
    capacity_requests: int = 160  # the closed loop's requests (the same workload, another seed)
    capacity_concurrency: int = 32  # requests it keeps in flight: more than the pools run at once
    workload: str = "mixed"
    seed: int = 7
    drain_s: float = 30.0  # after the last arrival, how long in-flight requests may still finish
    max_queue: int = 256
    max_queue_wait_s: float = 30.0
    kv_reserve_ratio: float | None = None  # None: RouterConfig's default
    # max_tokens = ceil(factor x output length); the client ends each stream at the output
    # length, as EOS would (policy_replay.generate_request). 1: they are the same.
    max_tokens_factor: float = 1.0
    address: str | None = None
    policy_label: str = "running"

    def __post_init__(self) -> None:
        if not self.policies:
            raise ValueError("BenchConfig.policies must name at least one policy (each may end in @RATIO)")
        for entry in self.policies:
            try:
                _router_config(self, entry)  # RouterConfig checks the policy's name and the ratio
            except ValueError as exc:
                raise ValueError(f"BenchConfig.policies: {entry!r}: {exc}") from None
        try:
            check_fractions(self.fractions)
        except ValueError as exc:
            raise ValueError(f"BenchConfig.{exc}") from None
        if self.capacity_rps is not None and not (self.capacity_rps > 0 and math.isfinite(self.capacity_rps)):
            raise ValueError(f"BenchConfig.capacity_rps must be positive and finite or None, got {self.capacity_rps}")
        if self.capacity_concurrency < 1:
            raise ValueError(f"BenchConfig.capacity_concurrency must be >= 1, got {self.capacity_concurrency}")
        if self.capacity_requests < 2 * self.capacity_concurrency + 10:
            raise ValueError(f"BenchConfig.capacity_requests must be >= 2 x capacity_concurrency + 10 "
                             f"({2 * self.capacity_concurrency + 10}), got {self.capacity_requests}")
        if self.num_requests < 1:
            raise ValueError(f"BenchConfig.num_requests must be >= 1, got {self.num_requests}")
        if not self.worker_kv_cache_memory or min(self.worker_kv_cache_memory) < 1:
            raise ValueError(f"BenchConfig.worker_kv_cache_memory must be positive, got {self.worker_kv_cache_memory}")
        if not self.drain_s > 0:
            raise ValueError(f"BenchConfig.drain_s must be positive, got {self.drain_s}")
        if not 1 <= self.max_tokens_factor < math.inf:
            raise ValueError(f"BenchConfig.max_tokens_factor must be >= 1, got {self.max_tokens_factor}")


class LocalCluster:
    """A kvserve Cluster on an asyncio loop in a thread of its own, the way `kvserve up` runs it."""

    def __init__(self, config: ClusterConfig) -> None:
        from cluster.local import Cluster

        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="cluster-loop", daemon=True)
        self.thread.start()
        self.cluster = Cluster(config)
        self.recorder = KVRecorder()

    def run(self, coroutine: Coroutine[Any, Any, T], timeout: float = 120.0) -> T:
        return asyncio.run_coroutine_threadsafe(coroutine, self.loop).result(timeout)

    def start(self) -> str:
        self.run(self.cluster.start(), timeout=600)
        self.run(self._attach())
        return self.cluster.address

    async def _attach(self) -> None:
        assert self.cluster.router is not None
        self.cluster.router.observers.append(self.recorder)

    async def _snapshot(self) -> tuple[list[KVSample], list[tuple[float, str]], dict[str, float], dict[str, float]]:
        r = self.recorder
        return list(r.samples), list(r.rejections), dict(r.placed_at), dict(r.committed_share)

    def snapshot(self) -> tuple[list[KVSample], list[tuple[float, str]], dict[str, float], dict[str, float]]:
        """The recorder's samples, rejections and placements so far, copied on the loop that
        appends to them."""
        return self.run(self._snapshot())

    def stop(self) -> None:
        try:
            self.run(self.cluster.stop(), timeout=120)
        finally:
            self.loop.call_soon_threadsafe(self.loop.stop)
            self.thread.join(timeout=10)


# -- the cluster side ---------------------------------------------------------------------------


class Plan(NamedTuple):
    """What the timed runs offer: the capacity they are fractions of, and a trace per fraction."""

    capacity: dict[str, Any]  # requests_per_s, how it was found, and the closed loop's numbers
    rates: dict[float, float]  # fraction -> req/s
    traces: dict[float, list[TraceRequest]]  # req/s -> the trace at that rate


class Measurements(NamedTuple):
    runs: list[dict[str, Any]]  # summarize_run's rows, policy by policy, rate by rate
    worker_blocks: list[int]  # each worker's KV pool, in worker id order
    plan: Plan


def plan_runs(config: BenchConfig, capacity: dict[str, Any]) -> Plan:
    """The fractions' rates and their traces (the same requests at each rate)."""
    rates = rates_at(capacity["requests_per_s"], config.fractions)
    traces = {rate: make_trace(config.workload, config.num_requests, rate, config.seed) for rate in rates.values()}
    offered_s = sum(config.num_requests / rate for rate in rates.values())
    log(f"capacity {capacity['requests_per_s']:.2f} req/s ({capacity['source']}); rates "
        f"{', '.join(f'{f:g}x = {r:.2f}' for f, r in rates.items())} req/s: {offered_s:.0f} s of arrivals per policy")
    return Plan(capacity, rates, traces)


def measure_capacity(client: ClientProcess, address: str, config: BenchConfig, label: str) -> dict[str, Any]:
    """The cluster's capacity with the workload's shapes: a closed loop (policy_rates), or
    --capacity as given."""
    if config.capacity_rps is not None:
        return {"requests_per_s": config.capacity_rps, "source": "given (--capacity)"}
    # Another seed: the same workload's shapes, other prompts, so the loop leaves no prefix in
    # this cluster's cache that the timed runs would find (the other policies' clusters start cold).
    trace = make_trace(config.workload, config.capacity_requests, math.inf, config.seed + 2000)
    began = time.monotonic()
    results = client.closed_loop(address, trace, f"capacity-{os.getpid()}-{time.monotonic_ns()}",
                                 config.capacity_concurrency, timeout_s=600.0,
                                 max_tokens_factor=config.max_tokens_factor)
    seconds = time.monotonic() - began
    finishes = [r.token_times[-1] for r in results if r.ok]
    measured: Capacity | None = closed_loop_capacity(finishes, config.capacity_concurrency)
    if measured is None:
        raise RuntimeError(f"the closed loop on {label} finished {len(finishes)} of {len(results)} requests: "
                           f"too few to measure a capacity (outcomes {sorted({r.outcome for r in results})})")
    log(f"{label}: closed loop of {len(results)} requests, {config.capacity_concurrency} in flight, "
        f"{len(finishes)} ok in {seconds:.0f} s: {measured.requests_per_s:.2f} req/s while full")
    return {
        "requests_per_s": measured.requests_per_s,
        "source": f"closed loop on the {label} cluster, {config.capacity_concurrency} in flight",
        "measured_on": label,
        "num_requests": len(results),
        "num_ok": len(finishes),
        "concurrency": config.capacity_concurrency,
        "num_counted": measured.num_counted,
        "window_s": measured.window_s,
        "seconds": seconds,
    }


def split_policy(entry: str) -> tuple[str, float | None, float | None]:
    """A --policies entry, NAME, NAME@RATIO or NAME@RATIO-FLOOR: the policy, the
    --kv-reserve-ratio its runs use (None: the bench's), and the --kv-reserve-floor its
    adaptive ratio keeps above (None: fixed; RouterConfig checks both). `kv@1,kv@0.5,kv@0.5-0.1` compares
    two fixed ratios and an adaptive one side by side in one run."""
    name, at, ratios = entry.partition("@")
    if not at:
        return name, None, None
    ratio, dash, floor = ratios.partition("-")
    try:
        return name, float(ratio), float(floor) if dash else None
    except ValueError:
        raise ValueError(f"the ratio after @ must be a number or two joined by '-', got {ratios!r}") from None


def _router_config(config: BenchConfig, policy: str = "kv") -> Any:
    """The RouterConfig a run (real or simulated) of this --policies entry uses: the bench's
    queue bounds, the entry's ratio (and floor) or else --kv-reserve-ratio, the rest the
    defaults."""
    from router.core import RouterConfig

    entry, order = queue_order(policy)
    name, ratio, floor = split_policy(entry)
    ratio = config.kv_reserve_ratio if ratio is None else ratio
    return RouterConfig(policy=name, max_queue=config.max_queue, max_queue_wait_s=config.max_queue_wait_s,
                        queue_order=order, kv_reserve_ratio=RouterConfig.kv_reserve_ratio if ratio is None else ratio,
                        kv_reserve_floor=floor)


BACKFILL_SUFFIX = "+backfill"


def queue_order(entry: str) -> tuple[str, str]:
    """A --policies entry ending in +backfill runs with --queue-order backfill: the entry
    without it, and the order."""
    if entry.endswith(BACKFILL_SUFFIX):
        return entry[: -len(BACKFILL_SUFFIX)], "backfill"
    return entry, "fifo"


def id_prefix(policy: str, fraction: float) -> str:
    """The request ids' prefix of one timed run: its --policies entry (a request id takes
    no '@' nor '+') and its fraction."""
    return f"{policy.replace('@', ':').replace('+', '.')}-{fraction:g}"


def _kind_lines(runs: list[dict[str, Any]]) -> list[str]:
    """TTFT of long and short requests apart, run by run (records before 2026-12-06 21:30
    kept no such split: nothing then), with the router's part of it where the run kept
    each request's placement (records from 2026-12-06 23:00 on)."""
    if not runs or not all("ttft_by_kind" in r for r in runs):
        return []
    waits = all("wait_p99" in r["ttft_by_kind"][kind] for r in runs for kind in ("long", "short"))
    lines = ["", "## TTFT of long and short requests", "",
             f"Long: a prompt of at least {LONG_PROMPT_TOKENS} tokens. p50 / p99 in s, of the requests that finished."]
    if waits:
        lines.append("Router wait: from its arrival to its first placement on a worker (the wait for KV room); "
                     "the rest of its TTFT is the worker's.")
    header = ["policy", "x capacity", "req/s"]
    for kind in ("long", "short"):
        header += [kind, f"{kind} TTFT p50 / p99"] + ([f"{kind} router wait p50 / p99"] if waits else [])
    lines += ["", "| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for r in runs:
        cells = [r["policy"], f"{r['fraction']:g}", f"{r['rate']:.2f}"]
        for kind in ("long", "short"):
            k = r["ttft_by_kind"][kind]
            cells += [str(k["n"]), f"{_f(k['p50'])} / {_f(k['p99'])}"]
            if waits:
                cells.append(f"{_f(k['wait_p50'])} / {_f(k['wait_p99'])}")
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def _share_lines(runs: list[dict[str, Any]]) -> list[str]:
    """What each run's placements committed of max_tokens (records from 2026-12-07 on):
    where a fixed ratio stood, or where an adaptive one moved."""
    if not runs or not all(r.get("committed_share") for r in runs):
        return []
    lines = ["", "## Commitment at placement", "",
             "The share of its max_tokens each request's first placement committed KV for (1: all of it): "
             "--kv-reserve-ratio, or where an adaptive ratio stood (`kv@RATIO-FLOOR`).", "",
             "| policy | x capacity | req/s | placed | p50 | min | max |", "|---|---|---|---|---|---|---|"]
    for r in runs:
        c = r["committed_share"]
        lines.append(f"| {r['policy']} | {r['fraction']:g} | {r['rate']:.2f} | {c['n']} | {c['p50']:.3f} "
                     f"| {c['min']:.3f} | {c['max']:.3f} |")
    return lines


def _own_ratios(policies: tuple[str, ...]) -> list[str]:
    """The header's note of the --policies entries that carry a ratio or a queue order of
    their own."""
    notes = []
    for p in policies:
        entry, order = queue_order(p)
        _, ratio, floor = split_policy(entry)
        if ratio is not None:
            notes.append(f" ({p}: {ratio:g})" if floor is None else f" ({p}: {ratio:g}, down to {floor:g})")
        if order != "fifo":
            notes.append(f" ({p}: --queue-order {order})")
    return notes


def measure_local(config: BenchConfig, client: ClientProcess, capacity: dict[str, Any] | None = None) -> Measurements:
    """Each policy on a fresh local cluster; the first one measures the capacity (unless one
    is given: a later round's), then every fraction's replay runs on each in turn."""
    import ray

    from cluster.local import ClusterConfig
    from router.server import ServerConfig
    from workers.config import EngineArgs

    runs: list[dict[str, Any]] = []
    worker_blocks: list[int] = []
    plan: Plan | None = None
    state_root = Path(tempfile.mkdtemp(prefix="bench-policies-"))
    ray.init(num_cpus=8, include_dashboard=False, logging_level=logging.WARNING)
    try:
        for policy in config.policies:
            cluster_config = ClusterConfig(
                engine=EngineArgs(model="tiny", kv_cache_memory=max(config.worker_kv_cache_memory), num_threads=1),
                num_workers=len(config.worker_kv_cache_memory),
                worker_cpus=1,
                worker_kv_cache_memory=config.worker_kv_cache_memory,
                state_dir=state_root / policy,
                router=_router_config(config, policy),
                server=ServerConfig(port=0),
                metrics_port=None,
                report_interval_s=0.1,
            )
            log(f"{policy}: starting a cluster")
            began = time.monotonic()
            cluster = LocalCluster(cluster_config)
            try:
                address = cluster.start()
                worker_blocks = _warm_up(client, address, config)
                log(f"{policy}: ready on {address} in {time.monotonic() - began:.0f} s; KV blocks {worker_blocks}")
                if plan is None:
                    plan = plan_runs(config, capacity or measure_capacity(client, address, config, policy))
                for fraction, rate in plan.rates.items():
                    if not wait_idle(address):
                        log(f"{policy}: WARNING the cluster did not go idle before {rate:.2f} req/s")
                    replay = replay_once(client, address, plan.traces[rate], id_prefix(policy, fraction),
                                         config.drain_s, config.max_tokens_factor)
                    samples, rejections, placed_at, shares = cluster.snapshot()
                    measured = MeasuredRun(policy, rate, replay.results, replay.window, samples, rejections,
                                           replay.cpu_share, replay.seconds, placed_at, shares)
                    runs.append({**summarize_run(measured), "fraction": fraction})
                    _log_run(runs[-1], replay.window)
            finally:
                cluster.stop()
    finally:
        ray.shutdown()
        shutil.rmtree(state_root, ignore_errors=True)
    assert plan is not None
    return Measurements(runs, worker_blocks, plan)


def measure_running(config: BenchConfig, client: ClientProcess) -> Measurements:
    """The policy a running cluster already has, at every fraction of its capacity; KV from ClusterStatus."""
    assert config.address is not None
    address = config.address
    worker_blocks = _warm_up(client, address, config)
    if not wait_idle(address):
        log(f"WARNING the cluster at {address} did not go idle before the capacity")
    plan = plan_runs(config, measure_capacity(client, address, config, config.policy_label))
    runs = []
    for fraction, rate in plan.rates.items():
        if not wait_idle(address):
            log(f"WARNING the cluster at {address} did not go idle before {rate:.2f} req/s")
        poller = StatusPoller(address)
        poller.start()
        try:
            replay = replay_once(client, address, plan.traces[rate],
                                 f"bench-{os.getpid()}-{config.policy_label}-{fraction:g}", config.drain_s,
                                 config.max_tokens_factor)
        finally:
            poller.stop()
        measured = MeasuredRun(config.policy_label, rate, replay.results, replay.window, poller.samples, [],
                               replay.cpu_share, replay.seconds)
        runs.append({**summarize_run(measured), "fraction": fraction})
        _log_run(runs[-1], replay.window)
    return Measurements(runs, worker_blocks, plan)


def _warm_up(client: ClientProcess, address: str, config: BenchConfig) -> list[int]:
    """A few requests at once (torch's first calls are slow), then each worker's pool in blocks."""
    import grpc

    from protos.kvserve.v1 import serving_pb2 as pb
    from protos.kvserve.v1 import serving_pb2_grpc as pb_grpc

    warmup = make_trace(config.workload, 8, math.inf, config.seed + 1000)
    client.replay(address, warmup, f"warmup-{os.getpid()}-{time.monotonic_ns()}", config.drain_s)
    with grpc.insecure_channel(address) as channel:
        status = pb_grpc.KVServeStub(channel).ClusterStatus(pb.ClusterStatusRequest(), timeout=10)
    return [w.total_blocks for w in sorted(status.workers, key=lambda w: w.worker_id) if w.alive]


def _log_run(run: dict[str, Any], window: tuple[float, float]) -> None:
    s = run["summary"] or {}
    log(
        f"{run['policy']} @ {run['fraction']:g}x = {run['rate']:.2f} req/s: {run['num_ok']}/{run['num_requests']} ok, "
        f"TTFT p50 {s.get('ttft_p50', math.nan):.2f} s p99 {s.get('ttft_p99', math.nan):.2f} s, "
        f"{run['num_preemptions']} preemptions, {run['num_rejected']} rejected, {run['num_incomplete']} incomplete, "
        f"{run['num_failed']} failed, "
        f"{'sustained' if run['sustained'] else 'not sustained'}, {window[1] - window[0]:.0f} s"
        + (f"; the first failure: {run['first_failure']}" if run.get("first_failure") else "")
    )


# -- the simulator, side by side --------------------------------------------------------------


def simulate_runs(
    config: BenchConfig,
    traces: dict[float, list[TraceRequest]],
    worker_blocks: list[int],
    policies: list[str],
    step_overhead_s: float = 0.0,
) -> list[dict[str, Any]]:
    """The same trace, pools, rates and router limits through loadtest.sim; every step
    priced by the fitted cost model plus step_overhead_s."""
    from loadtest.sim.cost_model import load_cost_model
    from loadtest.sim.simulator import ClusterConfig as SimClusterConfig
    from loadtest.sim.simulator import simulate

    fitted = load_cost_model()
    out = []
    for policy in policies:
        router = _router_config(config, policy)
        for rate, trace in traces.items():
            intercept, *rest = fitted.coefficients
            cost = _PricedSteps((intercept + step_overhead_s, *rest), fitted.facts, fitted.r2, fitted.num_samples)
            result = simulate(trace, SimClusterConfig(tuple(worker_blocks), router.policy, router,
                                                      max_tokens_factor=config.max_tokens_factor), cost)
            wanted = {r.request_id: r.output_len for r in trace}
            done = [t for rid, t in result.timelines.items() if len(t.token_times) == wanted[rid]]
            summary = summarize(done) if done else None
            good = sum(SLO.meets(RequestLatency.of(t)) for t in done)
            makespan = summary.makespan if summary is not None else float("nan")
            out.append({
                "policy": policy,
                "rate": rate,
                "step_overhead_s": step_overhead_s,
                "num_ok": len(done),
                "summary": asdict(summary) if summary is not None else None,
                "goodput_rps": good / makespan if makespan > 0 else float("nan"),
                "num_preemptions": result.num_preemptions,
                "num_rejected": result.num_rejected,
                "num_backfilled": result.num_backfilled,
                "peak_commit_ratio": max(c / b for c, b in zip(result.peak_committed_blocks, worker_blocks)),
                "step_ms_p50": percentile(cost.seconds, 50) * 1e3,
            })
    return out


@dataclass(frozen=True)
class _PricedSteps(CostModel):
    """The cost model, keeping the price of every step it is asked for (the simulated step times)."""

    seconds: list[float] = field(default_factory=list)

    def step_seconds(self, shape: StepShape) -> float:
        price = super().step_seconds(shape)
        self.seconds.append(price)
        return price


def step_overhead(runs: list[dict[str, Any]], sim: list[dict[str, Any]]) -> float:
    """Seconds a real worker's loop takes per step beyond what the cost model prices: the median
    over runs of (real p50 step - simulated p50 step). The engine alone steps as the model says
    (python -m loadtest.sim.validate); the rest is the actor's (reports, Ray, threads)."""
    simulated = {(s["policy"], s["rate"]): s["step_ms_p50"] for s in sim}
    gaps = [r["step_ms_p50"] - simulated[(r["policy"], r["rate"])] for r in runs
            if (r["policy"], r["rate"]) in simulated and r["step_ms_p50"] == r["step_ms_p50"]]
    return max(0.0, percentile(gaps, 50)) / 1e3 if gaps else math.nan


# -- targets --------------------------------------------------------------------------------------


def sustained_by_policy(runs: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Per policy, the highest fraction of capacity (and its rate) that it sustains, every
    lower fraction sustained too (policy_rates.highest_sustained); None where it sustains none."""
    out: dict[str, dict[str, Any]] = {}
    for policy in dict.fromkeys(r["policy"] for r in runs):
        mine = {r["fraction"]: r for r in runs if r["policy"] == policy}
        best = highest_sustained({f: r["sustained"] for f, r in mine.items()})
        out[policy] = {"fraction": best, "rate": mine[best]["rate"] if best is not None else None,
                       "sustained_at": [[f, mine[f]["sustained"]] for f in sorted(mine)]}  # pairs: JSON keys are strings
    return out


def compare_at(kv: dict[str, Any], rr: dict[str, Any], judged: JudgedAt) -> dict[str, Any]:
    """kv against round-robin in the two runs at one judged fraction."""
    out: dict[str, Any] = {"fraction": judged.fraction, "why": judged.why, "rate": kv["rate"]}
    if kv["summary"] and rr["summary"]:
        kv_p99, rr_p99 = kv["summary"]["ttft_p99"], rr["summary"]["ttft_p99"]
        ratio = rr_p99 / kv_p99 if kv_p99 > 0 else math.inf
        out["ttft_p99"] = {"kv": kv_p99, "round-robin": rr_p99, "ratio": ratio, "target": TARGET_TTFT_RATIO,
                           "met": ratio >= TARGET_TTFT_RATIO}
    kv_pre, rr_pre = kv["num_preemptions"], rr["num_preemptions"]
    out["preemptions"] = {"kv": kv_pre, "round-robin": rr_pre,
                          "ratio": rr_pre / kv_pre if kv_pre else (math.inf if rr_pre else math.nan),
                          "target": TARGET_PREEMPTION_RATIO,
                          "met": rr_pre > 0 and rr_pre >= TARGET_PREEMPTION_RATIO * kv_pre}
    return out


def check_targets(runs: list[dict[str, Any]], sim: list[dict[str, Any]]) -> dict[str, Any]:
    """Each policy's highest sustained fraction; kv against round-robin at the judged fractions
    (policy_rates.judged_fractions); sim against real for every run."""
    sustained = sustained_by_policy(runs)
    targets: dict[str, Any] = {"sustained": sustained, "judged": []}
    by_run = {(r["policy"], r["fraction"]): r for r in runs}
    if "kv" in sustained and "round-robin" in sustained:
        fractions = sorted({f for p, f in by_run if p == "kv"} & {f for p, f in by_run if p == "round-robin"})
        if fractions:
            kv_best, rr_best = sustained["kv"]["fraction"], sustained["round-robin"]["fraction"]
            for judged in judged_fractions(kv_best, rr_best, fractions):
                kv, rr = by_run.get(("kv", judged.fraction)), by_run.get(("round-robin", judged.fraction))
                if kv is not None and rr is not None:
                    targets["judged"].append(compare_at(kv, rr, judged))
    real = {(r["policy"], r["rate"]): r for r in runs}
    agreement = []
    for s in sim:
        r = real.get((s["policy"], s["rate"]))
        if r is None or not r["summary"] or not s["summary"]:
            continue
        row = {"policy": s["policy"], "rate": s["rate"]}
        for key in ("ttft_p50", "ttft_p99", "output_tokens_per_s"):
            a, b = r["summary"][key], s["summary"][key]
            row[key] = {"real": a, "sim": b, "diff": (b - a) / a if a else math.nan}
        row["within_target"] = all(
            abs(row[k]["diff"]) <= TARGET_SIM_AGREEMENT for k in ("ttft_p50", "ttft_p99", "output_tokens_per_s")
        )
        agreement.append(row)
    targets["sim_agreement"] = agreement
    return targets


# -- the report ----------------------------------------------------------------------------------


def write_markdown(report: dict[str, Any]) -> str:
    c, runs, targets = report["conditions"], report["runs"], report["targets"]
    cap = c["capacity"]
    workers = [f"w{i}" for i in range(len(c["worker_blocks"]))]
    fractions = sorted({r["fraction"] for r in runs})
    lines = [
        "# Placement policies on a real kvserve cluster",
        "",
        f"- **mode**: {c['mode']}",
        f"- **capacity**: {cap['requests_per_s']:.2f} req/s, {_capacity_words(cap)}",
        f"- **rates**: {', '.join(f'{f:g}x = {r:.2f}' for f, r in zip(c['fractions'], c['rates']))} req/s",
        f"- **workload**: {c['workload']}",
        f"- **workers**: {c['workers']}",
        f"- **router**: {c['router']}",
        f"- **SLO** (per request): {c['slo']}; goodput = requests meeting it / makespan; a run is sustained when "
        f"every request finished and {SLO.percentile:g}% met it",
        f"- **machine**: {c['machine']}, {c['date']}, {c['wall_s']:.0f} s in all",
        "",
        "## Highest load sustained",
        "",
        "The highest fraction of capacity whose run, and every run below it, the SLO sustains.",
        "",
        "| policy | highest sustained | req/s | sustained at " + ", ".join(f"{f:g}x" for f in fractions) + " |",
        "|---|---|---|---|",
    ]
    for policy, best in targets["sustained"].items():
        sustained_at = {f: ok for f, ok in best["sustained_at"]}
        marks = " ".join("yes" if sustained_at.get(f) else ("no" if f in sustained_at else "-") for f in fractions)
        highest = "none" if best["fraction"] is None else f"{best['fraction']:g}x"
        lines.append(f"| {policy} | {highest} "
                     f"| {_f(best['rate'])} | {marks} |")
    policies = list(targets["sustained"])
    by_run = {(r["policy"], r["fraction"]): r for r in runs}
    lines += [
        "",
        "## p99 TTFT and preemptions at each fraction of capacity",
        "",
        "Each cell: p99 TTFT in s / preemptions (of the requests that finished; a `*` marks a run with requests "
        "rejected or unfinished).",
        "",
    ]
    lines += markdown_by_fraction(by_run, policies, fractions,
                                  lambda r: f"{_f((r['summary'] or {}).get('ttft_p99'))} / {r['num_preemptions']}")
    lines += ["", "## Targets: kv against round-robin", ""]
    if targets["judged"]:
        lines += [
            "| judged at | why there | | kv | round-robin | round-robin / kv | target | |",
            "|---|---|---|---|---|---|---|---|",
        ]
        for j in targets["judged"]:
            where = f"{j['fraction']:g}x ({j['rate']:.2f} req/s)"
            t, p = j.get("ttft_p99"), j["preemptions"]
            if t is not None:
                lines.append(f"| {where} | {j['why']} | p99 TTFT (s) | {_f(t['kv'])} | {_f(t['round-robin'])} "
                             f"| {_ratio(t['ratio'])} | >= {t['target']:g}x | {'MET' if t['met'] else 'MISSED'} |")
            lines.append(f"| {where} | {j['why']} | preemptions | {p['kv']} | {p['round-robin']} "
                         f"| {_ratio(p['ratio'])} | >= {p['target']:g}x | {'MET' if p['met'] else 'MISSED'} |")
        lines += ["", _verdict(report)]
    else:
        lines.append("kv and round-robin were not both measured, so the targets were not checked.")
    lines += [
        "",
        "## Real cluster, every run",
        "",
        "TTFT from the request's scheduled arrival to its first token at the client; ITL between tokens at the "
        "client; tok/s = output tokens / makespan (first arrival to last token) of the requests that finished. "
        "Preemptions: sum over workers of the growth of their counter in the run. peak commit: most KV any "
        "worker's admitted requests held at max_tokens / its pool (> 1 is over-commitment). placed: requests "
        "(long ones) each worker got. CPU: cores the worker processes used in the run.",
        "",
    ]
    rows = []
    for r in runs:
        s = r["summary"] or {}
        peak = "/".join(_f(r["peak_commit_ratio"].get(w, math.nan)) for w in workers)
        placed = "/".join(f"{r['placed'].get(w, {}).get('requests', 0)} ({r['placed'].get(w, {}).get('long', 0)})"
                          for w in workers)
        rows.append((
            r["policy"], r["fraction"], r["rate"], f"{r['num_ok']}/{r['num_requests']}", s.get("ttft_p50"),
            s.get("ttft_p99"), s.get("itl_p50"), s.get("itl_p99"), s.get("output_tokens_per_s"), r["goodput_rps"],
            r["goodput_fraction"], "yes" if r["sustained"] else "no", r["num_preemptions"], r["num_rejected"],
            r["num_incomplete"] + r["num_failed"], peak, placed, r["cpu_share_of_one_core"]["workers"],
        ))
    lines += runs_table(workers).markdown(rows)
    lines += _kind_lines(runs)
    lines += _share_lines(runs)
    lines += _sim_lines(report)
    lines += [
        "",
        "## CPU during each run (cores; the machine has " + c["machine"].split(", ")[1] + ")",
        "",
    ]
    lines += CPU_TABLE.markdown([(r["policy"], r["rate"], *(r["cpu_share_of_one_core"][k] for k in CPU_ROLES),
                                  r["client_lag_max_s"]) for r in runs])
    return "\n".join(lines) + "\n"


def _capacity_words(cap: dict[str, Any]) -> str:
    if "window_s" not in cap:
        return str(cap["source"])
    return (f"{cap['source']}: {cap['num_ok']}/{cap['num_requests']} requests finished in {cap['seconds']:.0f} s; "
            f"{cap['num_counted']} finishes over {cap['window_s']:.1f} s while the loop was full")


def _verdict(report: dict[str, Any]) -> str:
    """The targets in one sentence per judged fraction, with the numbers that explain a miss."""
    by_run = {(r["policy"], r["fraction"]): r for r in report["runs"]}
    sentences = []
    for j in report["targets"]["judged"]:
        kv, rr = by_run[("kv", j["fraction"])], by_run[("round-robin", j["fraction"])]
        t, p = j.get("ttft_p99"), j["preemptions"]
        met = t is not None and t["met"] and p["met"]
        numbers = (
            f"p99 TTFT {_f(t['kv'] if t else None)} s vs {_f(t['round-robin'] if t else None)} s "
            f"({_ratio(t['ratio']) if t else '-'}); preemptions {p['kv']} vs {p['round-robin']}; TTFT p50 "
            f"{_f((kv['summary'] or {}).get('ttft_p50'))} vs {_f((rr['summary'] or {}).get('ttft_p50'))} s; good "
            f"{kv['goodput_fraction']:.0%} vs {rr['goodput_fraction']:.0%}; peak commit on the small worker w0 "
            f"{kv['peak_commit_ratio'].get('w0', math.nan):.2f} vs {rr['peak_commit_ratio'].get('w0', math.nan):.2f}"
        )
        lost = [f"{r['policy']} rejected {r['num_rejected']} and left {r['num_incomplete'] + r['num_failed']} "
                "unfinished (not in its TTFT percentiles)" for r in (kv, rr) if r["num_ok"] < r["num_requests"]]
        if lost:
            numbers += "; " + "; ".join(lost)
        verdict = "both targets met" if met else "not both met"
        sentences.append(f"**At {j['fraction']:g}x, {j['why']}: {verdict}**; kv vs round-robin: {numbers}.")
    return "\n\n".join(sentences)


def _sim_lines(report: dict[str, Any]) -> list[str]:
    rows = report["targets"]["sim_agreement"]
    if not rows:
        return ["", "## Simulator", "", "Not run: the running cluster's policy was not named (--policy-label)."]
    real = {(r["policy"], r["rate"]): r for r in report["runs"]}
    overhead_ms = report["step_overhead_s"] * 1e3
    lines = [
        "",
        f"## Simulator vs real (same pools {report['conditions']['worker_blocks']}, trace, rates and router limits; "
        "cost model fitted on one torch thread)",
        "",
        "diff = (sim - real) / real. step p50: the median turn of a worker's engine loop while requests run, real "
        "(from consecutive reports' sent_at) and as the cost model prices the simulated steps; worker CPU/step: the "
        "worker processes' CPU over the real run / its engine steps.",
        "",
    ]
    lines += _agreement_table(rows, {(s["policy"], s["rate"]): s for s in report["sim"]}, real, with_steps=True)
    num_within = sum(row["within_target"] for row in rows)
    lines += ["", f"As fitted: {num_within} of {len(rows)} runs agree within 25% on all three of TTFT p50, "
              "TTFT p99 and tok/s."]
    scaled = report["sim_scaled_agreement"]
    if scaled:
        lines += [
            "",
            f"With every simulated step charged {overhead_ms:.1f} ms more (the median real - simulated step p50 "
            "above, measured in this run: the worker actor's own cost per step), the same comparison:",
            "",
        ]
        lines += _agreement_table(scaled, {(s["policy"], s["rate"]): s for s in report["sim_scaled"]}, real,
                                  with_steps=False)
        lines += ["", f"With the overhead: {sum(row['within_target'] for row in scaled)} of {len(scaled)} runs "
                  "within 25%."]
    return lines


def _agreement_table(
    rows: list[dict[str, Any]], sim: dict[tuple[str, float], dict[str, Any]], real: dict[tuple[str, float], Any],
    with_steps: bool,
) -> list[str]:
    head = ("| policy | req/s | TTFT p50 real / sim | diff | TTFT p99 real / sim | diff | tok/s real / sim | diff "
            "| preempt real / sim | rejected real / sim | within 25% |")
    if with_steps:
        head += " step p50 ms real / sim | worker CPU/step ms |"
    lines = [head, "|" + "---|" * (13 if with_steps else 11)]
    for row in rows:
        key = (row["policy"], row["rate"])
        a, b, tput = row["ttft_p50"], row["ttft_p99"], row["output_tokens_per_s"]
        line = (
            f"| {row['policy']} | {row['rate']:.2f} | {_f(a['real'])} / {_f(a['sim'])} | {a['diff']:+.0%} "
            f"| {_f(b['real'])} / {_f(b['sim'])} | {b['diff']:+.0%} | {_f(tput['real'], 0)} / {_f(tput['sim'], 0)} "
            f"| {tput['diff']:+.0%} | {real[key]['num_preemptions']} / {sim[key]['num_preemptions']} "
            f"| {real[key]['num_rejected']} / {sim[key]['num_rejected']} | {'yes' if row['within_target'] else 'no'} |"
        )
        if with_steps:
            line += (f" {_f(real[key]['step_ms_p50'], 1)} / {_f(sim[key]['step_ms_p50'], 1)} "
                     f"| {_f(real[key]['worker_cpu_ms_per_step'], 1)} |")
        lines.append(line)
    return lines


def figures(report: dict[str, Any]) -> dict[str, Callable[[Path], None]]:
    """The three figures, by file name, each drawn from the report (with its raw TTFTs and ITLs)."""
    return {
        "latency.png": lambda path: plot_latency(report, path),
        "rates.png": lambda path: plot_rates(report, path),
        "kv.png": lambda path: plot_kv(report, path),
    }


def plot_all(report: dict[str, Any], out: Path) -> None:
    for name, draw in figures(report).items():
        draw(out / name)


def _policy_colors(runs: list[dict[str, Any]]) -> dict[str, str]:
    return {p: f"C{i}" for i, p in enumerate(dict.fromkeys(r["policy"] for r in runs))}


def plot_latency(report: dict[str, Any], path: Path) -> None:
    """TTFT and ITL CDFs, one row of panels per fraction of capacity."""
    runs = report["runs"]
    rates = sorted({r["rate"] for r in runs})
    fraction_of = {r["rate"]: r["fraction"] for r in runs}
    colors = _policy_colors(runs)
    with figure(path, len(rates), 2, dpi=100, figsize=(13, 4.2 * len(rates)), squeeze=False) as (_, axes):
        for row, rate in zip(axes, rates):
            for r in (r for r in runs if r["rate"] == rate):
                for ax, key in zip(row, ("ttfts", "itls")):
                    values = sorted(v for v in r[key] if v > 0)
                    if values:
                        ax.plot(values, [(i + 1) / len(values) for i in range(len(values))],
                                color=colors[r["policy"]], label=r["policy"])
            for ax, what in zip(row, ("TTFT", "ITL")):
                ax.set(xscale="log", xlabel=f"{what} (s, log)", title=f"{what} CDF at {fraction_of[rate]:g}x capacity ({rate:.2f} req/s)",
                       ylabel="fraction of requests" if what == "TTFT" else "fraction of gaps")
                ax.legend(fontsize=8)
            row[0].axvline(SLO.ttft_s, color="gray", linestyle="--")


def plot_rates(report: dict[str, Any], path: Path) -> None:
    """Throughput, goodput and p99 TTFT against the fraction of capacity (real and simulated), and preemptions."""
    runs, sim = report["runs"], report["sim"]
    colors = _policy_colors(runs)
    policies, rates = list(colors), sorted({r["rate"] for r in runs})
    fraction_of = {r["rate"]: r["fraction"] for r in runs}
    with figure(path, 2, 2, dpi=100, figsize=(13, 9)) as (_, axes):
        panels = ((axes[0][0], "output_tokens_per_s", "output tokens/s", False),
                  (axes[0][1], "goodput_rps", f"goodput, req/s ({report['conditions']['slo']})", False),
                  (axes[1][0], "ttft_p99", "p99 TTFT (s, log)", True))
        for ax, key, label, log_y in panels:
            for source, style in ((runs, "-o"), (sim, "--x")):
                for policy in policies:
                    points = [(fraction_of[r["rate"]], r[key] if key in r else (r["summary"] or {}).get(key, math.nan))
                              for r in source if r["policy"] == policy]
                    if points:
                        ax.plot(*zip(*sorted(points)), style, color=colors[policy],
                                label=f"{policy} ({'real' if source is runs else 'sim'})")
            ax.set(xlabel=f"arrival rate, x capacity ({report['conditions']['capacity']['requests_per_s']:.2f} req/s)",
                   ylabel=label, yscale="log" if log_y else "linear")
        axes[0][0].legend(fontsize=7, ncol=2)
        axes[0][0].set_title("throughput (solid: real, dashed: simulator)")
        axes[0][1].set_title("goodput")
        axes[1][0].set_title("p99 TTFT")
        ax = axes[1][1]
        width = 0.8 / max(1, len(policies))
        for i, policy in enumerate(policies):
            mine = sorted((r for r in runs if r["policy"] == policy), key=lambda r: r["rate"])
            xs = [rates.index(r["rate"]) + i * width for r in mine]
            ax.bar(xs, [r["num_preemptions"] for r in mine], width, color=colors[policy],
                   label=f"{policy} preemptions")
            ax.bar(xs, [r["num_rejected"] for r in mine], width, bottom=[r["num_preemptions"] for r in mine],
                   color=colors[policy], hatch="//", alpha=0.5)
        ax.set_xticks([k + 0.4 - width / 2 for k in range(len(rates))], [f"{fraction_of[r]:g}x" for r in rates])
        ax.set_title("preemptions (solid) and rejections (hatched), per run")
        ax.legend(fontsize=7)


def plot_kv(report: dict[str, Any], path: Path) -> None:
    """KV used and committed per worker over time, each policy at the top rate."""
    top = max(r["rate"] for r in report["runs"])
    shown = [r for r in report["runs"] if r["rate"] == top]
    with figure(path, len(shown), 1, dpi=100, figsize=(12, 2.6 * len(shown)), squeeze=False,
                sharex=True) as (_, axes):
        for (ax,), r in zip(axes, shown):
            for j, (worker, series) in enumerate(sorted(r["kv"].items())):
                blocks = series["total_blocks"][0]
                ax.plot(series["t"], series["used"], color=f"C{j}", label=f"{worker} used ({blocks} blocks)")
                ax.plot(series["t"], series["committed"], color=f"C{j}", linestyle="--",
                        label=f"{worker} committed")
            ax.axhline(1.0, color="gray", linewidth=0.8)
            ax.set_ylabel("share of pool")
            ax.set_title(f"{r['policy']} at {r['fraction']:g}x capacity ({top:.2f} req/s): "
                         f"{r['num_preemptions']} preemptions", fontsize=10)
            ax.legend(fontsize=7, loc="upper right", ncol=2)
        axes[-1][0].set_xlabel("seconds from the first arrival")


# -- main -----------------------------------------------------------------------------------------


def parse_size(text: str) -> int:
    text = text.strip()
    for suffix, scale in (("GiB", 2**30), ("MiB", MiB), ("KiB", 2**10), ("B", 1)):
        if text.endswith(suffix):
            return int(float(text[: -len(suffix)]) * scale)
    return int(text)


def main(argv: list[str] | None = None) -> int:
    from router.placement import POLICIES

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--policies", default=",".join(POLICIES),
                        help="comma-separated; an entry NAME@RATIO runs NAME at that --kv-reserve-ratio, "
                             "NAME@RATIO-FLOOR at a ratio that adapts between the two (--kv-reserve-floor); "
                             "one ending in +backfill with --queue-order backfill (kv+backfill)")
    parser.add_argument("--fractions", default=",".join(f"{f:g}" for f in DEFAULT_FRACTIONS),
                        help="arrival rates as fractions of the capacity measured at the start")
    parser.add_argument("--num-requests", type=int, default=100,
                        help="requests in the trace (each rate replays them all)")
    parser.add_argument("--capacity", type=float, default=None,
                        help="req/s to take as the capacity instead of measuring it")
    parser.add_argument("--capacity-requests", type=int, default=160, help="requests in the closed loop")
    parser.add_argument("--capacity-concurrency", type=int, default=32,
                        help="requests the closed loop keeps in flight")
    parser.add_argument("--worker-kv-cache-memory", default="12MiB,36MiB",
                        help="one KV budget per worker (the tiny preset: 128 KiB per 16-token block)")
    parser.add_argument("--workload", default="mixed", choices=("mixed", "trace", "shared-prefix"))
    parser.add_argument("--seed", type=int, default=7)
    parser.add_argument("--drain", type=float, default=30.0, help="seconds after the last arrival before giving up")
    parser.add_argument("--max-queue", type=int, default=256)
    parser.add_argument("--max-queue-wait", type=float, default=30.0)
    parser.add_argument("--kv-reserve-ratio", type=float, default=None,
                        help="what a kv-aware placement commits of max_tokens (default: the router's)")
    parser.add_argument("--max-tokens-factor", type=float, default=1.0,
                        help="ask for this many times each request's output length as max_tokens and end its "
                             "stream at its length, as EOS would (the simulator does the same)")
    parser.add_argument("--address", default=None, help="a running router: measure its policy only")
    parser.add_argument("--policy-label", default="running", help="with --address: the name of its policy")
    parser.add_argument("--repeats", type=int, default=1,
                        help="run the whole comparison this many times, each round at the capacity measured in "
                             "round 1, and judge the targets on every round's requests pooled; each round's report "
                             "goes into OUT/round-K")
    parser.add_argument("--vary-seed", action="store_true",
                        help="with --repeats: round K replays the workload drawn with --seed + K - 1 (another "
                             "sample of its shapes) instead of the same trace")
    parser.add_argument("--out", type=Path, default=Path("results/bench_policies"))
    args = parser.parse_args(argv)

    try:
        fractions = parse_fractions(args.fractions)
    except ValueError as exc:
        parser.error(str(exc))
    try:
        config = BenchConfig(
            policies=tuple(p for p in args.policies.split(",") if p),
            fractions=fractions,
            num_requests=args.num_requests,
            capacity_rps=args.capacity,
            capacity_requests=args.capacity_requests,
            capacity_concurrency=args.capacity_concurrency,
            worker_kv_cache_memory=tuple(parse_size(b) for b in args.worker_kv_cache_memory.split(",") if b),
            workload=args.workload,
            seed=args.seed,
            drain_s=args.drain,
            max_queue=args.max_queue,
            max_queue_wait_s=args.max_queue_wait,
            kv_reserve_ratio=args.kv_reserve_ratio,
            max_tokens_factor=args.max_tokens_factor,
            address=args.address,
            policy_label=args.policy_label,
        )
    except ValueError as exc:  # a bad --policies entry, ratio, size or count, named
        parser.error(str(exc))
    if args.repeats < 1:
        parser.error(f"--repeats must be >= 1, got {args.repeats}")
    if args.repeats > 1 and config.address is not None:
        parser.error("--repeats starts local clusters; with --address run the bench once per round")
    began = time.monotonic()
    client = ClientProcess()
    reports = []
    try:
        capacity: dict[str, Any] | None = None
        for k in range(args.repeats):
            if args.repeats > 1:
                log(f"round {k + 1} of {args.repeats}: seed {config.seed + k if args.vary_seed else config.seed}")
            round_config = replace(config, seed=config.seed + k) if args.vary_seed else config
            if config.address is None:
                runs, worker_blocks, plan = measure_local(round_config, client, capacity)
            else:
                runs, worker_blocks, plan = measure_running(round_config, client)
            if capacity is None:
                capacity = {**plan.capacity, "source": f"round 1: {plan.capacity['source']}"}
            reports.append(report_round(round_config, runs, worker_blocks, plan, time.monotonic() - began))
            if args.repeats > 1:
                write_report(reports[-1], args.out / round_dir(k + 1))
    finally:
        client.close()
    if args.repeats == 1:
        write_report(reports[0], args.out)
    else:
        write_pooled(reports, args.out, time.monotonic() - began)
    log(f"{time.monotonic() - began:.0f} s in all")
    return 0


def round_dir(k: int) -> str:
    """Where round k's own report goes under --out (rounds count from 1)."""
    return f"round-{k}"


def report_round(config: BenchConfig, runs: list[dict[str, Any]], worker_blocks: list[int], plan: Plan,
                 wall_s: float) -> dict[str, Any]:
    """One round's report: the real runs, then the simulator on the same trace and pools."""
    from router.placement import POLICIES

    traces = plan.traces
    sim_policies = list(config.policies) if config.address is None else (
        [config.policy_label] if config.policy_label in POLICIES else []
    )
    log(f"simulating the same trace on pools of {worker_blocks} blocks")
    sim = simulate_runs(config, traces, worker_blocks, sim_policies)
    overhead_s = step_overhead(runs, sim)
    scaled = simulate_runs(config, traces, worker_blocks, sim_policies, overhead_s) if overhead_s == overhead_s else []
    return build_report(config, plan, worker_blocks, runs, sim, scaled, wall_s)


def write_report(report: dict[str, Any], out: Path) -> None:
    """results.md (printed), results.json and the plots of one round into out."""
    markdown = write_markdown(report)
    write_results(out, _without_raw(report), lambda: print(markdown, end=""), figures(report), "results.md")


def write_pooled(reports: list[dict[str, Any]], out: Path, wall_s: float) -> None:
    """The rounds read together (policy_rounds): results.md (printed), results.json, rounds.png."""
    c = reports[0]["conditions"]
    pooled = pool_rounds([r["runs"] for r in reports], SLO)
    result = {
        "conditions": {**c, "wall_s": wall_s, "seeds": [r["conditions"]["seed"] for r in reports]},
        "pooled": pooled,
        "targets": judge_pooled(pooled, TARGET_TTFT_RATIO, TARGET_PREEMPTION_RATIO),
        "rounds": [{"dir": round_dir(k), "targets": r["targets"]} for k, r in enumerate(reports, 1)],
    }
    markdown = pooled_markdown(result)
    write_results(out, result, lambda: print(markdown, end=""),
                  {"rounds.png": lambda p: plot_rounds(pooled, p, c["capacity"]["requests_per_s"])}, "results.md")


def pooled_markdown(result: dict[str, Any]) -> str:
    """results.md of a run in rounds, from its results.json."""
    c = result["conditions"]
    lines = [
        "# Placement policies on a real kvserve cluster, in rounds",
        "",
        f"- **capacity**: {c['capacity']['requests_per_s']:.2f} req/s, {_capacity_words(c['capacity'])}",
        f"- **rates**: {', '.join(f'{f:g}x = {r:.2f}' for f, r in zip(c['fractions'], c['rates']))} req/s",
        f"- **workload**: {c['workload']} (round 1)",
        f"- **workers**: {c['workers']}",
        f"- **router**: {c['router']}",
        f"- **SLO** (per request): {c['slo']}; pooled, a run is sustained when every request of every round "
        f"finished and {SLO.percentile:g}% of them met it",
        f"- **machine**: {c['machine']}, {c['date']}, {c['wall_s']:.0f} s in all",
        "",
        *rounds_markdown(result["pooled"], result["targets"], c["capacity"], c["seeds"], round_dir),
        "",
    ]
    return "\n".join(lines)


def build_report(
    config: BenchConfig,
    plan: Plan,
    worker_blocks: list[int],
    runs: list[dict[str, Any]],
    sim: list[dict[str, Any]],
    sim_scaled: list[dict[str, Any]],
    wall_s: float,
) -> dict[str, Any]:
    trace = next(iter(plan.traces.values()))
    num_long = sum(1 for r in trace if len(r.prompt_ids) >= LONG_PROMPT_TOKENS)
    workers = (
        f"{len(worker_blocks)} CPU workers, tiny preset, 1 torch thread and 1 Ray CPU each"
        if config.address is None else f"{len(worker_blocks)} live workers (as ClusterStatus lists them)"
    )
    return {
        "conditions": {
            "mode": "local cluster, a fresh one per policy" if config.address is None else (
                f"running cluster at {config.address}: only its policy ({config.policy_label}) is measured (it "
                "cannot be switched from here); KV from ClusterStatus every 100 ms (committed = total - the router's "
                "headroom); CPU counts only this process and its children, so the cluster's processes are under "
                "'other processes' and worker CPU reads 0"
            ),
            "workload": f"{config.workload}: {config.num_requests} requests ({num_long} long), seed {config.seed}, "
                        "greedy, ignore_eos; the same requests at every rate, Poisson arrivals, open loop"
                        + ("" if config.max_tokens_factor == 1 else
                           f"; max_tokens {config.max_tokens_factor:g}x each request's output length, its "
                           "stream ended by the client at that length (as EOS would)"),
            "capacity": plan.capacity,
            "seed": config.seed,
            "fractions": list(plan.rates),
            "rates": list(plan.rates.values()),
            "workers": f"{workers}; KV pools {worker_blocks} blocks",
            "worker_blocks": worker_blocks,
            "router": f"max_queue {config.max_queue}, max_queue_wait {config.max_queue_wait_s:g} s, "
                      f"kv_reserve_ratio {_router_config(config).kv_reserve_ratio:g}"
                      f"{'' if config.address else ''.join(_own_ratios(config.policies))}, "
                      f"reports every step (idle: 100 ms); drain {config.drain_s:g} s after the last arrival",
            "slo": SLO.describe(),
            "machine": f"{platform.machine()}, {os.cpu_count()} CPUs",
            "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            "wall_s": wall_s,
        },
        "runs": runs,
        "sim": sim,
        "sim_scaled": sim_scaled,  # every step charged the per-step overhead measured in this run
        "step_overhead_s": sim_scaled[0]["step_overhead_s"] if sim_scaled else math.nan,
        "targets": check_targets(runs, sim),
        "sim_scaled_agreement": check_targets(runs, sim_scaled)["sim_agreement"] if sim_scaled else [],
    }


RAW_KEYS = ("ttfts", "itls", "latencies", "kind_ttfts")  # per request: for the plots and the pooled rounds, not the JSON


def _without_raw(report: dict[str, Any]) -> dict[str, Any]:
    """The JSON keeps per-run percentiles and KV series, not every TTFT and ITL."""
    runs = [{k: v for k, v in r.items() if k not in RAW_KEYS} for r in report["runs"]]
    return {**report, "runs": runs}


if __name__ == "__main__":
    sys.exit(main())
