"""Prefix caching and prefix-aware placement on the real model, through a real cluster.

    python -m loadtest.bench_prefix [--groups 6] [--users 5] [--fractions 0.5,1,1.5,2,3,4] [--duration 40]
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
    rates      each of --fractions (0.5,1,1.5,2,3,4) x that caching-off capacity: caching off
               should saturate near 1x, caching on much further; --rates (req/s) sets them instead

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
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import inspect
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
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, NamedTuple

from loadtest.metrics import percentile
from loadtest.policy_rates import closed_loop_capacity, highest_sustained, parse_fractions, rates_at
from loadtest.report import Column, RequestLatency, Slo, Table, figure, log, write_results

MiB = 2**20
CONFIGS = (  # (label, policy, prefix caching)
    ("round-robin", "round-robin", True),
    ("kv-no-cache", "kv", False),
    ("kv", "kv", True),
    ("prefix", "prefix", True),
    ("prefix-no-cache", "prefix", False),
)
# Caching on against off under one policy: (policy, its caching-on label, its caching-off label).
ON_OFF = (("kv", "kv", "kv-no-cache"), ("prefix", "prefix", "prefix-no-cache"))
# Real text for the system prompts: module documentation that ships with Python.
_DOC_MODULES = ("argparse", "asyncio", "collections", "contextlib", "csv", "dataclasses", "datetime", "decimal",
                "email", "enum", "functools", "gzip", "heapq", "http", "inspect", "itertools", "json", "logging",
                "pathlib", "pickle", "queue", "random", "re", "shutil", "socket", "sqlite3", "statistics",
                "string", "subprocess", "tarfile", "textwrap", "threading", "typing", "unittest", "uuid", "zipfile")
QUESTIONS = ("What is this library for?", "Name one function it provides.", "Is it thread safe?",
             "Give a one-line example.", "What should I read first?", "Who would use this?")
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
DEFAULT_FRACTIONS = (0.5, 1.0, 1.5, 2.0, 3.0, 4.0)  # of the caching-off capacity


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


@dataclass(frozen=True)
class PrefixRequest:
    group: int
    user: int
    messages: tuple[tuple[str, str], ...]


def system_prompts(groups: int, target_tokens: int, encode: Any) -> list[str]:
    """One system prompt per group, each about target_tokens tokens of documentation."""
    import importlib

    docs = []
    for name in _DOC_MODULES:
        try:
            docs.append(inspect.getdoc(importlib.import_module(name)) or "")
        except ImportError:
            continue
    text = "\n\n".join(d for d in docs if d)
    words = text.split()
    prompts, start = [], 0
    for group in range(groups):
        head = f"You are the documentation assistant of team {group}. Answer from this reference only.\n\n"
        end = start
        while len(encode(head + " ".join(words[start:end]))) < target_tokens:
            end += 50
            if end >= len(words):  # wrap around: still real text, another stretch of it
                words = words + words
        prompts.append(head + " ".join(words[start:end]))
        start = end
    return prompts


def make_workload(
    groups: int, users: int, system: list[str], seed: int, num_requests: int = 2000
) -> list[PrefixRequest]:
    """num_requests seeded requests (a longer list begins with a shorter one's requests)."""
    rng = random.Random(seed)
    requests = []
    for _ in range(num_requests):
        group, user = rng.randrange(groups), rng.randrange(users)
        question = f"I am user {user}. {rng.choice(QUESTIONS)}"
        requests.append(PrefixRequest(group, user, (("system", system[group]), ("user", question))))
    return requests


def first_of_groups(workload: Sequence[PrefixRequest], count: int) -> list[PrefixRequest]:
    """Up to count requests, each the first of its group in workload: none of them can find a
    prefix that another one left (fewer than count when there are fewer groups)."""
    seen: set[int] = set()
    out: list[PrefixRequest] = []
    for request in workload:
        if request.group not in seen and len(out) < count:
            seen.add(request.group)
            out.append(request)
    return out


# -- the client, in a process of its own -----------------------------------------------------


def client_main(conn: Any) -> None:
    """("replay", (address, requests, arrivals, max_tokens, drain_s)) or ("closed", (address,
    requests, concurrency, max_tokens, timeout_s)) answers one row per request; ("stop", ()) ends it."""
    while True:
        kind, payload = conn.recv()
        if kind == "stop":
            return
        if kind == "replay":
            conn.send(asyncio.run(_replay(*payload)))
        elif kind == "closed":
            conn.send(asyncio.run(_closed_loop(*payload)))


async def _replay(address: str, requests: list[PrefixRequest], arrivals: list[float], max_tokens: int,
                  drain_s: float) -> list[dict[str, Any]]:
    import grpc

    from protos.kvserve.v1 import serving_pb2_grpc as pb_grpc

    results: list[dict[str, Any]] = [{} for _ in requests]
    async with grpc.aio.insecure_channel(address) as channel:
        stub = pb_grpc.KVServeStub(channel)
        start = time.monotonic()

        async def one(index: int, request: PrefixRequest) -> None:
            await asyncio.sleep(max(0.0, start + arrivals[index] - time.monotonic()))
            results[index] = await _generate(stub, request, max_tokens, start, arrivals[-1] + drain_s + 60)

        await asyncio.gather(*(one(i, r) for i, r in enumerate(requests)))
    return results


async def _closed_loop(address: str, requests: list[PrefixRequest], concurrency: int, max_tokens: int,
                       timeout_s: float) -> list[dict[str, Any]]:
    """The requests in order, `concurrency` in flight at all times: each lane sends the next
    one as soon as its last one finished."""
    import grpc

    from protos.kvserve.v1 import serving_pb2_grpc as pb_grpc

    results: list[dict[str, Any]] = [{} for _ in requests]
    async with grpc.aio.insecure_channel(address) as channel:
        stub = pb_grpc.KVServeStub(channel)
        start = time.monotonic()
        order = iter(range(len(requests)))  # shared by the lanes: each takes the next index

        async def lane() -> None:
            for index in order:
                results[index] = await _generate(stub, requests[index], max_tokens, start, timeout_s)

        await asyncio.gather(*(lane() for _ in range(concurrency)))
    return results


async def _generate(stub: Any, request: PrefixRequest, max_tokens: int, start: float,
                    timeout_s: float) -> dict[str, Any]:
    """One streamed Generate call: its group, worker, when it was sent (since start), TTFT, end
    to end, and its usage."""
    import grpc

    from protos.kvserve.v1 import serving_pb2 as pb

    message = pb.GenerateRequest(
        messages=pb.ChatMessages(messages=[pb.ChatMessage(role=r, content=c) for r, c in request.messages]),
        sampling=pb.SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True),
    )
    sent = time.monotonic()
    row: dict[str, Any] = {"group": request.group, "sent": sent - start, "ok": False}
    try:
        async for event in stub.Generate(message, timeout=timeout_s):
            kind = event.WhichOneof("event")
            if kind == "started":
                row["worker"] = event.started.worker_id
            elif kind == "delta" and "ttft" not in row:
                row["ttft"] = time.monotonic() - sent
            elif kind == "finished":
                row["ok"] = event.finished.finish_reason == pb.FINISH_REASON_LENGTH
                row["prompt_tokens"] = event.finished.usage.prompt_tokens
                row["cached_tokens"] = event.finished.usage.cached_prompt_tokens
                row["output_tokens"] = event.finished.usage.completion_tokens
        row["e2e"] = time.monotonic() - sent
    except grpc.aio.AioRpcError as exc:
        row["error"] = exc.code().name
    return row


def replay(conn: Any, address: str, requests: list[PrefixRequest], arrivals: list[float],
           args: argparse.Namespace) -> list[dict[str, Any]]:
    """The requests open loop at their arrival times (seconds from now), through the client process."""
    conn.send(("replay", (address, requests, arrivals, args.max_tokens, args.drain)))
    results: list[dict[str, Any]] = conn.recv()
    return results


def closed_loop(conn: Any, address: str, requests: list[PrefixRequest], concurrency: int,
                args: argparse.Namespace) -> list[dict[str, Any]]:
    """The requests with `concurrency` always in flight, through the client process."""
    conn.send(("closed", (address, requests, concurrency, args.max_tokens, args.drain + 60)))
    results: list[dict[str, Any]] = conn.recv()
    return results


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
                           router=RouterConfig(policy=policy, max_queue=1024, max_queue_wait_s=600),
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


def run_config(args: argparse.Namespace, label: str, policy: str, caching: bool, workload: list[PrefixRequest],
               points: list[RatePoint], slo: Slo, worker_kv: int, conn: Any) -> list[dict[str, Any]]:
    rows = []
    with fresh_cluster(args, policy, caching, worker_kv) as address:
        offset = 0
        for point in points:
            count = max(args.min_requests, int(point.rate * args.duration))
            batch = workload[offset : offset + count]
            offset += count
            # Seeded by the fraction: at one fraction the arrivals have one shape whatever the capacity.
            rng = random.Random(args.seed + round((point.fraction or point.rate) * 1000))
            arrivals, t = [], 0.0
            for _ in batch:
                t += rng.expovariate(point.rate)
                arrivals.append(t)
            log(f"{label}: {count} requests at {_load(point.fraction, point.rate)}")
            results = replay(conn, address, batch, arrivals, args)
            row = {**summarize(label, point.rate, results, slo, arrivals), "fraction": point.fraction}
            row["trace"] = results  # per request: group, worker, sent, TTFT, cached and prompt tokens
            log(f"  TTFT p50 {row['ttft_p50']:.2f} s p90 {row['ttft_p90']:.2f} s, goodput {row['goodput']:.0%}, "
                f"hit rate {row['hit_rate']:.0%}, {row['output_tokens_per_s']:.1f} tok/s")
            rows.append(row)
            if not row["sustained"]:
                log(f"  {label} is past saturation at {_load(point.fraction, point.rate)}: "
                    "its higher rates are not run")
                break
    return rows


def _load(fraction: float | None, rate: float) -> str:
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


def oracle_hit_rate(workload: list[PrefixRequest], prompt_lengths: dict[int, int], block: int, encode_len: Any) -> float:
    """One infinite cache: a group's whole system prompt (its full blocks) hits after its first request."""
    seen: set[int] = set()
    hit = total = 0
    for request in workload:
        length = encode_len(request)
        total += length
        if request.group in seen:
            hit += (prompt_lengths[request.group] // block) * block
        seen.add(request.group)
    return hit / total


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
            f"rates {', '.join(_load(p.fraction, p.rate) for p in points)}")
        count = sum(max(args.min_requests, int(p.rate * args.duration)) for p in points)
        workload = make_workload(args.groups, args.users, system, args.seed, count)
        for label, policy, caching in configs:
            rows.extend(run_config(args, label, policy, caching, workload, points, slo, worker_kv, conn))
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
    ats = {name: f" at {_load(t.get('fraction'), t['rate'])}" if t["rate"] is not None else ""
           for name, t in report["targets"].items()}
    at_width = max([16, *(len(at) + 1 for at in ats.values())])
    for name, t in report["targets"].items():
        print(f"  {name:<{width}}{ats[name]:<{at_width}} {t['value']:.2f} (target {t['target']}) "
              f"{'MET' if t['met'] else 'MISSED'}")


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
    axes[2].axhline(report["oracle_hit_rate"], color="gray", linestyle=":", label="oracle")
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


if __name__ == "__main__":
    sys.exit(main())
