"""A burst, queued inside the workers or in the router: TTFT side by side.

    make bench-burst        (.venv/bin/python -m loadtest.bench_burst)

--requests Generate calls (64 new tokens each, greedy) go out at once to a cluster of two
default workers (the tiny preset, default KV budget, max_num_seqs 64). Two runs, one
after the other on the same Ray and Redis:

- in workers: the router places by KV room alone (RouterConfig.count_seq_slots=False),
  so every request is admitted at once and those past a worker's 64 running wait in
  that worker's queue, for that worker;
- in router (the default): a worker is sent no more than its free sequence slots, and
  the rest wait in the router's FIFO queue, each going to whichever worker frees first.

Reported per run: how many finished and were refused, TTFT p50/p90/p99/max, the
makespan and the output tokens/s; the TTFT CDFs are plotted. Writes results.json,
output.txt and bench_burst.png into --out.
"""

from __future__ import annotations

import argparse
import asyncio
import tempfile
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np

from loadtest.report import Column, Table, figure, log, write_results

DEFAULT_OUT = Path("docs/benchmarks/bench_burst")
MODES = (("in workers", False), ("in router", True))
TABLE = Table((
    Column("queue", 11, align="<"),
    Column("finished", 9, gap=1),
    Column("refused", 8, gap=1),
    Column("TTFT p50", 9, ".2f", "s", gap=1),
    Column("p90", 7, ".2f", "s", gap=1),
    Column("p99", 7, ".2f", "s", gap=1),
    Column("max", 7, ".2f", "s", gap=1),
    Column("makespan", 9, ".1f", "s", gap=1),
    Column("tok/s", 7, ".0f", gap=1),
))


@dataclass
class Outcome:
    ttft: float | None  # None: refused or failed
    num_tokens: int
    error: str = ""


async def _one(stub: Any, index: int, max_tokens: int, go: asyncio.Event) -> Outcome:
    import grpc

    from protos.kvserve.v1 import serving_pb2 as pb

    prompt = [1 + (index * 7 + t) % 250 for t in range(16)]
    request = pb.GenerateRequest(token_ids=pb.TokenIds(ids=prompt),
                                 sampling=pb.SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True))
    await go.wait()
    sent = time.perf_counter()
    ttft = None
    tokens = 0
    try:
        async for message in stub.Generate(request, timeout=600):
            if message.WhichOneof("event") == "delta" and message.delta.token_ids:
                if ttft is None:
                    ttft = time.perf_counter() - sent
                tokens += len(message.delta.token_ids)
    except grpc.aio.AioRpcError as error:
        return Outcome(None, tokens, f"{error.code().name}: {error.details()}")
    return Outcome(ttft, tokens)


async def _burst(address: str, count: int, max_tokens: int) -> tuple[list[Outcome], float]:
    import grpc

    from protos.kvserve.v1 import serving_pb2_grpc as pb_grpc

    async with grpc.aio.insecure_channel(address) as channel:
        await channel.channel_ready()
        stub = pb_grpc.KVServeStub(channel)
        await _one(stub, 0, 4, _set())  # warm: the first steps of a worker are slow
        go = asyncio.Event()
        calls = [asyncio.ensure_future(_one(stub, i, max_tokens, go)) for i in range(count)]
        await asyncio.sleep(0.1)
        began = time.perf_counter()
        go.set()
        outcomes = await asyncio.gather(*calls)
        return outcomes, time.perf_counter() - began


def _set() -> asyncio.Event:
    event = asyncio.Event()
    event.set()
    return event


def run_mode(label: str, count_seq_slots: bool, redis_url: str, state: Path, args: argparse.Namespace) -> dict[str, Any]:
    from cluster.local import Cluster, ClusterConfig
    from loadtest.bench_router import _LoopThread
    from router.core import RouterConfig
    from router.server import ServerConfig
    from workers.config import EngineArgs

    config = ClusterConfig(
        engine=EngineArgs(model=args.model),
        num_workers=2,
        redis_url=redis_url,
        state_dir=state,
        router=replace(RouterConfig(), count_seq_slots=count_seq_slots),
        server=ServerConfig(port=0),
        store_prefix=f"burst-{int(count_seq_slots)}-{time.monotonic_ns()}",
        metrics_port=None,
    )
    thread = _LoopThread()
    cluster = Cluster(config)
    log(f"{label}: starting two workers ({args.model})")
    try:
        thread.run(cluster.start(), timeout=300)
        log(f"{label}: {args.requests} requests of {args.max_tokens} tokens at once")
        outcomes, makespan = asyncio.run(_burst(cluster.address, args.requests, args.max_tokens))
    finally:
        thread.run(cluster.stop(), timeout=120)
        thread.close()
    ttfts = [o.ttft for o in outcomes if o.ttft is not None and not o.error]
    refused = [o for o in outcomes if o.error]
    tokens = sum(o.num_tokens for o in outcomes)
    q = np.percentile(ttfts, [50, 90, 99]) if ttfts else [float("nan")] * 3
    row = {
        "queue": label,
        "count_seq_slots": count_seq_slots,
        "finished": len(ttfts),
        "refused": len(refused),
        "errors": sorted({o.error.split(":")[0] for o in refused}),
        "ttft_p50_s": float(q[0]),
        "ttft_p90_s": float(q[1]),
        "ttft_p99_s": float(q[2]),
        "ttft_max_s": max(ttfts) if ttfts else float("nan"),
        "makespan_s": makespan,
        "output_tokens_per_s": tokens / makespan,
        "ttfts_s": sorted(ttfts),
    }
    log(f"{label}: TTFT p50 {row['ttft_p50_s']:.2f} s, max {row['ttft_max_s']:.2f} s, {len(refused)} refused")
    return row


def print_table(report: dict[str, Any]) -> None:
    c = report["conditions"]
    print(f"\nA burst of {c['requests']} x {c['max_tokens']}-token requests onto 2 workers ({c['model']}, "
          f"max_num_seqs 64): where requests that cannot start wait")
    rows = [[r["queue"], r["finished"], r["refused"], r["ttft_p50_s"], r["ttft_p90_s"], r["ttft_p99_s"],
             r["ttft_max_s"], r["makespan_s"], r["output_tokens_per_s"]] for r in report["runs"]]
    print("\n".join(TABLE.lines(rows)))


def plot(report: dict[str, Any], path: Path) -> None:
    with figure(path, title=f"TTFT of a burst of {report['conditions']['requests']} requests", figsize=(7, 4)) as (_, ax):
        for run in report["runs"]:
            ttfts = run["ttfts_s"]
            ax.plot(ttfts, np.arange(1, len(ttfts) + 1) / max(len(ttfts), 1), label=f"queue {run['queue']}")
        ax.set_xlabel("TTFT (s)")
        ax.set_ylabel("share of requests")
        ax.legend()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="tiny")
    parser.add_argument("--requests", type=int, default=400)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = parser.parse_args()

    import ray

    from cluster.redis_server import EmbeddedRedis, RedisServerConfig

    ray.init(namespace="kvserve-bench-burst", include_dashboard=False, logging_level="WARNING")
    try:
        with tempfile.TemporaryDirectory() as tmp, EmbeddedRedis(RedisServerConfig(state_dir=Path(tmp) / "redis")) as redis:
            runs = [run_mode(label, counted, redis.url, Path(tmp), args) for label, counted in MODES]
    finally:
        ray.shutdown()
    report = {
        "conditions": {"model": args.model, "requests": args.requests, "max_tokens": args.max_tokens, "workers": 2},
        "runs": runs,
    }
    write_results(args.out, report, lambda: print_table(report), {"bench_burst.png": lambda p: plot(report, p)})


if __name__ == "__main__":
    main()
