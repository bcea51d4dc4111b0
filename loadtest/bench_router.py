"""Router benchmark: what the router adds to one request, and what it delivers at saturation.

    python -m loadtest.bench_router [--model tiny] [--num-requests 30] [--concurrency 64] [--out results/bench_router]
    python -m loadtest.bench_router --model smollm2-135m-instruct --out results/bench_router_real

--model: the workers' and the in-process engine's (the `micro` ceiling keeps its own). The
tokens/s target is judged on `tiny` only, the model its 2026-12-01 baseline was measured on.

Measured side by side in one run, on the same EngineArgs and the same requests, taking
turns request by request so both paths see the same machine:
  in-process   the engine in this process (create_engine + step loop), one request at a
               time: TTFT from add_request to the first token, ITL between tokens
  router       the same requests through a real cluster (router in this process, 2 CPU
               worker actors, embedded Redis) from a gRPC client in another process, one at
               a time: TTFT from sending Generate to the first delta, ITL between deltas;
               and where the router's TTFT goes, hop by hop (HopClock)
  saturation   `concurrency` streaming clients (grpc.aio, in that other process) keep the
               cluster full; output tokens/s delivered to clients in a fixed window, and the
               CPU of this process in that window, which holds the router and nothing else
               then (clients, workers, Redis and Ray's daemons are processes of their own)
  interval     the same saturation with the router sending each stream's deltas every
               --stream-interval tokens (4) instead of every step: tokens/s and router CPU
  two routers  the same saturation with a `kvserve router` process beside this one's (what
               `kvserve up --routers 2` starts), the clients split between the two: tokens/s
               in all, and each router's CPU per token it delivered
  ceiling      the same saturation on a second cluster whose 2 workers run the `micro`
               preset (one 64-wide layer), so the router, not the workers' arithmetic,
               runs out first: the tokens/s one router process can deliver here
  floor        first, a bare grpc.aio server in this process streaming to as many
               clients in another process (loadtest/grpc_floor.py): its CPU per message
  own Python   first too, microbenchmarks in this process: the metrics observer per token
               event, and the router's token flow and stream per token with no gRPC or
               Redis I/O (loadtest/router_probes.py): what is kvserve's own code in the
               router's CPU per token, beside the floor
Prints a table; writes results.json, output.txt (the table) and bench_router.png.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import multiprocessing
import os
import platform
import shutil
import sys
import tempfile
import threading
import time
from collections.abc import Coroutine
from dataclasses import replace
from pathlib import Path
from typing import Any, TypeVar

from cluster.routers import RouterProcesses
from loadtest.grpc_floor import floor_us
from loadtest.grpc_load import Timeline, client_main, record_tokens
from loadtest.metrics import percentile
from loadtest.report import Column, Table, figure, log, write_results
from loadtest.router_probes import CpuPhase, HopClock, cpu_by_role, metrics_cost_us, token_path_cost_us
from loadtest.trace import TraceRequest, poisson_trace

T = TypeVar("T")
TTFT_ADDED_TARGET_MS = 5.0
ROUTER_US_PER_TOKEN_TARGET = 50.0
THROUGHPUT_BASELINE = 971.0  # tokens/s one router delivered to 64 clients on 2026-12-01 (issue 14)
THROUGHPUT_MODEL = "tiny"  # the model that baseline was measured on
THROUGHPUT_TARGET_X = 3.0
CEILING_MODEL = "micro"  # workers whose steps cost bookkeeping, not arithmetic: the router runs out first
ACTOR_STEP_TARGET_X = 1.10  # a worker actor's step time over the same engine's in-process
PATHS = Table((
    Column("path", 12, align="<"),
    Column("TTFT p50", 10, ".2f", scale=1e3),
    Column("TTFT p99", 10, ".2f", scale=1e3),
    Column("ITL p50", 9, ".2f", scale=1e3),
    Column("ITL p99", 9, ".2f", scale=1e3),
    Column("tokens", 8),
))
# The router's row minus the in-process row, signed, under the same columns.
ADDED = Table((PATHS.columns[0], *(replace(c, spec="+" + c.spec) for c in PATHS.columns[1:5])), rule=False)


# -- the in-process engine ------------------------------------------------------------------


class InProcessEngine:
    """The worker's engine, built from the same EngineArgs, stepped in this process."""

    def __init__(self, engine_args: Any) -> None:
        from workers.model.build import create_engine, load

        self.engine = create_engine(engine_args, load(engine_args), quiet=True)

    def run(self, r: TraceRequest, request_id: str) -> Timeline:
        from workers.engine.sampling import SamplingParams

        params = SamplingParams(max_tokens=r.output_len, temperature=0.0, ignore_eos=True)
        timeline = Timeline()
        sent_at = time.perf_counter()
        self.engine.add_request(request_id, r.prompt_ids, params)
        last_at = None
        while self.engine.has_unfinished:
            events = self.engine.step()
            now = time.perf_counter()
            for event in events:
                last_at = record_tokens(timeline, sent_at, last_at, now, list(event.token_ids))
        return timeline


class _LoopThread:
    """An asyncio loop in a thread of its own: the cluster lives there, like in `kvserve up`."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="cluster-loop", daemon=True)
        self.thread.start()

    def run(self, coroutine: Coroutine[Any, Any, T], timeout: float) -> T:
        return asyncio.run_coroutine_threadsafe(coroutine, self.loop).result(timeout)

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(timeout=10)


def summarize(timelines: list[Timeline]) -> dict[str, float]:
    ttfts = [t.ttft for t in timelines]
    itls = [gap for t in timelines for gap in t.itls]
    return {
        "ttft_p50": percentile(ttfts, 50),
        "ttft_p99": percentile(ttfts, 99),
        "itl_p50": percentile(itls, 50),
        "itl_p99": percentile(itls, 99),
        "num_requests": len(timelines),
        "num_tokens": sum(len(t.token_ids) for t in timelines),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="tiny",
                        help="the workers' model: a preset (tiny) or a named model (smollm2-135m-instruct)")
    parser.add_argument("--num-requests", type=int, default=30)
    parser.add_argument("--output-len", type=int, default=32, help="tokens per request at concurrency 1")
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--saturation-output-len", type=int, default=64)
    parser.add_argument("--warmup-s", type=float, default=3.0)
    parser.add_argument("--window-s", type=float, default=10.0)
    parser.add_argument("--stream-interval", type=int, default=4,
                        help="the router's --stream-interval in the second saturation run")
    parser.add_argument("--num-threads", type=int, default=1, help="torch threads, in-process and per worker")
    parser.add_argument("--kv-cache-memory", type=int, default=None,
                        help=f"bytes per engine (default: 64 MiB for {THROUGHPUT_MODEL}, 384 MiB for any other "
                        "model, enough for its share of the saturation's streams)")
    parser.add_argument("--out", type=Path, default=Path("results/bench_router"))
    args = parser.parse_args(argv)

    import ray

    from cluster.local import Cluster, ClusterConfig
    from router.server import ServerConfig
    from workers.config import EngineArgs

    kv_cache_memory = args.kv_cache_memory or (64 if args.model == THROUGHPUT_MODEL else 384) * 2**20
    engine_args = EngineArgs(model=args.model, kv_cache_memory=kv_cache_memory, num_threads=args.num_threads)
    serial_trace = poisson_trace(args.num_requests, float("inf"), seed=7, output_len=(args.output_len, args.output_len))
    saturation_trace = poisson_trace(
        256, float("inf"), seed=8, output_len=(args.saturation_output_len, args.saturation_output_len)
    )

    observer_us = metrics_cost_us()  # first, while nothing else runs
    token_path_us = token_path_cost_us()
    log(f"the floor: a bare grpc.aio server streaming to {args.concurrency} clients")
    floor = floor_us(num_streams=args.concurrency)
    log(f"loading {args.model} for the in-process engine")
    local = InProcessEngine(engine_args)

    state_dir = Path(tempfile.mkdtemp(prefix="bench-router-"))
    # kvserve's namespace: the second router finds the workers by name there.
    ray.init(num_cpus=8, include_dashboard=False, logging_level=logging.WARNING, namespace="kvserve")
    loop = _LoopThread()
    cluster = Cluster(
        ClusterConfig(
            engine=engine_args, num_workers=2, state_dir=state_dir, server=ServerConfig(port=0), metrics_port=0
        )
    )
    context = multiprocessing.get_context("spawn")
    try:
        parent, client = start_with_clients(cluster, loop, context)

        log(
            f"concurrency 1: {args.num_requests} requests (each after a warm-up twin), each in-process "
            "and then through the router, so both paths see the same machine"
        )
        phase = CpuPhase(client.pid)
        hops, in_process, through_router = serial_phase(cluster, local, parent, serial_trace)
        others_serial = phase.others_share()

        log(f"saturation: {args.concurrency} streaming clients, {args.warmup_s:g} s warm-up, {args.window_s:g} s")
        window = (saturation_trace, args.concurrency, args.warmup_s, args.window_s)
        saturation = saturate(parent, client.pid, window)

        log(f"saturation again, the router sending a stream's deltas every {args.stream_interval} tokens "
            f"(--stream-interval {args.stream_interval})")
        assert cluster.server is not None
        cluster.server.service.stream_interval = args.stream_interval
        try:
            with_interval = saturate(parent, client.pid, window)
        finally:
            cluster.server.service.stream_interval = 1

        log("two routers: a `kvserve router` process beside this one, the clients split between them")
        assert cluster.redis_url is not None
        routers = RouterProcesses()
        try:
            loop.run(routers.start(1, ray.get_runtime_context().gcs_address, cluster.redis_url, [], port=0,
                                   metrics_port=None), timeout=300)
            second_pid = routers.pids[0]
            addresses = [cluster.address, routers.addresses[0]]
            two_routers = saturate(parent, client.pid, (*window, addresses), (second_pid,))
        finally:
            routers.signal_stop()
            loop.run(routers.wait(30.0), timeout=60)
        parent.send(("stop", ()))
        client.join(timeout=30)
    finally:
        loop.run(cluster.stop(), timeout=120)

    log(f"the router's own ceiling: the same saturation on 2 workers of the `{CEILING_MODEL}` preset "
        "(one 64-wide layer: a step costs bookkeeping, not arithmetic)")
    ceiling = router_ceiling(replace(engine_args, model=CEILING_MODEL), state_dir / "ceiling", loop, context,
                             (saturation_trace, args.concurrency, args.warmup_s, args.window_s))

    # Concurrency 1 again, the engine on a CPU of its own (--engine-cpus): one worker, so
    # the one CPU it gets is the last, and this process (its router and the in-process
    # engine), the actor, Redis and the client keep to the others.
    engine_cpu = max(os.sched_getaffinity(0))
    pinned: dict[str, Any] | None = None
    if len(os.sched_getaffinity(0)) >= 2:
        log(f"concurrency 1 again with --engine-cpus {engine_cpu}: one worker, its engine alone on CPU {engine_cpu}")
        pinned_cluster = Cluster(
            ClusterConfig(engine=engine_args, num_workers=1, state_dir=state_dir / "engine-cpus", server=ServerConfig(port=0),
                          metrics_port=0, engine_cpus=(engine_cpu,))
        )
        try:
            parent, client = start_with_clients(pinned_cluster, loop, context)
            # A fresh in-process engine: the first one's prefix cache holds these prompts.
            pinned_hops, pinned_local, pinned_router = serial_phase(
                pinned_cluster, InProcessEngine(engine_args), parent, serial_trace
            )
            parent.send(("stop", ()))
            client.join(timeout=30)
            pinned = {"engine_cpus": [engine_cpu], "in_process": summarize(pinned_local),
                      "router": summarize(pinned_router), "router_hops": pinned_hops.breakdown(pinned_router),
                      "ttft_added_paired_p50_ms": paired_added_ms(pinned_local, pinned_router)}
        finally:
            loop.run(pinned_cluster.stop(), timeout=120)
    loop.close()
    ray.shutdown()
    shutil.rmtree(state_dir, ignore_errors=True)

    saturation["window_s"] = args.window_s
    with_interval["stream_interval"] = args.stream_interval
    saturation["with_stream_interval"] = with_interval
    share_two = two_routers["cpu_share_of_one_core"]
    two_routers["router_cpu_us_per_token"] = [
        share_two[role] / (tokens / args.window_s) * 1e6 if tokens else float("nan")
        for role, tokens in zip(("router", "router 2"), two_routers["tokens_by_router"])
    ]
    saturation["two_routers"] = two_routers
    saturation["router_ceiling"] = ceiling
    saturation["grpc_floor_us_per_message"] = floor
    report = build_report(args, engine_args, in_process, through_router, hops, saturation, observer_us, pinned,
                          token_path_us)
    report["concurrency_1"]["other_processes_cpu_share"] = others_serial
    write_results(args.out, report, lambda: print_table(report), {"bench_router.png": lambda p: plot(report, p)})
    return 0


def start_with_clients(cluster: Any, loop: _LoopThread, context: Any) -> tuple[Any, Any]:
    """Start the cluster and the client process aimed at its router: (the pipe to the
    client, the client process)."""
    loop.run(cluster.start(), timeout=300)
    parent, child = context.Pipe()
    client = context.Process(target=client_main, args=(child, cluster.address), name="bench-clients", daemon=True)
    client.start()
    assert client.pid is not None
    return parent, client


def router_ceiling(engine_args: Any, state_dir: Path, loop: _LoopThread, context: Any,
                   window: tuple[Any, ...]) -> dict[str, Any]:
    """One saturation run on a cluster whose workers cost next to nothing per token (the
    CEILING_MODEL preset), so the router, not the workers' arithmetic, is what runs out."""
    from cluster.local import Cluster, ClusterConfig
    from router.server import ServerConfig

    cluster = Cluster(ClusterConfig(engine=engine_args, num_workers=2, state_dir=state_dir,
                                    server=ServerConfig(port=0), metrics_port=0))
    try:
        parent, client = start_with_clients(cluster, loop, context)
        result = saturate(parent, client.pid, window)
        parent.send(("stop", ()))
        client.join(timeout=30)
    finally:
        loop.run(cluster.stop(), timeout=120)
    result["model"] = engine_args.model
    return result


def saturate(parent: Any, client_pid: int, window: tuple[Any, ...],
             router_pids: tuple[int, ...] = ()) -> dict[str, Any]:
    """One saturation run by the client process (window: its "saturate" arguments, the
    warm-up and window seconds third and fourth): what it counted, tokens/s, the CPU of
    each role in the window as a share of one core, and this router's CPU per token."""
    warmup_s, window_s = window[2], window[3]
    parent.send(("saturate", window))
    kind, start = parent.recv()
    assert kind == "started"
    time.sleep(max(0.0, start + warmup_s - time.monotonic()))
    before, window_start = cpu_by_role(client_pid, router_pids), time.monotonic()
    time.sleep(max(0.0, start + warmup_s + window_s - time.monotonic()))
    after, seconds = cpu_by_role(client_pid, router_pids), time.monotonic() - window_start
    result: dict[str, Any] = parent.recv()
    share = {role: (after[role] - before[role]) / seconds for role in after}
    result["tokens_per_s"] = result["tokens_in_window"] / window_s
    result["cpu_share_of_one_core"] = share
    result["router_cpu_us_per_token"] = (
        share["router"] / result["tokens_per_s"] * 1e6 if result["tokens_per_s"] else float("nan")
    )
    return result


def serial_phase(
    cluster: Any, local: InProcessEngine, parent: Any, trace: list[TraceRequest]
) -> tuple[HopClock, list[Timeline], list[Timeline]]:
    """Each request in-process, then through the cluster's router, one at a time; each
    after its warm-up twin on both paths: its prompt's length and other tokens (no prefix
    hit), since a prompt length a process meets the first time costs ~3 ms more (oneDNN
    makes its kernels for that shape), and a worker and this process have met different ones."""
    assert cluster.router is not None
    hops = HopClock()
    cluster.router.observers.append(hops.observe)
    in_process: list[Timeline] = []
    through_router: list[Timeline] = []
    for index, r in enumerate(trace):
        twin = replace(r, prompt_ids=tuple((t + 1) % 256 for t in r.prompt_ids))
        for measured, request, request_id in ((False, twin, f"warmup-{index}"), (True, r, f"serial-{index}")):
            a = local.run(request, request_id)
            parent.send(("one", (request, request_id)))
            b = parent.recv()
            if measured:
                in_process.append(a)
                through_router.append(b)
    cluster.router.observers.remove(hops.observe)
    return hops, in_process, through_router


def paired_added_ms(in_process: list[Timeline], through_router: list[Timeline]) -> float:
    """The median of each request's router TTFT minus its in-process TTFT (ms). Each request
    ran on both paths: this is steadier than the difference of the medians (what the target
    is judged on) where a TTFT is mostly prefill (the real model's ~175 ms)."""
    return percentile([(y.ttft - x.ttft) * 1e3 for x, y in zip(in_process, through_router)], 50)


def build_report(
    args: argparse.Namespace,
    engine_args: Any,
    in_process: list[Timeline],
    through_router: list[Timeline],
    hops: HopClock,
    saturation: dict[str, Any],
    observer_us: float | None,
    pinned: dict[str, Any] | None,
    token_path_us: tuple[float, float] | None = None,
) -> dict[str, Any]:
    a, b = summarize(in_process), summarize(through_router)
    added_ms = (b["ttft_p50"] - a["ttft_p50"]) * 1e3
    paired_ms = paired_added_ms(in_process, through_router)
    matches = sum(x.token_ids == y.token_ids for x, y in zip(in_process, through_router))
    router_hops = hops.breakdown(through_router)
    us = float(saturation["router_cpu_us_per_token"])
    x_baseline = saturation["tokens_per_s"] / THROUGHPUT_BASELINE
    # A worker's step as it sent the steps, against the same engine's step in this process.
    step_x = router_hops["itl_worker_p50_ms"] / (a["itl_p50"] * 1e3) if a["itl_p50"] else float("nan")
    pinned_x = float("nan")
    if pinned is not None:
        pinned["step_x_in_process"] = pinned_x = (
            pinned["router_hops"]["itl_worker_p50_ms"] / (pinned["in_process"]["itl_p50"] * 1e3)
        )
    targets = {
        "ttft_p50_added_ms": {"value": added_ms, "target": f"<= {TTFT_ADDED_TARGET_MS:g}",
                              "met": added_ms <= TTFT_ADDED_TARGET_MS},
        "router_us_per_token": {"value": us, "target": f"<= {ROUTER_US_PER_TOKEN_TARGET:g}",
                                "met": us <= ROUTER_US_PER_TOKEN_TARGET},
        "tokens_per_s_x_baseline": {"value": x_baseline,
                                    "target": f">= {THROUGHPUT_TARGET_X:g} (of {THROUGHPUT_BASELINE:g}/s)",
                                    "met": x_baseline >= THROUGHPUT_TARGET_X},
        "actor_step_x_in_process": {"value": step_x, "target": f"<= {ACTOR_STEP_TARGET_X:g}",
                                    "met": step_x <= ACTOR_STEP_TARGET_X},
        "actor_step_x_in_process_engine_cpus": {"value": pinned_x, "target": f"<= {ACTOR_STEP_TARGET_X:g}",
                                                "met": pinned_x <= ACTOR_STEP_TARGET_X},
    }
    if engine_args.model != THROUGHPUT_MODEL:
        del targets["tokens_per_s_x_baseline"]  # its baseline is tiny's: the table gives this model's tokens/s
    return {
        "conditions": {
            "model": "tiny preset (random weights)" if engine_args.model == "tiny" else engine_args.model,
            "engine_args": f"model={engine_args.model}, num_threads={engine_args.num_threads}, "
            f"kv_cache_memory={engine_args.kv_cache_memory // 2**20} MiB, device=cpu",
            "cluster": f"router in this process, 2 worker actors (1 Ray CPU and num_threads={engine_args.num_threads} "
            "each), embedded redis-server, Prometheus metrics on",
            "serial": f"{args.num_requests} requests, prompts 32-96 tokens (poisson_trace seed 7), "
            f"{args.output_len} output tokens, greedy, ignore_eos, one at a time, each in-process then through "
            f"the router, each after a warm-up twin (its length, other tokens) on both paths",
            "saturation": f"{args.concurrency} concurrent streaming clients, prompts 32-96, "
            f"{args.saturation_output_len} output tokens, {args.window_s:g} s window after {args.warmup_s:g} s",
            "machine": f"{platform.machine()}, {os.cpu_count()} CPUs",
            "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        },
        "concurrency_1": {
            "in_process": a, "router": b, "outputs_identical": matches, "router_hops": router_hops,
            "ttft_added_paired_p50_ms": paired_ms,
        },
        "saturation": saturation,
        "concurrency_1_engine_cpus": pinned,
        "metrics_observer_us_per_token_event": observer_us,
        "token_path_us_per_token": None if token_path_us is None else dict(zip(("flow", "stream"), token_path_us)),
        "targets": targets,
    }


def print_table(report: dict[str, Any]) -> None:
    c = report["conditions"]
    one = report["concurrency_1"]
    print(f"\nRouter benchmark — {c['model']}; engine: {c['engine_args']}")
    print(f"{c['cluster']}; {c['machine']}\n")
    print(f"Concurrency 1: {c['serial']} (times in ms)")
    keys = ("ttft_p50", "ttft_p99", "itl_p50", "itl_p99")
    a, b = one["in_process"], one["router"]
    rows = [(name, *(s[k] for k in keys), s["num_tokens"]) for name, s in (("in-process", a), ("router", b))]
    print("\n".join(PATHS.lines(rows)))
    print(ADDED.row(("added", *(b[k] - a[k] for k in keys))))
    paired = one.get("ttft_added_paired_p50_ms")
    if paired is not None:
        print(f"TTFT added, paired (the median of each request's router TTFT minus its in-process TTFT): {paired:+.2f} ms")
    print(f"outputs identical (greedy tokens, router vs in-process): {one['outputs_identical']}/{a['num_requests']}")
    print(f"other processes on the machine meanwhile: {one['other_processes_cpu_share']:.0%} of a core")
    h = one["router_hops"]
    print(
        f"router TTFT by hop, p50 ms: ingress (gRPC in, Redis create, placement) {h['ttft_ingress_p50_ms']:.2f}"
        f" | dispatch (Ray add_request) + worker prefill {h['ttft_dispatch_and_prefill_p50_ms']:.2f}"
        f" [in-process TTFT {a['ttft_p50'] * 1e3:.2f}]"
        f" | engine -> actor (pipe, relay) {h['ttft_engine_to_actor_p50_ms']:.2f}"
        f" | actor -> router (events connection) {h['ttft_events_wire_p50_ms']:.2f}"
        f" | router -> client (gRPC out) {h['ttft_grpc_out_p50_ms']:.2f}"
    )
    print(
        f"ITL p50 ms: between steps as the worker sent them {h['itl_worker_p50_ms']:.2f}, as the router got them "
        f"{h['itl_at_router_p50_ms']:.2f}, at the client {b['itl_p50'] * 1e3:.2f} [in-process {a['itl_p50'] * 1e3:.2f}]"
    )
    print(
        f"  of the worker's {h['itl_worker_p50_ms']:.2f}: engine.step() itself {h['engine_step_p50_ms']:.2f} "
        f"(in the engine process, timed there), the rest the engine process's loop (commands, report, pipe)"
    )

    p = report["concurrency_1_engine_cpus"]
    if p is not None:
        ph = p["router_hops"]
        print(f"\nConcurrency 1 again, one worker with --engine-cpus {p['engine_cpus'][0]} (its engine alone on that "
              "CPU, every other process on the rest):")
        print(f"  ITL p50 ms: in-process {p['in_process']['itl_p50'] * 1e3:.2f}, between steps as the worker sent "
              f"them {ph['itl_worker_p50_ms']:.2f} ({p['step_x_in_process']:.2f}x; engine.step() itself "
              f"{ph['engine_step_p50_ms']:.2f}), at the client {p['router']['itl_p50'] * 1e3:.2f}")
        print(f"  TTFT p50 ms: in-process {p['in_process']['ttft_p50'] * 1e3:.2f}, router "
              f"{p['router']['ttft_p50'] * 1e3:.2f} "
              f"({(p['router']['ttft_p50'] - p['in_process']['ttft_p50']) * 1e3:+.2f}"
              + (f", paired {p['ttft_added_paired_p50_ms']:+.2f}" if "ttft_added_paired_p50_ms" in p else "")
              + "); by hop: ingress "
              f"{ph['ttft_ingress_p50_ms']:.2f} | dispatch + prefill {ph['ttft_dispatch_and_prefill_p50_ms']:.2f} | "
              f"engine -> actor {ph['ttft_engine_to_actor_p50_ms']:.2f} | events connection "
              f"{ph['ttft_events_wire_p50_ms']:.2f} | gRPC out {ph['ttft_grpc_out_p50_ms']:.2f}")

    s = report["saturation"]
    share = s["cpu_share_of_one_core"]
    print(f"\nSaturation: {c['saturation']}")
    print(f"  output tokens/s delivered to clients   {s['tokens_per_s']:.0f}"
          f"  ({s['completed_in_window']} requests completed in the window, {s['num_errors']} errors)")
    print(f"  router process CPU                     {share['router']:.0%} of one core"
          f"  ({s['router_cpu_us_per_token']:.0f} us per delivered token)")
    print("  CPU in the window, % of one core:      "
          + ", ".join(f"{role} {value:.0%}" for role, value in share.items())
          + f"  (machine busy {sum(share.values()):.0%} of {c['machine'].split(', ')[1]})")
    if s["num_errors"]:
        print(f"  first error: {s['first_error']}")
    w = s["with_stream_interval"]
    print(f"  --stream-interval {w['stream_interval']}: {w['tokens_per_s']:.0f} tokens/s, router "
          f"{w['cpu_share_of_one_core']['router']:.0%} of a core ({w['router_cpu_us_per_token']:.0f} us per delivered "
          f"token; {w['num_errors']} errors)")
    two = s["two_routers"]
    share2 = two["cpu_share_of_one_core"]
    print(f"  two routers (clients split): {two['tokens_per_s']:.0f} tokens/s in all "
          f"({two['tokens_by_router'][0] / s['window_s']:.0f} + {two['tokens_by_router'][1] / s['window_s']:.0f}; "
          f"{two['num_errors']} errors)")
    print(f"    router 1 {share2['router']:.0%} of a core ({two['router_cpu_us_per_token'][0]:.0f} us/token), "
          f"router 2 {share2['router 2']:.0%} ({two['router_cpu_us_per_token'][1]:.0f} us/token); "
          + ", ".join(f"{role} {value:.0%}" for role, value in share2.items() if not role.startswith("router")))
    ceiling = s.get("router_ceiling")
    if ceiling is not None:
        share3 = ceiling["cpu_share_of_one_core"]
        print(f"  the router's own ceiling, the same clients on workers of the `{ceiling['model']}` preset: "
              f"{ceiling['tokens_per_s']:.0f} tokens/s, router {share3['router']:.0%} of a core "
              f"({ceiling['router_cpu_us_per_token']:.0f} us per delivered token; {ceiling['num_errors']} errors); "
              + ", ".join(f"{role} {value:.0%}" for role, value in share3.items() if role != "router"))
    floor = s.get("grpc_floor_us_per_message")
    if floor is not None:
        print(f"  the floor: a bare grpc.aio server (no kvserve) streaming one message per stream per 4 ms step to "
              f"as many clients spends {floor:.0f} us of CPU per message")
    cost = report["metrics_observer_us_per_token_event"]
    if cost is not None:
        print(f"  metrics observer, per token event (microbenchmark): {cost:.2f} us")
    path = report.get("token_path_us_per_token")  # not in records before 2026-12-05
    if path is not None:
        print(f"  the router's own Python per token, no gRPC or Redis I/O (microbenchmark): token flow and Redis "
              f"write building {path['flow']:.2f} us, stream delta to GenerateResponse {path['stream']:.2f} us")
    print("\nTargets:")
    for name, t in report["targets"].items():
        print(f"  {name:<24} {t['value']:.2f}  (target {t['target']}) {'MET' if t['met'] else 'MISSED'}")


def plot(report: dict[str, Any], path: Path) -> None:
    added = report["targets"]["ttft_p50_added_ms"]["value"]
    title = f"kvserve router benchmark — p50 TTFT added by the router: {added:+.2f} ms"
    with figure(path, 1, 3, title=title, figsize=(16, 5), gridspec_kw={"width_ratios": [3, 1.4, 1.4]}) as (_, axes):
        _draw(report, *axes)


def _draw(report: dict[str, Any], left: Any, middle: Any, right: Any) -> None:
    one = report["concurrency_1"]
    labels = ["TTFT p50", "TTFT p99", "ITL p50", "ITL p99"]
    keys = ["ttft_p50", "ttft_p99", "itl_p50", "itl_p99"]
    x = range(len(labels))
    for offset, name, key in ((-0.2, "in-process", "in_process"), (0.2, "router", "router")):
        values = [one[key][k] * 1e3 for k in keys]
        bars = left.bar([i + offset for i in x], values, width=0.4, label=name)
        left.bar_label(bars, fmt="%.1f", fontsize=8)
    left.set_xticks(list(x), labels)
    left.set_ylabel("ms")
    left.set_title("concurrency 1: router vs the same engine in-process")
    left.legend()

    h = one["router_hops"]
    hops = (
        ("ingress", "ttft_ingress_p50_ms"),
        ("dispatch + prefill", "ttft_dispatch_and_prefill_p50_ms"),
        ("engine -> actor", "ttft_engine_to_actor_p50_ms"),
        ("events connection", "ttft_events_wire_p50_ms"),
        ("gRPC out", "ttft_grpc_out_p50_ms"),
    )
    bottom = 0.0
    for name, key in hops:
        middle.bar(["router"], [h[key]], bottom=bottom, label=name)
        bottom += h[key]
    middle.bar(["in-process"], [one["in_process"]["ttft_p50"] * 1e3], color="tab:gray", label="in-process TTFT")
    middle.set_ylabel("ms")
    middle.set_title("p50 TTFT by hop")
    middle.legend(fontsize=8)

    s = report["saturation"]
    two = s["two_routers"]
    streams = report["conditions"]["saturation"].split(" concurrent")[0]
    w = s["with_stream_interval"]
    labels = [f"1 router\n{streams} streams", f"1 router\ninterval {w['stream_interval']}", "2 routers"]
    values = [s["tokens_per_s"], w["tokens_per_s"], two["tokens_per_s"]]
    ceiling = s.get("router_ceiling")
    if ceiling is not None:
        labels.append(f"1 router,\n{ceiling['model']} workers")
        values.append(ceiling["tokens_per_s"])
    bars = right.bar(labels, values, color=["tab:green", "tab:cyan", "tab:olive", "tab:purple"][:len(values)])
    right.bar_label(bars, fmt="%.0f")
    right.tick_params(axis="x", labelsize=8)
    right.set_title(f"saturation, output tokens/s\n(router CPU {s['router_cpu_us_per_token']:.0f} us/token with one)")


if __name__ == "__main__":
    sys.exit(main())
