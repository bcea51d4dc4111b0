"""Placement policies on a real cluster: the same open-loop trace through each policy.

    python -m loadtest.bench_policies [--policies kv,kv-least-loaded,least-requests,round-robin,random]
        [--rates 4,5] [--num-requests 160] [--worker-kv-cache-memory 12MiB,36MiB] [--out results/bench_policies]
    python -m loadtest.bench_policies --address HOST:PORT --policy-label kv   # a running cluster

A local cluster (Ray, embedded redis-server, the router in this process, CPU workers of
unequal KV budgets) is started fresh for each policy under one ray.init. The `mixed`
workload (80% short chats, 20% 512-1024-token documents with 128-256 output tokens) is
generated once with a seed, and the same requests are replayed at each arrival rate as
a Poisson process, open loop, by streaming Generate calls from a client process of its
own. After the real runs, the simulator (loadtest.sim) replays the same trace on the same
worker pools at the same rates, so both sides are read off one table.

The default pools, 12 and 36 MiB (96 and 288 blocks of 16 tokens), make KV the scarce
resource: a long request holds up to 80 blocks at its longest (prompt + max_tokens), so
the small worker has room for one and the large one for three or four, while the two
workers' CPU is not used up (about 1.4 of 2 cores at 5 req/s). The default rates are a
moderate load and one near the `kv` policy's saturation on this 2-core machine; 6 req/s
is past it (its router queue then grows for the whole trace). The targets, judged at the
top rate: `kv` has at least 2x lower p99 TTFT than `round-robin` and 5x fewer preemptions;
the simulator's TTFT p50/p99 and tokens/s within 25% of the real ones.

With --address the benchmark drives a cluster someone else started: its policy cannot be
switched from here, so only the running policy is measured (name it with --policy-label),
and KV comes from polling ClusterStatus instead of every worker report.

Writes results.md (the tables), results.json, latency.png (TTFT and ITL CDFs), rates.png
(throughput, goodput, p99 TTFT, preemptions and rejections against rate) and kv.png (KV
per worker over time) into --out; progress goes to stderr.
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
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple, TypeVar

from loadtest.metrics import percentile, summarize
from loadtest.policy_replay import (
    LONG_PROMPT_TOKENS,
    MEAN_ITL_SLO_S,
    TTFT_SLO_S,
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
TARGET_TTFT_RATIO = 2.0  # round-robin p99 TTFT / kv p99 TTFT at the top rate
TARGET_PREEMPTION_RATIO = 5.0  # round-robin preemptions / kv preemptions at the top rate
TARGET_SIM_AGREEMENT = 0.25  # |sim - real| / real
# Goodput's per-request SLO, for the simulated runs as for the real ones (policy_replay judges those).
SLO = Slo(ttft_s=TTFT_SLO_S, mean_itl_s=MEAN_ITL_SLO_S)
CPU_TABLE = Table((
    Column("policy", 0), Column("req/s", 0, "g"), Column("workers", 0, ".2f"),
    Column("router (this process)", 0, ".2f"), Column("client", 0, ".2f"), Column("redis", 0, ".2f"),
    Column("Ray daemons", 0, ".2f"), Column("other processes", 0, ".2f"), Column("client lag max s", 0, ".3f"),
))
CPU_ROLES = ("workers", "router", "clients", "redis", "ray daemons", "other processes")


def runs_table(workers: list[str]) -> Table:
    """The real cluster's table; its peak commit and placed columns name each worker."""
    return Table((
        Column("policy", 0), Column("req/s", 0, "g"), Column("ok", 0), Column("TTFT p50 s", 0, ".2f"),
        Column("TTFT p99 s", 0, ".2f"), Column("ITL p50 ms", 0, ".1f", scale=1e3),
        Column("ITL p99 ms", 0, ".0f", scale=1e3), Column("tok/s", 0, ".0f"), Column("goodput req/s", 0, ".2f"),
        Column("good %", 0, ".0f", scale=100), Column("preempt", 0), Column("rejected", 0), Column("incomplete", 0),
        Column("peak commit " + "/".join(workers), 0), Column("placed " + "/".join(workers), 0),
        Column("worker CPU", 0, ".2f"),
    ))


@dataclass(frozen=True)
class BenchConfig:
    """What one benchmark run replays, and against which cluster."""

    policies: tuple[str, ...]
    rates: tuple[float, ...]
    num_requests: int
    worker_kv_cache_memory: tuple[int, ...]
    workload: str = "mixed"
    seed: int = 7
    drain_s: float = 30.0  # after the last arrival, how long in-flight requests may still finish
    max_queue: int = 256
    max_queue_wait_s: float = 30.0
    address: str | None = None
    policy_label: str = "running"

    def __post_init__(self) -> None:
        from router.placement import POLICIES

        bad = [p for p in self.policies if p not in POLICIES]
        if bad or not self.policies:
            raise ValueError(f"BenchConfig.policies must name some of {', '.join(POLICIES)}, got {self.policies}")
        if not self.rates or not all(r > 0 and math.isfinite(r) for r in self.rates):
            raise ValueError(f"BenchConfig.rates must be positive and finite, got {self.rates}")
        if self.num_requests < 1:
            raise ValueError(f"BenchConfig.num_requests must be >= 1, got {self.num_requests}")
        if not self.worker_kv_cache_memory or min(self.worker_kv_cache_memory) < 1:
            raise ValueError(f"BenchConfig.worker_kv_cache_memory must be positive, got {self.worker_kv_cache_memory}")
        if not self.drain_s > 0:
            raise ValueError(f"BenchConfig.drain_s must be positive, got {self.drain_s}")


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

    async def _snapshot(self) -> tuple[list[KVSample], list[tuple[float, str]]]:
        return list(self.recorder.samples), list(self.recorder.rejections)

    def snapshot(self) -> tuple[list[KVSample], list[tuple[float, str]]]:
        """The recorder's samples so far, copied on the loop that appends to them."""
        return self.run(self._snapshot())

    def stop(self) -> None:
        try:
            self.run(self.cluster.stop(), timeout=120)
        finally:
            self.loop.call_soon_threadsafe(self.loop.stop)
            self.thread.join(timeout=10)


# -- the cluster side ---------------------------------------------------------------------------


class Measurements(NamedTuple):
    runs: list[dict[str, Any]]  # summarize_run's rows, policy by policy, rate by rate
    worker_blocks: list[int]  # each worker's KV pool, in worker id order


def measure_local(
    config: BenchConfig, traces: dict[float, list[TraceRequest]], client: ClientProcess
) -> Measurements:
    """Each policy on a fresh local cluster; every rate's replay on it in turn."""
    import ray

    from cluster.local import ClusterConfig
    from router.core import RouterConfig
    from router.server import ServerConfig
    from workers.config import EngineArgs

    runs: list[dict[str, Any]] = []
    worker_blocks: list[int] = []
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
                router=RouterConfig(
                    policy=policy, max_queue=config.max_queue, max_queue_wait_s=config.max_queue_wait_s
                ),
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
                for rate, trace in traces.items():
                    if not wait_idle(address):
                        log(f"{policy}: WARNING the cluster did not go idle before {rate:g} req/s")
                    replay = replay_once(client, address, trace, f"{policy}-{rate:g}", config.drain_s)
                    samples, rejections = cluster.snapshot()
                    measured = MeasuredRun(policy, rate, replay.results, replay.window, samples, rejections,
                                           replay.cpu_share, replay.seconds)
                    runs.append(summarize_run(measured))
                    _log_run(runs[-1], replay.window)
            finally:
                cluster.stop()
    finally:
        ray.shutdown()
        shutil.rmtree(state_root, ignore_errors=True)
    return Measurements(runs, worker_blocks)


def measure_running(
    config: BenchConfig, traces: dict[float, list[TraceRequest]], client: ClientProcess
) -> Measurements:
    """The policy a running cluster already has, at every rate; KV from ClusterStatus."""
    assert config.address is not None
    address = config.address
    worker_blocks = _warm_up(client, address, config)
    runs = []
    for rate, trace in traces.items():
        if not wait_idle(address):
            log(f"WARNING the cluster at {address} did not go idle before {rate:g} req/s")
        poller = StatusPoller(address)
        poller.start()
        try:
            replay = replay_once(
                client, address, trace, f"bench-{os.getpid()}-{config.policy_label}-{rate:g}", config.drain_s
            )
        finally:
            poller.stop()
        measured = MeasuredRun(config.policy_label, rate, replay.results, replay.window, poller.samples, [],
                               replay.cpu_share, replay.seconds)
        runs.append(summarize_run(measured))
        _log_run(runs[-1], replay.window)
    return Measurements(runs, worker_blocks)


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
        f"{run['policy']} @ {run['rate']:g} req/s: {run['num_ok']}/{run['num_requests']} ok, "
        f"TTFT p50 {s.get('ttft_p50', math.nan):.2f} s p99 {s.get('ttft_p99', math.nan):.2f} s, "
        f"{run['num_preemptions']} preemptions, {run['num_rejected']} rejected, {run['num_incomplete']} incomplete, "
        f"{window[1] - window[0]:.0f} s"
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
    from router.core import RouterConfig

    fitted = load_cost_model()
    router = RouterConfig(max_queue=config.max_queue, max_queue_wait_s=config.max_queue_wait_s)
    out = []
    for policy in policies:
        for rate, trace in traces.items():
            intercept, *rest = fitted.coefficients
            cost = _PricedSteps((intercept + step_overhead_s, *rest), fitted.facts, fitted.r2, fitted.num_samples)
            result = simulate(trace, SimClusterConfig(tuple(worker_blocks), policy, router), cost)
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


def check_targets(runs: list[dict[str, Any]], sim: list[dict[str, Any]]) -> dict[str, Any]:
    """kv against round-robin at the top rate, and sim against real for every run."""
    top = max(r["rate"] for r in runs)
    at_top = {r["policy"]: r for r in runs if r["rate"] == top}
    targets: dict[str, Any] = {"rate": top}
    kv, rr = at_top.get("kv"), at_top.get("round-robin")
    if kv is not None and rr is not None and kv["summary"] and rr["summary"]:
        ratio = rr["summary"]["ttft_p99"] / kv["summary"]["ttft_p99"]
        targets["ttft_p99"] = {"kv": kv["summary"]["ttft_p99"], "round-robin": rr["summary"]["ttft_p99"],
                               "ratio": ratio, "target": TARGET_TTFT_RATIO, "met": ratio >= TARGET_TTFT_RATIO}
        kv_pre, rr_pre = kv["num_preemptions"], rr["num_preemptions"]
        targets["preemptions"] = {"kv": kv_pre, "round-robin": rr_pre,
                                  "ratio": rr_pre / kv_pre if kv_pre else (math.inf if rr_pre else math.nan),
                                  "target": TARGET_PREEMPTION_RATIO,
                                  "met": rr_pre > 0 and rr_pre >= TARGET_PREEMPTION_RATIO * kv_pre}
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


def _f(value: float | None, digits: int = 2) -> str:
    return "-" if value is None or value != value else f"{value:.{digits}f}"


def _ratio(value: float) -> str:
    return "inf" if value == math.inf else _f(value, 1) + "x"


def write_markdown(report: dict[str, Any]) -> str:
    c, runs, targets = report["conditions"], report["runs"], report["targets"]
    workers = [f"w{i}" for i in range(len(c["worker_blocks"]))]
    lines = [
        "# Placement policies on a real kvserve cluster",
        "",
        f"- **mode**: {c['mode']}",
        f"- **workload**: {c['workload']}; rates {', '.join(f'{r:g}' for r in c['rates'])} req/s",
        f"- **workers**: {c['workers']}",
        f"- **router**: {c['router']}",
        f"- **goodput SLO** (per request): {c['slo']}; goodput = requests meeting it / makespan",
        f"- **machine**: {c['machine']}, {c['date']}, {c['wall_s']:.0f} s in all",
        "",
        "## Real cluster",
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
            r["policy"], r["rate"], f"{r['num_ok']}/{r['num_requests']}", s.get("ttft_p50"), s.get("ttft_p99"),
            s.get("itl_p50"), s.get("itl_p99"), s.get("output_tokens_per_s"), r["goodput_rps"],
            r["goodput_fraction"], r["num_preemptions"], r["num_rejected"], r["num_incomplete"] + r["num_failed"],
            peak, placed, r["cpu_share_of_one_core"]["workers"],
        ))
    lines += runs_table(workers).markdown(rows)
    lines += ["", f"## Targets at {targets['rate']:g} req/s (the top rate)", ""]
    if "ttft_p99" in targets:
        t, p = targets["ttft_p99"], targets["preemptions"]
        lines += [
            "| | kv | round-robin | round-robin / kv | target | |",
            "|---|---|---|---|---|---|",
            f"| p99 TTFT (s) | {_f(t['kv'])} | {_f(t['round-robin'])} | {_ratio(t['ratio'])} "
            f"| >= {t['target']:g}x | {'MET' if t['met'] else 'MISSED'} |",
            f"| preemptions | {p['kv']} | {p['round-robin']} | {_ratio(p['ratio'])} "
            f"| >= {p['target']:g}x | {'MET' if p['met'] else 'MISSED'} |",
            "",
            _verdict(report),
        ]
    else:
        lines.append("kv and round-robin were not both measured, so the targets were not checked.")
    lines += _sim_lines(report)
    lines += [
        "",
        "## CPU during each run (cores; the machine has " + c["machine"].split(", ")[1] + ")",
        "",
    ]
    lines += CPU_TABLE.markdown([(r["policy"], r["rate"], *(r["cpu_share_of_one_core"][k] for k in CPU_ROLES),
                                  r["client_lag_max_s"]) for r in runs])
    return "\n".join(lines) + "\n"


def _verdict(report: dict[str, Any]) -> str:
    targets = report["targets"]
    t, p = targets["ttft_p99"], targets["preemptions"]
    at_top = {r["policy"]: r for r in report["runs"] if r["rate"] == targets["rate"]}
    kv, rr = at_top["kv"], at_top["round-robin"]
    kv_cpu, rr_cpu = kv["cpu_share_of_one_core"], rr["cpu_share_of_one_core"]
    numbers = (
        f"kv p99 TTFT {t['kv']:.2f} s vs round-robin {t['round-robin']:.2f} s; preemptions {p['kv']} vs "
        f"{p['round-robin']}; peak commit on the small worker w0 {kv['peak_commit_ratio'].get('w0', math.nan):.2f} "
        f"vs {rr['peak_commit_ratio'].get('w0', math.nan):.2f}; the workers used {kv_cpu['workers']:.2f} / "
        f"{rr_cpu['workers']:.2f} cores, the router {kv_cpu['router']:.2f} / {rr_cpu['router']:.2f}, the client "
        f"{kv_cpu['clients']:.2f} / {rr_cpu['clients']:.2f}"
    )
    lost = [f"{r['policy']} rejected {r['num_rejected']} and left {r['num_incomplete'] + r['num_failed']} "
            "unfinished (not in its TTFT percentiles)" for r in (kv, rr) if r["num_ok"] < r["num_requests"]]
    if lost:
        numbers += "; " + "; ".join(lost)
    if t["met"] and p["met"]:
        return f"**Both targets met** in this run: {numbers}."
    return f"**Not all targets met** in this run: {numbers}. See the CPU table and the simulator's numbers below."


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
            f"| {row['policy']} | {row['rate']:g} | {_f(a['real'])} / {_f(a['sim'])} | {a['diff']:+.0%} "
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
    """TTFT and ITL CDFs, one row of panels per rate."""
    runs = report["runs"]
    rates = sorted({r["rate"] for r in runs})
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
                ax.set(xscale="log", xlabel=f"{what} (s, log)", title=f"{what} CDF at {rate:g} req/s",
                       ylabel="fraction of requests" if what == "TTFT" else "fraction of gaps")
                ax.legend(fontsize=8)
            row[0].axvline(SLO.ttft_s, color="gray", linestyle="--")


def plot_rates(report: dict[str, Any], path: Path) -> None:
    """Throughput, goodput and p99 TTFT against rate (real and simulated), and preemptions."""
    runs, sim = report["runs"], report["sim"]
    colors = _policy_colors(runs)
    policies, rates = list(colors), sorted({r["rate"] for r in runs})
    with figure(path, 2, 2, dpi=100, figsize=(13, 9)) as (_, axes):
        panels = ((axes[0][0], "output_tokens_per_s", "output tokens/s", False),
                  (axes[0][1], "goodput_rps", f"goodput, req/s ({report['conditions']['slo']})", False),
                  (axes[1][0], "ttft_p99", "p99 TTFT (s, log)", True))
        for ax, key, label, log_y in panels:
            for source, style in ((runs, "-o"), (sim, "--x")):
                for policy in policies:
                    points = [(r["rate"], r[key] if key in r else (r["summary"] or {}).get(key, math.nan))
                              for r in source if r["policy"] == policy]
                    if points:
                        ax.plot(*zip(*sorted(points)), style, color=colors[policy],
                                label=f"{policy} ({'real' if source is runs else 'sim'})")
            ax.set(xlabel="arrival rate (req/s)", ylabel=label, yscale="log" if log_y else "linear")
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
        ax.set_xticks([k + 0.4 - width / 2 for k in range(len(rates))], [f"{r:g} req/s" for r in rates])
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
            ax.set_title(f"{r['policy']} at {top:g} req/s: {r['num_preemptions']} preemptions", fontsize=10)
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
    parser.add_argument("--policies", default=",".join(POLICIES))
    parser.add_argument("--rates", default="4,5", help="arrival rates, requests/s for the whole cluster")
    parser.add_argument("--num-requests", type=int, default=160,
                        help="requests in the trace (each rate replays them all)")
    parser.add_argument("--worker-kv-cache-memory", default="12MiB,36MiB",
                        help="one KV budget per worker (the tiny preset: 128 KiB per 16-token block)")
    parser.add_argument("--workload", default="mixed", choices=("mixed", "trace", "shared-prefix"))
    parser.add_argument("--seed", type=int, default=7)
    parser.add_argument("--drain", type=float, default=30.0, help="seconds after the last arrival before giving up")
    parser.add_argument("--max-queue", type=int, default=256)
    parser.add_argument("--max-queue-wait", type=float, default=30.0)
    parser.add_argument("--address", default=None, help="a running router: measure its policy only")
    parser.add_argument("--policy-label", default="running", help="with --address: the name of its policy")
    parser.add_argument("--out", type=Path, default=Path("results/bench_policies"))
    args = parser.parse_args(argv)

    config = BenchConfig(
        policies=tuple(p for p in args.policies.split(",") if p),
        rates=tuple(sorted(float(r) for r in args.rates.split(",") if r)),
        num_requests=args.num_requests,
        worker_kv_cache_memory=tuple(parse_size(b) for b in args.worker_kv_cache_memory.split(",") if b),
        workload=args.workload,
        seed=args.seed,
        drain_s=args.drain,
        max_queue=args.max_queue,
        max_queue_wait_s=args.max_queue_wait,
        address=args.address,
        policy_label=args.policy_label,
    )
    traces = {rate: make_trace(config.workload, config.num_requests, rate, config.seed) for rate in config.rates}
    began = time.monotonic()
    client = ClientProcess()
    try:
        if config.address is None:
            runs, worker_blocks = measure_local(config, traces, client)
        else:
            runs, worker_blocks = measure_running(config, traces, client)
    finally:
        client.close()
    sim_policies = list(config.policies) if config.address is None else (
        [config.policy_label] if config.policy_label in POLICIES else []
    )
    log(f"simulating the same trace on pools of {worker_blocks} blocks")
    sim = simulate_runs(config, traces, worker_blocks, sim_policies)
    overhead_s = step_overhead(runs, sim)
    scaled = simulate_runs(config, traces, worker_blocks, sim_policies, overhead_s) if overhead_s == overhead_s else []
    report = build_report(config, traces, worker_blocks, runs, sim, scaled, time.monotonic() - began)
    markdown = write_markdown(report)
    write_results(args.out, _without_raw(report), lambda: print(markdown, end=""), figures(report), "results.md")
    log(f"{time.monotonic() - began:.0f} s in all")
    return 0


def build_report(
    config: BenchConfig,
    traces: dict[float, list[TraceRequest]],
    worker_blocks: list[int],
    runs: list[dict[str, Any]],
    sim: list[dict[str, Any]],
    sim_scaled: list[dict[str, Any]],
    wall_s: float,
) -> dict[str, Any]:
    trace = next(iter(traces.values()))
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
                        "greedy, ignore_eos; the same requests at every rate, Poisson arrivals, open loop",
            "rates": list(config.rates),
            "workers": f"{workers}; KV pools {worker_blocks} blocks",
            "worker_blocks": worker_blocks,
            "router": f"max_queue {config.max_queue}, max_queue_wait {config.max_queue_wait_s:g} s, "
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


def _without_raw(report: dict[str, Any]) -> dict[str, Any]:
    """The JSON keeps per-run percentiles and KV series, not every TTFT and ITL."""
    runs = [{k: v for k, v in r.items() if k not in ("ttfts", "itls")} for r in report["runs"]]
    return {**report, "runs": runs}


if __name__ == "__main__":
    sys.exit(main())
