"""Prefix caching and prefix-aware placement on the real model, through a real cluster.

    python -m loadtest.bench_prefix [--groups 6] [--users 5] [--rates 0.25,0.5,1] [--duration 40]
    make bench-prefix

A workload shaped like llm-d's prefix benchmark: G groups, each with a long shared system
prompt (about --system-tokens tokens of real English text: the standard library's own
documentation, through the model's chat template), several users per group asking short
questions, short answers (--max-tokens, greedy, EOS ignored so every answer has the same
length). The workers' KV is sized so that the groups' prefixes together are larger than
one worker's KV and smaller than the cluster's. Requests arrive open loop as a Poisson
process at each rate in turn (the same seeded sequence of groups and users at every rate);
a configuration past saturation at one rate (a request unfinished, or under half within
the TTFT SLO) is not run at the higher ones.

Five configurations run side by side in one run, each on a fresh cluster of the same
workers: `round-robin` (caching on), `kv` with caching off (`--no-prefix-caching`), `kv`
with caching on, `prefix`, and `prefix` with caching off (the default policy with the
cache off: it still places a group's requests together on its predictions, but every
request computes its whole prompt). Reported per configuration and rate: TTFT p50/p90/p99,
output tokens/s, goodput (the share of requests whose TTFT met --ttft-slo), and the
prefix-cache hit rate (cached prompt tokens over prompt tokens, from each response's
usage) against the oracle's: the hit rate of one infinite cache, where every request but
its group's first finds its group's whole system prompt cached.

Targets on this machine: caching on vs off, same policy, p90 TTFT at least 3x lower at
the rate where caching off saturates (judged for `kv` and for `prefix`: `kv` spreads each
group over every worker, so with the groups' prefixes larger than one worker's KV its hit
rate is bounded well below the oracle's whatever the cache does); prefix vs kv (both caching on) p90 TTFT at least 3x lower and
goodput at least 1.5x at the highest rate both sustain; prefix's hit rate at least 90% of
the oracle's. Writes results/bench_prefix/{results.json,output.txt,bench_prefix.png}.
"""

from __future__ import annotations

import argparse
import asyncio
import inspect
import logging
import math
import multiprocessing
import random
import shutil
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from loadtest.metrics import percentile
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


def slo_of(args: argparse.Namespace) -> Slo:
    """TTFT within --ttft-slo; a rate is sustained while every request finishes and half meet it."""
    return Slo(ttft_s=args.ttft_slo, percentile=50)


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


def make_workload(groups: int, users: int, system: list[str], seed: int) -> list[PrefixRequest]:
    rng = random.Random(seed)
    requests = []
    for _ in range(2000):
        group, user = rng.randrange(groups), rng.randrange(users)
        question = f"I am user {user}. {rng.choice(QUESTIONS)}"
        requests.append(PrefixRequest(group, user, (("system", system[group]), ("user", question))))
    return requests


# -- the client, in a process of its own -----------------------------------------------------


def client_main(conn: Any) -> None:
    while True:
        kind, payload = conn.recv()
        if kind == "stop":
            return
        conn.send(asyncio.run(_replay(*payload)))


async def _replay(address: str, requests: list[PrefixRequest], arrivals: list[float], max_tokens: int,
                  drain_s: float) -> list[dict[str, Any]]:
    import grpc

    from protos.kvserve.v1 import serving_pb2 as pb
    from protos.kvserve.v1 import serving_pb2_grpc as pb_grpc

    results: list[dict[str, Any]] = [{} for _ in requests]
    async with grpc.aio.insecure_channel(address) as channel:
        stub = pb_grpc.KVServeStub(channel)
        start = time.monotonic()

        async def one(index: int, request: PrefixRequest) -> None:
            await asyncio.sleep(max(0.0, start + arrivals[index] - time.monotonic()))
            message = pb.GenerateRequest(
                messages=pb.ChatMessages(messages=[pb.ChatMessage(role=r, content=c) for r, c in request.messages]),
                sampling=pb.SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True),
            )
            sent = time.monotonic()
            row: dict[str, Any] = {"group": request.group, "sent": sent - start, "ok": False}
            try:
                async for event in stub.Generate(message, timeout=arrivals[-1] + drain_s + 60):
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
            results[index] = row

        await asyncio.gather(*(one(i, r) for i, r in enumerate(requests)))
    return results


# -- one configuration --------------------------------------------------------------------


def run_config(args: argparse.Namespace, label: str, policy: str, caching: bool, workload: list[PrefixRequest],
               rates: list[float], client: Any, client_conn: Any) -> list[dict[str, Any]]:
    from cluster.local import ClusterConfig
    from loadtest.bench_policies import LocalCluster
    from router.core import RouterConfig
    from router.server import ServerConfig
    from workers.config import EngineArgs

    state = Path(tempfile.mkdtemp(prefix="bench-prefix-"))
    engine = EngineArgs(model=args.model, kv_cache_memory=args.worker_kv, num_threads=1,
                        enable_prefix_caching=caching, max_num_batched_tokens=args.max_num_batched_tokens)
    config = ClusterConfig(engine=engine, num_workers=args.workers, worker_cpus=1, state_dir=state,
                           router=RouterConfig(policy=policy, max_queue=1024, max_queue_wait_s=600),
                           server=ServerConfig(port=0), metrics_port=None)  # fmt: skip
    cluster = LocalCluster(config)
    rows = []
    try:
        address = cluster.start()
        offset = 0
        for rate in rates:
            count = max(args.min_requests, int(rate * args.duration))
            batch = workload[offset : offset + count]
            offset += count
            rng = random.Random(args.seed + int(rate * 1000))
            arrivals, t = [], 0.0
            for _ in batch:
                t += rng.expovariate(rate)
                arrivals.append(t)
            log(f"{label}: {count} requests at {rate:g} req/s")
            client_conn.send(("replay", (address, batch, arrivals, args.max_tokens, args.drain)))
            results = client_conn.recv()
            row = summarize(label, rate, results, slo_of(args), arrivals)
            row["trace"] = results  # per request: group, worker, sent, TTFT, cached and prompt tokens
            log(f"  TTFT p50 {row['ttft_p50']:.2f} s p90 {row['ttft_p90']:.2f} s, goodput {row['goodput']:.0%}, "
                f"hit rate {row['hit_rate']:.0%}, {row['output_tokens_per_s']:.1f} tok/s")
            rows.append(row)
            if not row["sustained"]:
                log(f"  {label} is past saturation at {rate:g} req/s: its higher rates are not run")
                break
    finally:
        cluster.stop()
        shutil.rmtree(state, ignore_errors=True)
    return rows


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
    parser.add_argument("--rates", default="0.4,0.6,0.8,1.0,1.2,1.6")
    parser.add_argument("--duration", type=float, default=40.0, help="seconds of arrivals per rate")
    parser.add_argument("--min-requests", type=int, default=12)
    parser.add_argument("--drain", type=float, default=120.0)
    # On this 2-core machine one worker thread prefills a 1,000-token system prompt in ~3-4 s:
    # the SLO is what a request that finds its prefix cached meets with room to spare.
    parser.add_argument("--ttft-slo", type=float, default=5.0, help="seconds; goodput counts requests within it")
    parser.add_argument("--max-num-batched-tokens", type=int, default=512)
    parser.add_argument("--configs", default=",".join(c[0] for c in CONFIGS))
    parser.add_argument("--seed", type=int, default=7)
    parser.add_argument("--out", type=Path, default=Path("results/bench_prefix"))
    args = parser.parse_args(argv)
    slo = slo_of(args)  # a bad --ttft-slo fails here, before any cluster starts
    rates = [float(r) for r in args.rates.split(",") if r]
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
    workload = make_workload(args.groups, args.users, system, args.seed)

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
    if args.worker_kv is None:
        args.worker_kv = int(3.6 * prefix_bytes)
    log(f"{args.groups} groups x ~{sum(shared.values()) // args.groups} shared tokens "
        f"({prefix_bytes / MiB:.0f} MiB of KV each); {args.workers} workers x {args.worker_kv / MiB:.0f} MiB")

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
        for label, policy, caching in configs:
            rows.extend(run_config(args, label, policy, caching, workload, rates, client, conn))
    finally:
        ray.shutdown()
        conn.send(("stop", ()))
        client.join(timeout=30)
    count = sum(max(args.min_requests, int(r * args.duration)) for r in rates)
    def oracle_of(n: int) -> float:
        return oracle_hit_rate(workload[:n], shared, block_size, rendered_len)

    oracle = oracle_of(count)
    report = {"conditions": {**vars(args), "slo": slo.describe(),
                             "sustained": f"every request finished and {slo.describe_sustained()}",
                             "date": time.strftime("%Y-%m-%d")},
              "oracle_hit_rate": oracle, "rows": rows, "targets": targets(rows, oracle_of)}
    write_results(args.out, report, lambda: print_table(report), {"bench_prefix.png": lambda p: plot(report, p)})
    return 0


def targets(rows: list[dict[str, Any]], oracle_of: Callable[[int], float]) -> dict[str, Any]:
    """The issue's targets; oracle_of(n) is the oracle's hit rate on the workload's first n requests."""
    by = {(r["config"], r["rate"]): r for r in rows}
    rates = sorted({r["rate"] for r in rows})

    def sustains(config: str, rate: float) -> bool:
        row = by.get((config, rate))
        return row is not None and bool(row["sustained"])

    out: dict[str, Any] = {}
    for policy, on_label, off_label in ON_OFF:
        # The rate where caching off saturates: its first unsustained one, else its last run.
        off_rates = [r for r in rates if (off_label, r) in by]
        off_saturates = next((r for r in off_rates if not sustains(off_label, r)), off_rates[-1] if off_rates else 0)
        off, on = by.get((off_label, off_saturates)), by.get((on_label, off_saturates))
        if off and on:
            out[f"caching on vs off ({policy}), p90 TTFT"] = {
                "rate": off_saturates, "value": off["ttft_p90"] / on["ttft_p90"], "target": 3.0}
    both = [r for r in rates if sustains("kv", r) and sustains("prefix", r)] or rates[:1]
    top = both[-1]
    kv, prefix = by.get(("kv", top)), by.get(("prefix", top))
    if kv and prefix:
        out["prefix vs kv, p90 TTFT"] = {"rate": top, "value": kv["ttft_p90"] / prefix["ttft_p90"], "target": 3.0}
        out["prefix vs kv, goodput"] = {"rate": top, "value": prefix["goodput"] / max(kv["goodput"], 1e-9),
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
    keys = ("config", "rate", "ttft_p50", "ttft_p90", "ttft_p99", "output_tokens_per_s", "goodput", "hit_rate",
            "per_worker")
    print()
    print("\n".join(TABLE.lines([[r[k] for k in keys] for r in report["rows"]])))
    print(f"oracle hit rate: {report['oracle_hit_rate']:.0%}")
    print("\nTargets:")
    width = max([28, *(len(name) + 1 for name in report["targets"])])
    for name, t in report["targets"].items():
        at = f" at {t['rate']:g} req/s" if t["rate"] is not None else ""
        print(f"  {name:<{width}}{at:<16} {t['value']:.2f} (target {t['target']}) {'MET' if t['met'] else 'MISSED'}")


def plot(report: dict[str, Any], path: Path) -> None:
    with figure(path, 1, 3, dpi=120, figsize=(15, 4.5)) as (_, axes):
        _draw(report, axes)


def _draw(report: dict[str, Any], axes: Any) -> None:
    for config in dict.fromkeys(r["config"] for r in report["rows"]):
        rows = [r for r in report["rows"] if r["config"] == config]
        rates = [r["rate"] for r in rows]
        axes[0].plot(rates, [r["ttft_p90"] for r in rows], "o-", label=config)
        axes[1].plot(rates, [r["goodput"] for r in rows], "o-", label=config)
        axes[2].plot(rates, [r["hit_rate"] for r in rows], "o-", label=config)
    axes[2].axhline(report["oracle_hit_rate"], color="gray", linestyle=":", label="oracle")
    for ax, title in zip(axes, ("p90 TTFT (s)", "goodput (TTFT within SLO)", "prefix-cache hit rate"), strict=True):
        ax.set_xlabel("arrival rate (req/s)")
        ax.set_title(title)
    axes[0].set_yscale("log")
    axes[0].legend()


if __name__ == "__main__":
    sys.exit(main())
